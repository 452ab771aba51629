"""The decoding paths one evaluation is measured through: the library's `sample_continuations` (the evaluator's
default) and the kit's own call of `model.generate` with the library's per-row sampler, plain, with a static cache,
and with a static cache + torch.compile; and the vLLM engine, which runs in a server of its own (`vllm_path`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from probdiff_callback.core.decoding import RowSampler, StopWhenAsked, left_padded, sample_continuations
from probdiff_callback.core.scoring import NonFiniteLogits

from .report import Figure

PATHS = {
    "ours": "ours (sample_continuations)",
    "generate": "generate",
    "generate-static": "generate + static cache",
    "generate-compile": "generate + static cache + torch.compile",
    "vllm": "vLLM (colocate, LoRA adapter by path)",  # no decode function: vllm_path measures it
}


# `sample_continuations` is generate with its default dynamic cache and no options; this copy of its call is kept
# to measure generate's static cache and torch.compile against it, with the same sampler.
def generate_continuations(
    model,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    pad_token_id: int,
    n_valid_ids: int | None = None,
    synced_gpus: bool = False,
    static_cache: bool = False,
    compile_forward: bool = False,
    stop_early: Callable[[], bool] | None = None,
) -> list[list[int]]:
    """`sample_continuations`' contract through `model.generate`, so the evaluator runs unchanged around it."""
    from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

    device = model.get_output_embeddings().weight.device
    input_ids, attention_mask = (t.to(device) for t in left_padded(prompts, pad_token_id))
    sampler = RowSampler(
        seeds,
        temperatures,
        top_ps,
        prompt_width=input_ids.shape[1],
        stop_ids=stop_ids,
        pad_token_id=pad_token_id,
        n_valid_ids=n_valid_ids,
        device=device,
    )
    generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=sorted(stop_ids),
        pad_token_id=pad_token_id,
        bos_token_id=None,  # a complete configuration, as sample_continuations': none of the model's defaults
        cache_implementation="static" if static_cache else None,
        # transformers compiles the forward by itself when the cache is static and the device a GPU
        disable_compile=not compile_forward,
    )
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        generation_config=generation_config,
        logits_processor=LogitsProcessorList([sampler]),
        stopping_criteria=StoppingCriteriaList([StopWhenAsked(stop_early)] if stop_early is not None else []),
        synced_gpus=synced_gpus,
    )
    if sampler.saw_nan.item():  # as sample_continuations: a NaN model's texts are noise, and so would its timings be
        raise NonFiniteLogits("NaN in the model's logits while generating")
    stops = set(stop_ids)
    generated = []
    for row in output[:, input_ids.shape[1] :].tolist():
        end = next((i for i, token in enumerate(row) if token in stops), len(row))
        generated.append(row[:end])
    return generated


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
