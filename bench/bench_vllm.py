"""The vLLM engine against the HF engine, as whole processes (imports, model load and vLLM's start included),
side by side in one run, alternately `--pairs` times (bench/_side_by_side.py).

- eval: `probdiff eval --model smollm2` on the first `--limit` MT-Bench questions (../shared/data; else the shipped
  English summarization samples), `--max-new-tokens` (default: the settings' 512), two ways: vLLM in the evaluating
  process (`use_vllm=true`, colocate, vLLM installed here) and the HF engine. With
  `--adapter` a random LoRA adapter is evaluated, as a checkpoint is, so that its weights are handed to vLLM: the
  start-up, the hand-off and the bytes written on the way are read from the command's own line.
- train: `accelerate launch train/sft.py recipe=summarization model=smollm2` with and without
  `probdiff.use_vllm=true`; the evaluations' share of the training time is read from the run's own cost line.
- sync: how a LoRA adapter reaches a colocated engine on this device: `probdiff eval --model smollm2 --adapter A`
  (A: a random r 16 adapter on all 7 projections) with `vllm_weight_sync=lora` (vLLM's LoRA kernels) and `merged`
  (merged weights reloaded), on `--limit` questions with 64 new tokens.

Both at one torch thread (OMP_NUM_THREADS=1). vLLM is the project's environment's (README's Setup). Results go to
bench/results/vllm-<what>.json.

- auto: `use_vllm=auto` (the default) against the engine it did not take, one after the other: the README's quick
  start (`model=tiny`), the smollm2 summarization preset (beside training) and `probdiff eval --model smollm2` with
  128 new tokens on `--limits` questions; each case's `ProbDiff engine:` line says what auto took and why. `--case`
  measures only the cases whose name holds it; the file keeps the other cases an earlier run measured.

Run: python bench/bench_vllm.py eval [--pairs 1] [--limit 64] [--max-new-tokens 128] [--adapter]
     python bench/bench_vllm.py sync [--pairs 1] [--limit 8]
     python bench/bench_vllm.py train [--pairs 1] [--n-queries 8] [--train-option key=value ...]
     python bench/bench_vllm.py auto [--limits 4 8 16 64] [--case eval]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import _side_by_side as harness

QUERIES = harness.MT_BENCH if harness.MT_BENCH.is_file() else harness.SUMMARIZATION_SAMPLES
ENGINES, SYNCS = ("vllm", "hf"), ("lora", "merged")  # each pair's first side; the next pair turns the order around
COST = re.compile(r"ProbDiff cost: (\d+) evaluations during training took ([\d.]+) min, (\d+)% on top of ([\d.]+) min")
READY = re.compile(r"started in ([\d.]+)s; weights handed over in ([\d.]+)s, ([\d,]+) MB written")


def run(command: list[str]) -> harness.Done:
    """`command` at one thread, with vLLM in this environment; vLLM's engine polls a core beside its worker, so its
    CPU time is more than its wall time."""
    load = harness.load_average()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    done = harness.run(command, env)
    print(f"  {done.seconds:7.1f} s, CPU {done.cpu_seconds:7.1f} s  (load before {load})  {' '.join(command[-3:])}")
    return done


def eval_side(engine: str, options: list[str], limit: int, folder: Path, pair: int) -> dict:
    """One `probdiff eval` on smollm2 with `options`, and what it generated at what rate."""
    out = folder / f"{pair}-{engine}"
    command = ["probdiff", "eval", "--model", "smollm2", "--queries", str(QUERIES), "--limit", str(limit)]
    done = run(command + ["--out", str(out), *options])
    records, summary = harness.read_run(out)
    tokens = sum(r["n_tokens_response"] + r["n_tokens_revised"] for r in records)
    ready = READY.search(done.stderr)
    return {
        "engine": engine,
        "seconds": round(done.seconds, 1),
        "cpu_seconds": round(done.cpu_seconds, 1),
        "evaluation_seconds": summary["seconds"],
        "start_seconds": float(ready.group(1)) if ready else None,
        "handover_seconds": float(ready.group(2)) if ready else None,
        "handover_mb_written": int(ready.group(3).replace(",", "")) if ready else None,
        "generated_tokens": tokens,
        "tokens_per_second_whole_process": round(tokens / done.seconds, 1),
        "tokens_per_second_in_evaluation": round(tokens / summary["seconds"], 1),
        "confidence": summary["confidence"],
        "capped": [summary["n_capped"], summary["n_revision_capped"]],
        "first_answer": records[0]["response"][:200],
    }


def train_side(engine: str, n_queries: int, options: list[str], folder: Path, pair: int) -> dict:
    out = folder / f"{pair}-{engine}"
    accelerate = shutil.which("accelerate") or "accelerate"
    command = [accelerate, "launch", "--num_processes", "1", str(harness.ROOT / "train/sft.py"), "recipe=summarization"]
    command += ["model=smollm2", f"output_dir={out}", "report_to=none", f"probdiff.n_queries={n_queries}", *options]
    done = run(command + [f"probdiff.use_vllm={'true' if engine == 'vllm' else 'false'}"])
    cost = COST.search(done.stdout + done.stderr)
    if cost is None:
        sys.exit(f"no cost line in the run's output:\n{(done.stdout + done.stderr)[-3000:]}")
    rows = [json.loads(line) for line in (out / "probdiff" / "history.jsonl").read_text().splitlines()]
    summaries = [row.get("summary") or {} for row in rows]
    return {
        "engine": engine,
        "seconds": round(done.seconds, 1),
        "cpu_seconds": round(done.cpu_seconds, 1),
        "evaluations": int(cost.group(1)),
        "evaluation_minutes": float(cost.group(2)),
        "share_of_training": int(cost.group(3)) / 100,
        "training_minutes": float(cost.group(4)),
        "cost_line": cost.group(0),
        "confidence": [s.get("confidence") for s in summaries],
        "ci": [s.get("confidence_ci") for s in summaries],
    }


def auto_cases(limits: list[int]) -> dict[str, tuple[list[str], str]]:
    """`use_vllm=auto`'s measured cases: the command (its output folder added later) and the key that sets the engine.
    The README's quick start and the smollm2 preset as a newcomer runs them; `probdiff eval` on smollm2 with 128 new
    tokens at each of `limits` questions."""
    train = [sys.executable, str(harness.ROOT / "train/sft.py"), "report_to=none"]
    cases = {
        "quick start (tiny, blog)": ([*train, "recipe=blog", "model=tiny"], "probdiff.use_vllm"),
        "smollm2 preset (summarization)": ([*train, "recipe=summarization", "model=smollm2"], "probdiff.use_vllm"),
    }
    for limit in limits:
        command = ["probdiff", "eval", "--model", "smollm2", "--queries", str(QUERIES), "--limit", str(limit)]
        cases[f"probdiff eval, {limit} questions"] = ([*command, "max_new_tokens=128"], "use_vllm")
    return cases


def engine_line(out: Path, done: harness.Done) -> str:
    """The run's `ProbDiff engine:` line: in its output, or (beside training) in its evaluator's log."""
    texts = [done.stdout + done.stderr] + [p.read_text(errors="replace") for p in sorted(out.rglob("*.log"))]
    lines = [line for text in texts for line in text.splitlines() if "ProbDiff engine: " in line]
    if not lines:
        sys.exit(f"no 'ProbDiff engine:' line from {out}:\n{(done.stdout + done.stderr)[-3000:]}")
    return lines[-1][lines[-1].index("ProbDiff engine: ") :]


def auto_case(name: str, command: list[str], key: str, folder: Path) -> dict:
    """The case with `use_vllm=auto` (the default), then with the engine auto did not take: which is faster."""
    out_option = (lambda out: ["--out", str(out)]) if command[0] == "probdiff" else (lambda out: [f"output_dir={out}"])
    slug = re.sub(r"\W+", "-", name)
    auto_out, other_out = folder / f"{slug}-auto", folder / f"{slug}-other"
    auto = run(command + out_option(auto_out))
    chosen = engine_line(auto_out, auto)
    took_vllm = chosen.startswith("ProbDiff engine: vLLM")
    other = run(command + [f"{key}={'false' if took_vllm else 'true'}"] + out_option(other_out))  # keys before options
    return {
        "case": name,
        "auto": chosen,
        "auto_seconds": round(auto.seconds, 1),
        "other": f"{key}={'false' if took_vllm else 'true'}: {engine_line(other_out, other)}",
        "other_seconds": round(other.seconds, 1),
    }


def auto_report(limits: list[int], only: list[str] | None) -> int:
    """Measure auto's cases (those named in `only`, or all), print each against the other engine, and keep them in
    bench/results/vllm-auto.json beside the cases an earlier run measured."""
    chosen = {name: case for name, case in auto_cases(limits).items() if not only or any(o in name for o in only)}
    target = harness.ROOT / "bench" / "results" / "vllm-auto.json"
    cases = json.loads(target.read_text())["cases"] if target.is_file() else []
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as scratch:
        for name, case in chosen.items():  # each case kept as it ends: a later one's failure loses nothing
            cases = [c for c in cases if c["case"] != name] + [auto_case(name, *case, Path(scratch))]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps({"what": "auto", "threads": 1, "cases": cases}, indent=1) + "\n")
    print(f"use_vllm=auto against the other engine, whole processes, one run each ({target}):")
    for case in cases:
        ratio = case["other_seconds"] / case["auto_seconds"]
        print(f"  {case['case']}: {case['auto_seconds']:.0f} s with auto ({case['auto']}); "
              f"{case['other_seconds']:.0f} s with {case['other']}: auto {ratio:.2f}x")  # fmt: skip
    return 0


def random_adapter(folder: Path) -> Path:
    """A LoRA adapter of the recipes' shape (r 16, alpha 32, all 7 projections) for smollm2, random B so that it
    changes the texts."""
    import torch
    from peft import LoraConfig, get_peft_model

    from probdiff_callback.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer("smollm2", dtype="float32", device="cpu")
    torch.manual_seed(0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapted = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets, init_lora_weights=False))
    for module in adapted.modules():  # small, so the texts stay language
        for weight in getattr(module, "lora_B", {}).values():
            torch.nn.init.normal_(weight.weight, std=1e-3)
    adapted.save_pretrained(folder)
    return folder


def sides(args: argparse.Namespace, folder: Path) -> dict[str, Callable[[int], dict]]:
    """What each side runs for a pair: the two ways of `eval`, the two engines in training, or the two ways an
    adapter reaches vLLM."""
    if args.what == "eval":
        options = ["--adapter", str(random_adapter(folder / "adapter"))] if args.adapter else []  # options first
        options += [f"max_new_tokens={args.max_new_tokens}"] if args.max_new_tokens else []
        vllm = [*options, "use_vllm=true"]
        return {
            "colocate": partial(eval_side, "colocate", vllm, args.limit, folder),
            "hf": partial(eval_side, "hf", [*options, "use_vllm=false"], args.limit, folder),
        }
    if args.what == "train":
        return {e: partial(train_side, e, args.n_queries, args.train_option, folder) for e in ENGINES}
    options = ["--adapter", str(random_adapter(folder / "adapter")), "max_new_tokens=64", "use_vllm=true"]
    return {s: partial(eval_side, s, [*options, f"vllm_weight_sync={s}"], args.limit, folder) for s in SYNCS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["eval", "train", "sync", "auto"])
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("--limit", type=int, default=64, help="eval, sync: MT-Bench questions")
    parser.add_argument("--max-new-tokens", type=int, help="eval: max_new_tokens (default: the settings')")
    parser.add_argument("--adapter", action="store_true", help="eval: evaluate a random LoRA adapter")
    parser.add_argument("--n-queries", type=int, default=8, help="train: probdiff.n_queries")
    parser.add_argument("--train-option", action="append", default=[], help="train: another key=value")
    parser.add_argument("--limits", type=int, nargs="*", default=[4, 8, 16, 64], help="auto: eval's questions")
    parser.add_argument("--case", action="append", help="auto: only the cases whose name holds this (repeatable)")
    args = parser.parse_args()
    if args.what == "auto":
        return auto_report(args.limits, args.case)
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as scratch:
        results = harness.alternately(args.pairs, sides(args, Path(scratch)))
    report = {"what": args.what, "pairs": args.pairs, "threads": 1, "results": results}
    if args.what == "sync":
        rate = {s: statistics.median(r["tokens_per_second_in_evaluation"] for r in results[s]) for s in results}
        print(f"LoRA adapter on a colocated engine, {args.limit} questions x 64 tokens: by path (vLLM's LoRA) "
              f"{rate['lora']:.1f} tokens/s, merged and reloaded {rate['merged']:.1f} tokens/s: "
              f"merged {rate['merged'] / rate['lora']:.1f}x")  # fmt: skip
        report |= {"limit": args.limit, "tokens_per_second": rate}
    elif args.what == "eval":
        report |= {"limit": args.limit, "queries": str(QUERIES), "max_new_tokens": args.max_new_tokens}
        print(f"probdiff eval, {args.limit} questions, whole processes (median of {args.pairs}):")
        hf = statistics.median(r["seconds"] for r in results["hf"])
        for way, runs in results.items():
            seconds = statistics.median(r["seconds"] for r in runs)
            handover = "" if way == "hf" else (
                f"; start {runs[-1]['start_seconds']} s, hand-off {runs[-1]['handover_seconds']} s, "
                f"{runs[-1]['handover_mb_written']} MB written"
            )  # fmt: skip
            print(f"  {way:9s} {seconds:7.1f} s ({hf / seconds:.2f}x the HF engine's speed){handover}")
    else:
        hf, vllm = (statistics.median(r["evaluation_minutes"] for r in results[e]) for e in ("hf", "vllm"))
        report |= {"speedup": round(hf / vllm, 2), "n_queries": args.n_queries, "options": args.train_option}
        for engine in ("hf", "vllm"):
            print(f"{engine:5s} {results[engine][-1]['cost_line']}")
        print(f"the evaluations during training: vLLM {hf / vllm:.2f}x faster")
    target = harness.ROOT / "bench" / "results" / f"vllm-{args.what}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
