"""The training command and what only it uses, one concern per module: the command users start (`command`: the
settings checked before torch, transformers and trl are imported (`precheck`, with SFTConfig's fields known without
them: `sft_config_cache`), then training here or the launcher of the training processes (`launch`)), the training
process's steps (`sft`), the recipe and its `SFTConfig` (`recipe`), the run directory and resuming (`run_dir`), one job
per run directory (`run_lock`), the conversations and held-out queries (`data`), the model and its LoRA
(`model_setup`), trl's `SFTTrainer` with the ProbDiff and preemption callbacks (`trainer`), one W&B run across resumes
(`wandb_run`) and the end-of-run report (`report`).

Installed with the package (TRL ships `trl/scripts/sft.py` the same way); `train/sft.py` in a checkout is its
entry point. A recipe named `recipe=NAME` and a relative data path are looked up in the checkout the package runs
from (`PROJECT_ROOT`, which holds `recipes/` and `data/`), or, for an installed package, the working directory; a
recipe can also be a path to a .yaml file.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parents[2]
# the checkout holding recipes/ and data/ (an editable install, tests), else the working directory (an installed wheel)
PROJECT_ROOT = _CHECKOUT if (_CHECKOUT / "recipes").is_dir() else Path.cwd()


def is_main_process() -> bool:
    """Rank 0 of the launch, known before any distributed state exists (the launcher sets RANK)."""
    return int(os.environ.get("RANK", "0")) == 0


def say(message: str) -> None:
    """Print once per run (on the main process)."""
    if is_main_process():
        print(message, flush=True)


def configure_logging() -> None:
    """The library's log (`probdiff_callback.*`) on the console as plain lines, like `say`: INFO and up on the main
    process (the cost forecast, notices), warnings on every rank; warnings and errors to stderr, the rest to stdout."""
    library = logging.getLogger("probdiff_callback")
    library.setLevel(logging.INFO if is_main_process() else logging.WARNING)
    library.propagate = False  # the script owns the console: a root handler someone else adds would print it twice
    if any(getattr(handler, "probdiff_console", False) for handler in library.handlers):
        return  # configured by an earlier run in this process
    out = _Console("stdout")
    out.addFilter(lambda record: record.levelno < logging.WARNING)
    err = _Console("stderr")
    err.setLevel(logging.WARNING)
    for handler in (out, err):
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.probdiff_console = True  # type: ignore[attr-defined]
        library.addHandler(handler)


class _Console(logging.StreamHandler):
    """A handler on `sys.stdout` or `sys.stderr` as they are when a record comes, not when it was made (a test or a
    notebook may swap them between runs)."""

    def __init__(self, name: str) -> None:
        self._stream_name = name  # not `_name`: logging.Handler keeps its own name there
        super().__init__()

    @property
    def stream(self):  # type: ignore[override]
        return getattr(sys, self._stream_name)

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler sets it; ours is looked up
        pass
