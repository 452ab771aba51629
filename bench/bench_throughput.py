"""An evaluation's own throughput, this checkout's way against the earlier one, side by side in one process at one
torch thread (bench/_side_by_side.py's alternation, `--pairs` times, the ratio of the medians; float32 on the CPU).
Each side's time is this process's CPU time while it runs (one thread: its work), which other processes on a shared
machine disturb less than its wall time.

  sampler  decoding: the `tiny` preset (2 layers, Qwen's 152,064-id vocabulary) decodes 16 prompts (the paper's
           Xiaohongshu test set when its data is present, else the shipped blog samples) for 64 new tokens with
           `sample_continuations`, at the answers' settings (temperature 0.7, top_p 1) and the revisions' (0.1, top_p
           1), with this checkout's sampler and with an earlier commit's (`--before`: its `sampling.py` and
           `decoding.py` read from git and loaded in this process). Every row decodes all 64 steps (the stop id is
           one without text, never drawn), so both sides do the same work. Then 32 prompts at the answers' settings
           with the model's own stop ids, as an evaluation decodes them: rows stop at different steps (where the LM
           head on the rows still drawing counts). Prints tokens/s.
  scoring  XSum-length work, as the smollm2 summarization recipe scores it: 16 documents of the paper's XSum test
           set (else the shipped XSum-style samples) whose summarization prompt is 400-600 tokens, each with two
           texts of 30-60 tokens (spans of the document: what they say does not change the work), scored by
           `score_texts` as `evaluate` does, with `score_prompt_once=true` (the prompt's KV cache once, both texts
           from it) and `false` (each text after its prompt as a whole sequence). Prints both times and the largest
           difference between the two paths' mean log-probs. `--precision` measures instead how far each path's
           scores and d are from the float32 whole sequences when the model runs in bfloat16 (`--device cuda` on a
           GPU), the whole sequences one at a time included, whose rounding differs from a batch's.

Run: python bench/bench_throughput.py sampler [--before 18cb74b] [--pairs 3]
     python bench/bench_throughput.py scoring [--models smollm2 tiny] [--pairs 3] [--documents 16]
     python bench/bench_throughput.py scoring --precision [--device cuda] [--models smollm2 tiny]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _side_by_side as harness
import torch

# --- sampler ------------------------------------------------------------------------------------------------------
SAMPLER_FILES = ("probdiff_callback/core/sampling.py", "probdiff_callback/core/decoding.py")
N_ROWS, N_STOPPING_ROWS, NEW_TOKENS = 16, 32, 64


def module_at(commit: str, path: str, name: str, directory: Path):
    """The module `path` as it was at `commit`, loaded under `name`."""
    shown = ["git", "show", f"{commit}:{path}"]
    source = subprocess.run(shown, cwd=harness.ROOT, capture_output=True, text=True, check=True).stdout
    file = directory / f"{name}.py"
    file.write_text(source, encoding="utf-8")
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


def blog_queries(n: int) -> tuple[list[str], str]:
    xiaohongshu = harness.PAPER_DATA / "redbook" / "test.json"
    if xiaohongshu.is_file():
        lines = xiaohongshu.read_text(encoding="utf-8").splitlines()[:n]
        return [json.loads(line)["user"] for line in lines], f"the paper's Xiaohongshu test set ({xiaohongshu})"
    rows = []
    for split in ("heldout", "train"):
        text = (harness.ROOT / "data" / "samples" / "blog" / f"{split}.jsonl").read_text(encoding="utf-8")
        rows += [json.loads(line)["messages"][0]["content"] for line in text.splitlines()]
    return rows[:n], "the shipped blog samples"


def decode_side_by_side(
    modules: dict, model, tokenizer, prompts: list[list[int]], temperature: float, stops: bool, pairs: int
) -> None:
    """Each side's `sample_continuations` on the same rows, alternately, with the model's stop ids (`stops`) or one
    that is never drawn; prints tokens/s of each."""
    from probdiff_callback.core.chat_format import stop_token_ids
    from probdiff_callback.core.sampling import row_seed

    never_drawn = model.config.vocab_size - 1  # past len(tokenizer): an id without text, so every row runs on
    assert never_drawn >= len(tokenizer)
    stop_ids = set(stop_token_ids(tokenizer, model.generation_config)) if stops else {never_drawn}
    texts: dict[str, list[list[int]]] = {}

    def decode(side: str) -> float:
        started = time.process_time()
        texts[side] = modules[side].sample_continuations(
            model,
            prompts,
            [row_seed(0, i) for i in range(len(prompts))],
            [temperature] * len(prompts),
            [1.0] * len(prompts),
            max_new_tokens=NEW_TOKENS,
            stop_ids=stop_ids,
            pad_token_id=tokenizer.pad_token_id,
            n_valid_ids=len(tokenizer),
        )
        return time.process_time() - started

    seconds = harness.alternately(pairs, {side: lambda _, s=side: decode(s) for side in modules})
    tokens = {side: sum(map(len, texts[side])) for side in modules}
    rate = {side: tokens[side] / took for side, took in harness.medians(seconds).items()}
    rows = f"{len(prompts)} rows, " + ("the model's stop ids" if stops else "all to the cap")
    print(f"{rows}, temperature {temperature}, top_p 1: before {rate['before']:6.1f} tokens/s ({tokens['before']} "
          f"tokens a run)   after {rate['after']:6.1f} tokens/s ({tokens['after']})   after / before "
          f"{rate['after'] / rate['before']:4.2f}x {harness.runs_note(seconds)}")  # fmt: skip


def sampler(before: str, pairs: int) -> None:
    from probdiff_callback.core import decoding
    from probdiff_callback.core.prompts import chat_prompt_ids
    from probdiff_callback.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("tiny", dtype="float32", device="cpu")
    queries, source = blog_queries(max(N_ROWS, N_STOPPING_ROWS))
    prompts = [chat_prompt_ids(tokenizer, None, q) for q in queries]
    print(f"load average {harness.load_average()}; tiny (float32, CPU, 1 thread), prompts of {source}, "
          f"{NEW_TOKENS} new tokens; before = {before}, after = this checkout")  # fmt: skip
    with tempfile.TemporaryDirectory() as directory:
        modules = {"before": decoding_at(before, Path(directory)), "after": decoding}
        for temperature in (0.7, 0.1):
            decode_side_by_side(modules, model, tokenizer, prompts[:N_ROWS], temperature, False, pairs)
        decode_side_by_side(modules, model, tokenizer, prompts[:N_STOPPING_ROWS], 0.7, True, pairs)
    print(f"load average now {harness.load_average()}")


# --- scoring ------------------------------------------------------------------------------------------------------
PROMPT_TOKENS, TEXT_TOKENS = (400, 600), (30, 60)


def documents() -> tuple[list[str], str]:
    from probdiff_callback.data.summarization import SUMMARIZATION_PROMPT

    xsum = harness.PAPER_DATA / "xsum" / "test.json"
    if xsum.is_file():
        rows = [json.loads(line) for line in xsum.read_text(encoding="utf-8").splitlines()]
        return [SUMMARIZATION_PROMPT.format(content=r["document"]) for r in rows], f"the XSum test set ({xsum})"
    path = harness.ROOT / "data" / "samples" / "summarization"
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
        sys.exit(f"only {len(prompts)} documents have a prompt of {PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]} tokens")
    return prompts, texts


def score_side_by_side(name: str, pairs: int, n_documents: int) -> None:
    """Both paths of `score_texts` on the same work, alternately; prints their times."""
    from probdiff_callback.core.config import ProbDiffConfig
    from probdiff_callback.core.evaluator import inference_mode
    from probdiff_callback.core.scoring import score_texts
    from probdiff_callback.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(name, dtype="float32", device="cpu")
    prompts, texts = workload(tokenizer, n_documents)
    text_lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for row in texts for t in row]
    configs = {"one pass": ProbDiffConfig(), "whole": ProbDiffConfig(score_prompt_once=False)}
    scores = {}

    def scored(path: str) -> float:
        started = time.process_time()
        scores[path] = score_texts(model, tokenizer, prompts, texts, configs[path])
        return time.process_time() - started

    with inference_mode(model):
        seconds = harness.alternately(pairs, {path: lambda _, p=path: scored(p) for path in configs})
    one_pass, whole = harness.medians(seconds).values()
    difference = max(
        abs(a[0] - b[0]) for row_a, row_b in zip(scores["one pass"], scores["whole"]) for a, b in zip(row_a, row_b)
    )
    print(f"{name}: {len(prompts)} prompts of {statistics.mean(map(len, prompts)):.0f} tokens on average, "
          f"{len(text_lengths)} texts of {statistics.mean(text_lengths):.0f}: one pass {one_pass:.2f} s, whole "
          f"sequences {whole:.2f} s, {whole / one_pass:.2f}x faster; largest difference of a mean log-prob "
          f"{difference:.1e} {harness.runs_note(seconds)}; load average now {harness.load_average()}")  # fmt: skip


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
        print(f"  {path:32s} mean log-prob off by {statistics.mean(logp):.1e} on average (at most {max(logp):.1e}), "
              f"d by {statistics.mean(d):.1e} (at most {max(d):.1e})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["sampler", "scoring"])
    parser.add_argument("--pairs", type=int, default=3, help="alternating runs of each side [3]")
    parser.add_argument("--before", default="18cb74b", help="sampler: the commit to compare with [18cb74b]")
    parser.add_argument("--models", nargs="+", default=["smollm2", "tiny"], help="scoring: presets [smollm2 tiny]")
    parser.add_argument("--documents", type=int, default=16, help="scoring: queries, one scoring batch [16]")
    parser.add_argument("--precision", action="store_true", help="scoring: bf16 against fp32 instead of the timing")
    parser.add_argument("--device", default="cpu", help="scoring --precision: where the model runs [cpu]")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.what == "sampler":
        sampler(args.before, args.pairs)
    elif args.precision:
        for name in args.models:
            precision(name, args.documents, args.device)
    else:
        print(f"load average {harness.load_average()}; {documents()[1]}; float32, CPU, 1 thread")
        for name in args.models:
            score_side_by_side(name, args.pairs, args.documents)


if __name__ == "__main__":
    main()
