"""Scoring both texts of a query in one pass over their prompt, against each text as a whole sequence, side by side.

XSum-length work, as the smollm2 summarization recipe scores it: 16 documents of the paper's XSum test set (when
../shared/data is present, else the shipped XSum-style samples) whose summarization prompt is 400-600 tokens, each with
two texts of 30-60 tokens (spans of the document itself: what they say does not change the work). `score_texts` scores
them as `evaluate` does, once with `score_prompt_once=true` (the prompt's KV cache once, both texts from it) and once
with `false` (each text after its prompt as a whole sequence), alternately `--pairs` times at one torch thread, in
float32 on the CPU; the medians are compared and the largest difference between the two paths' scores is printed.

`--precision` measures instead how far each path's scores and d (second text minus first) are from the float32 whole
sequences when the model runs in bfloat16 (`--device cuda` on a GPU): both paths in bf16, and the whole sequences
one at a time, whose rounding differs from a batch's.

Run: python bench/bench_scoring.py [--models smollm2 tiny] [--pairs 3] [--documents 16] [--precision [--device cuda]]
"""

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
from _side_by_side import PAPER_DATA, ROOT

XSUM = PAPER_DATA / "xsum" / "test.json"
PROMPT_TOKENS = (400, 600)
TEXT_TOKENS = (30, 60)
sys.path.insert(0, str(ROOT))  # data/, for the summarization prompt, when run as a script from a checkout


def documents() -> tuple[list[str], str]:
    from data.preparers.summarization import SUMMARIZATION_PROMPT

    if XSUM.is_file():
        rows = [json.loads(line) for line in XSUM.read_text(encoding="utf-8").splitlines()]
        return [SUMMARIZATION_PROMPT.format(content=r["document"]) for r in rows], f"XSum test set ({XSUM})"
    path = ROOT / "data" / "samples" / "summarization"
    rows = [json.loads(line) for split in ("heldout", "train") for line in (path / f"{split}.jsonl").open()]
    return [r["messages"][0]["content"] for r in rows if r["category"] == "xsum"], f"the shipped samples ({path})"


def workload(tokenizer, n: int) -> tuple[list[list[int]], list[list[str]]]:
    """`n` chat prompts of 400-600 tokens, each with two texts of 30-60 tokens cut from its document."""
    from probdiff_callback.core.prompts import chat_prompt_ids

    rng = random.Random(0)
    prompts, texts = [], []
    for query in documents()[0]:
        ids = chat_prompt_ids(tokenizer, None, query)
        if not PROMPT_TOKENS[0] <= len(ids) <= PROMPT_TOKENS[1]:
            continue
        words = tokenizer(query, add_special_tokens=False)["input_ids"]
        spans = []
        for _ in range(2):
            length = rng.randint(*TEXT_TOKENS)
            start = rng.randrange(0, max(1, len(words) - length))
            spans.append(tokenizer.decode(words[start : start + length]))
        prompts.append(ids)
        texts.append(spans)
        if len(prompts) == n:
            break
    if len(prompts) < n:
        raise SystemExit(f"only {len(prompts)} documents have a prompt of {PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]} tokens")
    return prompts, texts


def precision(name: str, n_documents: int, device: str) -> None:
    """Each path's distance in bf16 from the fp32 whole sequences: mean |error| and the largest, of a text's mean
    log-prob and of d."""
    from probdiff_callback.core.scoring import score_batch, score_shared_prompts
    from probdiff_callback.models import load_model_and_tokenizer

    scores = {}
    for dtype in ("float32", "bfloat16"):
        model, tokenizer = load_model_and_tokenizer(name, dtype=dtype, device=device)
        prompts, texts = workload(tokenizer, n_documents)
        ids = [[tokenizer(t, add_special_tokens=False)["input_ids"] for t in row] for row in texts]
        pad, n = tokenizer.pad_token_id, len(prompts)
        flat = [row[j] for j in range(2) for row in ids]
        with torch.no_grad():
            whole = score_batch(model.eval(), prompts * 2, flat, pad)
            alone = score_batch(model, prompts * 2, flat, pad, rows_per_forward=1)
            shared = score_shared_prompts(model, prompts, ids, pad)
        scores[dtype] = {
            "whole sequences, 16 a forward": [[whole[i][0], whole[n + i][0]] for i in range(n)],
            "whole sequences, one at a time": [[alone[i][0], alone[n + i][0]] for i in range(n)],
            "one pass": [[s[0] for s in row] for row in shared],
        }
        del model
    reference = scores["float32"]["whole sequences, 16 a forward"]
    print(f"{name}, {n_documents} prompts, bfloat16 on {device}, against float32 whole sequences:")
    for path, rows in scores["bfloat16"].items():
        logp = [abs(a - b) for row, ref in zip(rows, reference) for a, b in zip(row, ref)]
        d = [abs((row[1] - row[0]) - (ref[1] - ref[0])) for row, ref in zip(rows, reference)]
        print(
            f"  {path:32s} mean log-prob off by {statistics.mean(logp):.1e} on average (at most {max(logp):.1e}), "
            f"d by {statistics.mean(d):.1e} (at most {max(d):.1e})"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["smollm2", "tiny"], help="presets [smollm2 tiny]")
    parser.add_argument("--pairs", type=int, default=3, help="alternating runs of each path [3]")
    parser.add_argument("--documents", type=int, default=16, help="queries, one scoring batch [16]")
    parser.add_argument("--precision", action="store_true", help="bf16 against fp32 instead of the timing")
    parser.add_argument("--device", default="cpu", help="--precision: where the model runs [cpu]")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"documents: {documents()[1]}; load average {os.getloadavg()[0]:.2f} at the start")
    if args.precision:
        for name in args.models:
            precision(name, args.documents, args.device)
        return

    from probdiff_callback.core.config import ProbDiffConfig
    from probdiff_callback.core.evaluator import inference_mode, score_texts
    from probdiff_callback.models import load_model_and_tokenizer

    print("float32, 1 thread")
    for name in args.models:
        model, tokenizer = load_model_and_tokenizer(name, dtype="float32", device="cpu")
        prompts, texts = workload(tokenizer, args.documents)
        text_lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for row in texts for t in row]
        paths = {"one pass": ProbDiffConfig(), "whole": ProbDiffConfig(score_prompt_once=False)}
        seconds: dict[str, list[float]] = {path: [] for path in paths}
        scores = {}
        with inference_mode(model):
            for _ in range(args.pairs):
                for path, config in paths.items():
                    started = time.perf_counter()
                    scores[path] = score_texts(model, tokenizer, prompts, texts, config)
                    seconds[path].append(time.perf_counter() - started)
        one_pass, whole = (statistics.median(seconds[path]) for path in paths)
        difference = max(
            abs(a[0] - b[0]) for row_a, row_b in zip(scores["one pass"], scores["whole"]) for a, b in zip(row_a, row_b)
        )
        runs = "; ".join(f"{path} " + ", ".join(f"{s:.2f}" for s in seconds[path]) + " s" for path in paths)
        print(
            f"{name}: {len(prompts)} prompts of {statistics.mean(map(len, prompts)):.0f} tokens on average, "
            f"{len(text_lengths)} texts of {statistics.mean(text_lengths):.0f}; one pass {one_pass:.2f} s, whole "
            f"sequences {whole:.2f} s: {whole / one_pass:.2f}x faster; largest difference of a mean log-prob "
            f"{difference:.1e} (medians of {args.pairs}: {runs}; load average {os.getloadavg()[0]:.2f})"
        )


if __name__ == "__main__":
    main()
