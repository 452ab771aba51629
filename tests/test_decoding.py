import contextlib

import pytest
import torch

from probdiff_callback.core import decoding
from probdiff_callback.core.chat_format import stop_token_ids
from probdiff_callback.core.decoding import LiveRowsHead, RowSampler, hit_cap, sample_continuations
from probdiff_callback.core.prompts import chat_prompt_ids
from probdiff_callback.core.sampling import row_seed

QUESTIONS = [
    "写一首关于秋天的诗",
    "推荐一家咖啡店",
    "Hi",
    "如何在家做蛋糕？请一步一步地写出来，越详细越好。",
    "周末去哪儿玩",
    "夏天的穿搭",
]


@pytest.fixture(scope="module")
def prompts(tiny_model):
    _, tokenizer = tiny_model
    return [chat_prompt_ids(tokenizer, "You are a helpful assistant.", q) for q in QUESTIONS]


def decode(tiny_model, prompts, temperature, max_new_tokens=24, seed=0, top_p=0.8, **kwargs):
    model, tokenizer = tiny_model
    n = len(prompts)
    return sample_continuations(
        model,
        prompts,
        [row_seed(seed, i) for i in range(n)] if "seeds" not in kwargs else kwargs.pop("seeds"),
        [temperature] * n,
        [top_p] * n,
        max_new_tokens=max_new_tokens,
        stop_ids=stop_token_ids(tokenizer, model.generation_config),
        pad_token_id=tokenizer.pad_token_id,
        n_valid_ids=kwargs.pop("n_valid_ids", len(tokenizer)),
        **kwargs,
    )


@pytest.mark.slow
def test_greedy_equals_hf_generate(tiny_model, prompts):
    """Left padding, positions, the KV cache and dropping finished rows: greedy ids as HF's own loop."""
    from transformers import GenerationConfig

    model, tokenizer = tiny_model
    ours = decode(tiny_model, prompts, temperature=0.0, max_new_tokens=40)
    stops = set(stop_token_ids(tokenizer, model.generation_config))
    config = GenerationConfig(
        do_sample=False, max_new_tokens=40, eos_token_id=sorted(stops), pad_token_id=tokenizer.pad_token_id
    )
    for prompt, ids in zip(prompts, ours):
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([prompt]), generation_config=config)[0, len(prompt) :].tolist()
        expected = out[: next((i for i, t in enumerate(out) if t in stops), len(out))]
        assert ids == expected
        # capped exactly when HF's own loop found no stop token within max_new_tokens
        assert hit_cap(ids, 40) == (not any(t in stops for t in out))
    assert len({len(ids) for ids in ours}) > 1, "rows should finish at different steps, so some are dropped early"
    assert any(hit_cap(ids, 40) for ids in ours) and not all(hit_cap(ids, 40) for ids in ours)
    assert any(len(ids) < 40 for ids in ours) and not any(t in stops for ids in ours for t in ids)


def test_rows_do_not_depend_on_the_batch(tiny_model, prompts):
    seeds = [row_seed(3, i) for i in range(len(prompts))]
    together = decode(tiny_model, prompts, 0.7, seeds=seeds)
    alone = [decode(tiny_model, [p], 0.7, seeds=[s])[0] for p, s in zip(prompts, seeds)]
    assert together == alone
    reversed_ = decode(tiny_model, prompts[::-1], 0.7, seeds=seeds[::-1])
    assert reversed_[::-1] == together


def test_rows_do_not_depend_on_the_batch_at_top_p_one(tiny_model, prompts):
    """The default settings (top_p 1) draw by the race: a row's ids are the same alone, in pairs and all together."""
    seeds = [row_seed(4, i) for i in range(len(prompts))]
    together = decode(tiny_model, prompts, 0.7, seeds=seeds, top_p=1.0)
    alone = [decode(tiny_model, [p], 0.7, seeds=[s], top_p=1.0)[0] for p, s in zip(prompts, seeds)]
    assert together == alone
    pairs = [decode(tiny_model, prompts[i : i + 2], 0.7, seeds=seeds[i : i + 2], top_p=1.0) for i in (0, 2, 4)]
    assert [row for pair in pairs for row in pair] == together
    assert len({tuple(row) for row in together}) == len(prompts)


def test_ids_without_text_are_never_sampled(tiny_model, prompts):
    # pretend only the first 2,000 ids have text; at temperature 5 the model would pick others
    ids = decode(tiny_model, prompts, 5.0, max_new_tokens=16, n_valid_ids=2_000)
    flat = [t for row in ids for t in row]
    assert len(flat) > 50 and max(flat) < 2_000


def test_the_head_runs_on_the_rows_still_drawing_and_is_put_back(tiny_model, prompts, monkeypatch):
    """On a CPU the LM head computes the logits of the rows that have not stopped only (`LiveRowsHead`): one call per
    step, on as many rows as still draw at it. The ids are those of the model's own head on every row, and the
    model has its own head back afterwards."""
    model, _ = tiny_model
    head = model.get_output_embeddings()
    rows_per_call: list[int] = []
    hook = head.register_forward_hook(lambda module, args, output: rows_per_call.append(args[0].shape[0]))
    try:
        ids = decode(tiny_model, prompts, 0.7, max_new_tokens=40, top_p=1.0)
    finally:
        hook.remove()
    assert model.get_output_embeddings() is head
    lengths = [len(row) for row in ids]
    assert len(set(lengths)) > 2 and min(lengths) < 20, "rows must stop at different steps for the test to see it"
    # a row of n ids drew at steps 0..n-1, and its stop id at step n unless it was cut at the cap
    steps = max(n if hit_cap(row, 40) else n + 1 for n, row in zip(lengths, ids))
    assert rows_per_call == [sum(n >= step for n in lengths) for step in range(steps)]

    monkeypatch.setattr(decoding, "live_rows_head", lambda model, sampler: contextlib.nullcontext())
    assert decode(tiny_model, prompts, 0.7, max_new_tokens=40, top_p=1.0) == ids  # the head on every row


def test_live_rows_head_computes_the_drawing_rows_alone():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(4, 1, 8)

    class Sampler:
        drawing_next = None

    live = LiveRowsHead(head, Sampler())
    assert torch.equal(live(hidden), head(hidden))  # before the first draw: every row
    Sampler.drawing_next = torch.tensor([True, False, True, False])
    seen: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda module, args, output: seen.append(args[0]))
    logits = live(hidden)
    hook.remove()
    assert torch.equal(seen[0], hidden[[0, 2]]) and torch.equal(logits, head(hidden[[0, 2]]))
    Sampler.drawing_next = torch.tensor([True] * 4)
    assert torch.equal(live(hidden), head(hidden))


def test_the_sampler_takes_every_rows_logits_or_the_live_rows_and_no_other_count(tiny_model):
    """The model's own head gives every row's logits, `LiveRowsHead` the live rows' only: the same draw from both,
    and generate's argmax over the scores handed back takes it."""
    model, tokenizer = tiny_model
    sampler = RowSampler(
        [row_seed(0, i) for i in range(3)],
        [0.7] * 3,
        [1.0] * 3,
        prompt_width=2,
        stop_ids=[5],
        pad_token_id=0,
        n_valid_ids=None,
        device=torch.device("cpu"),
    )
    sampler.finished = torch.tensor([False, True, False])
    logits = torch.randn(3, 300)
    input_ids = torch.tensor([[1, 2, 3]] * 3)
    every = sampler(input_ids, logits.clone()).argmax(dim=-1)
    live = sampler(input_ids, logits[[0, 2]].clone()).argmax(dim=-1)
    assert torch.equal(every, live) and every[1] == 0  # a finished row gets the pad id
    with pytest.raises(RuntimeError, match="logits for 1 rows: the batch has 3, 2 live"):
        sampler(input_ids, logits[:1].clone())


def test_the_head_is_put_back_when_generate_fails(tiny_model, prompts):
    model, _ = tiny_model
    head = model.get_output_embeddings()

    def interrupted() -> bool:  # asked at every step, inside generate
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        decode(tiny_model, prompts[:1], 0.7, stop_early=interrupted)
    assert model.get_output_embeddings() is head


def test_a_rows_ids_are_reproducible_whatever_the_global_generators(tiny_model, prompts):
    """The sampler reads no global random state: the same seeds give the same ids after torch's and numpy's global
    generators were reseeded or drawn from."""
    import numpy as np

    torch.manual_seed(1)
    first = decode(tiny_model, prompts[:3], 0.7, max_new_tokens=12, top_p=1.0)
    torch.manual_seed(2)
    torch.rand(1000)
    np.random.seed(3)
    assert decode(tiny_model, prompts[:3], 0.7, max_new_tokens=12, top_p=1.0) == first
