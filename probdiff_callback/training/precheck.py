"""The settings of `python train/sft.py ...` checked before the training stack is imported (`refused`).

Importing torch, transformers and trl takes seconds, tens of them on a loaded machine: a misspelt key, a recipe that
is not there or a missing data file should not wait for them. So the command first runs the checks of its settings
that `train` runs before it loads anything, in the same order and through the same functions, with SFTConfig's
stand-in (sft_config_cache.py) where they need trl's class: the same `error:` line and exit status 2, without
those imports. Whatever passes here, `train` checks again after the imports, as it always did; what only it can see
stops there: SFTConfig's own checks, a model whose files cannot be had, a bad row in a data file, and the few keys
whose types the stand-in cannot write (`sft_config_cache.UNCHECKED`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
import time

from probdiff_callback.core.queries import DataFileError
from probdiff_callback.training import is_main_process, say
from probdiff_callback.training.data import data_files
from probdiff_callback.training.model_setup import check_model_name
from probdiff_callback.training.recipe import Recipe, RecipeError, load_recipe, report_to_list, sft_config_stand_in
from probdiff_callback.training.run_dir import resolve_run
from probdiff_callback.training.sft_config_cache import stand_in

# A setup error on a rank other than the main one: how long it waits for the launcher to stop it (torchrun and
# accelerate stop the other ranks within a second of the main one's exit)
OTHER_RANKS_WAIT_SECONDS = 10.0
HELP_OPTIONS = (["-h"], ["--help"])


def refused(options: list[str], arguments: list[str]) -> int | None:
    """The exit status of a setup error that `arguments` (the key=value ones) show, said as train/sft.py's `main`
    says it; None where they show none (or `options` ask for the launcher's help, which needs no settings)."""
    if options in HELP_OPTIONS:
        return None
    try:
        check_settings(arguments)
    except (RecipeError, DataFileError) as err:
        return setup_error(err)
    except KeyboardInterrupt:
        say("interrupted before training started")
        return 130
    return None


def check_settings(arguments: list[str]) -> None:
    """What `train` checks of the settings before the model loads, in its order: the recipe, its run directory,
    W&B's package, the data files, the model's name. Its lines (resume=true's notes) are left to the run, which says
    them again."""
    sft_config = stand_in()
    if sft_config is None:  # no stand-in could be made: the checks after the imports do it all
        return
    with sft_config_stand_in(sft_config):
        recipe = load_recipe(arguments)
        with contextlib.redirect_stdout(io.StringIO()):
            resolve_run(recipe)
        check_wandb_installed(recipe)
        data_files(recipe)
        check_model_name(recipe.model)


def check_wandb_installed(recipe: Recipe) -> None:
    if "wandb" in report_to_list(recipe) and importlib.util.find_spec("wandb") is None:
        raise RecipeError("report_to includes wandb but wandb is not installed: pip install wandb, or report_to=none")


def setup_error(err: RecipeError | DataFileError) -> int:
    """Say a configuration or data error and return its exit status, 2. A recipe's error is the same on every rank:
    said once, by the main process; a data file's may differ (a node's own copy): every rank says its own."""
    if isinstance(err, RecipeError) and not is_main_process():
        # the main process meets it too: its launcher stops this one when it exits, after the line is out
        time.sleep(OTHER_RANKS_WAIT_SECONDS)  # (exiting first, this one could have the main one stopped unsaid)
    else:
        print(f"error: {err}", file=sys.stderr)
    return 2
