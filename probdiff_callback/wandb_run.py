"""One W&B run per training run, across resumes.

The run id lives in `RUN_DIR/wandb_run_id`. A fresh start (no checkpoint to resume from) gets a new
id; `resume=` reuses the stored one. When the Trainer saves `checkpoint-N`, `WandbStepRecord` writes
`checkpoint-N/wandb_step.json`: the run id and the last W&B `_step` logged by then (the step's training
loss, eval metrics and ProbDiff rows are all logged before the Trainer calls `on_save`). The record
travels with its checkpoint, so checkpoint rotation deletes it too. Resuming from `checkpoint-N`
*rewinds* the W&B run to that `_step` with W&B's own mechanism, `wandb.init(resume_from="<id>?_step=N")`:
the rows logged after the checkpoint by the interrupted process are dropped and the resumed process
logs in their place, so each step is in the run once. A checkpoint without the record (saved before
these records, or without W&B) resumes the run instead (`resume="allow"`, appending).

Online, W&B applies the rewind when the run starts. W&B documents rewinding as a preview feature
that it enables per account, and refuses to rewind a run it still sees as running (a crash is
noticed after a few minutes): if the rewind is refused, the run is resumed instead (`resume="allow"`,
appending), and the message names the steps that will appear twice.

Offline, nothing can be rewound on the spot: each process writes its own segment directory
`wandb/offline-run-<time>-<id>/`, and a resumed segment records its rewind point. `wandb sync --id <id>
<its segments>` uploads the segments in order of start time into the one run, and W&B applies each
rewind on upload (the same preview feature). That is the command `sync_command` prints.
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

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

RUN_ID_FILE = "wandb_run_id"
STEP_RECORD_FILE = "wandb_step.json"
ID_ALPHABET = string.ascii_lowercase + string.digits


@dataclass
class StartedRun:
    run_id: str
    init_kwargs: dict  # what wandb.init was called with (besides project and name)
    rewound_to: int | None  # the `_step` the run was rewound to, or None
    message: str  # one line for the user


@dataclass(frozen=True)
class StepRecord:
    """What `checkpoint-N/wandb_step.json` holds: the W&B run and its last `_step` logged by global step N."""

    run_id: str
    global_step: int
    last_wandb_step: int


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


def resume_step_of(checkpoint: str | os.PathLike) -> int:
    """The global step a checkpoint resumes at (its trainer_state.json)."""
    path = Path(checkpoint) / "trainer_state.json"
    try:
        return int(json.loads(path.read_text(encoding="utf-8"))["global_step"])
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{path}: cannot read the checkpoint's global_step ({err})") from None


def write_step_record(checkpoint: str | os.PathLike, record: StepRecord) -> Path:
    path = Path(checkpoint) / STEP_RECORD_FILE
    partial = path.with_name(path.name + ".tmp")
    # a process killed mid-write leaves the .tmp file, never a cut record that would stop the resume
    partial.write_text(json.dumps(record.__dict__) + "\n", encoding="utf-8")
    os.replace(partial, path)
    return path


def read_step_record(checkpoint: str | os.PathLike, global_step: int) -> StepRecord | None:
    """The W&B step record of the checkpoint of `global_step`, or None when it has none."""
    path = Path(checkpoint) / STEP_RECORD_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        record = StepRecord(str(data["run_id"]), int(data["global_step"]), int(data["last_wandb_step"]))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"{path}: not a W&B step record ({type(err).__name__}: {err}); delete it to resume without rewinding"
        ) from None
    if record.global_step != global_step or record.last_wandb_step < 0:
        raise ValueError(
            f"{path}: global_step {record.global_step}, last_wandb_step {record.last_wandb_step} do not fit a "
            f"checkpoint of step {global_step}; delete it to resume without rewinding"
        )
    return record


def plan_init(
    run_id: str, reused: bool, resume_step: int | None, record: StepRecord | None
) -> tuple[dict, int | None, str]:
    """(wandb.init keyword arguments, rewind point, message) for starting or continuing the run; `record` is the
    step record of the checkpoint resumed from."""
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
    checkpoint = f"{PREFIX_CHECKPOINT_DIR}-{resume_step}"
    if record is None or record.run_id != run_id:
        why = (
            f"{checkpoint} has no {STEP_RECORD_FILE} (saved without W&B, or by an older version)"
            if record is None
            else f"the {STEP_RECORD_FILE} of {checkpoint} is of W&B run {record.run_id}"
        )
        return (
            {"id": run_id, "resume": "allow"},
            None,
            (
                f"W&B run {run_id} resumed without rewinding: {why}, "
                f"so rows logged after step {resume_step} by the interrupted process stay in the run"
            ),
        )
    point = record.last_wandb_step
    return (
        {"resume_from": f"{run_id}?_step={point}"},
        point,
        (
            f"W&B run {run_id} rewound to _step {point} (the last row logged by step {resume_step}, "
            f"from {checkpoint}/{STEP_RECORD_FILE}); rows the interrupted process logged after step {resume_step} "
            "are replaced"
        ),
    )


def start_run(
    run_dir: str | os.PathLike,
    resume_checkpoint: str | os.PathLike | None,
    *,
    project: str,
    name: str | None,
    init: Callable | None = None,
) -> StartedRun:
    """Start the W&B run of a training run (main process only), rewinding it on resume to the step recorded in
    the checkpoint. The Trainer's W&B integration then logs to this run instead of creating one."""
    if init is None:
        import wandb

        init = wandb.init
    resume_step = None if resume_checkpoint is None else resume_step_of(resume_checkpoint)
    run_id, reused = choose_run_id(run_dir, resuming=resume_step is not None)
    record = None
    if reused and resume_checkpoint is not None and resume_step is not None:
        record = read_step_record(resume_checkpoint, resume_step)
    kwargs, point, message = plan_init(run_id, reused, resume_step, record)
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


class WandbStepRecord(TrainerCallback):
    """Writes `checkpoint-N/wandb_step.json` when the Trainer saves checkpoint-N (main process only).

    Add it after ProbDiffCallback, which may log in its own on_save; `Trainer.add_callback` appends after the
    Trainer's WandbCallback. `rewound_to` is the `_step` this process's run was rewound to: offline, wandb counts
    from 0 until the first row after a rewind, so a checkpoint saved before any row records the rewind point.
    """

    def __init__(self, rewound_to: int | None = None) -> None:
        self.rewound_to = rewound_to

    def on_save(self, args, state, control, **kwargs) -> None:
        import wandb

        if not state.is_world_process_zero or wandb.run is None:
            return
        checkpoint = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        last = wandb.run.step - 1  # `step` is the `_step` of the next row
        if self.rewound_to is not None:
            last = max(last, self.rewound_to)
        if last < 0 or not checkpoint.is_dir():  # nothing logged yet: no row to rewind to
            return
        write_step_record(checkpoint, StepRecord(wandb.run.id, state.global_step, last))


def step_recorder(started: StartedRun, offline: bool) -> WandbStepRecord | None:
    """The callback that records each checkpoint's W&B step, or None where this process's step counter is not the
    run's: offline, a run resumed without rewinding counts from 0 in its own segment."""
    if offline and started.init_kwargs.get("resume") == "allow":
        return None
    return WandbStepRecord(started.rewound_to)


def sync_command(wandb_dir: str | os.PathLike, run_id: str) -> str:
    """The command that uploads every offline segment of the run into the one W&B run, in order."""
    return f"wandb sync --id {run_id} {Path(wandb_dir) / f'offline-run-*-{run_id}'}"
