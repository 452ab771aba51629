"""Batched decoding with the reproducible sampler: `model.generate` with our per-row sampler as a logits processor.

`generate` brings left padding, positions, the KV cache, every architecture's attention (sliding windows, GQA) and,
with `synced_gpus`, ZeRO-3 with sharded parameters (every rank runs the model until all ranks are done). Its own
sampling draws every row from one global generator, so a query's text would depend on the batch it lands in; instead
`RowSampler` draws each row's token from the row's own seed and hands generate scores that are 1 at that token and 0
everywhere else, so generate's greedy step takes it.

Rows that have finished are skipped by the sampler (generate pads them): the sampler's work per row is a pass over
the whole vocabulary whether the row is live or not, and on a small model with a large vocabulary that pass is a
large part of a decoding step (docs/benchmarks.md). On a CPU the LM head skips them too (`LiveRowsHead`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from probdiff_callback.core.chat_format import stop_token_ids
from probdiff_callback.core.engine import Generated, GenerationRequest
from probdiff_callback.core.sampling import counter_uniforms, sample_tokens
from probdiff_callback.core.scoring import NonFiniteLogits, left_padded, split_model


class RowSampler(LogitsProcessor):
    """Temperature + top-p sampling inside `generate`, row i drawing from `seeds[i]` alone (see sampling.py).

    A row counts as finished once it has emitted a stop id; from then on generate pads it and the sampler leaves
    it alone.
    """

    def __init__(
        self,
        seeds: Sequence[int],
        temperatures: Sequence[float],
        top_ps: Sequence[float],
        *,
        prompt_width: int,
        stop_ids: Collection[int],
        pad_token_id: int,
        n_valid_ids: int | None,
        device: torch.device,
    ) -> None:
        self.seeds = list(seeds)
        self.temperatures = torch.tensor(temperatures, dtype=torch.float64, device=device)
        self.top_ps = torch.tensor(top_ps, dtype=torch.float64, device=device)
        self.prompt_width = prompt_width
        self.stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        self.pad_token_id = pad_token_id
        self.n_valid_ids = n_valid_ids
        self.finished = torch.zeros(len(self.seeds), dtype=torch.bool, device=device)
        # the rows that draw at the next step (None: all of them), for `LiveRowsHead`
        self.drawing_next: torch.Tensor | None = None
        self.saw_nan = torch.zeros((), dtype=torch.bool, device=device)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_width
        if step > 0:
            self.finished |= torch.isin(input_ids[:, -1], self.stops)
        chosen = torch.full(self.finished.shape, self.pad_token_id, dtype=torch.long, device=scores.device)
        live = (~self.finished).nonzero().squeeze(-1)
        if scores.shape[0] not in (len(chosen), live.numel()):
            raise RuntimeError(f"logits for {scores.shape[0]} rows: the batch has {len(chosen)}, {live.numel()} live")
        if live.numel():
            # Every row's logits from the model's own head, the live rows' only from `LiveRowsHead`. sample_tokens
            # overwrites its input: generate hands us a float32 copy of the logits it does not reuse, so when these
            # are the live rows' it works on `scores` itself, else on a copy of the live rows.
            logits = scores.float() if live.numel() == scores.shape[0] else scores[live].float()
            valid = logits if self.n_valid_ids is None else logits[:, : self.n_valid_ids]
            # NaN anywhere makes a row's maximum NaN: one cheap reduction, kept on the device and read once, after
            # generate (no sync per step)
            self.saw_nan |= torch.isnan(valid.amax(dim=-1)).any()
            uniforms = counter_uniforms([self.seeds[i] for i in live.tolist()], step).to(scores.device)
            chosen[live] = sample_tokens(
                logits, self.temperatures[live], self.top_ps[live], uniforms, n_valid_ids=self.n_valid_ids
            )
        self.drawing_next = ~(self.finished | torch.isin(chosen, self.stops))
        # Each row's scores are 1 at the chosen id and 0 elsewhere, in int8: generate's argmax takes the chosen id
        # and reads a quarter of what float scores of every row would be (it reads the whole vocabulary of every row
        # at every step).
        one_hot = torch.zeros((len(chosen), scores.shape[-1]), dtype=torch.int8, device=scores.device)
        return one_hot.scatter_(1, chosen[:, None], 1)


class LiveRowsHead(torch.nn.Module):
    """An LM head that computes the logits of the rows still drawing only, in place of the model's own during
    `generate`, and hands over those rows alone: `generate` passes the last position's logits to the sampler as they
    are, and the sampler knows which rows they are (`RowSampler`, whose `drawing_next` says which rows draw next).

    `generate` runs the whole batch at every step until its last row stops. On a CPU with a large vocabulary the LM
    head is most of a step (152,064 x hidden products per row on a 2-layer model), so the rows that have already
    stopped would cost nearly what the live ones do, and so would copying and reading their logits."""

    def __init__(self, head: torch.nn.Module, sampler: RowSampler) -> None:
        super().__init__()
        self.head, self.sampler = head, sampler

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        drawing = self.sampler.drawing_next
        if drawing is None or bool(drawing.all()) or not bool(drawing.any()):
            return self.head(hidden)
        return self.head(hidden[drawing.nonzero().squeeze(-1)])


@contextlib.contextmanager
def live_rows_head(model, sampler: RowSampler) -> Iterator[None]:
    """`model`'s LM head replaced by a `LiveRowsHead` on `sampler` while the block runs (the base model's, under a
    PEFT or DDP wrapper); the model's own head is put back after it, whatever happens. A model without an LM head
    module of its own runs unchanged."""
    base = getattr(model, "module", model)
    base = base.get_base_model() if hasattr(base, "get_base_model") else base
    head = base.get_output_embeddings()
    if head is None:  # a model without a separate LM head module: it runs as it is
        yield
        return
    base.set_output_embeddings(LiveRowsHead(head, sampler))
    try:
        yield
    finally:
        base.set_output_embeddings(head)


class StopWhenAsked(StoppingCriteria):
    """Ends generation for every row once `asked()` is true (a preemption signal arrived)."""

    def __init__(self, asked: Callable[[], bool]) -> None:
        self.asked = asked

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.asked(), dtype=torch.bool, device=input_ids.device)


def hit_cap(ids: Sequence[int], max_new_tokens: int) -> bool:
    """Whether a row of `sample_continuations` ended at `max_new_tokens` without a stop id: a row gains one id at
    every step until it draws a stop id (which is not kept), so only a row that never stopped holds
    `max_new_tokens` ids."""
    return len(ids) >= max_new_tokens


@torch.no_grad()
def sample_continuations(
    model,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    *,
    max_new_tokens: int,
    stop_ids: Collection[int],
    pad_token_id: int,
    n_valid_ids: int | None = None,
    synced_gpus: bool = False,
    stop_early: Callable[[], bool] | None = None,
    generation_options: Mapping[str, Any] | None = None,
) -> list[list[int]]:
    """The token ids sampled after each prompt, up to (not including) a stop id; a row that drew none within
    `max_new_tokens` steps was cut there (`hit_cap`).

    Row i draws from `seeds[i]` alone, so its ids do not depend on the other rows. Ids at or past `n_valid_ids`
    (vocabulary rows without text) are never sampled. When `stop_early()` turns true, generation ends at the next
    token (the caller then drops the batch).

    `generation_options` are further `GenerationConfig` fields for how generate runs, not what it draws (the GPU
    kit's `cache_implementation="static"`, `disable_compile`); one that the sampler's configuration sets itself
    (`do_sample`, `max_new_tokens`, the token ids) is a TypeError.
    """
    device = split_model(model)[1].weight.device
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
    # A complete configuration: none of the model's own sampling defaults (temperature, top_k) leak in.
    generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=sorted(stop_ids),
        pad_token_id=pad_token_id,
        bos_token_id=None,
        **(generation_options or {}),
    )
    # On a GPU the finished rows' share of the head is cheap, and picking the live rows would make the host wait for
    # the device at every step; with synced_gpus every rank must run the same head calls.
    skip_finished = device.type == "cpu" and not synced_gpus
    with live_rows_head(model, sampler) if skip_finished else contextlib.nullcontext():
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=generation_config,
            logits_processor=LogitsProcessorList([sampler]),
            stopping_criteria=StoppingCriteriaList([StopWhenAsked(stop_early)] if stop_early is not None else []),
            synced_gpus=synced_gpus,
        )
    if sampler.saw_nan.item():  # a diverged or overflowing model: its texts are noise, and its scores would be too
        raise NonFiniteLogits("NaN in the model's logits while generating")
    stops = set(stop_ids)
    generated = []
    for row in output[:, input_ids.shape[1] :].tolist():
        end = next((i for i, token in enumerate(row) if token in stops), len(row))
        generated.append(row[:end])
    return generated


# ---- the evaluator's default engine (core/engine.py's protocol) ------------------------------------------------


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
