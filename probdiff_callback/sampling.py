"""Exact temperature + top-p sampling that is reproducible per row and fast on a 152k vocabulary.

HF `generate` samples every row from one global generator, so a query's text depends on
the batch it lands in, the batch size and the rank. Here each row draws its uniform
number from a counter-based hash of (row seed, decoding step), so a row's text depends
only on its seed. The draw is an inverse-CDF lookup in the nucleus: exactly the
distribution of temperature + top-p sampling. The nucleus is found among the top-k
logits (`torch.topk` is linear in the vocabulary, a full sort is not) and only rows
whose top-k hold less than top_p of the mass fall back to a full sort.

The sampler plugs into `generate` as a `LogitsProcessor` that leaves only the chosen
token finite, with greedy decoding, so HF keeps doing the KV cache, stopping, padding
and ZeRO-3's `synced_gpus`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


def row_seed(seed: int, *key: object) -> int:
    """A 64-bit seed for one generation row from the run seed and a key such as (query id, sample, stage)."""
    text = "\x1f".join([str(seed), *map(str, key)])
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + _GOLDEN_GAMMA
        z = (z ^ (z >> np.uint64(30))) * _MIX_1
        z = (z ^ (z >> np.uint64(27))) * _MIX_2
        return z ^ (z >> np.uint64(31))


def counter_uniforms(seeds: Sequence[int], step: int) -> torch.Tensor:
    """One uniform in [0, 1) per seed for decoding step `step`; stateless, so order-free."""
    keys = np.asarray(seeds, dtype=np.uint64)
    with np.errstate(over="ignore"):
        mixed = _splitmix64(_splitmix64(keys) ^ np.uint64(step))
    return torch.from_numpy((mixed >> np.uint64(11)).astype(np.float64) * 2.0**-53)


def _pick_in_nucleus(probs_desc: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index into descending-sorted probabilities: keep a token while the mass ranked above it is
    below top_p (HF's `TopPLogitsWarper` rule, at least one token), renormalise, invert the CDF."""
    mass_above = torch.cumsum(probs_desc, dim=-1) - probs_desc
    kept = torch.where(mass_above < top_p[:, None], probs_desc, torch.zeros_like(probs_desc))
    kept[:, 0] = probs_desc[:, 0]
    cdf = torch.cumsum(kept, dim=-1)
    target = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    n_kept = (kept > 0).sum(-1).clamp(min=1)
    return torch.minimum(index, n_kept - 1)


def sample_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    uniforms: torch.Tensor,
    candidates: int = 64,
) -> torch.Tensor:
    """Token ids [B] sampled from `logits` [B, V] with per-row temperature (<= 0: greedy) and top-p."""
    chosen = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    greedy = temperatures <= 0
    if greedy.any():
        chosen[greedy] = logits[greedy].argmax(dim=-1)
    rows = (~greedy).nonzero().squeeze(-1)
    if rows.numel() == 0:
        return chosen
    sampled = logits if rows.numel() == logits.shape[0] else logits[rows]
    # One fused softmax over the vocabulary (fp32); only the candidates go to fp64.
    probs = torch.softmax(sampled.float() / temperatures[rows, None].float(), dim=-1)
    top_p = top_ps[rows].double()
    u = uniforms[rows]

    # Widen the candidate set only for rows that need it: when the candidates already hold
    # top_p of the mass, the nucleus lies inside them. Flat rows (an untrained model, top_p = 1)
    # end in a sort of the whole vocabulary.
    result = torch.empty_like(rows)
    pending = torch.arange(rows.numel(), device=logits.device)
    vocab = probs.shape[-1]
    for k in (min(candidates, vocab), min(candidates * 64, vocab), vocab):
        if pending.numel() == 0:
            break
        subset = probs if pending.numel() == probs.shape[0] else probs[pending]
        if k == vocab:
            top_probs, top_ids = torch.sort(subset, dim=-1, descending=True)
            inside = torch.ones_like(pending, dtype=torch.bool)
        else:
            top_probs, top_ids = torch.topk(subset, k, dim=-1)
            inside = (top_probs.double().sum(-1) >= top_p[pending]) & (top_p[pending] < 1.0)
        if inside.any():
            pick = _pick_in_nucleus(top_probs[inside].double(), top_p[pending][inside], u[pending][inside])
            result[pending[inside]] = top_ids[inside].gather(1, pick[:, None]).squeeze(1)
        pending = pending[~inside]
    chosen[rows] = result
    return chosen


class ReproducibleSampler:
    """`LogitsProcessor` for `generate(do_sample=False)`: samples each row from its own seed.

    Rows keep their order inside one `generate` call, so row i always belongs to seed i;
    the step is the number of tokens generated so far. Ids at or past `n_valid_ids`
    (vocabulary rows without text) are never chosen.
    """

    def __init__(
        self,
        seeds: Sequence[int],
        temperatures: Sequence[float],
        top_ps: Sequence[float],
        prompt_length: int,
        n_valid_ids: int | None = None,
        candidates: int = 64,
    ) -> None:
        self.seeds = list(seeds)
        self.temperatures = torch.tensor(temperatures, dtype=torch.float64)
        self.top_ps = torch.tensor(top_ps, dtype=torch.float64)
        self.prompt_length = prompt_length
        self.n_valid_ids = n_valid_ids
        self.candidates = candidates

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = input_ids.shape[1] - self.prompt_length
        # generate hands processors a fresh fp32 copy of the logits: edit it in place.
        if self.n_valid_ids is not None and self.n_valid_ids < scores.shape[-1]:
            scores[:, self.n_valid_ids :] = float("-inf")
        device = scores.device
        tokens = sample_tokens(
            scores,
            self.temperatures.to(device),
            self.top_ps.to(device),
            counter_uniforms(self.seeds, step).to(device),
            self.candidates,
        )
        return scores.fill_(float("-inf")).scatter_(1, tokens[:, None], 0.0)
