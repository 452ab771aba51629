"""A small SFT run whose eval loss is kept per conversation, shared by tests/test_eval_losses.py: imported for the
single-process runs, and launched as a script on 2 processes (DDP over gloo on CPU):

    accelerate launch --num_processes 2 --multi_gpu tests/_distributed_eval_losses.py --mode ddp --model DIR --out DIR

(or DeepSpeed ZeRO-3 with `--use_deepspeed --zero_stage 3 ... --mode zero3`).

The script trains one LoRA step with ProbDiffCallback (the Trainer's eval loss at steps 0 and 1, on 5 conversations in
batches of 2, so the ranks' last batches are padded), then has every rank compute the per-conversation losses of the
final weights once more, and writes what each rank holds to DIR/rank-<r>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
N_EVAL = 5  # odd: 2 ranks with batches of 2 pad their last batch


def build_trainer(model_path: str | Path, output_dir: str | Path, n_eval: int = N_EVAL, **training_args):
    """An SFTTrainer with LoRA on a fresh copy of the tiny model, `n_eval` held-out blog conversations for the eval loss
    (64 tokens, assistant-only loss), evaluated at the start and every step."""
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    sys.path.insert(0, str(REPO / "tests"))
    from _distributed_eval import chat_dataset, load_tiny

    model, tokenizer = load_tiny(model_path)
    dataset = chat_dataset(16)
    settings = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        learning_rate=5e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        max_steps=1,
        eval_strategy="steps",
        eval_steps=1,
        eval_on_start=True,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=7,
        data_seed=7,
        disable_tqdm=True,
        dataloader_num_workers=0,
        bf16=False,
        max_length=64,
        packing=False,
        dataset_num_proc=None,
        activation_checkpointing=True,  # trl's default under its transformers 5 name (the old one warns)
    )
    settings.update(training_args)
    return SFTTrainer(
        model=model,
        args=SFTConfig(**settings),
        train_dataset=dataset,
        eval_dataset=dataset.select(range(8, 8 + n_eval)),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )


def add_callback(trainer) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from _distributed_eval import held_out_queries, probdiff_config

    from probdiff_callback.callback.probdiff import ProbDiffCallback

    trainer.add_callback(ProbDiffCallback(trainer, held_out_queries(), probdiff_config(n_queries=3)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ddp", "zero3"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    from _distributed_eval import _zero3_config

    from probdiff_callback.callback.eval_losses import per_example_eval_losses
    from probdiff_callback.runs.run_files import write_json

    extra = {"deepspeed": _zero3_config()} if args.mode == "zero3" else {}
    trainer = build_trainer(args.model, Path(args.out) / "run", **extra)
    add_callback(trainer)
    trainer.train()
    rank = trainer.accelerator.process_index
    final = per_example_eval_losses(trainer, trainer.get_eval_dataloader())
    seen = {"rank": rank, "world_size": trainer.accelerator.num_processes, "final_losses": final.losses}
    write_json(Path(args.out) / f"rank-{rank}.json", seen)
    trainer.accelerator.wait_for_everyone()
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    sys.exit(main())
