"""Mean per-token log p(response | chat prompt), causal, in bounded memory.

A plain forward materialises [batch, sequence, vocabulary] logits (5 GB in fp32 for
8 x 1,024 tokens at Qwen's 152k vocabulary) although only the response positions are
needed. We run the decoder for hidden states, keep the positions that predict response
tokens, and apply the LM head to them a chunk at a time with an fp32 log-sum-exp (a
plain linear head also a vocabulary tile at a time), so the extra memory is proportional
to the chunk. The logits themselves come from fp32 products of the (bf16) hidden state and
weights, not from a cast after a bf16 matmul: bf16 logits near 16 are spaced 0.125 apart,
coarser than the thresholds (0.02-0.05) we compare against.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch.overrides import TorchFunctionMode

# Sequences per scoring forward, in order of length: little padding, and a count of forwards
# that depends only on the number of texts (ZeRO-3 with sharded parameters needs equal counts).
SCORE_ROWS_PER_FORWARD = 16


class NonFiniteLogits(FloatingPointError):
    """The model's logits hold NaN (or a response's log-probability is not finite): the evaluation fails."""


def split_model(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(decoder that returns hidden states, LM head) of a causal LM, a PEFT wrapper or DDP."""
    model = getattr(model, "module", model)  # DDP / DeepSpeed engine
    if hasattr(model, "get_base_model"):  # PEFT: the LoRA layers live inside the base model
        model = model.get_base_model()
    return model.get_decoder(), model.get_output_embeddings()


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _upcast(value):
    return value.float() if isinstance(value, torch.Tensor) and value.dtype in _LOW_PRECISION else value


class Fp32Products(TorchFunctionMode):
    """Inside this mode every linear layer and matrix product takes its bf16/fp16 operands in fp32.

    For an LM head that is more than a plain `nn.Linear` (a LoRA-wrapped head, ZeRO-3's
    parameter-gathering hooks) we cannot take its weight and tile it ourselves, so we run the
    module as it is and upcast inside its products: the hooks still gather, the LoRA branch
    still adds, and the logits come out of fp32 products (PEFT casts its result back to the
    dtype of the base layer's output, which is then fp32 too).
    """

    FUNCTIONS = frozenset(
        {
            torch.nn.functional.linear,
            torch.matmul,
            torch.mm,
            torch.addmm,
            torch.Tensor.matmul,
            torch.Tensor.__matmul__,
        }
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FUNCTIONS:
            args = tuple(_upcast(a) for a in args)
            kwargs = {key: _upcast(value) for key, value in kwargs.items()}
        return func(*args, **kwargs)


def token_logprobs_chunked(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    lm_head: torch.nn.Module,
    chunk_size: int,
    sync_n_chunks: Callable[[int], int] | None = None,
) -> torch.Tensor:
    """log p(target) for each row of `hidden` [N, H], with the LM head applied `chunk_size` rows at a time.

    `sync_n_chunks` (for ZeRO-3 with sharded parameters, where every rank must call the
    LM head equally often) maps this rank's chunk count to the count all ranks run;
    the extra calls run on a dummy row.
    """
    n_chunks = math.ceil(hidden.shape[0] / chunk_size)
    if sync_n_chunks is not None:
        n_chunks = sync_n_chunks(n_chunks)
    plain_weight = _plain_linear_weight(lm_head)
    out = torch.empty(targets.shape[0], dtype=torch.float32, device=hidden.device)
    for index in range(n_chunks):
        start = index * chunk_size
        if start >= hidden.shape[0]:
            lm_head(hidden.new_zeros((1, hidden.shape[-1])))
            continue
        rows, chunk_targets = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        if plain_weight is not None:
            out[start : start + chunk_size] = _logprobs_by_vocabulary_tiles(rows, chunk_targets, plain_weight)
            continue
        with Fp32Products():
            logits = lm_head(rows).float()
        # log-softmax at the targets only: one [chunk, vocabulary] tensor, not two
        out[start : start + chunk_size] = logits.gather(1, chunk_targets[:, None]).squeeze(1) - torch.logsumexp(
            logits, dim=-1
        )
        del logits
    return out


VOCABULARY_TILE = 8192


def _plain_linear_weight(lm_head: torch.nn.Module) -> torch.Tensor | None:
    """The weight of an LM head that is nothing but a bias-free `nn.Linear` (no LoRA, no
    ZeRO-3 hooks that gather its parameters in forward), else None."""
    if type(lm_head) is not torch.nn.Linear or lm_head.bias is not None:
        return None
    if lm_head._forward_hooks or lm_head._forward_pre_hooks:
        return None
    return lm_head.weight


def _logprobs_by_vocabulary_tiles(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """log p(target) of each row of `hidden`: logits and a running log-sum-exp one tile of
    the vocabulary at a time, so they never leave the cache (faster on CPU than the whole
    [rows, vocabulary] logits and torch.logsumexp, in a fraction of the memory)."""
    hidden = hidden.float()  # each weight tile is upcast too: fp32 products, not a cast of bf16 ones
    n_rows = hidden.shape[0]
    target_logits = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
    running_max = torch.full((n_rows,), float("-inf"), dtype=torch.float32, device=hidden.device)
    running_sum = torch.zeros(n_rows, dtype=torch.float64, device=hidden.device)
    for start in range(0, weight.shape[0], VOCABULARY_TILE):
        tile = hidden @ weight[start : start + VOCABULARY_TILE].float().T
        here = ((targets >= start) & (targets < start + tile.shape[1])).nonzero().squeeze(-1)
        target_logits[here] = tile[here, targets[here] - start]
        new_max = torch.maximum(running_max, tile.amax(dim=-1))
        tile.sub_(new_max[:, None]).exp_()
        running_sum = running_sum * torch.exp(running_max - new_max).double() + tile.sum(dim=-1).double()
        running_max = new_max
    return target_logits - running_max - running_sum.log().float()


@torch.no_grad()
def score_batch(
    model,
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    pad_token_id: int,
    chunk_size: int = 512,
    sync_n_chunks: Callable[[int], int] | None = None,
    rows_per_forward: int = SCORE_ROWS_PER_FORWARD,
) -> list[tuple[float, int]]:
    """(mean log-prob of the response tokens, number of response tokens) for each pair.

    Prompt and response are tokenized apart and concatenated, so no token merges across
    their boundary. An empty response scores NaN; a non-finite score of a non-empty one raises
    `NonFiniteLogits`. Sequences run `rows_per_forward` at a time in order of length: one forward
    padded to the longest sequence would spend most of its positions on the padding of the shorter
    ones (docs/benchmarks.md); the number of forwards depends only on the number of pairs, as ZeRO-3
    with sharded parameters needs.
    """
    decoder, lm_head = split_model(model)
    device = lm_head.weight.device if hasattr(lm_head, "weight") else next(model.parameters()).device
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]) + len(response_ids[i]))
    sums = [0.0] * len(prompt_ids)
    for start in range(0, len(order), rows_per_forward):
        group = order[start : start + rows_per_forward]
        group_sums = _logprob_sums(
            decoder,
            lm_head,
            device,
            [prompt_ids[i] for i in group],
            [response_ids[i] for i in group],
            pad_token_id,
            chunk_size,
            sync_n_chunks,
        )
        for i, total in zip(group, group_sums):
            sums[i] = total
    broken = [i for i, r in enumerate(response_ids) if len(r) and not math.isfinite(sums[i])]
    if broken:  # unlike an empty response (NaN by the paper's rule), this is the model failing
        raise NonFiniteLogits(
            f"the log-probability of {len(broken)} of {len(response_ids)} responses is not finite: the model's "
            "logits hold NaN or infinity"
        )
    return [(sums[i] / len(r) if len(r) else math.nan, len(r)) for i, r in enumerate(response_ids)]


def _logprob_sums(
    decoder, lm_head, device, prompt_ids, response_ids, pad_token_id, chunk_size, sync_n_chunks
) -> list[float]:
    """Sum of log p(response token) for each pair, in one right-padded forward (positions intact)."""
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(lengths), width), dtype=torch.long)
    rows, positions, targets = [], [], []
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        ids = list(p) + list(r)
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
        # hidden state at position t predicts the token at t + 1
        for t in range(len(p) - 1, len(ids) - 1):
            rows.append(i)
            positions.append(t)
            targets.append(ids[t + 1])
    hidden = decoder(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False
    ).last_hidden_state
    long = dict(dtype=torch.long, device=device)
    selected = hidden[torch.tensor(rows, **long), torch.tensor(positions, **long)]
    del hidden
    logprobs = token_logprobs_chunked(selected, torch.tensor(targets, **long), lm_head, chunk_size, sync_n_chunks).cpu()
    sums = torch.zeros(len(lengths), dtype=torch.float64).index_add_(
        0, torch.tensor(rows, dtype=torch.long), logprobs.double()
    )
    return sums.tolist()
