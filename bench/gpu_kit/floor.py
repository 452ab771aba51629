"""The floor: what one token costs a model of a given shape, and the seconds decoding, scoring and a LoRA
training step need at least on given hardware. The floor of a decode step is its weight bytes plus its KV-cache
bytes over the bandwidth; prefill, scoring and training are bounded by their FLOPs over the matmul throughput."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .report import Figure


@dataclass(frozen=True)
class Hardware:
    bandwidth: float  # bytes per second
    flops: float  # FLOP per second


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
        mlp = 3 * hidden * config.intermediate_size
        element_size = torch.empty((), dtype=dtype).element_size()
        return cls(
            layers=config.num_hidden_layers,
            attention_width=heads * head_dim,
            decoder_matmul_params=config.num_hidden_layers * (attention + mlp),
            head_params=config.vocab_size * hidden,
            element_size=element_size,
            kv_bytes_per_token=2 * config.num_hidden_layers * kv_width * element_size,
        )

    @property
    def weight_bytes_per_step(self) -> int:
        # Every decode step reads the decoder and the LM head; the embedding lookup reads only the batch's rows.
        return (self.decoder_matmul_params + self.head_params) * self.element_size

    def forward_flops(self, tokens: int, head_positions: int) -> float:
        """FLOPs of a causal forward over `tokens` from an empty cache, the LM head at `head_positions`."""
        attention = 2 * self.layers * self.attention_width * tokens**2  # QK^T and AV over the causal half
        return 2 * self.decoder_matmul_params * tokens + attention + 2 * self.head_params * head_positions


@dataclass(frozen=True)
class DecodeFloor:
    """Seconds one decoding batch needs at least, by what bounds them."""

    prefill: float
    weights: float
    kv_cache: float

    @property
    def total(self) -> float:
        return self.prefill + self.weights + self.kv_cache


def decode_floor(
    cost: ModelCost, hardware: Hardware, prompt_lengths: Sequence[int], steps_per_row: Sequence[int]
) -> DecodeFloor:
    """The prefill (compute-bound, one weight read at least), then per decode step one read of the weights and
    of the KV cache of the rows still generating, up to their position."""
    prefill_flops = sum(cost.forward_flops(length, head_positions=1) for length in prompt_lengths)
    prefill = max(prefill_flops / hardware.flops, cost.weight_bytes_per_step / hardware.bandwidth)
    kv_tokens = sum(steps * prompt + steps * (steps - 1) // 2 for prompt, steps in zip(prompt_lengths, steps_per_row))
    return DecodeFloor(
        prefill,
        max(steps_per_row) * cost.weight_bytes_per_step / hardware.bandwidth,
        kv_tokens * cost.kv_bytes_per_token / hardware.bandwidth,
    )


def scoring_floor(
    cost: ModelCost,
    hardware: Hardware,
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[Sequence[int]],
) -> float:
    """Seconds the scoring forwards need at least: their FLOPs, each prompt run once for all its responses (as
    `score_shared_prompts` does), the LM head on the response positions only."""
    flops = 0.0
    for p, responses in zip(prompt_lengths, response_lengths):
        prompt = cost.forward_flops(p, head_positions=0)
        flops += prompt + sum(cost.forward_flops(p + r, head_positions=r) - prompt for r in responses)
    return flops / hardware.flops


def training_floor(cost: ModelCost, hardware: Hardware, tokens: int) -> float:
    """Seconds forward + backward of one sequence needs at least under LoRA with activation checkpointing: the
    frozen matmuls run three times (forward, recomputation, backward to the activations; frozen weights get no
    gradient), attention four (its backward is two), or three reads of the weights if that is longer. The
    adapter's own FLOPs are left out."""
    matmuls = 3 * 2 * (cost.decoder_matmul_params + cost.head_params) * tokens
    attention = 4 * 2 * cost.layers * cost.attention_width * tokens**2
    return max((matmuls + attention) / hardware.flops, 3 * cost.weight_bytes_per_step / hardware.bandwidth)


def steps_per_row(generated_lengths: Sequence[int], cap: int) -> list[int]:
    """Sampling steps each row was live for: one per token, plus the step that drew its stop token."""
    return [min(length + 1, cap) for length in generated_lengths]


def cost_figures(cost: ModelCost) -> list[Figure]:
    return [
        Figure(
            "bytes per decode step",
            f"{cost.weight_bytes_per_step / 1e9:.2f} GB weights + "
            f"{cost.kv_bytes_per_token / 1e6:.3f} MB per token of context",
            "decoder and LM head (the embedding lookup reads only the batch's rows); KV: 2 x layers x kv width x bytes",
            {"weight_bytes": cost.weight_bytes_per_step, "kv_bytes_per_token": cost.kv_bytes_per_token},
        )
    ]
