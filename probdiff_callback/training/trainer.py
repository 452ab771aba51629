"""trl's SFTTrainer as the recipes use it: the ProbDiff callback attached, checkpoints that work on their own, a
model card that names the base model, and the plain loss on a CPU."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

from transformers import TrainerCallback

from probdiff_callback.training import say
from probdiff_callback.training.data import LOSS_MASKING_NOTES, loss_datasets
from probdiff_callback.training.recipe import Recipe, RecipeError


def build_trainer(recipe: Recipe, args, model, tokenizer, train_rows, eval_rows, peft_config, queries):
    """(trainer, its PreemptionCallback): the script asks the latter whether training stopped for a signal."""
    from probdiff_callback.callback.preemption import PreemptionCallback
    from probdiff_callback.callback.probdiff import ProbDiffCallback
    from probdiff_callback.models import peft_without_deprecated_alias_warning

    train_dataset, eval_dataset, masking = loss_datasets(tokenizer, train_rows, eval_rows, args.assistant_only_loss)
    say(LOSS_MASKING_NOTES[masking])
    if masking == "spans":
        args.assistant_only_loss = False  # the masks in the tokenized rows keep the loss on assistant turns
    if args.world_size > 1 and args.device.type == "cpu":
        read_indexed_cpu_locations_as_cpu()
    with peft_without_deprecated_alias_warning():
        trainer = trainer_class(plain_loss=args.use_cpu, base_model=resolved_model_name(recipe.model))(
            model=model,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            peft_config=peft_config,
        )
    if peft_config is not None and trainer.is_world_process_zero():
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        targets = trainer.model.peft_config["default"].target_modules  # names as peft resolved them
        modules = ", ".join(sorted({name.rsplit(".", 1)[-1] for name in targets}))
        say(f"LoRA r={recipe.lora.r} on {modules}: {trainable / 1e6:,.2f}M trainable parameters")
    preemption = PreemptionCallback(trainer)
    trainer.add_callback(preemption)  # first: its signal handlers are in place for the baseline evaluation
    probdiff = ProbDiffCallback(trainer, queries, recipe.probdiff, preemption=preemption)
    trainer.add_callback(probdiff)
    trainer.add_callback(SelfContainedCheckpoints(tokenizer, model.generation_config))
    if problem := probdiff.setup_problem(args):  # before training: one line, not a traceback from every rank
        raise RecipeError(problem)
    return trainer, preemption


@functools.cache  # once per process: torch keeps the registration
def read_indexed_cpu_locations_as_cpu() -> None:
    """transformers before 5.18 resumes a run of several CPU processes with `torch.load(map_location=args.device)`,
    "cpu:N", which torch cannot restore to, so the resume dies in the optimizer's state (5.18 passes "cpu"). Before
    5.18, such a location is read as the CPU, through torch's public registry of storage locations."""
    import torch
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.18"):
        torch.serialization.register_package(
            30, lambda storage: None, lambda storage, location: storage if location.startswith("cpu:") else None
        )


def trainer_class(plain_loss: bool, base_model: str):
    """SFTTrainer whose model card names the base model, and, with `plain_loss`, the model's own cross-entropy.

    trl writes "a fine-tuned version of [None](https://huggingface.co/None)" for a base model loaded from a
    local directory (the `tiny` preset, a converted checkpoint); the card names it instead.

    Without Triton (on the CPU) trl runs its fused, tiled LM-head loss as many small torch ops over every
    position (with entropy and top-1 side outputs), several times slower per step than the plain loss on the
    tiny model's large vocabulary head. The loss is the same (assistant tokens only, through the same labels);
    trl's entropy and token-accuracy logs are left out.

    A run resumed from a checkpoint at `max_steps` (stopped at its last step: in its evaluation, or while it waited
    for the evaluator beside it) trains no step: transformers' loop checks `max_steps` only after a step, and would
    train one more (another checkpoint, evaluation and history row; with a constant learning rate, other weights).
    Given no batch, the loop ends before that step, and the end of training runs as after the last one.
    """
    from transformers import Trainer
    from trl import SFTTrainer

    class RecipeSFTTrainer(SFTTrainer):
        def get_batch_samples(self, epoch_iterator, num_batches, device):
            if 0 < self.state.max_steps <= self.state.global_step:
                self.control.should_training_stop = True
                return [], None
            return super().get_batch_samples(epoch_iterator, num_batches, device)

        def create_model_card(self, *args, **kwargs):
            with no_link_to_offline_wandb_run():
                super().create_model_card(*args, **kwargs)
            card = Path(self.args.output_dir) / "README.md"
            if self.is_world_process_zero() and card.is_file():
                card.write_text(name_local_base_model(card.read_text(encoding="utf-8"), base_model), encoding="utf-8")

        if plain_loss:

            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                inputs["use_cache"] = False
                return Trainer.compute_loss(
                    self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
                )

    return RecipeSFTTrainer


def no_link_to_offline_wandb_run():
    """While trl writes the model card (at every checkpoint), W&B counts as absent when its run is offline.

    trl links the card to the W&B run by reading `wandb.run.url`, which an offline run answers with None and the
    warning "URL not available in offline run", once per checkpoint; offline there is no URL to link, so trl's own
    check (`is_wandb_available` in the module that writes the card) says no for that long."""
    import sys
    from unittest import mock

    from trl import SFTTrainer

    card_module = sys.modules[SFTTrainer.create_model_card.__module__]
    wandb = getattr(card_module, "wandb", None)
    if wandb is None or wandb.run is None or not wandb.run.offline or not hasattr(card_module, "is_wandb_available"):
        return contextlib.nullcontext()
    return mock.patch.object(card_module, "is_wandb_available", lambda: False)


def resolved_model_name(model: str) -> str:
    """The hub id of a preset, `probdiff tiny` / `probdiff smollm2` for the CPU presets, else the directory or id."""
    from probdiff_callback.models import PRESET_HUB_IDS

    return PRESET_HUB_IDS.get(model, f"probdiff {model}" if model in ("tiny", "smollm2") else model)


def name_local_base_model(card: str, base_model: str) -> str:
    """trl's model card with `[None](https://huggingface.co/None)` replaced by the base model's name."""
    named = f"[{base_model}](https://huggingface.co/{base_model})" if base_model.count("/") == 1 else f"`{base_model}`"
    return card.replace("[None](https://huggingface.co/None)", named).replace(
        'model="None"', 'model="<this directory>"'
    )


def save_inference_files(directory: Path, tokenizer, generation_config) -> None:
    """Tokenizer (with its chat template) and generation_config.json (stop ids) beside the weights, so
    `probdiff eval --model <base> --adapter <directory>` works on the directory as it is."""
    if not (directory / "tokenizer_config.json").is_file():
        tokenizer.save_pretrained(directory)
    generation_config.save_pretrained(directory)


class SelfContainedCheckpoints(TrainerCallback):
    """Each checkpoint gets the files `save_inference_files` writes."""

    def __init__(self, tokenizer, generation_config) -> None:
        self.tokenizer, self.generation_config = tokenizer, generation_config

    def on_save(self, args, state, control, **kwargs):
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and checkpoint.is_dir():
            save_inference_files(checkpoint, self.tokenizer, self.generation_config)
