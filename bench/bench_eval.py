"""`probdiff eval` against a plain pipeline doing the same work (bench/_plain.py), both as whole processes, side by
side in one run (bench/_side_by_side.py: alternately `--pairs` times, the ratio of the medians), then one measurement
of the same model in a process of its own.

  tiny     the `tiny` preset on the first 32 queries of the paper's Xiaohongshu test set (../shared/data; else the
           shipped blog samples), max_new_tokens 64, batch 32, K = 1, against the reference pipeline's way (`loop`:
           one query, one text at a time); then the peak memory of scoring 8 x 1,024 tokens with the 152k vocabulary,
           ours (chunked LM head) against a plain forward, and both against float64 (bench/_score_memory.py).
  smollm2  SmolLM2-135M-Instruct (30 layers, grouped-query attention) on the first 16 MT-Bench questions (else the
           shipped summarization samples), max_new_tokens 128, batch 8, against plain batched `generate`
           (`batched`); then one forward of 8 x 300 tokens in float32 and in bfloat16, the reason the presets run in
           float32 on a CPU.

Both sides run on the CPU in float32 with the same thread rule; `--threads N` runs every process at N torch threads
(OMP_NUM_THREADS). `--before DIR` adds `probdiff eval` from another checkout of the project (its source first on
PYTHONPATH, run from its own directory) to the alternation, so that a change's gain is measured in the same run.

Run: python bench/bench_eval.py tiny [--pairs 3] [--limit 32] [--threads 1] [--before DIR]
     python bench/bench_eval.py smollm2 [--pairs 3] [--limit 16] [--max-new-tokens 128] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import _side_by_side as harness
from _side_by_side import run


@dataclass(frozen=True)
class Preset:
    plain: str  # the plain pipeline: bench/_plain.py's mode
    limit: int
    max_new_tokens: int
    batch_size: int


PRESETS = {"tiny": Preset("loop", 32, 64, 32), "smollm2": Preset("batched", 16, 128, 8)}


def queries_file(model: str, tmp: Path) -> tuple[Path, str]:
    """The queries each preset is measured on, and where they came from."""
    if model == "smollm2":
        found = harness.MT_BENCH if harness.MT_BENCH.is_file() else harness.SUMMARIZATION_SAMPLES
        return found, str(found)
    xiaohongshu = harness.PAPER_DATA / "redbook" / "test.json"
    if xiaohongshu.is_file():
        return xiaohongshu, f"the paper's Xiaohongshu test set ({xiaohongshu})"
    lines = [
        line for split in ("heldout", "train") for line in (harness.ROOT / f"data/samples/blog/{split}.jsonl").open()
    ]
    (tmp / "blog.jsonl").write_text("".join(lines), encoding="utf-8")
    return tmp / "blog.jsonl", "the shipped blog samples (held-out then train)"


def side_by_side(model: str, preset: Preset, pairs: int, threads: int | None, before: Path | None) -> None:
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    harness.prepare_model(model)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        queries, source = queries_file(model, tmp)
        print(f"load average {harness.load_average()}; {model} (float32, CPU), first {preset.limit} queries of "
              f"{source}, max_new_tokens {preset.max_new_tokens}, batch {preset.batch_size}, K = 1, "
              f"OMP_NUM_THREADS={env.get('OMP_NUM_THREADS', 'unset')}")  # fmt: skip
        settings = [str(preset.limit), str(preset.max_new_tokens), str(preset.batch_size)]
        evaluation = ["eval", "--model", model, "--device", "cpu", "--dtype", "float32", "--queries", str(queries),
                      "--limit", settings[0], "--overwrite", f"max_new_tokens={settings[1]}",
                      f"batch_size={settings[2]}"]  # fmt: skip
        commands = {
            "ours": (["probdiff", *evaluation, "--out", str(tmp / "ours")], env, harness.ROOT),
            "plain": ([sys.executable, "bench/_plain.py", preset.plain, model, str(queries), *settings,
                       str(tmp / "plain.json")], env, harness.ROOT),
        }  # fmt: skip
        if before is not None:  # the same command from the other checkout, its source first on the path
            command = [sys.executable, "-m", "probdiff_callback.cli", *evaluation, "--out", str(tmp / "before")]
            commands["before"] = (command, harness.checkout_env(before, env), before)
        done = harness.alternately(pairs, {side: lambda _, c=command: run(*c) for side, command in commands.items()})
        summary = harness.read_run(tmp / "ours")[1]
        plain = json.loads((tmp / "plain.json").read_text())
    seconds = {side: [d.seconds for d in runs] for side, runs in done.items()}
    cpu = {side: [d.cpu_seconds for d in runs] for side, runs in done.items()}
    wall, busy = harness.medians(seconds), harness.medians(cpu)
    for side, label in (("ours", "probdiff eval"), ("before", f"probdiff eval from {before}")):
        if side in wall:
            print(f"end to end   {label} {wall[side]:6.1f} s   plain {preset.plain} {wall['plain']:6.1f} s   "
                  f"ratio (plain / ours) {wall['plain'] / wall[side]:4.2f}x; CPU time {busy[side]:6.1f} s against "
                  f"{busy['plain']:6.1f} s, {busy['plain'] / busy[side]:4.2f}x")  # fmt: skip
    print(f"             wall {harness.runs_note(seconds)}")
    print(f"             CPU {harness.runs_note(cpu)}")
    print(f"             ours: n={summary['n']}, mean length of answers {summary['len_response_mean']:.1f} and "
          f"revisions {summary['len_revised_mean']:.1f} tokens ({summary['n_capped']} answers, "
          f"{summary['n_revision_capped']} revisions capped); plain: n={plain['n']}, mean length "
          f"{plain['mean_length']:.1f} tokens; load average now {harness.load_average()}")  # fmt: skip


def scoring_memory() -> None:
    """Peak memory of scoring 8 x 1,024 tokens, each way in a process of its own."""
    peaks = {mode: json.loads(run([sys.executable, "bench/_score_memory.py", mode]).last_line)
             for mode in ("chunked", "plain", "fp64")}  # fmt: skip
    error = {
        m: max(abs(a - b) for a, b in zip(peaks[m]["scores"], peaks["fp64"]["scores"])) for m in ("chunked", "plain")
    }
    chunked, plain = (peaks[mode]["peak_bytes"] / 1024**3 for mode in ("chunked", "plain"))
    print(f"scoring 8 x 1,024 tokens, vocabulary 152,064: peak memory chunked {chunked:5.2f} GiB   plain "
          f"{plain:5.2f} GiB   ratio {chunked / plain:.3f}x\n             mean log-prob per sequence against "
          f"float64: chunked max |error| {error['chunked']:.1e}, plain {error['plain']:.1e}")  # fmt: skip


FORWARD = """import sys, time, torch; from transformers import AutoModelForCausalLM
from probdiff_callback.models import resolve_model_path; from probdiff_callback.runtime.threads import configure_threads
configure_threads(); dtype = getattr(torch, sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(resolve_model_path("smollm2"), dtype=dtype).eval()
x = torch.randint(0, 49152, (8, 300)); model.model(x[:, :8]); started = time.perf_counter()
with torch.no_grad(): model.model(x)
print(time.perf_counter() - started)"""


def forward_dtypes() -> None:
    """One forward of 8 x 300 tokens through smollm2 in float32 and in bfloat16, each in a process of its own."""
    took = {d: float(run([sys.executable, "-c", FORWARD, d]).last_line) for d in ("float32", "bfloat16")}
    print(f"one forward of 8 x 300 tokens: float32 {took['float32']:.2f} s, bfloat16 {took['bfloat16']:.2f} s "
          f"({took['bfloat16'] / took['float32']:.1f}x float32)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=list(PRESETS))
    parser.add_argument("--pairs", type=int, default=3, help="alternating runs of each side [3]")
    parser.add_argument("--limit", type=int, help="queries [tiny 32, smollm2 16]")
    parser.add_argument("--max-new-tokens", type=int, help="cap of answers and revisions [tiny 64, smollm2 128]")
    parser.add_argument("--batch-size", type=int, help="queries per batch, both sides [tiny 32, smollm2 8]")
    parser.add_argument("--threads", type=int, help="torch threads of every process (OMP_NUM_THREADS) [unset]")
    parser.add_argument("--before", type=Path, help="another checkout whose `probdiff eval` joins the alternation")
    parser.add_argument("--end-to-end-only", action="store_true", help="only the side-by-side run")
    args = parser.parse_args()
    preset = PRESETS[args.model]
    chosen = {"limit": args.limit, "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size}
    preset = Preset(preset.plain, **{k: getattr(preset, k) if v is None else v for k, v in chosen.items()})
    side_by_side(args.model, preset, args.pairs, args.threads, args.before and args.before.resolve())
    if args.end_to_end_only:
        return
    if args.model == "tiny":
        scoring_memory()
    else:
        forward_dtypes()


if __name__ == "__main__":
    main()
