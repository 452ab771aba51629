"""The vLLM engine against the HF engine, as whole processes (imports, model load and vLLM's start included),
measured side by side in one run, alternating the two engines `--pairs` times.

- eval: `probdiff eval --model smollm2` on the first `--limit` MT-Bench questions (../shared/data; else the shipped
  English summarization samples), default settings (512 new tokens), with and without `use_vllm=true`.
- train: `accelerate launch train/sft.py recipe=summarization model=smollm2` with and without
  `probdiff.use_vllm=true`; the evaluations' share of the training time is read from the run's own cost line.
- sync: how a LoRA adapter reaches a colocated engine on this device: `probdiff eval --model smollm2 --adapter A`
  (A: a random r 16 adapter on all 7 projections) with `vllm_weight_sync=lora` (vLLM's LoRA kernels) and `merged`
  (merged weights reloaded), on `--limit` questions with 64 new tokens.

Both at one torch thread (OMP_NUM_THREADS=1, the vLLM server too). vLLM comes from `$PROBDIFF_VLLM_PYTHON`
(README's Setup). Results go to bench/results/vllm-<what>.json.

Run: python bench/bench_vllm.py eval [--pairs 1] [--limit 64]
     python bench/bench_vllm.py sync [--pairs 1] [--limit 8]
     python bench/bench_vllm.py train [--pairs 1] [--n-queries 8] [--train-option key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MT_BENCH = ROOT.parent / "shared" / "data" / "probdiff-reference" / "mtbench" / "question.jsonl"
SAMPLES = ROOT / "data" / "samples" / "summarization" / "heldout.jsonl"
COST = re.compile(r"ProbDiff cost: (\d+) evaluations during training took ([\d.]+) min, (\d+)% on top of ([\d.]+) min")


def environment() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    if "PROBDIFF_VLLM_PYTHON" not in env:
        sys.exit("set PROBDIFF_VLLM_PYTHON to the Python of the vLLM environment (README's Setup)")
    return env


def load_average() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def cpu_seconds_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(command: list[str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the whole process tree, output). vLLM's engine runs in processes of its own: its
    scheduler polls a core beside the worker, so its CPU time is more than its wall time at one thread."""
    load = load_average()
    cpu_before, started = cpu_seconds_of_children(), time.time()
    result = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True)
    seconds, cpu = time.time() - started, cpu_seconds_of_children() - cpu_before
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(command)}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    print(f"  {seconds:7.1f} s, CPU {cpu:7.1f} s  (load before {load})  {' '.join(command[-3:])}", flush=True)
    return seconds, cpu, result.stdout + result.stderr


def eval_side(vllm: bool, limit: int, out: Path) -> dict:
    command = ["probdiff", "eval", "--model", "smollm2", "--queries", str(queries_file()), "--limit", str(limit)]
    command += ["--out", str(out)] + (["use_vllm=true"] if vllm else [])
    seconds, cpu, output = run(command)
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    tokens = sum(r["n_tokens_response"] + r["n_tokens_revised"] for r in records)
    return {
        "engine": "vllm" if vllm else "hf",
        "seconds": round(seconds, 1),
        "cpu_seconds": round(cpu, 1),
        "evaluation_seconds": summary["seconds"],
        "generated_tokens": tokens,
        "tokens_per_second_whole_process": round(tokens / seconds, 1),
        "confidence": summary["confidence"],
        "capped": [summary["n_capped"], summary["n_revision_capped"]],
        "first_answer": records[0]["response"][:200],
    }


def random_adapter(folder: Path) -> Path:
    """A LoRA adapter of the recipes' shape (r 16, alpha 32, all 7 projections) for smollm2, random B so that it
    changes the texts."""
    import torch
    from peft import LoraConfig, get_peft_model

    from probdiff_callback.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer("smollm2", dtype="float32", device="cpu")
    torch.manual_seed(0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=16, lora_alpha=32, target_modules=targets, init_lora_weights=False)
    adapted = get_peft_model(model, config)
    for module in adapted.modules():  # small, so the texts stay language
        if hasattr(module, "lora_B"):
            for weight in module.lora_B.values():
                torch.nn.init.normal_(weight.weight, std=1e-3)
    adapted.save_pretrained(folder)
    return folder


def sync_side(sync: str, limit: int, adapter: Path, out: Path) -> dict:
    command = ["probdiff", "eval", "--model", "smollm2", "--adapter", str(adapter), "--queries", str(queries_file())]
    command += ["--limit", str(limit), "--out", str(out), "max_new_tokens=64", "use_vllm=true"]
    command += [f"vllm_weight_sync={sync}"]
    seconds, cpu, output = run(command)
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    tokens = sum(r["n_tokens_response"] + r["n_tokens_revised"] for r in records)
    evaluation = json.loads((out / "summary.json").read_text())["seconds"]
    return {
        "engine": sync,
        "seconds": round(seconds, 1),
        "cpu_seconds": round(cpu, 1),
        "evaluation_seconds": evaluation,
        "generated_tokens": tokens,
        "tokens_per_second_in_evaluation": round(tokens / evaluation, 1),
        "first_answer": records[0]["response"][:200],
    }


def queries_file() -> Path:
    return MT_BENCH if MT_BENCH.is_file() else SAMPLES


def train_side(vllm: bool, n_queries: int, options: list[str], out: Path) -> dict:
    accelerate = shutil.which("accelerate") or "accelerate"
    command = [accelerate, "launch", "--num_processes", "1", str(ROOT / "train/sft.py"), "recipe=summarization"]
    command += ["model=smollm2", f"output_dir={out}", "report_to=none", f"probdiff.n_queries={n_queries}", *options]
    command += ["probdiff.use_vllm=true"] if vllm else []
    seconds, cpu, output = run(command)
    cost = COST.search(output)
    if cost is None:
        sys.exit(f"no cost line in the run's output:\n{output[-3000:]}")
    rows = [json.loads(line) for line in (out / "probdiff" / "history.jsonl").read_text().splitlines()]
    return {
        "engine": "vllm" if vllm else "hf",
        "seconds": round(seconds, 1),
        "cpu_seconds": round(cpu, 1),
        "evaluations": int(cost.group(1)),
        "evaluation_minutes": float(cost.group(2)),
        "share_of_training": int(cost.group(3)) / 100,
        "training_minutes": float(cost.group(4)),
        "cost_line": cost.group(0),
        "confidence": [row["summary"]["confidence"] if row.get("summary") else None for row in rows],
        "ci": [row["summary"]["confidence_ci"] if row.get("summary") else None for row in rows],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["eval", "train", "sync"])
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("--limit", type=int, default=64, help="eval: MT-Bench questions")
    parser.add_argument("--n-queries", type=int, default=8, help="train: probdiff.n_queries")
    parser.add_argument("--train-option", action="append", default=[], help="train: another key=value")
    args = parser.parse_args()
    if args.what == "sync":
        return compare_syncs(args)
    results: dict[str, list[dict]] = {"hf": [], "vllm": []}
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as scratch:
        for pair in range(args.pairs):
            order = [True, False] if pair % 2 == 0 else [False, True]
            for vllm in order:
                out = Path(scratch) / f"{pair}-{'vllm' if vllm else 'hf'}"
                if args.what == "eval":
                    side = eval_side(vllm, args.limit, out)
                else:
                    side = train_side(vllm, args.n_queries, args.train_option, out)
                results[side["engine"]].append(side)
    key = "seconds" if args.what == "eval" else "evaluation_minutes"
    hf, vllm = (statistics.median(r[key] for r in results[e]) for e in ("hf", "vllm"))
    report = {"what": args.what, "pairs": args.pairs, "threads": 1, "results": results, "speedup": round(hf / vllm, 2)}
    if args.what == "eval":
        report |= {"limit": args.limit, "queries": str(MT_BENCH if MT_BENCH.is_file() else SAMPLES)}
        print(f"probdiff eval, {args.limit} questions, whole processes: HF {hf:.0f} s, vLLM {vllm:.0f} s: "
              f"vLLM {hf / vllm:.2f}x faster")  # fmt: skip
    else:
        report |= {"n_queries": args.n_queries, "options": args.train_option}
        for engine in ("hf", "vllm"):
            print(f"{engine:5s} {results[engine][-1]['cost_line']}")
        print(f"the evaluations during training: vLLM {hf / vllm:.2f}x faster")
    return write_report(args.what, report)


def compare_syncs(args) -> int:
    results: dict[str, list[dict]] = {"lora": [], "merged": []}
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as scratch:
        adapter = random_adapter(Path(scratch) / "adapter")
        for pair in range(args.pairs):
            for sync in ("lora", "merged") if pair % 2 == 0 else ("merged", "lora"):
                results[sync].append(sync_side(sync, args.limit, adapter, Path(scratch) / f"{pair}-{sync}"))
    rate = {s: statistics.median(r["tokens_per_second_in_evaluation"] for r in results[s]) for s in results}
    print(f"LoRA adapter on a colocated engine, {args.limit} questions x 64 tokens: by path (vLLM's LoRA) "
          f"{rate['lora']:.1f} tokens/s, merged and reloaded {rate['merged']:.1f} tokens/s: "
          f"merged {rate['merged'] / rate['lora']:.1f}x")  # fmt: skip
    report = {"what": "sync", "pairs": args.pairs, "limit": args.limit, "results": results, "tokens_per_second": rate}
    return write_report("sync", report)


def write_report(what: str, report: dict) -> int:
    target = ROOT / "bench" / "results" / f"vllm-{what}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
