"""Exact temperature + top-p sampling that is reproducible per row and fast on a 152k vocabulary.

HF `generate` samples every row from one global generator, so a query's text depends on
the batch it lands in, the batch size and the rank. Here each row draws from a counter-based
hash of (row seed, decoding step), so a row's text depends only on its seed.

At top_p 1 (the reference code's setting) the draw is an exponential race over the whole
vocabulary in two stages: a block of 64 ids wins with probability its mass over the total,
then an id of that block with probability its weight over the block's. Each stage races
(the largest weight / Exp(1) wins) on noise hashed from the row's uniform, so a few thousand
noise values per row and step instead of one per id; see `race`. With top_p < 1 the draw is
an inverse-CDF lookup in the nucleus, found without sorting the vocabulary: the top token
alone when it holds top_p of the mass, else among the k heaviest tokens (found blockwise,
see `largest`); only rows whose top 8,192 hold less than top_p of the mass fall back to a
full sort. Both are exactly the distribution of temperature + top-p sampling.
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


# The race's two noise streams, apart from each other and from `counter_uniforms`.
_RACE_BLOCKS, _RACE_IDS = np.uint64(0x5241434542), np.uint64(0x52414345494)
RACE_BLOCK = 64  # ids per block of the race: 2,376 blocks of Qwen's 152,064 ids


def race_exponentials(keys: np.ndarray, counters: np.ndarray, stream: np.uint64) -> np.ndarray:
    """Exp(1) noise [rows, len(counters)]: entry (r, j) hashed from (keys[r], stream, counters[j]) alone."""
    with np.errstate(over="ignore"):
        mixed = _splitmix64((_splitmix64(keys ^ stream))[:, None] ^ counters[None, :])
    # (h + 0.5) / 2**53: uniform in (0, 1), never 0, so the exponential is finite
    return -np.log(((mixed >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53)


def block_sums(weights: torch.Tensor, block: int) -> torch.Tensor:
    """Sums of `weights` [rows, width] over consecutive blocks of `block` columns, the last block holding the
    remainder of the width (no copy of `weights`)."""
    n_rows, width = weights.shape
    full = width // block
    sums = weights[:, : full * block].reshape(n_rows, full, block).sum(-1)
    if width % block:
        sums = torch.cat([sums, weights[:, full * block :].sum(-1, keepdim=True)], dim=1)
    return sums


def race(weights: torch.Tensor, sums: torch.Tensor, keys: torch.Tensor, block: int = RACE_BLOCK) -> torch.Tensor:
    """An id per row of `weights` [rows, width] (unnormalised, >= 0), id i with probability weights[i] / total.

    An exponential race: with E_i ~ Exp(1) independent, argmax_i w_i / E_i is i with probability w_i / sum(w).
    Run over all 152k ids it costs one random number per id and step, most of a decoding step on a small model. Run
    in two stages it is the same distribution for far less: block b (of `block` ids, `sums` [rows, blocks] their
    masses, `block_sums`) wins with probability W_b / total, then id i of the winning block with probability
    w_i / W_b. Each stage's noise is hashed from the row's key ([rows] int64) and the block's index or the id's
    place in the block, so a row's draw depends on its own logits and key alone.

    Unlike inverting a CDF over the vocabulary, where the rounding of every weight ranked before the drawn id moves
    the boundary, a race's winner moves only when two ratios tie to within rounding: so a row's token does not
    change with the batch it is decoded in, whose logits differ from its own in the last bits.
    """
    n_rows, width = weights.shape
    host_keys = keys.cpu().numpy().astype(np.uint64)
    block_noise = race_exponentials(host_keys, np.arange(sums.shape[1], dtype=np.uint64), _RACE_BLOCKS)
    id_noise = race_exponentials(host_keys, np.arange(block, dtype=np.uint64), _RACE_IDS)
    device = weights.device
    winner = torch.argmax(sums.double() / torch.from_numpy(block_noise).to(device), dim=-1)
    ids = winner[:, None] * block + torch.arange(block, device=device)
    inside = ids < width  # the last block may be shorter
    candidates = weights.gather(1, ids.clamp(max=width - 1)).double() * inside
    pick = torch.argmax(candidates / torch.from_numpy(id_noise).to(device), dim=-1)
    return ids.gather(1, pick[:, None]).squeeze(1)


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


# exp() of anything below -87 (denormal results, underflow, -inf) takes x86 several times longer
# than of a normal number, and at low temperatures most of the vocabulary lands there. So exponents
# are clamped to -87: a token that far below the top weighs 1.6e-38
# instead of less; over the whole vocabulary that is < 2.5e-33 of the mass, below what
# fp32 sums or 53-bit uniforms resolve.
LOWEST_EXPONENT = -87.0


def block_size(width: int, k: int) -> int:
    """Blocks for `largest`: a power of two up to 64 dividing `width`, with k blocks at most
    1/8 of it; 1 (no blocking) when there is none."""
    block = min(64, width & -width)
    while block > 1 and 8 * k * block > width:
        block //= 2
    return block


def largest(
    x: torch.Tensor,
    k: int,
    rows: torch.Tensor | None = None,
    block_max: torch.Tensor | None = None,
    block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(x[rows], k)` over the last dim (values descending, ids), faster when k is small against
    the width.

    The k largest entries lie in the k blocks with the largest block maxima (a block
    outside those is beaten by k block maxima, so each of its entries by k entries), so
    only those blocks are searched. `block_max` ([len(rows), n_blocks], any order-keeping
    transform of x's) may be given. Ties may come out in another order than torch.topk's.
    """
    width = x.shape[-1]
    block = block or block_size(width, k)
    if block < 8:
        return torch.topk(x if rows is None else x[rows], k, dim=-1)
    blocks = x.view(x.shape[0], width // block, block)
    if rows is None:
        rows = torch.arange(x.shape[0], device=x.device)
    if block_max is None:
        block_max = blocks[rows].amax(dim=-1)
    _, top_blocks = torch.topk(block_max, k, dim=-1, sorted=False)
    values = blocks[rows[:, None], top_blocks].view(len(rows), k * block)
    ids = (top_blocks[:, :, None] * block + torch.arange(block, device=x.device)).view(len(rows), k * block)
    top_values, where = torch.topk(values, k, dim=-1)
    return top_values, ids.gather(1, where)


def sample_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    uniforms: torch.Tensor,
    candidates: Sequence[int] = (64, 1024, 8192),
    n_valid_ids: int | None = None,
) -> torch.Tensor:
    """Token ids [B] sampled from `logits` [B, V] with per-row temperature (<= 0: greedy) and top-p.

    Ids at or past `n_valid_ids` (vocabulary rows without text) are never drawn.
    `logits` is overwritten (it becomes the unnormalised probabilities): callers hand over
    a fresh fp32 tensor, and in-place work avoids four [B, V] allocations per step.
    """
    if n_valid_ids is not None and n_valid_ids < logits.shape[-1]:
        logits[:, n_valid_ids:] = float("-inf")
    chosen = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    greedy = temperatures <= 0
    if greedy.any():
        chosen[greedy] = logits[greedy].max(dim=-1).indices  # max: faster than argmax on CPU
    rows = (~greedy).nonzero().squeeze(-1)
    if rows.numel() == 0:
        return chosen
    weights = logits if rows.numel() == logits.shape[0] else logits[rows]
    n_rows, vocab = weights.shape
    # Maxima of blocks of the logits give the row maximum, the argmax and the first
    # candidates below in one pass (exp keeps their order).
    block = block_size(vocab, candidates[0] if candidates else vocab)
    blocks = weights.view(n_rows, vocab // block, block)
    block_max = blocks.amax(dim=-1)
    # weights = exp((logit - max) / T), in place, not torch.softmax (slower on CPU, and a copy).
    # The top token weighs 1, so 1 / total is its probability.
    weights.sub_(block_max.amax(dim=-1, keepdim=True)).mul_((1.0 / temperatures[rows, None]).to(weights.dtype))
    weights.clamp_(min=LOWEST_EXPONENT).exp_()
    if n_valid_ids is not None:
        weights[:, n_valid_ids:] = 0.0  # exactly: the clamp gave them the floor weight
    # The race's block masses, in fp32 (exact to ~1e-7 relative; an fp64 pass over the vocabulary would cost
    # several times as much), and their total in fp64.
    sums = block_sums(weights, RACE_BLOCK)
    total = sums.double().sum(dim=-1)
    top_p = top_ps[rows].double()
    u = uniforms[rows]

    result = torch.full((n_rows,), -1, dtype=torch.long, device=logits.device)
    # The top token alone holds top_p of the mass (typical at low temperature): the
    # nucleus is that token.
    alone = ((1.0 / total) >= top_p).nonzero().squeeze(-1)
    if alone.numel():
        best_block = block_max[alone].argmax(dim=-1)
        result[alone] = best_block * block + blocks[alone, best_block].argmax(dim=-1)
    pending = (result < 0).nonzero().squeeze(-1)
    # top_p = 1 (the reference code's setting): the whole vocabulary, by a race (no sort), its noise keyed by the
    # row's uniform: the uniform's 53 bits identify (row seed, step).
    whole = pending[top_p[pending] >= 1.0]
    if whole.numel():
        keys = (u[whole] * 2.0**53).to(torch.int64)
        every = whole.numel() == n_rows  # all rows race (the default settings): no copy of the weights
        result[whole] = race(weights if every else weights[whole], sums if every else sums[whole], keys)
    pending = pending[top_p[pending] < 1.0]
    # Otherwise widen the candidate set only for rows that need it: when the k heaviest
    # tokens hold top_p of the mass, the nucleus lies among them. Flat rows (an untrained
    # model) end in a sort of the whole vocabulary.
    for level, k in enumerate([c for c in candidates if c < vocab] + [vocab]):
        if pending.numel() == 0:
            break
        if k == vocab:
            top_weights, top_ids = torch.sort(weights[pending], dim=-1, descending=True)
            inside = torch.ones_like(pending, dtype=torch.bool)
        else:
            shared = dict(block_max=block_max[pending], block=block) if level == 0 else {}
            top_weights, top_ids = largest(weights, k, pending, **shared)
            inside = top_weights.sum(-1, dtype=torch.float64) / total[pending] >= top_p[pending]
        if inside.any():
            probs = top_weights[inside].double() / total[pending][inside, None]
            pick = _pick_in_nucleus(probs, top_p[pending][inside], u[pending][inside])
            result[pending[inside]] = top_ids[inside].gather(1, pick[:, None]).squeeze(1)
        pending = pending[~inside]
    chosen[rows] = result
    return chosen
