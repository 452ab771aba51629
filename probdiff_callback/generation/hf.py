"""HF `generate` as the engine that writes answers and revisions: the evaluator's default. It runs on the model being
evaluated, so it always holds the weights being evaluated, with our per-row sampler (`decoding.py`): each request draws
from its own seed, so a query's text does not depend on its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from probdiff_callback.core.chat_format import stop_token_ids
from probdiff_callback.core.decoding import hit_cap, sample_continuations
from probdiff_callback.generation import Generated, GenerationRequest


def generate_texts(
    model,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    max_new_tokens: int,
    synced_gpus: bool = False,
    should_stop: Callable[[], bool] | None = None,
    generation_options: Mapping[str, Any] | None = None,
) -> list[Generated]:
    """One batch of sampled texts, special tokens stripped, with whether each hit `max_new_tokens` and its tokens;
    when `should_stop()` turns true during the batch, generation ends at the next token (the texts are cut short).
    `generation_options` go to `model.generate` as they are (the GPU kit compares cache and compile settings)."""
    generated = sample_continuations(
        model,
        prompts,
        seeds,
        temperatures,
        top_ps,
        max_new_tokens=max_new_tokens,
        stop_ids=stop_token_ids(tokenizer, getattr(model, "generation_config", None)),
        pad_token_id=tokenizer.pad_token_id,
        n_valid_ids=len(tokenizer),
        synced_gpus=synced_gpus,
        stop_early=should_stop,
        generation_options=generation_options,
    )
    return [
        Generated(tokenizer.decode(ids, skip_special_tokens=True).strip(), hit_cap(ids, max_new_tokens), len(ids))
        for ids in generated
    ]


class HFEngine:
    """HF `generate` on `model`, `batch_size` requests at a time; with `synced_gpus` every rank of a sharded ZeRO-3
    model runs the same forward passes, so none stops early when asked to. `generation_options` go to
    `model.generate` as they are."""

    name = "hf"

    def __init__(
        self,
        model,
        tokenizer,
        batch_size: int,
        synced_gpus: bool = False,
        generation_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.model, self.tokenizer, self.batch_size, self.synced_gpus = model, tokenizer, batch_size, synced_gpus
        self.generation_options = generation_options

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        max_new_tokens: int,
        should_stop: Callable[[], bool] | None = None,
        progress: Callable[[int], object] | None = None,
    ) -> list[Generated]:
        generated = generate_texts(
            self.model,
            self.tokenizer,
            [r.prompt_ids for r in requests],
            [r.seed for r in requests],
            [r.temperature for r in requests],
            [r.top_p for r in requests],
            max_new_tokens,
            self.synced_gpus,
            None if self.synced_gpus else should_stop,
            self.generation_options,
        )
        if progress is not None:
            progress(len(requests))
        return generated
