"""`probdiff eval` from two checkouts of the project (before and after a change), side by side in one run.

Each checkout runs as a whole process through `python -m probdiff_callback.cli` with its own source first on
PYTHONPATH, on the same queries and settings, alternately `--pairs` times per model (bench/_side_by_side.py). Prints
the median seconds of each, the ratio, and whether the two wrote the same records (texts and d), which is what a
refactoring must keep.

Run: python bench/bench_checkouts.py BEFORE_DIR AFTER_DIR [--models tiny smollm2] [--pairs 2] [--limit 8]
  e.g. git worktree add /tmp/before <commit>; python bench/bench_checkouts.py /tmp/before .
"""

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import _side_by_side as harness

QUERIES = {  # the data each preset is made for; MT-Bench for smollm2 where the paper's data is present
    "tiny": harness.ROOT / "data" / "samples" / "blog" / "heldout.jsonl",
    "smollm2": harness.MT_BENCH if harness.MT_BENCH.is_file() else harness.SUMMARIZATION_SAMPLES,
}
SETTINGS = {"tiny": ["max_new_tokens=32", "batch_size=12"], "smollm2": ["max_new_tokens=128", "batch_size=8"]}


def run_eval(checkout: Path, model: str, limit: int, out: Path) -> float:
    command = [sys.executable, "-m", "probdiff_callback.cli", "eval", "--model", model, "--device", "cpu"]
    command += ["--queries", str(QUERIES[model]), "--limit", str(limit), "--out", str(out), *SETTINGS[model]]
    return harness.run(command, env={**os.environ, "PYTHONPATH": str(checkout)}, cwd=checkout).seconds


def side(checkout: Path, model: str, limit: int, folder: Path) -> Callable[[int], float]:
    """One checkout's evaluation, into a folder of its own for each pair: `probdiff eval` keeps earlier results."""
    return lambda pair: run_eval(checkout, model, limit, folder / str(pair))


def same_records(a: Path, b: Path) -> str:
    left, right = ([(r["id"], r["response"], r["revisions"], r["d"]) for r in harness.read_run(p)[0]] for p in (a, b))
    counts = "" if len(left) == len(right) else f", counts differ ({len(left)} vs {len(right)})"
    return f"{sum(x == y for x, y in zip(left, right))}/{len(left)} records identical (texts and d){counts}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    parser.add_argument("--pairs", type=int, default=2, help="alternating runs of each checkout [2]")
    parser.add_argument("--limit", type=int, default=8, help="queries [8]")
    args = parser.parse_args()
    checkouts = {"before": args.before.resolve(), "after": args.after.resolve()}
    for checkout in checkouts.values():  # not the installed copy
        harness.checkout_env(checkout, os.environ)
    print(f"load average {harness.load_average()}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    with tempfile.TemporaryDirectory() as tmp_dir:
        for model in args.models:
            run_eval(checkouts["after"], model, 1, Path(tmp_dir) / model / "warm")  # builds the preset's cache once
            folders = {name: Path(tmp_dir) / model / name for name in checkouts}
            sides = {name: side(checkouts[name], model, args.limit, folders[name]) for name in checkouts}
            seconds = harness.alternately(args.pairs, sides)
            before, after = harness.medians(seconds).values()
            records = same_records(folders["before"] / "0", folders["after"] / "0")
            print(f"{model:8s} {args.limit} queries ({' '.join(SETTINGS[model])}): before {before:6.1f} s  "
                  f"after {after:6.1f} s  ratio (before / after) {before / after:4.2f}x  {harness.runs_note(seconds)}; "
                  f"{records}")  # fmt: skip
    print(f"load average now {harness.load_average()}")


if __name__ == "__main__":
    main()
