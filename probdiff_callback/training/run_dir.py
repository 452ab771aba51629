"""Where a run writes (`runs/<recipe>/<run name>/`) and which checkpoint it resumes from."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from probdiff_callback.runs.checkpoints import (
    CHECKPOINT_NAME,
    checkpoint_problem,
    checkpoint_step,
    checkpoints,
    is_cut_off,
)
from probdiff_callback.training import say
from probdiff_callback.training.launch import training_command
from probdiff_callback.training.recipe import Recipe, RecipeError
from probdiff_callback.training.run_lock import raise_if_held

RUNS_DIR = Path("runs")
# The exit status of a run stopped because a machine's launcher died: EX_TEMPFAIL (sysexits.h), "try again later";
# not 0, which a scheduler or a requeue script takes for a run that finished
RUN_NOT_FINISHED = 75
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


def latest_checkpoint(run_dir: Path, save_only_model: bool = False) -> Path | None:
    """The newest complete `checkpoint-N` in `run_dir`, if any (transformers' own lookup takes the newest by name,
    whole or not)."""
    return newest_complete(checkpoints(run_dir), save_only_model)


def newest_complete(candidates: list[Path], save_only_model: bool) -> Path | None:
    return next((c for c in reversed(candidates) if checkpoint_problem(c, save_only_model) is None), None)


def checkpoint_to_resume(run_dir: Path, save_only_model: bool = False) -> Path | None:
    """`resume=true`: the newest checkpoint, past any whose save a kill cut off (said in one line); a broken one (a
    file missing or cut short, its save finished) stops with the file and the previous complete checkpoint."""
    found = checkpoints(run_dir)
    cut_off = []
    for index in range(len(found) - 1, -1, -1):
        checkpoint = found[index]
        problem = checkpoint_problem(checkpoint, save_only_model)
        if problem is None:
            if cut_off:
                say(f"resume=true: skipping {'; '.join(cut_off)}. Continuing from {checkpoint}")
            return checkpoint
        if not is_cut_off(checkpoint):
            raise RecipeError(
                f"cannot resume from {checkpoint}: {problem}. " + previous_offer(found[:index], save_only_model)
            )
        cut_off.append(f"{checkpoint.name} (its save was cut off: no {checkpoint.name}/trainer_state.json)")
    if cut_off:
        raise RecipeError(
            f"{run_dir} has no complete checkpoint ({'; '.join(cut_off)}). Start afresh with overwrite=true"
        )
    return None


def previous_offer(older: list[Path], save_only_model: bool) -> str:
    """The command's way on: the newest complete checkpoint among `older`, or a fresh start."""
    previous = newest_complete(older, save_only_model)
    if previous is None:
        return "No earlier checkpoint is complete: start afresh with overwrite=true"
    return f"Continue from the previous complete checkpoint with resume={previous}, or start afresh with overwrite=true"


def set_aside_unusable(run_dir: Path, resumed: str | None, save_only_model: bool = False) -> list[str]:
    """Move the cut-off or broken checkpoints newer than the one resumed to `incomplete-checkpoint-N`, so that the
    Trainer's rotation and checkpoint lookup never take them for checkpoints (its rotation counts every folder whose
    name starts with `checkpoint-`). Main process, with the run directory held (`run_lock`)."""
    start = checkpoint_step(resumed) if resumed else 0
    moved = []
    for checkpoint in checkpoints(run_dir):
        problem = checkpoint_problem(checkpoint, save_only_model) if checkpoint_step(checkpoint) > start else None
        if problem is not None:
            target = checkpoint.with_name(f"incomplete-{checkpoint.name}")
            suffix = 2
            while target.exists():
                target, suffix = checkpoint.with_name(f"incomplete-{checkpoint.name}.{suffix}"), suffix + 1
            checkpoint.rename(target)
            moved.append(f"set {checkpoint} aside as {target.name} ({problem})")
    return moved


def recipe_run_dir(recipe: Recipe, checkpoint: Path | None = None) -> Path:
    """output_dir, else the run of the checkpoint resumed, else runs/<recipe>/<run_name or model-hash>."""
    output_dir, run_name = recipe.training.get("output_dir"), recipe.training.get("run_name")
    if output_dir:
        return Path(output_dir)
    if checkpoint is not None:
        return checkpoint.parent  # the checkpoint's own run goes on
    return RUNS_DIR / recipe.recipe / (run_name or default_run_name(recipe))


def not_a_checkpoint(resume: str, recipe: Recipe) -> str:
    """Why `resume=PATH` cannot be resumed from, and the checkpoints that can: those beside PATH, else those of the
    run directory this recipe names."""
    path = Path(resume)
    what = (
        "no such directory"
        if not path.exists()
        else "not a training checkpoint (a checkpoint-N folder of a run, holding trainer_state.json and the weights)"
    )
    own_run = recipe_run_dir(recipe)
    run_dir = path.parent if path.parent.is_dir() and checkpoints(path.parent) else own_run
    found = checkpoints(run_dir)
    if not found:
        return (
            f"resume={resume}: {what}; {run_dir}, this recipe's run directory, has no checkpoint yet. "
            "Leave resume out to start the run, or give resume=RUN_DIR/checkpoint-N of another run"
        )
    shown = ", ".join(c.name for c in found[-10:])
    latest = latest_checkpoint(run_dir) or found[-1]
    also = ", or resume=true for the latest complete one" if run_dir == own_run else ""
    return (
        f"resume={resume}: {what}. {run_dir} has {'..., ' if len(found) > 10 else ''}{shown}: "
        f"give one of them (e.g. resume={latest}){also}"
    )


def resolve_run(recipe: Recipe) -> tuple[Path, str | None]:
    """(run directory, checkpoint to resume from or None), checking the directory can be used."""
    resume = recipe.resume
    resume_flag = None if resume is None else resume.strip().lower()
    checkpoint = None
    save_only_model = bool(recipe.training.get("save_only_model"))
    if resume_flag not in (None, "", "false", "true"):
        checkpoint = Path(resume)  # type: ignore[arg-type]
        if not checkpoint.is_dir() or not CHECKPOINT_NAME.match(checkpoint.name):
            raise RecipeError(not_a_checkpoint(resume, recipe))  # type: ignore[arg-type]
        problem = checkpoint_problem(checkpoint, save_only_model)
        if problem is not None:
            older = [c for c in checkpoints(checkpoint.parent) if checkpoint_step(c) < checkpoint_step(checkpoint)]
            raise RecipeError(f"cannot resume from {checkpoint}: {problem}. {previous_offer(older, save_only_model)}")
    run_dir = recipe_run_dir(recipe, checkpoint)
    raise_if_held(run_dir)  # before any advice on its checkpoints: a live job is writing them
    if resume_flag == "true":
        checkpoint = checkpoint_to_resume(run_dir, save_only_model)
        if checkpoint is None:
            say(f"resume=true: {run_dir} has no checkpoint yet; starting from step 0")
    elif checkpoint is None and checkpoints(run_dir) and not recipe.overwrite:
        latest = latest_checkpoint(run_dir, save_only_model) or checkpoints(run_dir)[-1]
        raise RecipeError(
            f"{run_dir} already has checkpoints ({latest.name} the latest complete one). "
            "Continue it with resume=true, start afresh with overwrite=true, or choose another run_name="
        )
    return run_dir, None if checkpoint is None else str(checkpoint)


def resume_command(args: list[str]) -> str:
    """The command that continues a run: the same options and arguments, `resume=true` (across machines: on each)."""
    kept = [arg for arg in args if not arg.startswith("resume=")]
    command = f"{training_command()} {' '.join(kept)} resume=true"
    machines = int(os.environ.get("GROUP_WORLD_SIZE", "1"))  # torchrun's, in a training process: the machines
    return command if machines == 1 else f"{command} (on each of the {machines} machines, with its --machine_rank)"


def resume_hint(run_dir: Path, args: list[str]) -> str:
    """After Ctrl-C: where the run stopped and the command that continues it."""
    latest = latest_checkpoint(run_dir)
    where = f"the last checkpoint is {latest}" if latest is not None else "no checkpoint was saved yet"
    return f"interrupted: {where}. Continue with: {resume_command(args)}"


def lost_launcher_hint(preemption, args: list[str]) -> str:
    """After a machine's launcher died: which, the checkpoint every rank saved, and the command that continues."""
    machines = ", ".join(str(machine) for machine in preemption.lost_machines)
    which = f"machine {machines}" if len(preemption.lost_machines) == 1 else f"machines {machines}"
    return (
        f"the run did not finish: {which} lost its launcher (accelerate launch), so every rank saved "
        f"{preemption.checkpoint} and stopped (exit status {RUN_NOT_FINISHED}). Continue with: {resume_command(args)}"
    )


def lost_peer_hint(args: list[str], lost: str, err: BaseException) -> str:
    """After `lost` (a machine) went away in a collective: the command that continues from the last checkpoint."""
    cause = str(err).split("] ", 1)[-1].split(". ")[0]  # the backend's message without its source location
    return (
        f"the run did not finish: {lost} is gone ({cause}; exit status {RUN_NOT_FINISHED}). Continue from the last "
        f"checkpoint with: {resume_command(args)}"
    )


def preempted_hint(preemption, args: list[str]) -> str:
    """After a preemption's signal: the checkpoint saved for it and the command that continues the run."""
    return f"stopped by {preemption.signal_name}: saved {preemption.checkpoint}. Continue with: {resume_command(args)}"
