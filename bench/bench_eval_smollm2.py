"""`probdiff eval` on a real architecture against a plain batched `model.generate` pipeline doing the same work,
both as whole processes (imports and model load included), measured side by side in one run.

The model is the `smollm2` preset (SmolLM2-135M-Instruct: 30 layers, grouped-query attention, float32 on CPU). The
queries are the paper's MT-Bench questions (first turns) when ../shared/data is present, else the shipped English
summarization samples. Both sides answer at temperature 0.7, revise at 0.1 with the Response Refinement Prompt, in
batches of the same size, then score answers and revisions (bench/_plain_generate.py is the plain side). The two
processes run alternately `--pairs` times and the ratio is taken of the medians, since the machine's speed drifts.

A second measurement shows why the preset is float32 on the CPU: one forward over the same tokens in float32 and in
bfloat16.

Run: python bench/bench_eval_smollm2.py [--pairs 3] [--limit 16] [--max-new-tokens 128] [--batch-size 8]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _side_by_side import ROOT, alternately, probdiff_eval

MT_BENCH = ROOT.parent / "shared" / "data" / "probdiff-reference" / "mtbench" / "question.jsonl"
SAMPLES = ROOT / "data" / "samples" / "summarization" / "heldout.jsonl"


def forward_seconds(dtype: str, tokens: int = 300, rows: int = 8) -> float:
    code = (
        "import time, torch; from transformers import AutoModelForCausalLM;"
        "from probdiff_callback.models import resolve_model_path; from probdiff_callback.runtime.threads import "
        f"configure_threads; configure_threads(); m = AutoModelForCausalLM.from_pretrained(resolve_model_path("
        f"'smollm2'), dtype=torch.{dtype}).eval(); x = torch.randint(0, 49152, ({rows}, {tokens}));"
        "m.model(x[:, :8]); t = time.perf_counter();\nwith torch.no_grad(): m.model(x)\n"
        "print(time.perf_counter() - t)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return float(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=3, help="alternating runs of each process [3]")
    parser.add_argument("--limit", type=int, default=16, help="queries [16]")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="cap of answers and revisions [128]")
    parser.add_argument("--batch-size", type=int, default=8, help="queries per batch, both sides [8]")
    args = parser.parse_args()
    subprocess.run(  # dequantize the preset once, outside the timings
        [
            sys.executable,
            "-c",
            "from probdiff_callback.models import resolve_model_path; resolve_model_path('smollm2')",
        ],
        cwd=ROOT,
        check=True,
    )
    queries = MT_BENCH if MT_BENCH.is_file() else SAMPLES
    print(
        f"load average {os.getloadavg()[0]:.2f}; smollm2 (float32, CPU), {args.limit} queries of {queries}, "
        f"max_new_tokens {args.max_new_tokens}, batch {args.batch_size}, K = 1"
    )
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        ours_command = probdiff_eval("smollm2", queries, args.limit, tmp / "ours", args.max_new_tokens, args.batch_size)
        plain_command = [
            sys.executable, "bench/_plain_generate.py", "smollm2", str(queries), str(args.limit),
            str(args.max_new_tokens), str(args.batch_size), str(tmp / "plain.json"),
        ]  # fmt: skip
        runs = alternately(args.pairs, ours_command, plain_command)
        ours_s, plain_s = runs.medians()
        summary = json.loads((tmp / "ours" / "summary.json").read_text())
        plain = json.loads((tmp / "plain.json").read_text())
    print(
        f"end to end   probdiff eval {ours_s:6.1f} s   plain batched generate {plain_s:6.1f} s   "
        f"ratio (plain / ours) {plain_s / ours_s:4.2f}x   {runs.note()}"
    )
    ours_length = (summary["len_response_mean"] + summary["len_revised_mean"]) / 2
    print(
        f"             mean length of answers and revisions: ours {ours_length:.1f} tokens "
        f"({summary['n_capped']} answers, {summary['n_revision_capped']} revisions capped), "
        f"plain {plain['mean_length']:.1f} tokens; load average now {os.getloadavg()[0]:.2f}"
    )
    fp32, bf16 = forward_seconds("float32"), forward_seconds("bfloat16")
    print(f"one forward of 8 x 300 tokens: float32 {fp32:.2f} s, bfloat16 {bf16:.2f} s ({bf16 / fp32:.1f}x float32)")


if __name__ == "__main__":
    main()
