"""ProbDiff core against the reference pipeline's way, measured side by side in one run.

1. End to end, both as whole processes (imports and model load included), on the `tiny`
   preset and the same 32 real blog queries (the paper's Xiaohongshu test set when
   ../shared/data is present, else the shipped samples), max_new_tokens 64, K = 1:
   `probdiff eval` against a plain per-query loop (bench/_plain_loop.py).
2. Peak memory of scoring 8 sequences x 1,024 tokens with the 152k vocabulary: chunked
   LM head (ours) against a plain batched forward + fp32 log-softmax, and the error of
   both against a float64 log-softmax.

The machine this was written on shares its cores (timings of one command vary by
10-30% between runs), so the two processes run alternately `--pairs` times and the
ratio is taken of the medians.

Run: python bench/bench_core.py [--pairs 3]
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _side_by_side import REFERENCE_DATA, ROOT, alternately, probdiff_eval, timed

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
    args = parser.parse_args()
    # build (or find) the tiny model first, outside the timings
    subprocess.run(
        [sys.executable, "-c", "from probdiff_callback.models.presets import tiny_model_dir; tiny_model_dir()"],
        cwd=ROOT,
        check=True,
    )
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        queries, source = queries_file(tmp)
        print(f"queries: {source}; max_new_tokens {MAX_NEW_TOKENS}, K = 1, model tiny (fp32, CPU)")
        ours_command = probdiff_eval("tiny", queries, N_QUERIES, tmp / "ours", MAX_NEW_TOKENS, batch_size=32)
        plain_command = [
            sys.executable, "bench/_plain_loop.py", str(queries), str(MAX_NEW_TOKENS), str(tmp / "plain.json"),
            str(N_QUERIES),
        ]  # fmt: skip
        runs = alternately(args.pairs, ours_command, plain_command)
        ours_s, plain_s = runs.medians()
        summary = json.loads((tmp / "ours" / "summary.json").read_text())
        plain = json.loads((tmp / "plain.json").read_text())
        print(
            f"end to end   probdiff eval {ours_s:7.1f} s   plain per-query loop {plain_s:7.1f} s   "
            f"speed-up {plain_s / ours_s:5.1f}x   {runs.note()}"
        )
        print(
            f"             (ours: n={summary['n']}, mean answer length {summary['len_response_mean']:.1f} tokens, "
            f"revision {summary['len_revised_mean']:.1f}; plain loop: n={plain['n']})"
        )

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
