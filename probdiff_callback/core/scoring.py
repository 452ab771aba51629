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

import inspect
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from probdiff_callback.core.config import ProbDiffConfig

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


# What one scoring forward gives: the hidden states [N, H] that predict the texts' tokens, those N tokens, and the
# text each belongs to (numbered within the forward's group, prompt by prompt).
_TokenStates = tuple[torch.Tensor, list[int], list[int]]


def score_texts(
    model,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    texts: Sequence[Sequence[str]],
    config: ProbDiffConfig,
    sync_n_chunks: Callable[[int], int] | None = None,
) -> list[list[tuple[float, int]]]:
    """(mean log-prob, token count) of each of `texts[i]` after the chat prompt `prompts[i]` (every prompt with the
    same number of texts); a text is tokenized on its own. With `score_prompt_once` a prompt runs once for all its
    texts (`score_shared_prompts`), else each text runs as a whole sequence (`score_batch`)."""
    if any(isinstance(row, str) for row in texts):
        raise TypeError("score_texts takes a list of texts per prompt, not one text")
    ids = [[tokenizer(t, add_special_tokens=False)["input_ids"] for t in row] for row in texts]
    pad, chunk = tokenizer.pad_token_id, config.score_chunk_tokens
    if config.score_prompt_once and shares_prompt_cache(model):
        return score_shared_prompts(model, prompts, ids, pad, chunk, sync_n_chunks)
    k = len(ids[0]) if ids else 0  # the whole sequences in text-major order: all first texts, then all second ...
    flat = score_batch(model, list(prompts) * k, [row[j] for j in range(k) for row in ids], pad, chunk, sync_n_chunks)
    return [[flat[j * len(ids) + i] for j in range(k)] for i in range(len(ids))]


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
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]) + len(response_ids[i]))

    def forward(decoder, device, group: list[int]) -> _TokenStates:
        prompts, responses = [prompt_ids[i] for i in group], [response_ids[i] for i in group]
        return _whole_sequence_states(decoder, device, prompts, responses, pad_token_id)

    sums = _grouped_logprob_sums(model, order, 1, forward, chunk_size, sync_n_chunks, rows_per_forward)
    return [row[0] for row in _means(sums, [[len(r)] for r in response_ids])]


def _whole_sequence_states(decoder, device, prompt_ids, response_ids, pad_token_id) -> _TokenStates:
    """Each pair, prompt then response, in one right-padded forward (positions intact): the states that predict the
    response tokens."""
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
    return hidden[torch.tensor(rows, **long), torch.tensor(positions, **long)], targets, rows


def left_padded(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) of `prompts` padded on the left, as `generate` takes them: each prompt ends in
    the last column."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[i, width - len(prompt) :] = 1
    return input_ids, attention_mask


def shares_prompt_cache(model) -> bool:
    """Whether `score_shared_prompts` can score `model`: its KV cache, as the model builds it from its config, can be
    copied along the batch. Every attention layer's can (full, sliding window, quantized); the linear-attention and
    recurrent layers of hybrid models cannot, and those are scored as whole sequences (`score_batch`)."""
    from transformers import DynamicCache

    decoder, _ = split_model(model)
    return all(hasattr(layer, "batch_repeat_interleave") for layer in DynamicCache(config=decoder.config).layers)


@torch.no_grad()
def score_shared_prompts(
    model,
    prompt_ids: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[Sequence[int]]],
    pad_token_id: int,
    chunk_size: int = 512,
    sync_n_chunks: Callable[[int], int] | None = None,
    rows_per_forward: int = SCORE_ROWS_PER_FORWARD,
) -> list[list[tuple[float, int]]]:
    """For each prompt, (mean log-prob, token count) of each of its continuations, as `score_batch` gives them, with
    the prompt run once: its KV cache, copied for each continuation, then the continuations from it.

    An answer and its revision share the query's chat prompt, usually the longer part (an XSum document: ~500 tokens
    against 30-60): scoring both as whole sequences runs the prompt twice. Every prompt has the same number of
    continuations (k). `rows_per_forward // k` prompts run together, in order of length; each group is two decoder
    calls (the prompts, left-padded as `generate` pads them, then their continuations, right-padded) and its LM-head
    chunks, so the number of calls depends only on the number of prompts, as ZeRO-3 with sharded parameters needs.
    The empty-response and non-finite rules are `score_batch`'s.
    """
    k = len(continuations[0]) if continuations else 0
    if any(len(texts) != k for texts in continuations) or len(continuations) != len(prompt_ids):
        raise ValueError("score_shared_prompts: every prompt needs the same number of continuations")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("score_shared_prompts: an empty prompt has no position to predict a first token from")
    order = sorted(range(len(prompt_ids)), key=lambda i: (len(prompt_ids[i]), max(map(len, continuations[i]))))

    def forward(decoder, device, group: list[int]) -> _TokenStates:
        prompts, texts = [prompt_ids[i] for i in group], [continuations[i] for i in group]
        return _shared_prompt_states(decoder, device, prompts, texts, pad_token_id)

    sums = _grouped_logprob_sums(model, order, k, forward, chunk_size, sync_n_chunks, rows_per_forward)
    return _means(sums, [[len(text) for text in texts] for texts in continuations])


def _cache_keyword(decoder) -> str:
    """The name of a decoder's KV cache, in its forward's arguments and its output: transformers 5.24 renamed
    `past_key_values` to `cache`."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def _shared_prompt_states(decoder, device, prompt_ids, continuations, pad_token_id) -> _TokenStates:
    """The prompts in one left-padded forward that keeps its KV cache, then every continuation of each prompt in one
    right-padded forward from the cache, copied k times: the states that predict the continuations' tokens."""
    from transformers import Cache

    k = len(continuations[0])
    long = dict(dtype=torch.long, device=device)
    cache_keyword = _cache_keyword(decoder)
    input_ids, prompt_mask = (t.to(device) for t in left_padded(prompt_ids, pad_token_id))
    prompt = decoder(
        input_ids=input_ids,
        attention_mask=prompt_mask,
        position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0),  # as generate: positions count real tokens only
        use_cache=True,
    )
    cache = getattr(prompt, cache_keyword)
    if not isinstance(cache, Cache) or not all(hasattr(layer, "batch_repeat_interleave") for layer in cache.layers):
        raise TypeError(
            f"{type(decoder).__name__} returned a KV cache ({type(cache).__name__}) that cannot be copied along the "
            "batch: score this model with score_prompt_once=false"
        )
    cache.batch_repeat_interleave(k)  # rows: prompt 0's k continuations, then prompt 1's, ...
    last_prompt_state = prompt.last_hidden_state[:, -1].repeat_interleave(k, dim=0)  # predicts each first token
    del prompt
    texts = [text for texts in continuations for text in texts]
    width = max(1, max(map(len, texts)))  # one padding position where all are empty: every rank runs this call
    text_ids = torch.full((len(texts), width), pad_token_id, dtype=torch.long)
    text_mask = torch.zeros((len(texts), width), dtype=torch.long)
    for row, text in enumerate(texts):
        text_ids[row, : len(text)] = torch.tensor(text, dtype=torch.long)
        text_mask[row, : len(text)] = 1
    prompt_lengths = prompt_mask.sum(-1).repeat_interleave(k)
    hidden = decoder(
        input_ids=text_ids.to(device),
        attention_mask=torch.cat([prompt_mask.repeat_interleave(k, dim=0), text_mask.to(device)], dim=1),
        position_ids=prompt_lengths[:, None] + torch.arange(width, device=device),
        use_cache=True,
        **{cache_keyword: cache},
    ).last_hidden_state
    del cache
    # token t of a text is predicted by the state before it: the prompt's last for t = 0, else the text's own t - 1
    states = torch.cat([last_prompt_state[:, None], hidden[:, :-1]], dim=1)
    del hidden
    rows = [row for row, text in enumerate(texts) for _ in text]
    positions = [t for text in texts for t in range(len(text))]
    targets = [token for text in texts for token in text]
    return states[torch.tensor(rows, **long), torch.tensor(positions, **long)], targets, rows


def _grouped_logprob_sums(
    model,
    order: list[int],
    k: int,
    forward: Callable[..., _TokenStates],
    chunk_size: int,
    sync_n_chunks: Callable[[int], int] | None,
    rows_per_forward: int,
) -> list[list[float]]:
    """Sum of log p(token) of each of the `k` texts of each prompt, by prompt index: the prompts in `order`,
    `rows_per_forward // k` at a time, each group in one `forward(decoder, device, group)`, whose states the LM head
    then takes `chunk_size` at a time."""
    decoder, lm_head = split_model(model)
    device = lm_head.weight.device if hasattr(lm_head, "weight") else next(model.parameters()).device
    sums: list[list[float]] = [[] for _ in order]
    per_forward = max(1, rows_per_forward // max(k, 1))
    for start in range(0, len(order), per_forward):
        group = order[start : start + per_forward]
        states, targets, rows = forward(decoder, device, group)
        targets_on_device = torch.tensor(targets, dtype=torch.long, device=device)
        logprobs = token_logprobs_chunked(states, targets_on_device, lm_head, chunk_size, sync_n_chunks).cpu()
        del states  # freed before the next group's forward
        totals = torch.zeros(len(group) * k, dtype=torch.float64).index_add_(
            0, torch.tensor(rows, dtype=torch.long), logprobs.double()
        )
        for i, text_sums in zip(group, totals.view(len(group), k).tolist()):
            sums[i] = text_sums
    return sums


def _means(sums: list[list[float]], lengths: list[list[int]]) -> list[list[tuple[float, int]]]:
    """(mean log-prob, token count) of each text from its sum. An empty text scores NaN (the paper's rule); a
    non-finite sum of a non-empty one is the model failing, and raises `NonFiniteLogits`."""
    broken = sum(1 for row, ns in zip(sums, lengths) for total, n in zip(row, ns) if n and not math.isfinite(total))
    if broken:
        raise NonFiniteLogits(
            f"the log-probability of {broken} of {sum(map(len, lengths))} responses is not finite: the model's "
            "logits hold NaN or infinity"
        )
    return [[(total / n if n else math.nan, n) for total, n in zip(row, ns)] for row, ns in zip(sums, lengths)]
