"""The decoding paths one evaluation is measured through, each an engine that `evaluate(engine=...)` takes: the
library's HF engine as the evaluator runs it by default ("ours"), the same `sample_continuations` call with
generate's options set (compiling off; a static cache; a static cache + torch.compile), and vLLM in the process
(`vllm_path`). `Recording` wraps any of them and keeps each generation call's lengths for the floor."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from probdiff_callback.core.decoding import HFEngine
from probdiff_callback.core.engine import Engine, Generated

from .report import Figure

PATHS = {
    "ours": "ours (sample_continuations)",
    "generate": "generate",
    "generate-static": "generate + static cache",
    "generate-compile": "generate + static cache + torch.compile",
    "vllm": "vLLM (colocate, LoRA adapter by path)",  # started by vllm_path
}
# generate's options of each path after ours: the dynamic or a static cache, and whether generate may compile its
# forward (transformers compiles it by itself when the cache is static and the device a GPU)
OPTIONS = {
    "generate": {"cache_implementation": None, "disable_compile": True},
    "generate-static": {"cache_implementation": "static", "disable_compile": True},
    "generate-compile": {"cache_implementation": "static", "disable_compile": False},
}


@dataclass(frozen=True)
class Call:
    """One generation call: each request's prompt length and the tokens its text took."""

    prompt_lengths: list[int]
    generated_lengths: list[int]


@dataclass
class Recording:
    """`engine` as the evaluator sees it, each call's lengths kept in `calls`, in the order they were made."""

    engine: Engine
    calls: list[Call] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def batch_size(self) -> int | None:
        return self.engine.batch_size

    def generate(self, requests, max_new_tokens, should_stop=None, progress=None) -> list[Generated]:
        generated = self.engine.generate(requests, max_new_tokens, should_stop, progress)
        self.calls.append(Call([len(r.prompt_ids) for r in requests], [g.n_tokens for g in generated]))
        return generated


def stage_calls(calls: Sequence[Call], n_revisions: int) -> dict[str, list[Call]]:
    """The calls of each stage: for each generation batch the evaluator asks once for the answers, then once per
    revision round."""
    per_batch = 1 + n_revisions
    return {
        "answer": [c for i, c in enumerate(calls) if i % per_batch == 0],
        "revision": [c for i, c in enumerate(calls) if i % per_batch],
    }


# An HF path's engine for (model, tokenizer, batch size)
MakeEngine = Callable[[Any, Any, int], Engine]
HF_ENGINES: dict[str, MakeEngine] = {"ours": HFEngine} | {
    name: functools.partial(HFEngine, generation_options=options) for name, options in OPTIONS.items()
}


def hf_paths(requested: Sequence[str], device: torch.device) -> tuple[dict[str, MakeEngine], list[Figure]]:
    """The HF paths to measure, and a row for each requested one that cannot run here."""
    chosen = {name: HF_ENGINES[name] for name in requested if name in HF_ENGINES}
    skipped = []
    if device.type != "cuda" and chosen.pop("generate-compile", None) is not None:
        reason = "CUDA only: transformers compiles generate's forward itself on GPUs, not on a CPU"
        skipped.append(Figure(f"{PATHS['generate-compile']}: evaluation", "skipped", reason))
    return chosen, skipped
