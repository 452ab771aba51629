"""`probdiff eval` from two checkouts of the project (before and after a change), side by side in one run.

Each checkout runs as a whole process (imports and model load included) through `python -m probdiff_callback.cli`
with its own source first on PYTHONPATH, alternately `--pairs` times per model, on the same queries and settings.
Prints the median seconds of each, the ratio, and whether the two wrote the same records (texts and d), which is what
a refactoring must keep.

Run: python bench/bench_checkouts.py BEFORE_DIR AFTER_DIR [--models tiny smollm2] [--pairs 2] [--limit 8]
  e.g. git worktree add /tmp/before <commit>; python bench/bench_checkouts.py /tmp/before .
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MT_BENCH = ROOT.parent / "shared" / "data" / "probdiff-reference" / "mtbench" / "question.jsonl"
QUERIES = {  # the data each preset is made for; MT-Bench for smollm2 where the paper's data is present
    "tiny": ROOT / "data" / "samples" / "blog" / "heldout.jsonl",
    "smollm2": MT_BENCH if MT_BENCH.is_file() else ROOT / "data" / "samples" / "summarization" / "heldout.jsonl",
}
SETTINGS = {"tiny": ["max_new_tokens=32", "batch_size=12"], "smollm2": ["max_new_tokens=128", "batch_size=8"]}


def run_eval(checkout: Path, model: str, limit: int, out: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    command = [sys.executable, "-m", "probdiff_callback.cli", "eval", "--model", model, "--device", "cpu"]
    command += ["--queries", str(QUERIES[model]), "--limit", str(limit), "--out", str(out), *SETTINGS[model]]
    started = time.time()
    result = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"failed in {checkout}: {' '.join(command)}\n{result.stderr[-3000:]}")
    return time.time() - started


def source_of(checkout: Path) -> str:
    """Where `probdiff_callback` is imported from with the checkout on PYTHONPATH (not the installed copy)."""
    code = "import probdiff_callback; print(probdiff_callback.__file__)"
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    return subprocess.run([sys.executable, "-c", code], cwd=checkout, env=env, capture_output=True, text=True).stdout


def same_records(a: Path, b: Path) -> str:
    def rows(path: Path) -> list[tuple]:
        records = [json.loads(line) for line in (path / "records.jsonl").read_text().splitlines()]
        return [(r["id"], r["response"], r["revisions"], r["d"]) for r in records]

    left, right = rows(a), rows(b)
    same = sum(x == y for x, y in zip(left, right))
    counts = "" if len(left) == len(right) else f", counts differ ({len(left)} vs {len(right)})"
    return f"{same}/{len(left)} records identical (texts and d){counts}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    parser.add_argument("--pairs", type=int, default=2, help="alternating runs of each checkout [2]")
    parser.add_argument("--limit", type=int, default=8, help="queries [8]")
    args = parser.parse_args()
    checkouts = {"before": args.before.resolve(), "after": args.after.resolve()}
    for name, checkout in checkouts.items():
        found = source_of(checkout).strip()
        if not found.startswith(str(checkout)):
            sys.exit(f"{name}: probdiff_callback comes from {found}, not from {checkout}")
    print(f"load average {os.getloadavg()[0]:.2f}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    with tempfile.TemporaryDirectory() as tmp_dir:
        for model in args.models:
            run_eval(checkouts["after"], model, 1, Path(tmp_dir) / "warm")  # builds the preset's cache once
            times: dict[str, list[float]] = {"before": [], "after": []}
            for pair in range(args.pairs):
                for name, checkout in checkouts.items():  # an --out of its own: `probdiff eval` keeps earlier results
                    times[name].append(run_eval(checkout, model, args.limit, Path(tmp_dir) / model / f"{name}-{pair}"))
            before, after = statistics.median(times["before"]), statistics.median(times["after"])
            runs = "; ".join(f"{name} " + ", ".join(f"{t:.1f}" for t in values) for name, values in times.items())
            print(
                f"{model:8s} {args.limit} queries ({' '.join(SETTINGS[model])}): before {before:6.1f} s  "
                f"after {after:6.1f} s  ratio (before / after) {before / after:4.2f}x  (runs: {runs})"
                f"; {same_records(Path(tmp_dir) / model / 'before', Path(tmp_dir) / model / 'after')}"
            )
    print(f"load average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
