"""Supervised fine-tuning (LoRA or full) with ProbDiff self-evaluation at every checkpoint.

    accelerate launch [--config_file recipes/accelerate/<name>.yaml] train/sft.py recipe=blog [key=value ...]
    python train/sft.py recipe=blog model=tiny

`recipe=NAME` reads recipes/NAME.yaml; `key=value` overrides any of its keys (nested with dots:
`lora.r=8`, `probdiff.delta=-0.02`, `probdiff.n_queries=50`). See the README.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from transformers import TrainerCallback

from probdiff_callback.recipe import (
    Recipe,
    RecipeError,
    configure_threads,
    count_without_assistant_tokens,
    data_files,
    fail,
    format_table,
    heldout_queries,
    is_main_process,
    load_recipe,
    pct,
    quantization_config,
    read_conversations,
    report_to_list,
    resolve_run,
    setup_wandb,
    subset,
)


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    # 1. Config: recipe + overrides, threads, run directory, W&B
    try:
        recipe = load_recipe(sys.argv[1:] if argv is None else argv)
        run_dir, resume_from = resolve_run(recipe)
        wandb_sync = setup_wandb(recipe, run_dir)
    except RecipeError as err:
        fail(str(err))
    threads, why = configure_threads(recipe.threads)
    say(f"recipe {recipe.recipe}: model {recipe.model}, run directory {run_dir}; {threads} CPU threads per process ({why})")

    # 2. Data: conversations for the loss, held-out queries for ProbDiff (a bad file stops before anything is written)
    train_rows, eval_rows, queries = load_data(recipe)

    # 3. Model files: built or unpacked on first use (the `tiny` preset) before any distributed or DeepSpeed
    #    context exists; every rank waits for the one complete copy
    prepare_model_files(recipe.model)
    args = training_arguments(recipe, run_dir)
    if is_main_process():
        run_dir.mkdir(parents=True, exist_ok=True)
        save_resolved_config(recipe, run_dir / "recipe.yaml")

    # 4. Model and tokenizer
    model, tokenizer = load_model(recipe)
    report_truncation(tokenizer, train_rows, eval_rows, recipe.max_seq_length)

    # 5. LoRA (or all weights)
    peft_config = lora_config(recipe)

    # 6. Trainer with the ProbDiff callback
    trainer = build_trainer(recipe, args, model, tokenizer, train_rows, eval_rows, peft_config, queries)

    # 7. Train (one W&B run per training run: resuming continues, and rewinds, the run of the first start)
    if "wandb" in report_to_list(recipe) and is_main_process():
        wandb_sync = start_wandb(recipe, run_dir, resume_from, args.run_name) or wandb_sync
    trainer.train(resume_from_checkpoint=resume_from)

    # 8. Save the final weights, select and name the best checkpoint, say where everything is
    final_dir = run_dir / "final"
    trainer.save_model(str(final_dir))
    if trainer.is_world_process_zero():
        save_inference_files(final_dir, tokenizer, model.generation_config)
        summarize_run(trainer, recipe, run_dir, final_dir, wandb_sync, time.time() - started)
    trainer.accelerator.wait_for_everyone()
    return 0


# --- the steps' details ---------------------------------------------------------------------------
def say(message: str) -> None:
    if is_main_process():
        print(message, flush=True)


def load_data(recipe: Recipe):
    """(training conversations, eval-loss conversations, ProbDiff queries): the prepared files, or the
    samples with a notice; a missing file or a bad row stops with its message."""
    from probdiff_callback.io import DataFileError

    try:
        train_file, heldout_file, notices = data_files(recipe)
        for notice in notices:
            say(notice)
        train_rows = read_conversations(train_file)
        eval_rows = subset(read_conversations(heldout_file), recipe.max_eval_samples, recipe.seed)
        queries = heldout_queries(heldout_file)
    except (RecipeError, DataFileError) as err:
        fail(str(err))
    n_probdiff = min(len(queries), recipe.probdiff.n_queries or len(queries))
    say(f"data: {len(train_rows)} training conversations ({train_file}), {len(eval_rows)} for the eval loss and "
        f"{n_probdiff} of {len(queries)} held-out queries for ProbDiff ({heldout_file})")
    return train_rows, eval_rows, queries


def save_resolved_config(recipe: Recipe, path: Path) -> None:
    from omegaconf import OmegaConf

    path.write_text(f"# resolved recipe: python train/sft.py recipe={recipe.recipe} ... (all layers applied)\n" + OmegaConf.to_yaml(recipe.to_dict()), encoding="utf-8")


def prepare_model_files(name: str) -> None:
    from probdiff_callback.models import resolve_model_path

    try:
        resolve_model_path(name)
    except (FileNotFoundError, ValueError) as err:
        fail(f"model={name}: {err}")


def training_arguments(recipe: Recipe, run_dir: Path):
    """trl.SFTConfig from the recipe. Built before the model is loaded, so that DeepSpeed ZeRO-3 can
    partition the weights while they load."""
    import torch
    from trl import SFTConfig

    reports = report_to_list(recipe)
    return SFTConfig(
        output_dir=str(run_dir),
        run_name=f"{recipe.recipe}/{run_dir.name}",
        # loss on the assistant turns only: the chat template's {% generation %} markers, a `messages` column
        assistant_only_loss=True,
        max_length=recipe.max_seq_length,
        packing=False,
        learning_rate=recipe.learning_rate,
        num_train_epochs=recipe.num_train_epochs,
        max_steps=recipe.max_steps,
        per_device_train_batch_size=recipe.per_device_train_batch_size,
        per_device_eval_batch_size=recipe.per_device_eval_batch_size,
        gradient_accumulation_steps=recipe.gradient_accumulation_steps,
        weight_decay=recipe.weight_decay,
        adam_beta2=recipe.adam_beta2,
        warmup_steps=recipe.warmup_ratio,  # a float in [0, 1) is a share of the steps
        lr_scheduler_type=recipe.lr_scheduler_type,
        max_grad_norm=recipe.max_grad_norm,
        bf16=recipe.bf16,
        activation_checkpointing=recipe.gradient_checkpointing,  # transformers 5's name for gradient checkpointing
        activation_checkpointing_kwargs={"use_reentrant": False},
        eval_strategy="steps",
        eval_steps=recipe.eval_steps,
        eval_on_start=True,  # the eval loss of the base model, beside the ProbDiff baseline
        save_strategy="steps",
        save_steps=recipe.save_steps,
        save_total_limit=recipe.save_total_limit,
        metric_for_best_model=recipe.metric_for_best_model,
        greater_is_better=not recipe.metric_for_best_model.endswith("loss"),
        logging_steps=recipe.logging_steps,
        logging_first_step=True,
        seed=recipe.seed,
        dataloader_num_workers=recipe.dataloader_num_workers,
        report_to=reports or "none",
        push_to_hub=recipe.push_to_hub,
        hub_model_id=recipe.hub_model_id,
        use_cpu=not torch.cuda.is_available(),
        ddp_find_unused_parameters=False,  # every trainable weight (adapters or all) gets a gradient each step
    )


def load_model(recipe: Recipe):
    import os

    from probdiff_callback.models import load_model_and_tokenizer

    kwargs = {"attn_implementation": recipe.attn_implementation}
    try:
        quantization = quantization_config(recipe)
    except RecipeError as err:
        fail(str(err))
    if quantization is not None:
        kwargs.update(quantization_config=quantization, device_map={"": int(os.environ.get("LOCAL_RANK", "0"))})
    started = time.time()
    model, tokenizer = load_model_and_tokenizer(recipe.model, dtype=recipe.dtype, **kwargs)
    if quantization is not None:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=recipe.gradient_checkpointing)
    model.config.use_cache = False  # training; the ProbDiff evaluation turns the cache on for generation
    ensure_generation_markers(tokenizer, recipe.model)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"model: {recipe.model} loaded in {time.time() - started:.0f}s ({n_params / 1e6:,.1f}M parameters, {recipe.dtype}"
        f"{', 4-bit NF4' if quantization is not None else ''})")
    return model, tokenizer


def ensure_generation_markers(tokenizer, model_name: str) -> None:
    """The assistant-only loss needs `{% generation %}` markers in the chat template. Ours (Qwen v1, tiny)
    has them; a chatml template without them (Qwen1.5-Chat's) is replaced by ours, the same format with
    markers. Other templates are left to trl, which patches the ones it knows and stops on the rest."""
    from probdiff_callback.tokenizer import CHATML_TEMPLATE

    template = tokenizer.chat_template or ""
    if "generation" not in template and "<|im_start|>" in template:
        tokenizer.chat_template = CHATML_TEMPLATE
        say(f"{model_name}: its chatml template has no generation markers; using the project's chatml template "
            "(same format, with {% generation %} around the assistant turns) for the assistant-only loss")


def report_truncation(tokenizer, train_rows: list[dict], eval_rows: list[dict], max_length: int) -> None:
    """Conversations whose assistant turns lie wholly past max_length train nothing: trl drops them
    silently, so count and name them here."""
    for name, rows in (("training", train_rows), ("eval-loss", eval_rows)):
        lost = count_without_assistant_tokens(tokenizer, rows, max_length)
        if lost:
            shown = ", ".join(lost[:10]) + (" ..." if len(lost) > 10 else "")
            say(f"warning: {len(lost)} of {len(rows)} {name} conversations keep no assistant token after truncation to "
                f"max_seq_length={max_length} and are left out by the trainer: {shown}")
        else:
            say(f"{name} conversations: all {len(rows)} keep assistant tokens within max_seq_length={max_length}")


def lora_config(recipe: Recipe):
    if not recipe.lora.enabled:
        say("LoRA off: training all weights")
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=recipe.lora.r,
        lora_alpha=recipe.lora.alpha,
        lora_dropout=recipe.lora.dropout,
        target_modules=list(recipe.lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def build_trainer(recipe, args, model, tokenizer, train_rows, eval_rows, peft_config, queries):
    from datasets import Dataset

    from probdiff_callback.callback import ProbDiffCallback
    from probdiff_callback.models import peft_without_deprecated_alias_warning

    with peft_without_deprecated_alias_warning():
        trainer = trainer_class(plain_loss=args.use_cpu, base_model=resolved_model_name(recipe.model))(
            model=model,
            args=args,
            train_dataset=Dataset.from_list([{"messages": r["messages"]} for r in train_rows]),
            eval_dataset=Dataset.from_list([{"messages": r["messages"]} for r in eval_rows]),
            processing_class=tokenizer,
            peft_config=peft_config,
        )
    if peft_config is not None and trainer.is_world_process_zero():
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        say(f"LoRA r={recipe.lora.r} on {', '.join(recipe.lora.target_modules)}: {trainable / 1e6:,.2f}M trainable parameters")
    trainer.add_callback(ProbDiffCallback(trainer, queries, recipe.probdiff))
    trainer.add_callback(SelfContainedCheckpoints(tokenizer, model.generation_config))
    trainer.add_callback(RecipeToWandb(recipe))
    return trainer


def start_wandb(recipe: Recipe, run_dir: Path, resume_from: str | None, run_name: str) -> str | None:
    """Start (or continue) the training run's W&B run; the `wandb sync` command when offline, else None."""
    import os

    from probdiff_callback.wandb_run import start_run, sync_command

    wandb_dir = Path(os.environ.get("WANDB_DIR") or run_dir) / "wandb"
    started = start_run(run_dir, resume_from, project=os.environ.get("WANDB_PROJECT") or f"probdiff-{recipe.recipe}",
                        name=run_name, wandb_dir=wandb_dir)
    say(started.message)
    if os.environ.get("WANDB_MODE") in ("offline", "dryrun"):
        return sync_command(wandb_dir, started.run_id)
    return None


def trainer_class(plain_loss: bool, base_model: str):
    """SFTTrainer whose model card names the base model, and, with `plain_loss`, the model's own cross-entropy.

    trl writes "a fine-tuned version of [None](https://huggingface.co/None)" for a base model loaded from a
    local directory (the `tiny` preset, a converted checkpoint); the card names it instead.

    Without Triton (on the CPU) trl runs its fused, tiled LM-head loss as many small torch ops over every
    position (with entropy and top-1 side outputs), several times slower per step than the plain loss on the
    tiny model's 152,064-row head. The loss is the same (assistant tokens only, through the same labels);
    trl's entropy and token-accuracy logs are left out.
    """
    from transformers import Trainer
    from trl import SFTTrainer

    class RecipeSFTTrainer(SFTTrainer):
        def create_model_card(self, *args, **kwargs):
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


def resolved_model_name(model: str) -> str:
    """The hub id of a preset, `probdiff tiny` for the embedded model, else the directory or id as given."""
    from probdiff_callback.models import PRESET_HUB_IDS

    return PRESET_HUB_IDS.get(model, "probdiff tiny" if model == "tiny" else model)


def name_local_base_model(card: str, base_model: str) -> str:
    """trl's model card with `[None](https://huggingface.co/None)` replaced by the base model's name."""
    named = f"[{base_model}](https://huggingface.co/{base_model})" if base_model.count("/") == 1 else f"`{base_model}`"
    return card.replace("[None](https://huggingface.co/None)", named).replace('model="None"', 'model="<this directory>"')


def save_inference_files(directory: Path, tokenizer, generation_config) -> None:
    """Tokenizer (with its chat template) and generation_config.json (stop ids) beside the weights, so
    `probdiff eval --model <base> --adapter <directory>` works on the directory as it is."""
    if not (directory / "tokenizer_config.json").is_file():
        tokenizer.save_pretrained(directory)
    generation_config.save_pretrained(directory)


class SelfContainedCheckpoints(TrainerCallback):
    def __init__(self, tokenizer, generation_config) -> None:
        self.tokenizer, self.generation_config = tokenizer, generation_config

    def on_save(self, args, state, control, **kwargs):
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and checkpoint.is_dir():
            save_inference_files(checkpoint, self.tokenizer, self.generation_config)


class RecipeToWandb(TrainerCallback):
    """The resolved recipe in the W&B run's config (the Trainer's integration sends only its own arguments)."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and "wandb" in (args.report_to or []):
            import wandb

            if wandb.run is not None:
                wandb.run.config.update({"recipe": self.recipe.to_dict()}, allow_val_change=True)


def reference_cell(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.2f}"


def summarize_run(trainer, recipe: Recipe, run_dir: Path, final_dir: Path, wandb_sync: str | None, seconds: float) -> None:
    from probdiff_callback import history, versus_base
    from probdiff_callback.agreement import crosscheck, load_run, one_line
    from probdiff_callback.plotting import plot_run
    from probdiff_callback.reference_metrics import METRIC_LABELS
    from probdiff_callback.selection import format_selection, point_best, select_checkpoints

    subdir = recipe.probdiff.output_subdir
    rows = [r for r in history.read_history(history.history_path(run_dir, subdir)) if r.get("summary") is not None]
    logs = trainer.state.log_history
    overall = [(r["summary"].get("reference") or {}).get("overall", {}) for r in rows]
    references = [name for name in METRIC_LABELS if any(name in values for values in overall)]

    def last(key: str, step: int) -> str:
        values = [e[key] for e in logs if key in e and e.get("step", 0) <= step]
        return f"{values[-1]:.4f}" if values else "-"

    table = []
    for row in rows:
        s = row["summary"]
        low, high = s["confidence_ci"]
        d_mean = s["d_mean"]
        table.append([
            str(row["global_step"]), row["kind"], last("loss", row["global_step"]) if row["global_step"] else "-",
            last("eval_loss", row["global_step"]), pct(s["confidence"]), f"[{pct(low)}, {pct(high)}]",
            "n/a" if d_mean is None or not math.isfinite(d_mean) else f"{d_mean:+.4f}", str(s["n"]),
            # histories written before the cap was counted have no n_capped
            f"{s['n_capped']}/{s['n_revision_capped']}" if "n_capped" in s else "-",
            versus_base.format_win_tie_lose(row.get("vs_base")), versus_base.format_p(row.get("vs_base")),
            *[reference_cell((s.get("reference") or {}).get("overall", {}).get(name)) for name in references],
        ])
    print(f"\nProbDiff over training (delta {recipe.probdiff.delta:g}; loss: last logged training loss up to the step; "
          f"capped: answers/revisions that hit max_new_tokens={recipe.probdiff.max_new_tokens} without an end-of-turn "
          "token; vs base: win/tie/lose against the base model on the same queries, with the Wilcoxon p)")
    print(format_table(["step", "kind", "loss", "eval loss", "confidence", "95% CI", "mean d", "n", "capped", "vs base",
                        "p", *[METRIC_LABELS[name] for name in references]], table))
    if rows and not references:
        print("(no reference metric for these queries: blog and AlignBench answers have none)")
    try:
        print(one_line(crosscheck(*load_run(run_dir, subdir))) + f"; details: probdiff crosscheck {run_dir}")
    except FileNotFoundError as err:
        print(f"no cross-check: {err}")
    best_dir = None
    try:
        selection = select_checkpoints(run_dir, subdir)
        print("\n" + format_selection(selection))
        if selection.best_checkpoint is not None:
            best_dir = point_best(run_dir, selection.best_checkpoint.checkpoint)
    except FileNotFoundError as err:
        print(f"no checkpoint selection: {err}")
    plot = None
    try:
        plot = plot_run(run_dir, subdir=subdir)
    except FileNotFoundError as err:
        print(f"no plot: {err}")
    print(f"\ndone in {seconds / 60:.1f} min. Run directory {run_dir}:")
    print(f"  recipe as run        {run_dir / 'recipe.yaml'}")
    print(f"  ProbDiff history     {history.history_path(run_dir, subdir)}")
    if plot is not None:
        print(f"  plot                 {plot}")
    print(f"  final weights        {final_dir}")
    if best_dir is not None:
        print(f"  best checkpoint      {best_dir} -> {selection.best_checkpoint.checkpoint}")
        print(f"  evaluate it          probdiff eval --model {recipe.model} --adapter {best_dir} --queries <held-out file> --out <dir>"
              if recipe.lora.enabled else f"  evaluate it          probdiff eval --model {best_dir} --queries <held-out file> --out <dir>")
    print(f"  rank again           probdiff select {run_dir}")
    print(f"  cross-check          probdiff crosscheck {run_dir}")
    if wandb_sync:
        print(f"  W&B (offline: not logged in); upload with: {wandb_sync}")


if __name__ == "__main__":
    sys.exit(main())
