"""Small SFT runs with ProbDiffCallback on the `tiny` preset, shared by the callback tests.

Imported by the tests for `build_trainer`, and launched by tests/e2e/test_distributed.py
as a script under `accelerate launch` (DDP or DeepSpeed ZeRO-3 over gloo on CPU):

    accelerate launch --num_processes 2 --multi_gpu tests/_distributed_eval.py --mode ddp --out DIR

The script trains 2 LoRA steps with the callback (baseline, then an evaluation at the
checkpoint of step 2; the Trainer's eval loss at both, kept per conversation; with --vllm
the texts of both written by vLLM), evaluates the final weights again with HF `generate`,
the parameters gathered and (ZeRO-3) left sharded, checks that a failure on rank 1 reaches
every rank, has every rank compute the per-conversation eval losses of the final weights
by a pass of their own (the reference for what the callback tapped from the Trainer's
evaluation), and writes what each rank saw to DIR/rank-<r>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN_FILE = REPO / "data" / "samples" / "blog" / "train.jsonl"
QUERY_FILE = REPO / "data" / "samples" / "alignbench" / "heldout.jsonl"
N_QUERIES = 5  # odd, so two ranks need padding
EVAL_LOSS_ROWS = range(8, 13)  # 5 held-out conversations in batches of 2: the ranks' last batches are padded
EVAL_SETTINGS = dict(max_new_tokens=8, batch_size=8, seed=3)


def probdiff_config(**options):
    """The tests' evaluation settings, with the callback's `options` (n_queries, every, ...)."""
    from probdiff_callback.core.config import ProbDiffConfig

    return ProbDiffConfig(**{**EVAL_SETTINGS, **options})


def held_out_queries():
    from probdiff_callback.core.queries import load_queries

    return load_queries(QUERY_FILE)


def chat_dataset(n_rows: int):
    from datasets import Dataset

    rows = [json.loads(line) for line in TRAIN_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]
    return Dataset.from_list([{"messages": row["messages"]} for row in rows[:n_rows]])


def load_tiny(model_path: str | Path):
    """The model at `model_path` (the `tiny` preset's directory) for training, with its tokenizer. The preset's
    directory loads as the preset does (`model=tiny`, as train/sft.py loads it): its tokenizer read straight from
    tokenizer.json, in a fraction of a second where AutoTokenizer takes seconds, and hashed by `datasets` (which
    fingerprints each `map` of the trainer's data with it) ten times faster."""
    from probdiff_callback.models import load_model_and_tokenizer
    from probdiff_callback.models.presets import tiny_model_dir

    name = "tiny" if Path(model_path).resolve() == tiny_model_dir().resolve() else str(model_path)
    model, tokenizer = load_model_and_tokenizer(name, dtype="float32")
    model.train()
    return model, tokenizer


def build_trainer(
    model_path: str | Path,
    output_dir: str | Path,
    *,
    lora: bool = True,
    plain_trainer: bool = False,
    n_train_rows: int = 16,
    eval_rows: range = range(2),
    callbacks: list | None = None,
    **training_args,
):
    """An SFTTrainer (LoRA by default) or a plain Trainer (full fine-tuning) on a fresh copy
    of the tiny model: 64-token blog samples, batch 2, fp32 on CPU, no reporting; `eval_rows` of the training
    rows are the eval dataset."""
    from peft import LoraConfig

    model, tokenizer = load_tiny(model_path)
    settings = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        learning_rate=5e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        seed=7,
        data_seed=7,
        disable_tqdm=True,
        save_only_model=False,
        dataloader_num_workers=0,
        bf16=False,
    )
    settings.update(training_args)
    if plain_trainer:
        from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

        texts = [tokenizer.apply_chat_template(row["messages"], tokenize=False) for row in chat_dataset(n_train_rows)]
        encoded = [tokenizer(text, truncation=True, max_length=64) for text in texts]
        from datasets import Dataset

        dataset = Dataset.from_list(
            [{"input_ids": e["input_ids"], "attention_mask": e["attention_mask"]} for e in encoded]
        )
        return Trainer(
            model=model,
            args=TrainingArguments(**settings),
            train_dataset=dataset,
            eval_dataset=dataset.select(eval_rows),
            data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
            processing_class=tokenizer,
            callbacks=callbacks,
        )
    from trl import SFTConfig, SFTTrainer

    from probdiff_callback.training.recipe import as_installed

    dataset = chat_dataset(n_train_rows)
    return SFTTrainer(
        model=model,
        # trl's default (activation checkpointing on) under the installed transformers' name for it
        args=SFTConfig(
            **as_installed(
                dict(max_length=64, packing=False, dataset_num_proc=None, activation_checkpointing=True, **settings)
            )
        ),
        train_dataset=dataset,
        eval_dataset=dataset.select(eval_rows),
        processing_class=tokenizer,
        callbacks=callbacks,
        peft_config=LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
        )
        if lora
        else None,
    )


def eval_losses_by_a_pass_of_their_own(trainer) -> list[float]:
    """Each eval conversation's loss computed apart from the Trainer's evaluation, as a reference for what the callback
    taps from it: the trainer's model (through the DeepSpeed engine under DeepSpeed) over the trainer's eval
    dataloader, eval mode and no gradients, each row's loss gathered as the Trainer gathers its losses."""
    import torch

    from probdiff_callback.callback.eval_losses import row_losses

    model = trainer.model_wrapped if getattr(trainer, "is_deepspeed_enabled", False) else trainer.model
    was_training, gathered = model.training, []
    model.eval()
    try:
        with torch.no_grad():
            for batch in trainer.get_eval_dataloader():
                inputs = {k: v for k, v in batch.items() if k != "labels"}
                logits = model(**inputs, use_cache=False).logits
                gathered += trainer.accelerator.gather_for_metrics(row_losses(logits, batch["labels"])).tolist()
    finally:
        model.train(was_training)
    return gathered


def _zero3_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ddp", "zero3"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--vllm", action="store_true", help="generate through vLLM (colocate): train, evaluate, stop")
    args = parser.parse_args(argv)

    import probdiff_callback.callback.trainer_evaluation as evaluation_module
    from probdiff_callback.callback.probdiff import ProbDiffCallback

    extra = {"deepspeed": _zero3_config()} if args.mode == "zero3" else {}
    trainer = build_trainer(args.model, Path(args.out) / "run", max_steps=2, save_steps=2, eval_rows=EVAL_LOSS_ROWS,
                            eval_strategy="steps", eval_steps=2, eval_on_start=True, **extra)  # fmt: skip
    config = probdiff_config(n_queries=N_QUERIES, fail_on_error=True, use_vllm=args.vllm)
    callback = ProbDiffCallback(trainer, held_out_queries(), config)
    trainer.add_callback(callback)
    trainer.train()
    rank = trainer.accelerator.process_index

    seen: dict = {"rank": rank, "world_size": trainer.accelerator.num_processes, "history_metrics": callback.evaluated}
    if args.vllm:  # the run's engine is stopped at the end of training: what the callback logged last is its result
        seen["last"] = outcome_seen(callback.way.state.last_outcome)
    seen["gathered"] = outcome_seen(evaluate_after_training(callback, gather_params=True))
    if args.mode == "zero3":
        seen["sharded"] = outcome_seen(evaluate_after_training(callback, gather_params=False))

    real_evaluate = evaluation_module.evaluate

    def fail_on_rank_1(*a, **k):
        if rank == 1:
            raise RuntimeError("injected failure on rank 1")
        return real_evaluate(*a, **k)

    evaluation_module.evaluate = fail_on_rank_1
    failed = evaluate_after_training(callback, gather_params=True)
    evaluation_module.evaluate = real_evaluate
    seen["failed"] = {"error": failed.error, "metrics": failed.metrics, "records": failed.records}
    seen["final_losses"] = eval_losses_by_a_pass_of_their_own(trainer)

    return _write_seen(args.out, rank, seen, trainer)


def evaluate_after_training(callback, **settings):
    """`callback.evaluate_model()` with HF `generate` and `settings` (gather_params): the engine and its settings were
    decided when training began, as a copy of the callback's config (`in_loop.config`), which the evaluation reads."""
    decided = callback.in_loop.config
    callback.in_loop.config = dataclasses.replace(decided, use_vllm=False, **settings)
    try:
        return callback.evaluate_model()
    finally:
        callback.in_loop.config = decided


def outcome_seen(outcome) -> dict:
    return {"records": outcome.records, "summary": outcome.summary, "error": outcome.error, "cost": outcome.cost}


def _write_seen(out: str, rank: int, seen: dict, trainer) -> int:
    from probdiff_callback.runs.run_files import write_json

    write_json(Path(out) / f"rank-{rank}.json", seen)
    trainer.accelerator.wait_for_everyone()
    return 0


if __name__ == "__main__":
    sys.exit(main())
