"""The floor: what one token costs a model of a given shape, and the seconds decoding and scoring need at least on
given hardware. A decode step's floor is its weight bytes plus its KV-cache bytes over the bandwidth; prefill and
scoring are bounded by their FLOPs over the matmul throughput."""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Sequence
from dataclasses import dataclass

import torch

Hardware = namedtuple("Hardware", "bandwidth flops")  # bytes per second, FLOP per second


@dataclass(frozen=True)
class ModelCost:
    """What one token costs a model of this shape: bytes read per decode step, FLOPs per token."""

    layers: int
    attention_width: int  # heads x head size
    decoder_matmul_params: int  # q, k, v, o and the MLP of every layer
    head_params: int
    element_size: int
    kv_bytes_per_token: int

    @classmethod
    def from_config(cls, config, dtype: torch.dtype) -> ModelCost:
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv_width = config.num_key_value_heads * head_dim
        attention = hidden * heads * head_dim + 2 * hidden * kv_width + heads * head_dim * hidden
        size, layers = torch.empty((), dtype=dtype).element_size(), config.num_hidden_layers
        matmuls = layers * (attention + 3 * hidden * config.intermediate_size)
        return cls(layers, heads * head_dim, matmuls, config.vocab_size * hidden, size, 2 * layers * kv_width * size)

    @property
    def weight_bytes_per_step(self) -> int:
        # Every decode step reads the decoder and the LM head; the embedding lookup reads only the batch's rows.
        return (self.decoder_matmul_params + self.head_params) * self.element_size

    def forward_flops(self, tokens: int, head_positions: int) -> float:
        """FLOPs of a causal forward over `tokens` from an empty cache, the LM head at `head_positions`."""
        attention = 2 * self.layers * self.attention_width * tokens**2  # QK^T and AV over the causal half
        return 2 * self.decoder_matmul_params * tokens + attention + 2 * self.head_params * head_positions


def decode_floor(cost: ModelCost, hardware: Hardware, prompts: Sequence[int], steps: Sequence[int]) -> tuple:
    """(prefill, weights, KV cache) seconds: the prefill (compute-bound, one weight read at least), then per decode
    step one read of the weights and of the KV cache of the rows still generating, up to their position (`steps`:
    each row's)."""
    prefill = sum(cost.forward_flops(length, head_positions=1) for length in prompts) / hardware.flops
    kv_tokens = sum(n * prompt + n * (n - 1) // 2 for prompt, n in zip(prompts, steps))
    weights = cost.weight_bytes_per_step / hardware.bandwidth
    return max(prefill, weights), max(steps) * weights, kv_tokens * cost.kv_bytes_per_token / hardware.bandwidth


def scoring_floor(cost: ModelCost, hardware: Hardware, prompts: Sequence[int], texts: Sequence[Sequence[int]]):
    """Seconds the scoring forwards need at least: their FLOPs, each prompt run once for all its texts (as
    `score_shared_prompts` does), the LM head on the texts' positions only."""
    flops = 0.0
    for p, lengths in zip(prompts, texts):
        prompt = cost.forward_flops(p, head_positions=0)
        flops += prompt + sum(cost.forward_flops(p + r, head_positions=r) - prompt for r in lengths)
    return flops / hardware.flops


def steps_per_row(generated_lengths: Sequence[int], cap: int) -> list[int]:
    """Sampling steps each row was live for: one per token, plus the step that drew its stop token."""
    return [min(length + 1, cap) for length in generated_lengths]
