"""ProbDiff core against the reference pipeline's way, measured side by side in one run.

1. End to end, both as whole processes (imports and model load included), on the `tiny`
   preset and the same 32 real blog queries (the paper's Xiaohongshu test set when
   ../shared/data is present, else the shipped samples), max_new_tokens 64, K = 1:
   `probdiff eval` against a plain per-query loop (bench/_plain_loop.py). `--before DIR`
   adds `probdiff eval` from another checkout of the project (its source first on
   PYTHONPATH) to the alternation, so a change's gain is measured in the same run;
   `--threads N` runs every process at N torch threads (OMP_NUM_THREADS).
2. Peak memory of scoring 8 sequences x 1,024 tokens with the 152k vocabulary: chunked
   LM head (ours) against a plain batched forward + fp32 log-softmax, and the error of
   both against a float64 log-softmax (`--end-to-end-only` leaves it out).

The machine this was written on shares its cores (timings of one command vary by
10-30% between runs), so the processes run alternately `--pairs` times and the
ratio is taken of the medians.

Run: python bench/bench_core.py [--pairs 3] [--threads 1] [--before DIR] [--end-to-end-only]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _side_by_side import REFERENCE_DATA, ROOT, probdiff_eval, timed

REAL_BLOG = REFERENCE_DATA / "redbook" / "test.json"
N_QUERIES, MAX_NEW_TOKENS = 32, 64


def queries_file(tmp: Path) -> tuple[Path, str]:
    if REAL_BLOG.is_file():
        return REAL_BLOG, f"the paper's Xiaohongshu test set ({REAL_BLOG}), first {N_QUERIES}"
    rows = []
    for split in ("heldout", "train"):
        for line in (ROOT / "data" / "samples" / "blog" / f"{split}.jsonl").read_text(encoding="utf-8").splitlines():
            rows.append(json.loads(line))
    path = tmp / "blog_queries.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path, f"the shipped blog samples (held-out then train), first {N_QUERIES}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=3, help="alternating runs of each process [3]")
    parser.add_argument("--threads", type=int, help="torch threads of every process (OMP_NUM_THREADS) [unset]")
    parser.add_argument("--before", type=Path, help="another checkout whose `probdiff eval` joins the alternation")
    parser.add_argument("--end-to-end-only", action="store_true", help="leave out the scoring memory measurement")
    args = parser.parse_args()
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}))
    # build (or find) the tiny model first, outside the timings
    subprocess.run(
        [sys.executable, "-c", "from probdiff_callback.models.presets import tiny_model_dir; tiny_model_dir()"],
        cwd=ROOT,
        check=True,
        env=env,
    )
    if args.before is not None:
        where = "import probdiff_callback; print(probdiff_callback.__file__)"
        before_env = dict(env, PYTHONPATH=str(args.before.resolve()))
        found = timed([sys.executable, "-c", where], before_env, args.before.resolve())[1].strip()
        if not found.startswith(str(args.before.resolve())):
            sys.exit(f"--before: probdiff_callback comes from {found}, not from {args.before}")
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        queries, source = queries_file(tmp)
        print(
            f"queries: {source}; max_new_tokens {MAX_NEW_TOKENS}, K = 1, model tiny (fp32, CPU), "
            f"OMP_NUM_THREADS={env.get('OMP_NUM_THREADS', 'unset')}; load average {os.getloadavg()[0]:.2f}"
        )
        commands = {"ours": probdiff_eval("tiny", queries, N_QUERIES, tmp / "ours", MAX_NEW_TOKENS, batch_size=32)}
        environments, places = {"ours": env}, {"ours": ROOT}
        if args.before is not None:  # the same command run from the other checkout, its source first on the path
            before = probdiff_eval("tiny", queries, N_QUERIES, tmp / "before", MAX_NEW_TOKENS, batch_size=32)
            commands["before"] = [sys.executable, "-m", "probdiff_callback.cli", *before[1:]]
            environments["before"] = dict(env, PYTHONPATH=str(args.before.resolve()))
            places["before"] = args.before.resolve()
        commands["plain"] = [
            sys.executable, "bench/_plain_loop.py", str(queries), str(MAX_NEW_TOKENS), str(tmp / "plain.json"),
            str(N_QUERIES),
        ]  # fmt: skip
        environments["plain"], places["plain"] = env, ROOT
        seconds: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.pairs):
            for name, command in commands.items():
                seconds[name].append(timed(command, environments[name], places[name])[0])
        median = {name: statistics.median(runs) for name, runs in seconds.items()}
        runs = "; ".join(f"{name} " + ", ".join(f"{t:.1f}" for t in times) + " s" for name, times in seconds.items())
        summary = json.loads((tmp / "ours" / "summary.json").read_text())
        plain = json.loads((tmp / "plain.json").read_text())
        for name in [n for n in ("before", "ours") if n in commands]:
            label = "probdiff eval" if name == "ours" else f"probdiff eval ({args.before})"
            print(
                f"end to end   {label} {median[name]:7.1f} s   plain per-query loop {median['plain']:7.1f} s   "
                f"speed-up {median['plain'] / median[name]:5.1f}x"
            )
        print(f"             (medians of {args.pairs}: {runs}; load average {os.getloadavg()[0]:.2f} at the end)")
        print(
            f"             (ours: n={summary['n']}, mean answer length {summary['len_response_mean']:.1f} tokens, "
            f"revision {summary['len_revised_mean']:.1f}; plain loop: n={plain['n']})"
        )
    if args.end_to_end_only:
        return

    peaks = {}
    for mode in ("chunked", "plain", "fp64"):
        _, out = timed([sys.executable, "bench/_score_memory.py", mode])
        peaks[mode] = json.loads(out.strip().splitlines()[-1])
    error = {
        mode: max(abs(a - b) for a, b in zip(peaks[mode]["scores"], peaks["fp64"]["scores"]))
        for mode in ("chunked", "plain")
    }
    gib = 1024**3
    print(
        f"scoring 8 x 1,024 tokens, vocabulary 152,064: "
        f"peak memory chunked {peaks['chunked']['peak_bytes'] / gib:5.2f} GiB   "
        f"plain {peaks['plain']['peak_bytes'] / gib:5.2f} GiB   "
        f"ratio {peaks['chunked']['peak_bytes'] / peaks['plain']['peak_bytes']:.3f}x"
    )
    print(
        f"             mean log-prob per sequence against float64: "
        f"chunked max |error| {error['chunked']:.1e}, plain {error['plain']:.1e}"
    )


if __name__ == "__main__":
    main()
