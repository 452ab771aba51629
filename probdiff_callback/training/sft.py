"""Supervised fine-tuning (LoRA or full) with ProbDiff self-evaluation at every checkpoint: the training process,
`main()` in numbered steps. It is started by `command.run` (train/sft.py, `python -m probdiff_callback.training`),
directly or through `accelerate launch`. See docs/configuration.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from probdiff_callback.core.queries import DataFileError
from probdiff_callback.runtime.parent import parent_command
from probdiff_callback.runtime.threads import configure_threads
from probdiff_callback.training import configure_logging, is_main_process, launch, say
from probdiff_callback.training.data import load_data, report_truncation
from probdiff_callback.training.machines import is_local_main_process, lost_peer
from probdiff_callback.training.model_setup import load_model, lora_config, prepare_model_files
from probdiff_callback.training.precheck import setup_error
from probdiff_callback.training.recipe import Recipe, RecipeError, load_recipe, report_to_list, sft_config
from probdiff_callback.training.report import summarize_run
from probdiff_callback.training.run_dir import (
    RUN_NOT_FINISHED,
    lost_launcher_hint,
    lost_peer_hint,
    preempted_hint,
    resolve_run,
    resume_hint,
    set_aside_unusable,
)
from probdiff_callback.training.run_lock import hold_on_every_rank
from probdiff_callback.training.trainer import build_trainer, save_inference_files
from probdiff_callback.training.wandb_run import finish_wandb, setup_wandb, start_wandb


def main(argv: list[str] | None = None) -> int:
    """Train; a configuration or data error stops with its message (exit status 2) before anything is written, and a
    machine lost in the middle of it with one line (exit status 75)."""
    try:
        return train(sys.argv[1:] if argv is None else argv)
    except (RecipeError, DataFileError) as err:
        return setup_error(err)
    except KeyboardInterrupt:  # before training started: nothing to continue
        say("interrupted before training started")
        return 130
    except RuntimeError as err:  # another machine gone, in a collective: one line on each machine left
        if (lost := lost_peer(err)) is None:
            raise
        if is_local_main_process():
            print(f"\n{lost_peer_hint(sys.argv[1:] if argv is None else argv, lost, err)}", flush=True)  # after a bar
        return RUN_NOT_FINISHED


def train(args: list[str]) -> int:
    started = time.time()
    configure_logging()
    # 1. Config: recipe layers and overrides, run directory, W&B environment, CPU threads
    recipe = load_recipe(args)
    run_dir, resume_from = resolve_run(recipe)
    wandb_sync = setup_wandb(recipe, run_dir)
    threads, why = configure_threads(recipe.threads)
    say(f"recipe {recipe.recipe}: model {recipe.model}, run directory {run_dir}; "
        f"{threads} CPU threads per process ({why})")  # fmt: skip

    # 2. Data: conversations for the loss, held-out queries for ProbDiff (a bad file stops before anything is written)
    train_rows, eval_rows, queries = load_data(recipe)

    # 3. Model files, made before any distributed or DeepSpeed context exists (every rank waits for the one copy);
    #    then the SFTConfig, before the model loads, so that ZeRO-3 can partition the weights while they load
    prepare_model_files(recipe.model)
    training_args = sft_config(recipe, run_dir, resuming=resume_from is not None)
    if is_main_process():
        say(launch.processes_line(training_args.world_size, parent_command()))
    # one job per run directory (a second one stops here, naming the first); then cut-off or broken checkpoints
    # past the one resumed are moved aside, where the Trainer's lookup by name cannot take them for checkpoints
    lock = hold_on_every_rank(run_dir, training_args.world_size)
    if is_main_process():
        for line in set_aside_unusable(run_dir, resume_from, training_args.save_only_model):
            say(line)
        save_resolved_recipe(recipe, run_dir / "recipe.yaml")

    # 4. Model and tokenizer; count the conversations truncation leaves without an assistant token
    model, tokenizer = load_model(recipe)
    report_truncation(tokenizer, train_rows, eval_rows, training_args.max_length)

    # 5. LoRA (or all weights)
    peft_config = lora_config(recipe, model)

    # 6. Trainer with the ProbDiff callback
    trainer, preemption = build_trainer(
        recipe, training_args, model, tokenizer, train_rows, eval_rows, peft_config, queries
    )

    # 7. Train (one W&B run per training run: resuming continues, and rewinds, the run of the first start);
    #    SIGTERM/SIGUSR1 (preemption) save a checkpoint at the next step boundary and stop with exit status 0; a
    #    machine whose launcher died stops them the same way, with exit status 75
    if "wandb" in report_to_list(recipe) and is_main_process():
        wandb_sync = start_wandb(recipe, run_dir, resume_from, trainer) or wandb_sync
    try:
        trainer.train(resume_from_checkpoint=resume_from)
    except KeyboardInterrupt:  # Ctrl-C: one line on how to go on, instead of a traceback per process
        say(resume_hint(run_dir, args))
        return 130
    if preemption.stopping:
        finish_wandb()
        if preemption.lost_machines:  # the run did not finish: not the clean stop a scheduler asked for
            say(lost_launcher_hint(preemption, args))
            return RUN_NOT_FINISHED
        say(preempted_hint(preemption, args))
        return 0

    # 8. Save the final weights, select and name the best checkpoint, say where everything is
    final_dir = run_dir / "final"
    trainer.save_model(str(final_dir))
    if trainer.is_world_process_zero():
        save_inference_files(final_dir, tokenizer, model.generation_config)
        finish_wandb()
        summarize_run(trainer, recipe, run_dir, final_dir, wandb_sync, time.time() - started)
    trainer.accelerator.wait_for_everyone()
    if lock is not None:
        lock.release()
    return 0


def save_resolved_recipe(recipe: Recipe, path: Path) -> None:
    from omegaconf import OmegaConf

    header = f"# resolved recipe: python train/sft.py recipe={recipe.recipe} ... (all layers applied)\n"
    path.write_text(header + OmegaConf.to_yaml(recipe.to_dict()), encoding="utf-8")
