"""Decoding throughput of the per-row sampler: this checkout's against an earlier commit's, side by side in one run.

The `tiny` preset (2 layers, Qwen's 152,064-id vocabulary) in float32 at one torch thread decodes 16 prompts (the
paper's Xiaohongshu test set when ../shared/data is present, else the shipped blog samples) for 64 new tokens with
`sample_continuations`, at the answers' settings (temperature 0.7, top_p 1) and the revisions' (0.1, top_p 1). Every
row decodes all 64 steps (the stop id is one without text, never drawn), so both sides do the same work. The earlier
commit's `sampling.py` and `decoding.py` are read from git and run in this process on the same model; the two
alternate `--pairs` times and the medians are compared.

Run: python bench/bench_sampler.py [--before 18cb74b] [--pairs 3]
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _side_by_side import PAPER_DATA, ROOT

REAL_BLOG = PAPER_DATA / "redbook" / "test.json"
SAMPLER_FILES = ("probdiff_callback/core/sampling.py", "probdiff_callback/core/decoding.py")
N_ROWS, NEW_TOKENS = 16, 64


def module_at(commit: str, path: str, name: str, directory: Path):
    """The module `path` as it was at `commit`, loaded under `name`."""
    source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True)
    file = directory / f"{name}.py"
    file.write_text(source.stdout, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def decoding_at(commit: str, directory: Path):
    """`decoding.py` at `commit`, importing `sampling.py` at `commit`."""
    sampling = module_at(commit, SAMPLER_FILES[0], "sampling_before", directory)
    current = sys.modules["probdiff_callback.core.sampling"]
    sys.modules["probdiff_callback.core.sampling"] = sampling
    try:
        return module_at(commit, SAMPLER_FILES[1], "decoding_before", directory)
    finally:
        sys.modules["probdiff_callback.core.sampling"] = current


def blog_queries() -> list[str]:
    if REAL_BLOG.is_file():
        lines = REAL_BLOG.read_text(encoding="utf-8").splitlines()
        return [json.loads(line)["user"] for line in lines[:N_ROWS]]
    rows = []
    for split in ("heldout", "train"):
        text = (ROOT / "data" / "samples" / "blog" / f"{split}.jsonl").read_text(encoding="utf-8")
        rows += [json.loads(line)["messages"][0]["content"] for line in text.splitlines()]
    return rows[:N_ROWS]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--before", default="18cb74b", help="the commit to compare with [18cb74b: the whole-vocabulary race]"
    )
    parser.add_argument("--pairs", type=int, default=3, help="alternating runs of each side [3]")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from probdiff_callback.core import decoding
    from probdiff_callback.core.prompts import chat_prompt_ids
    from probdiff_callback.core.sampling import row_seed
    from probdiff_callback.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("tiny", dtype="float32", device="cpu")
    prompts = [chat_prompt_ids(tokenizer, None, q) for q in blog_queries()]
    never_drawn = model.config.vocab_size - 1  # past len(tokenizer): an id without text, so every row runs on
    assert never_drawn >= len(tokenizer)
    with tempfile.TemporaryDirectory() as directory:
        sides = {"before": decoding_at(args.before, Path(directory)), "after": decoding}
        print(
            f"tiny, float32, 1 thread; {len(prompts)} rows x {NEW_TOKENS} new tokens; before = {args.before}, after = "
            f"this checkout; load average {os.getloadavg()[0]:.2f} at the start"
        )
        for temperature in (0.7, 0.1):
            seconds = {side: [] for side in sides}
            texts = {}
            for _ in range(args.pairs):
                for side, module in sides.items():
                    started = time.perf_counter()
                    texts[side] = module.sample_continuations(
                        model,
                        prompts,
                        [row_seed(0, i) for i in range(len(prompts))],
                        [temperature] * len(prompts),
                        [1.0] * len(prompts),
                        max_new_tokens=NEW_TOKENS,
                        stop_ids={never_drawn},
                        pad_token_id=tokenizer.pad_token_id,
                        n_valid_ids=len(tokenizer),
                    )
                    seconds[side].append(time.perf_counter() - started)
            tokens = {side: sum(len(ids) for ids in texts[side]) for side in sides}
            rate = {side: tokens[side] / statistics.median(seconds[side]) for side in sides}
            runs = "; ".join(f"{side} " + ", ".join(f"{s:.2f}" for s in seconds[side]) + " s" for side in sides)
            print(
                f"temperature {temperature}, top_p 1: before {rate['before']:6.1f} tokens/s   after "
                f"{rate['after']:6.1f} tokens/s   after / before {rate['after'] / rate['before']:4.1f}x   "
                f"({tokens['after']} tokens a run; medians of {args.pairs}: {runs})"
            )
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
