"""Seconds until a mistake on the command line is said, from two checkouts (before and after a change) side by side.

The README's training command with one mistake (`probdiff.delta=abc`, `recipe=nope`, `train_file=/nope.jsonl`) and
`probdiff eval` with a bad setting, each run as a whole process from each checkout (its source first on PYTHONPATH),
alternately `--pairs` times (bench/_side_by_side.py). Prints the median seconds of each side, the ratio, and whether
both said the same error line (exit status 2); the load average before and after. The after side's cache of
SFTConfig's fields (training/sft_config_cache.py) is made once before the timings; `cold` is one run of the first case
with an empty cache, the first command after installing or upgrading trl.

Run: python bench/bench_errors.py BEFORE_DIR AFTER_DIR [--pairs 3]
  e.g. mkdir /tmp/before && git archive <commit> | tar -x -C /tmp/before; python bench/bench_errors.py /tmp/before .
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _side_by_side as harness

BLOG_QUERIES = "data/samples/blog/heldout.jsonl"
CASES = {  # name -> the command's arguments after `python`
    "sft probdiff.delta=abc": ["train/sft.py", "recipe=blog", "model=tiny", "probdiff.delta=abc"],
    "sft recipe=nope": ["train/sft.py", "recipe=blog", "model=tiny", "recipe=nope"],
    "sft train_file=/nope.jsonl": ["train/sft.py", "recipe=blog", "model=tiny", "train_file=/nope.jsonl"],
    "probdiff eval delta=abc": ["-m", "probdiff_callback.cli", "eval", "--queries", BLOG_QUERIES, "delta=abc"],
}


def refusal(checkout: Path, args: list[str], workdir: Path, cache: Path) -> tuple[float, str]:
    """(seconds, the error line with the checkout's path left out) of one refused command, run in `workdir`."""
    command = [sys.executable, *[str(checkout / a) if a.startswith(("train/", "data/")) else a for a in args]]
    if "eval" in args:
        command += ["--out", str(workdir / "out")]
    env = {**os.environ, "PYTHONPATH": str(checkout), "PROBDIFF_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    started = time.time()
    result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
    seconds = time.time() - started
    lines = result.stderr.strip().splitlines()
    if result.returncode != 2 or not lines:
        sys.exit(f"expected exit status 2: {' '.join(command)}\n{result.stderr[-3000:]}")
    return seconds, lines[-1].replace(str(checkout), "<checkout>")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--pairs", type=int, default=3, help="alternating runs of each checkout [3]")
    args = parser.parse_args()
    checkouts = {"before": args.before.resolve(), "after": args.after.resolve()}
    for checkout in checkouts.values():  # not the installed copy
        harness.checkout_env(checkout, os.environ)
    print(f"load average {harness.load_average()} ({os.cpu_count()} cores)")
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp, first = Path(tmp_dir), next(iter(CASES.values()))
        cold, _ = refusal(checkouts["after"], first, tmp, tmp / "cold-cache")
        refusal(checkouts["after"], first, tmp, tmp / "cache")  # the stand-in made, outside the timings
        for name, case in CASES.items():
            said: dict[str, set[str]] = {side: set() for side in checkouts}

            def side(which: str, case: list[str] = case, said: dict[str, set[str]] = said):
                def once(pair: int) -> float:
                    seconds, line = refusal(checkouts[which], case, tmp, tmp / "cache")
                    said[which].add(line)
                    return seconds

                return once

            seconds = harness.alternately(args.pairs, {which: side(which) for which in checkouts})
            before, after = harness.medians(seconds).values()
            same = "same error line" if len(said["before"] | said["after"]) == 1 else f"DIFFERENT lines: {said}"
            print(f"{name:28s} before {before:5.2f} s  after {after:5.2f} s  ratio (before / after) "
                  f"{before / after:5.1f}x  {harness.runs_note(seconds)}; {same}")  # fmt: skip
        print(f"{'cold (no stand-in yet)':28s} after {cold:5.2f} s (one run: {next(iter(CASES))})")
    print(f"load average now {harness.load_average()}")


if __name__ == "__main__":
    main()
