"""Where a run writes (`runs/<recipe>/<run name>/`) and which checkpoint it resumes from."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from probdiff_callback.training.recipe import Recipe, RecipeError

RUNS_DIR = Path("runs")
# Settings that name or steer a run rather than define what is trained: left out of the run name's hash,
# so `resume=true` or `report_to=none` finds the same run directory.
RUN_LEVEL_KEYS = (
    "recipe", "output_dir", "run_name", "resume", "overwrite", "report_to", "wandb_project", "wandb_entity",
    "push_to_hub", "hub_model_id", "threads", "presets", "description",
)  # fmt: skip


def model_tag(model: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model.rstrip("/")).name) or "model"


def default_run_name(recipe: Recipe) -> str:
    """`<model>-<hash>`: the same settings give the same name (and directory) on every rank and rerun."""
    settings = {k: v for k, v in recipe.to_dict().items() if k not in RUN_LEVEL_KEYS}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{model_tag(recipe.model)}-{digest}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The Trainer's newest `checkpoint-N` in `run_dir`, if any (transformers' own lookup)."""
    from transformers.trainer_utils import get_last_checkpoint

    found = get_last_checkpoint(str(run_dir)) if run_dir.is_dir() else None
    return None if found is None else Path(found)


def resolve_run(recipe: Recipe) -> tuple[Path, str | None]:
    """(run directory, checkpoint to resume from or None), checking the directory can be used."""
    resume = recipe.resume
    resume_flag = None if resume is None else resume.strip().lower()
    checkpoint = None
    if resume_flag not in (None, "", "false", "true"):
        checkpoint = Path(resume)  # type: ignore[arg-type]
        if not (checkpoint / "trainer_state.json").is_file():
            raise RecipeError(f"resume={resume}: not a training checkpoint (no trainer_state.json there)")
    output_dir, run_name = recipe.training.get("output_dir"), recipe.training.get("run_name")
    if output_dir:
        run_dir = Path(output_dir)
    elif checkpoint is not None:
        run_dir = checkpoint.parent  # the checkpoint's own run goes on
    else:
        run_dir = RUNS_DIR / recipe.recipe / (run_name or default_run_name(recipe))
    latest = latest_checkpoint(run_dir)
    if resume_flag == "true":
        if latest is not None:
            checkpoint = latest
        else:
            print(f"resume=true: {run_dir} has no checkpoint yet; starting from step 0", flush=True)
    elif checkpoint is None and latest is not None and not recipe.overwrite:
        raise RecipeError(
            f"{run_dir} already has checkpoints ({latest.name} the latest). "
            "Continue it with resume=true, start afresh with overwrite=true, or choose another run_name="
        )
    return run_dir, None if checkpoint is None else str(checkpoint)


def resume_command(args: list[str]) -> str:
    """The command that continues a run: the same arguments, `resume=true`."""
    kept = [arg for arg in args if not arg.startswith("resume=")]
    return f"accelerate launch train/sft.py {' '.join(kept)} resume=true"


def resume_hint(run_dir: Path, args: list[str]) -> str:
    """After Ctrl-C: where the run stopped and the command that continues it."""
    latest = latest_checkpoint(run_dir)
    where = f"the last checkpoint is {latest}" if latest is not None else "no checkpoint was saved yet"
    return f"interrupted: {where}. Continue with: {resume_command(args)}"


def preempted_hint(preemption, args: list[str]) -> str:
    """After a preemption's signal: the checkpoint saved for it and the command that continues the run."""
    return f"stopped by {preemption.signal_name}: saved {preemption.checkpoint}. Continue with: {resume_command(args)}"
