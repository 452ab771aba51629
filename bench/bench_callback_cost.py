"""What one ProbDiffCallback evaluation costs next to the training it watches.

Trains the `tiny` preset with LoRA on the blog samples (SFTTrainer, a few dozen steps,
no callback), then evaluates the trained weights as the callback does (its
`evaluate_model`, on the held-out blog queries) and prints:

  - seconds per training step and for the whole demo run,
  - seconds per evaluation (the first one, with warm-up, and a warm one) and of each of its stages,
  - the evaluation's cost in training steps, and the share of the run's time that
    evaluating every N steps (plus the baseline) adds.

An evaluation makes n_queries x n_samples x (1 + K) generations of at most
max_new_tokens tokens (batched by batch_size) and scores 2 texts per query, 16 per forward.

    python bench/bench_callback_cost.py [--steps 24] [--n-queries 12] [--max-new-tokens 64] [--every 8]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
STAGES = ("answers", "revisions", "scoring", "reference")  # the evaluator's own timing of each (Evaluation.cost)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24, help="training steps of the demo run [24]")
    parser.add_argument("--batch-size", type=int, default=2, help="per-device train batch size [2]")
    parser.add_argument("--max-length", type=int, default=128, help="training sequence length [128]")
    parser.add_argument("--n-queries", type=int, default=12, help="held-out blog queries per evaluation [12]")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="ProbDiff max_new_tokens [64]")
    parser.add_argument("--eval-batch-size", type=int, default=16, help="ProbDiff batch_size [16]")
    parser.add_argument("--every", type=int, default=8, help="evaluate every N steps for the share estimate [8]")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads [torch's default]")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from probdiff_callback.callback.probdiff import ProbDiffCallback
    from probdiff_callback.core.config import ProbDiffConfig
    from probdiff_callback.core.queries import load_queries, read_jsonl
    from probdiff_callback.core.scoring import SCORE_ROWS_PER_FORWARD
    from probdiff_callback.models import load_model_and_tokenizer
    from probdiff_callback.training.recipe import as_installed

    model, tokenizer = load_model_and_tokenizer("tiny", dtype="float32")
    model.train()
    rows = read_jsonl(REPO / "data" / "samples" / "blog" / "train.jsonl")
    queries = load_queries(REPO / "data" / "samples" / "blog" / "heldout.jsonl")
    config = ProbDiffConfig(
        max_new_tokens=args.max_new_tokens, batch_size=args.eval_batch_size, n_queries=args.n_queries
    )
    with tempfile.TemporaryDirectory() as out:
        trainer = SFTTrainer(
            model=model,
            args=SFTConfig(
                **as_installed(  # activation_checkpointing under the installed transformers' name for it
                    dict(
                        output_dir=out,
                        max_steps=args.steps,
                        per_device_train_batch_size=args.batch_size,
                        max_length=args.max_length,
                        learning_rate=2e-3,
                        logging_steps=10,
                        save_strategy="no",
                        eval_strategy="no",
                        report_to="none",
                        use_cpu=True,
                        bf16=False,
                        disable_tqdm=True,
                        seed=0,
                        activation_checkpointing=True,
                    )
                )
            ),
            train_dataset=Dataset.from_list([{"messages": row["messages"]} for row in rows]),
            processing_class=tokenizer,
            peft_config=LoraConfig(
                r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM"
            ),
        )
        callback = ProbDiffCallback(trainer, queries, config)
        started = time.perf_counter()
        trainer.train()
        train_seconds = time.perf_counter() - started
        first = callback.evaluate_model()
        warm = callback.evaluate_model()
    if first.error or warm.error:
        print(first.error or warm.error, file=sys.stderr)
        return 1

    n_queries, cost = len(callback.queries), warm.cost
    generations = n_queries * config.n_samples * (1 + config.n_revisions)
    chains = n_queries * config.n_samples
    batch_sizes = [min(config.batch_size, chains - start) for start in range(0, chains, config.batch_size)]
    per_step = train_seconds / args.steps
    evaluations = args.steps // args.every + 1  # every N steps, plus the baseline
    share = evaluations * warm.seconds / (train_seconds + evaluations * warm.seconds)
    figures = {
        "threads": torch.get_num_threads(),
        "train_steps": args.steps,
        "train_batch_size": args.batch_size,
        "train_max_length": args.max_length,
        "train_seconds": round(train_seconds, 2),
        "seconds_per_step": round(per_step, 3),
        "n_queries": n_queries,
        "max_new_tokens": config.max_new_tokens,
        "generations_per_evaluation": generations,
        "decoding_loops": len(batch_sizes) * (1 + config.n_revisions),
        # two decoder calls (the prompts, then both texts from their cache) per group of SCORE_ROWS_PER_FORWARD / 2
        "scoring_forwards": sum(2 * math.ceil(2 * size / SCORE_ROWS_PER_FORWARD) for size in batch_sizes),
        "generated_tokens": cost.generated_tokens,
        "evaluation_seconds_first": round(first.seconds, 2),
        "evaluation_seconds": round(warm.seconds, 2),
        "stage_seconds": {stage: round(getattr(cost, f"{stage}_seconds"), 2) for stage in STAGES},
        "evaluation_in_training_steps": round(warm.seconds / per_step, 1),
        "every": args.every,
        "evaluations_in_run": evaluations,
        "share_of_run": round(share, 3),
    }
    stages = ", ".join(f"{stage} {seconds:.1f}s" for stage, seconds in figures["stage_seconds"].items())
    print(
        f"demo run: {args.steps} LoRA steps (batch {args.batch_size} x {args.max_length} tokens) "
        f"in {train_seconds:.1f}s, {per_step:.2f}s/step\n"
        f"one evaluation: {n_queries} queries -> {generations} generations of <= {config.max_new_tokens} tokens "
        f"({cost.generated_tokens} generated) in {figures['decoding_loops']} decoding loops "
        f"+ {figures['scoring_forwards']} scoring forwards: {warm.seconds:.1f}s warm ({stages}; {first.seconds:.1f}s "
        f"the first time) = {figures['evaluation_in_training_steps']} training steps\n"
        f"evaluating every {args.every} steps plus the baseline ({evaluations} evaluations): "
        f"{evaluations * warm.seconds:.0f}s, {100 * share:.1f}% of the run's time"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
