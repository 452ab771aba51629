"""One W&B run per training run, across resumes.

The run id lives in `RUN_DIR/wandb_run_id`. A fresh start (no checkpoint to resume from) gets a new
id; `resume=` reuses the stored one. Resuming from the checkpoint of global step S *rewinds* the
W&B run with W&B's own mechanism, `wandb.init(resume_from="<id>?_step=N")`, where N is the last W&B
`_step` logged at a global step <= S (read from the run's local files, which wandb-core writes
online and offline). The rows logged after the checkpoint by the interrupted process are dropped
and the resumed process logs in their place, so each step is in the run once.

Online, W&B applies the rewind when the run starts. W&B documents rewinding as a preview feature
that it enables per account, and refuses to rewind a run it still sees as running (a crash is
noticed after a few minutes): if the rewind is refused, the run is resumed instead (`resume="allow"`,
appending), and the message names the steps that will appear twice.

Offline, nothing can be rewound on the spot: each process writes its own segment directory
`wandb/offline-run-<time>-<id>/`, and a resumed segment records its rewind point (`branch_point`) in
its first record. `wandb sync --id <id> <its segments>` uploads the segments in order of start time
into the one run, and W&B applies each rewind on upload (the same preview feature). That is the
command `sync_command` prints.
"""

from __future__ import annotations

import json
import os
import secrets
import string
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from probdiff_callback.wandb_files import (
    Segment,
    effective_history,
    last_step_at_or_before,
    read_segment,
)

RUN_ID_FILE = "wandb_run_id"
ID_ALPHABET = string.ascii_lowercase + string.digits


@dataclass
class StartedRun:
    run_id: str
    init_kwargs: dict  # what wandb.init was called with (besides project and name)
    rewound_to: int | None  # the `_step` the run was rewound to, or None
    message: str  # one line for the user


def new_run_id(length: int = 8) -> str:
    return "".join(secrets.choice(ID_ALPHABET) for _ in range(length))


def run_id_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / RUN_ID_FILE


def read_run_id(run_dir: str | os.PathLike) -> str | None:
    path = run_id_path(run_dir)
    if not path.is_file():
        return None
    value = path.read_text(encoding="utf-8").strip()
    if not value or any(c not in ID_ALPHABET + "-_" for c in value):
        raise ValueError(f"{path}: not a W&B run id ({value!r}); delete the file to start a new W&B run")
    return value


def choose_run_id(
    run_dir: str | os.PathLike, resuming: bool, make_id: Callable[[], str] = new_run_id
) -> tuple[str, bool]:
    """(run id, whether it was reused): the stored id when resuming, else a new one, written to the run directory."""
    stored = read_run_id(run_dir) if resuming else None
    run_id = stored or make_id()
    if stored is None:
        path = run_id_path(run_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(run_id + "\n", encoding="utf-8")
    return run_id, stored is not None


def segment_files(wandb_dir: str | os.PathLike, run_id: str) -> list[Path]:
    """The local run files of `run_id` (online and offline segments), oldest first (the directory
    names begin with the start time)."""
    found = [
        p
        for pattern in (f"run-*-{run_id}", f"offline-run-*-{run_id}")
        for p in Path(wandb_dir).glob(f"{pattern}/run-{run_id}.wandb")
    ]
    return sorted(found, key=lambda p: p.parent.name.removeprefix("offline-"))


def readable_segments(paths: list[Path]) -> list[Segment]:
    """The segments that can be read; a file cut before its first record (a process killed at start) is skipped."""
    segments = []
    for path in paths:
        try:
            segments.append(read_segment(path))
        except ValueError as err:
            print(f"W&B: skipping {path}: {err}", file=sys.stderr)
    return segments


def resume_step_of(checkpoint: str | os.PathLike) -> int:
    """The global step a checkpoint resumes at (its trainer_state.json)."""
    path = Path(checkpoint) / "trainer_state.json"
    try:
        return int(json.loads(path.read_text(encoding="utf-8"))["global_step"])
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{path}: cannot read the checkpoint's global_step ({err})") from None


def rewind_point(segments: list[Segment], resume_step: int) -> int | None:
    """The `_step` to rewind to for a resume at global step `resume_step`, or None when the local
    files hold no row at or before it."""
    return last_step_at_or_before(effective_history(segments), resume_step)


def plan_init(
    run_id: str, reused: bool, segments: list[Segment], resume_step: int | None
) -> tuple[dict, int | None, str]:
    """(wandb.init keyword arguments, rewind point, message) for starting or continuing the run."""
    if resume_step is None:
        return {"id": run_id}, None, f"W&B run {run_id} (new)"
    if not reused:
        return (
            {"id": run_id},
            None,
            (
                f"W&B run {run_id} (new): this run directory has no {RUN_ID_FILE} from before, "
                "so the earlier W&B run(s) of this training stay separate"
            ),
        )
    point = rewind_point(segments, resume_step)
    if point is None:
        return (
            {"id": run_id, "resume": "allow"},
            None,
            (
                f"W&B run {run_id} resumed without rewinding: no local W&B file holds step {resume_step} or earlier, "
                f"so rows logged after step {resume_step} by the interrupted process stay in the run"
            ),
        )
    return (
        {"resume_from": f"{run_id}?_step={point}"},
        point,
        (
            f"W&B run {run_id} rewound to _step {point} (the last row at global step <= {resume_step}); "
            f"rows the interrupted process logged after step {resume_step} are replaced"
        ),
    )


def start_run(
    run_dir: str | os.PathLike,
    resume_checkpoint: str | os.PathLike | None,
    *,
    project: str,
    name: str | None,
    wandb_dir: str | os.PathLike | None = None,
    init: Callable | None = None,
) -> StartedRun:
    """Start the W&B run of a training run (main process only), rewinding it on resume.

    `wandb_dir` is where wandb writes its run directories (`$WANDB_DIR/wandb`, by default
    `RUN_DIR/wandb`). The Trainer's W&B integration then logs to this run instead of creating one.
    """
    if init is None:
        import wandb

        init = wandb.init
    wandb_dir = Path(wandb_dir) if wandb_dir is not None else Path(os.environ.get("WANDB_DIR") or run_dir) / "wandb"
    resume_step = None if resume_checkpoint is None else resume_step_of(resume_checkpoint)
    run_id, reused = choose_run_id(run_dir, resuming=resume_step is not None)
    segments = readable_segments(segment_files(wandb_dir, run_id)) if reused else []
    kwargs, point, message = plan_init(run_id, reused, segments, resume_step)
    try:
        init(project=project, name=name, **kwargs)
    except Exception as err:  # online: rewinding refused (not enabled, or the run not yet marked crashed)
        if point is None:
            raise
        print(
            f"W&B refused to rewind run {run_id} ({type(err).__name__}: {str(err)[:200]}); resuming it instead",
            file=sys.stderr,
        )
        kwargs, point = {"id": run_id, "resume": "allow"}, None
        init(project=project, name=name, **kwargs)
        message = (
            f"W&B run {run_id} resumed without rewinding: rows the interrupted process logged after step {resume_step} "
            "appear twice in it"
        )
    return StartedRun(run_id=run_id, init_kwargs=kwargs, rewound_to=point, message=message)


def sync_command(wandb_dir: str | os.PathLike, run_id: str) -> str:
    """The command that uploads every offline segment of the run into the one W&B run, in order."""
    return f"wandb sync --id {run_id} {Path(wandb_dir) / f'offline-run-*-{run_id}'}"
