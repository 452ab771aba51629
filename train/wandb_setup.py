"""W&B for a training run: the environment the Trainer's integration reads (project per recipe, files in the run
directory, offline when not logged in), and the one W&B run per training run, across resumes."""

from __future__ import annotations

import importlib.util
import os
from functools import partial
from pathlib import Path

from environment import say
from recipe import Recipe, RecipeError, report_to_list


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
    if importlib.util.find_spec("wandb") is None:
        raise RecipeError("report_to includes wandb but wandb is not installed: pip install wandb, or report_to=none")
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

    from probdiff_callback.wandb_run import start_run, step_recorder, sync_command

    offline = os.environ.get("WANDB_MODE") in ("offline", "dryrun")
    started = start_run(
        run_dir,
        resume_from,
        project=os.environ.get("WANDB_PROJECT") or f"probdiff-{recipe.recipe}",
        name=trainer.args.run_name,
        init=partial(wandb.init, config={"recipe": recipe.project_dict()}),
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
