"""The decoding paths one evaluation is measured through: the library's `sample_continuations` (the evaluator's
default) as it is, and with generate's options set through its `generation_options`: compiling off, a static cache,
and a static cache + torch.compile; and the vLLM engine, which runs in a server of its own (`vllm_path`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from probdiff_callback.core.decoding import sample_continuations

from .report import Figure

PATHS = {
    "ours": "ours (sample_continuations)",
    "generate": "generate",
    "generate-static": "generate + static cache",
    "generate-compile": "generate + static cache + torch.compile",
    "vllm": "vLLM (colocate, LoRA adapter by path)",  # no decode function: vllm_path measures it
}


def generate_continuations(
    model, *args, static_cache: bool = False, compile_forward: bool = False, **kwargs
) -> list[list[int]]:
    """The library's `sample_continuations` (same arguments, same sampler) with generate's options set: the dynamic
    or a static cache, and whether generate may compile its forward (transformers compiles it by itself when the
    cache is static and the device a GPU)."""
    options = {"cache_implementation": "static" if static_cache else None, "disable_compile": not compile_forward}
    return sample_continuations(model, *args, generation_options=options, **kwargs)


def decoding_paths(requested: Sequence[str], device: torch.device) -> tuple[dict[str, Callable], list[Figure]]:
    """The HF decode functions to measure, and a row for each requested one that cannot run here (the vLLM path is
    not one of them)."""
    available = {
        "ours": sample_continuations,
        "generate": generate_continuations,
        "generate-static": functools.partial(generate_continuations, static_cache=True),
        "generate-compile": functools.partial(generate_continuations, static_cache=True, compile_forward=True),
    }
    chosen = {name: available[name] for name in requested if name in available}
    skipped = []
    if device.type != "cuda" and chosen.pop("generate-compile", None) is not None:
        reason = "CUDA only: transformers compiles generate's forward itself on GPUs, not on a CPU"
        skipped.append(Figure(f"{PATHS['generate-compile']}: evaluation", "skipped", reason))
    return chosen, skipped
