"""Where built artefacts (the converted tokenizer, the `tiny` model) live, and a lock so
that several processes started by `accelerate launch` build them only once."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


def cache_dir() -> Path:
    """`$PROBDIFF_CACHE`, else `$XDG_CACHE_HOME/probdiff`, else `~/.cache/probdiff`."""
    if os.environ.get("PROBDIFF_CACHE"):
        root = Path(os.environ["PROBDIFF_CACHE"])
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "probdiff"
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive advisory lock on `path`, held for the `with` block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
