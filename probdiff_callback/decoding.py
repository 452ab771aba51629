"""Batched decoding with the reproducible sampler: left padding, KV cache, finished rows dropped.

HF `generate` runs a batch until its longest row ends, applies the LM head to every row
at every step, copies the logits and takes an argmax over them, and its cache copies
itself at every step. Here the LM head and the sampler see only the rows still
generating, and the batch (KV cache included) is compacted whenever a quarter of it has
finished: on the tiny model's 32 blog queries that halves the rows decoded, since
answers end at ~27 of 64 tokens. Prompts are prefilled in groups of similar length into
a cache with room for the new tokens (see `prefill`).

Under ZeRO-3 with sharded parameters every rank must call the decoder and the LM head
equally often (each call gathers parameters collectively), so with `synced_gpus` all
ranks agree each step whether anyone is still generating, and a rank with nothing left
calls both on a dummy token, as `generate(synced_gpus=True)` does.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer

from probdiff_callback.sampling import counter_uniforms, sample_tokens
from probdiff_callback.scoring import split_model

COMPACT_WHEN_LIVE_SHARE = 0.75
PREFILL_ROWS_PER_FORWARD = 8


def left_padded(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[i, width - len(prompt) :] = 1
    return input_ids, attention_mask


def _room_shape(states: torch.Tensor, batch: int, length: int) -> tuple[int, ...]:
    return (batch, states.shape[1], length, states.shape[3])


class RoomyLayer(DynamicLayer):
    """A full-attention cache layer whose keys and values are views into buffers with room
    for the positions still to come."""

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int) -> None:
        super().__init__()
        self.dtype, self.device, self.is_initialized = key_buffer.dtype, key_buffer.device, True
        self.key_buffer, self.value_buffer, self.length = key_buffer, value_buffer, length
        self._expose()

    def _expose(self) -> None:
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]

    def write_rows(self, rows: torch.Tensor, offset: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.key_buffer[rows, :, offset : offset + keys.shape[2]] = keys
        self.value_buffer[rows, :, offset : offset + values.shape[2]] = values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + key_states.shape[2]
        if end > self.key_buffer.shape[2]:  # more than planned: grow, as DynamicLayer would
            grow = end - self.key_buffer.shape[2]
            self.key_buffer = torch.cat(
                [self.key_buffer, self.key_buffer.new_zeros(_room_shape(self.key_buffer, len(self.key_buffer), grow))],
                2,
            )
            self.value_buffer = torch.cat(
                [
                    self.value_buffer,
                    self.value_buffer.new_zeros(_room_shape(self.value_buffer, len(self.value_buffer), grow)),
                ],
                2,
            )
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
        self._expose()


def prefill(
    decoder, prompts: Sequence[Sequence[int]], pad_token_id: int, room: int, device: torch.device
) -> tuple[Cache, torch.Tensor, torch.Tensor]:
    """(KV cache, last hidden state [B, H], attention mask [B, width]) of the left-padded prompts.

    Prompts run `PREFILL_ROWS_PER_FORWARD` at a time in order of length (one forward
    padded to the longest prompt spent 43-72% of its positions on padding on the blog
    set), and the cache keeps `room` free positions per layer, so that decoding writes
    one position per step where `DynamicCache` copies the whole cache. The number of
    forwards depends only on len(prompts), as ZeRO-3 with sharded parameters needs.
    Models with other than full attention (sliding windows) get one plain forward.
    """
    input_ids, attention_mask = (t.to(device) for t in left_padded(prompts, pad_token_id))
    layer_types = getattr(decoder.config, "layer_types", None) or ["full_attention"]
    if any(kind != "full_attention" for kind in layer_types):
        cache = DynamicCache(config=decoder.config)
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        hidden = decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state[:, -1]
        return cache, hidden, attention_mask

    width = input_ids.shape[1]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    hidden, layers = None, None
    for start in range(0, len(order), PREFILL_ROWS_PER_FORWARD):
        rows = torch.tensor(order[start : start + PREFILL_ROWS_PER_FORWARD], device=device)
        group_width = max(len(prompts[i]) for i in rows.tolist())
        group_mask = attention_mask[rows, width - group_width :]
        group_cache = DynamicCache(config=decoder.config)
        out = decoder(
            input_ids=input_ids[rows, width - group_width :],
            attention_mask=group_mask,
            position_ids=(group_mask.cumsum(-1) - 1).clamp(min=0),
            past_key_values=group_cache,
            use_cache=True,
        ).last_hidden_state[:, -1]
        if hidden is None:
            hidden = out.new_empty((len(prompts), out.shape[-1]))
            # zeros, not empty: padded positions are masked, but 0 * NaN garbage would still be NaN
            layers = [
                RoomyLayer(
                    layer.keys.new_zeros(_room_shape(layer.keys, len(prompts), width + room)),
                    layer.values.new_zeros(_room_shape(layer.values, len(prompts), width + room)),
                    width,
                )
                for layer in group_cache.layers
            ]
        hidden[rows] = out
        for layer, group_layer in zip(layers, group_cache.layers):
            layer.write_rows(rows, width - group_width, group_layer.keys, group_layer.values)
    return Cache(layers=layers), hidden, attention_mask


def hit_cap(ids: Sequence[int], max_new_tokens: int) -> bool:
    """Whether a row of `sample_continuations` ended at `max_new_tokens` without a stop id: a live
    row gains one id at every step until it draws a stop id (which is not kept), so only a row
    that never stopped holds `max_new_tokens` ids."""
    return len(ids) >= max_new_tokens


def _anyone_generating(local: bool, synced_gpus: bool, device: torch.device) -> bool:
    if not synced_gpus:
        return local
    import torch.distributed as dist

    flag = torch.tensor(1.0 if local else 0.0, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.SUM)
    return flag.item() > 0


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
) -> list[list[int]]:
    """The token ids sampled after each prompt, up to (not including) a stop id; a row that
    drew none within `max_new_tokens` steps was cut there (`hit_cap`).

    Row i draws from `seeds[i]` alone, so its ids do not depend on the other rows. Ids at
    or past `n_valid_ids` (vocabulary rows without text) are never sampled.
    """
    decoder, lm_head = split_model(model)
    device = lm_head.weight.device
    cache, hidden, attention_mask = prefill(decoder, prompts, pad_token_id, room=max_new_tokens, device=device)
    next_position = attention_mask.sum(dim=-1)

    temperatures_t = torch.tensor(temperatures, dtype=torch.float64, device=device)
    top_ps_t = torch.tensor(top_ps, dtype=torch.float64, device=device)
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    generated: list[list[int]] = [[] for _ in prompts]
    slot_row = torch.arange(len(prompts), device=device)  # the prompt each batch slot decodes
    live = torch.ones(len(prompts), dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        live_slots = live.nonzero().squeeze(-1)
        if live_slots.numel():
            logits = lm_head(hidden[live_slots]).float()
            rows = slot_row[live_slots]
            row_list = rows.tolist()
            tokens = sample_tokens(
                logits,
                temperatures_t[rows],
                top_ps_t[rows],
                counter_uniforms([seeds[r] for r in row_list], step).to(device),
                n_valid_ids=n_valid_ids,
            )
            finished = torch.isin(tokens, stops)
            for row, token, stop in zip(row_list, tokens.tolist(), finished.tolist()):
                if not stop:
                    generated[row].append(token)
            live[live_slots[finished]] = False
            next_tokens = torch.full_like(slot_row, pad_token_id).index_copy_(0, live_slots, tokens)
        else:  # synced: this rank is done, the others are not
            lm_head(hidden.new_zeros((1, hidden.shape[-1])))
        if step == max_new_tokens - 1 or not _anyone_generating(bool(live.any()), synced_gpus, device):
            break
        if not live.any():
            decoder(input_ids=torch.full((1, 1), pad_token_id, device=device), use_cache=False)
            continue
        if live.sum() <= COMPACT_WHEN_LIVE_SHARE * live.numel():
            keep = live.nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            attention_mask, next_position, slot_row, next_tokens = (
                t[keep] for t in (attention_mask, next_position, slot_row, next_tokens)
            )
            live = live[keep]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=1)
        hidden = decoder(
            input_ids=next_tokens[:, None],
            attention_mask=attention_mask,
            position_ids=next_position[:, None],
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state[:, -1]
        next_position = next_position + 1
    return generated
