"""W&B for a training run: the environment the Trainer's integration reads (project per recipe, files in the run
directory, offline when not logged in), and one W&B run per training run, across resumes.

The run id lives in `RUN_DIR/wandb_run_id`. A fresh start gets a new id; `resume=` reuses the stored one. When the
Trainer saves `checkpoint-N`, `WandbStepRecord` writes `checkpoint-N/wandb_step.json` with the last W&B `_step`
logged up to step N (everything of step N is logged by then). Resuming from that checkpoint rewinds the W&B run
there with W&B's public `wandb.init(resume_from="<id>?_step=<that step>")`: rows logged after the checkpoint by the
interrupted process are replaced, so each step is in the run once. The record travels with its checkpoint (rotation
deletes both); a checkpoint without one resumes the run with `resume="allow"` and says so.

Online, W&B applies the rewind when the run starts (a preview feature it enables per account, refused while it still
sees the run as running): if the rewind is refused, the run is resumed instead and the message names the steps that
appear twice. Offline, each process writes its own segment directory and `wandb sync --id <id> <segments>` applies
the rewinds on upload (`sync_command`).
"""

from __future__ import annotations

import json
import os
import secrets
import string
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from probdiff_callback.training import say
from probdiff_callback.training.precheck import check_wandb_installed
from probdiff_callback.training.recipe import Recipe, report_to_list

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


def wandb_logged_in(environ: dict[str, str] | None = None) -> bool:
    """An API key in WANDB_API_KEY or in the netrc file `wandb login` writes."""
    import netrc

    environ = os.environ if environ is None else environ
    if environ.get("WANDB_API_KEY"):
        return True
    host = environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].rstrip("/")
    try:
        path = environ.get("NETRC") or str(Path.home() / ".netrc")
        return Path(path).is_file() and netrc.netrc(path).authenticators(host) is not None
    except (netrc.NetrcParseError, OSError):
        return False


def setup_wandb(recipe: Recipe, run_dir: Path) -> str | None:
    """Environment for the Trainer's W&B integration. Returns the `wandb sync` command for an offline run, else None."""
    if "wandb" not in report_to_list(recipe):
        return None
    check_wandb_installed(recipe)  # the one message, also said before the imports (precheck.py)
    os.environ.setdefault("WANDB_PROJECT", recipe.wandb_project or f"probdiff-{recipe.recipe}")
    if recipe.wandb_entity:
        os.environ["WANDB_ENTITY"] = recipe.wandb_entity
    os.environ.setdefault("WANDB_DIR", str(run_dir))
    os.environ.setdefault("WANDB_LOG_MODEL", "false")
    if os.environ.get("WANDB_MODE") is None and not wandb_logged_in():
        os.environ["WANDB_MODE"] = "offline"
    if os.environ.get("WANDB_MODE") in ("offline", "dryrun"):
        return f"wandb sync {Path(os.environ['WANDB_DIR']) / 'wandb' / 'offline-run-*'}"
    return None


def start_wandb(recipe: Recipe, run_dir: Path, resume_from: str | None, trainer) -> str | None:
    """Start (or continue, rewinding it) the training run's W&B run on the main process, and add to `trainer` the
    callback that records each checkpoint's W&B step (after ProbDiffCallback, so its rows are counted). The
    `wandb sync` command when offline, else None. The Trainer's integration logs the SFTConfig into the run's config;
    the project's own keys (model, LoRA, ProbDiff, data) go in with it here, as `recipe`."""
    import wandb

    offline = os.environ.get("WANDB_MODE") in ("offline", "dryrun")
    # Offline, W&B's closing lines offer `wandb sync` for this process's segment alone; the command returned here
    # uploads every segment of the run with its rewinds, and is the one the run's summary prints
    settings = wandb.Settings(quiet=True) if offline else None
    started = start_run(
        run_dir,
        resume_from,
        project=os.environ.get("WANDB_PROJECT") or f"probdiff-{recipe.recipe}",
        name=trainer.args.run_name,
        init=partial(wandb.init, config={"recipe": recipe.project_dict()}, settings=settings),
    )
    say(started.message)
    recorder = step_recorder(started, offline)
    if recorder is None:
        say(
            f"W&B run {started.run_id}: offline and resumed without rewinding, so this process's W&B steps are not "
            "the run's; its checkpoints get no W&B step record, and resuming from them will not rewind either"
        )
    else:
        trainer.add_callback(recorder)
    if offline:
        return sync_command(Path(os.environ.get("WANDB_DIR") or run_dir) / "wandb", started.run_id)
    return None


def finish_wandb() -> None:
    """Close this process's W&B run before the run's summary is printed. Left open, the run is closed at exit by
    W&B's service, whose closing lines ignore `quiet` and offer `wandb sync` for this process's segment alone. A
    process that never imported wandb (report_to=none, or wandb not installed) has no run to close."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish()
