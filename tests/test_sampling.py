import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from probdiff_callback.core.sampling import (
    RACE_BLOCK,
    block_sums,
    counter_uniforms,
    largest,
    race,
    row_seed,
    sample_tokens,
)


def nucleus_distribution(logits: torch.Tensor, temperature: float, top_p: float) -> np.ndarray:
    """Temperature + top-p as HF's warpers define it, written out directly."""
    probs = torch.softmax(logits.double() / temperature, -1).numpy()
    order = np.argsort(-probs, kind="stable")
    mass_above = np.cumsum(probs[order]) - probs[order]
    keep = order[mass_above < top_p]
    out = np.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


def draw(logits, temperature, top_p, n, candidates):
    rows = logits.expand(n, -1).clone()  # sample_tokens overwrites its input
    uniforms = counter_uniforms([row_seed(7, i) for i in range(n)], step=0)
    return sample_tokens(
        rows,
        torch.full((n,), temperature, dtype=torch.float64),
        torch.full((n,), top_p, dtype=torch.float64),
        uniforms,
        candidates=candidates,
    ).numpy()


@pytest.mark.parametrize(
    "candidates", [(16,), (2,), (2, 4)], ids=["candidates-hold-nucleus", "fallback-to-sort", "second-level"]
)
def test_sampler_matches_temperature_top_p_distribution(candidates):
    torch.manual_seed(0)
    logits = torch.randn(24) * 2
    expected = nucleus_distribution(logits, 0.7, 0.8)
    n = 40_000
    tokens = draw(logits[None], 0.7, 0.8, n, candidates)
    counts = np.bincount(tokens, minlength=24)
    assert counts[expected == 0].sum() == 0, "sampled a token outside the nucleus"
    support = expected > 0
    assert support.sum() >= 3
    p_value = chisquare(counts[support], expected[support] * n).pvalue
    assert p_value > 1e-3, f"chi-square p={p_value:.2g}: sampler distribution differs from temperature+top-p"


def test_sampler_top_p_one_samples_full_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n = 20_000
    tokens = draw(logits[None], 1.0, 1.0, n, candidates=(2,))
    expected = torch.softmax(logits.double(), -1).numpy()
    assert chisquare(np.bincount(tokens, minlength=4), expected * n).pvalue > 1e-3


def test_zero_temperature_is_greedy():
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, 0.0, 0.0]])
    tokens = sample_tokens(
        logits, torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64), counter_uniforms([1, 2], 0)
    )
    assert tokens.tolist() == [1, 0]


def test_uniforms_depend_only_on_seed_and_step():
    a = counter_uniforms([11, 22, 33], step=5)
    b = counter_uniforms([33, 11], step=5)
    assert a[0] == b[1] and a[2] == b[0]
    assert not torch.equal(counter_uniforms([11], 5), counter_uniforms([11], 6))
    many = counter_uniforms(list(range(100_000)), step=3).numpy()
    assert 0 <= many.min() and many.max() < 1
    assert abs(many.mean() - 0.5) < 0.01


def test_row_seed_is_stable_and_keyed():
    assert row_seed(0, "q1", 0, "answer") == row_seed(0, "q1", 0, "answer")
    assert (
        len(
            {
                row_seed(0, "q1", 0, "answer"),
                row_seed(1, "q1", 0, "answer"),
                row_seed(0, "q2", 0, "answer"),
                row_seed(0, "q1", 1, "answer"),
                row_seed(0, "q1", 0, "revision-1"),
            }
        )
        == 5
    )


def test_top_token_alone_when_it_holds_top_p():
    """At low temperature the top token often holds top_p by itself: then it is the nucleus."""
    logits = torch.tensor([5.0, 3.0, 2.0, 0.0])
    n = 2_000
    p_top = torch.softmax(logits / 0.5, -1)[0].item()  # 0.98
    assert (draw(logits[None], 0.5, 0.9, n, candidates=(2,)) == 0).all()
    # just above the top token's mass the second token joins the nucleus, in its proportion
    tokens = draw(logits[None], 0.5, p_top + 1e-4, 20_000, candidates=(2,))
    expected = nucleus_distribution(logits, 0.5, p_top + 1e-4)
    assert set(np.flatnonzero(expected)) == {0, 1}
    assert chisquare(np.bincount(tokens, minlength=4)[:2], expected[:2] * 20_000).pvalue > 1e-3


def test_tokens_far_below_the_top_are_not_drawn():
    """Exponents are clamped at -87 (denormals are slow): such tokens weigh ~1e-38, never 0 < p drawn."""
    logits = torch.tensor([0.0, -5.0, -200.0, -1e30])  # -5: about 135 of 20,000 draws
    tokens = draw(logits[None], 1.0, 1.0, 20_000, candidates=(2,))
    assert set(np.unique(tokens)) == {0, 1}


def test_ids_past_n_valid_ids_are_never_drawn():
    logits = torch.zeros(64, 12)
    logits[:, 8:] = 50.0  # padded rows the model happens to like
    tokens = sample_tokens(
        logits,
        torch.full((64,), 1.0, dtype=torch.float64),
        torch.ones(64, dtype=torch.float64),
        counter_uniforms(list(range(64)), 0),
        candidates=(2,),
        n_valid_ids=8,
    )
    assert tokens.max() < 8 and len(set(tokens.tolist())) > 4
    greedy = sample_tokens(
        torch.tensor([[0.0, 1.0, 9.0]]),
        torch.zeros(1, dtype=torch.float64),
        torch.ones(1, dtype=torch.float64),
        counter_uniforms([0], 0),
        n_valid_ids=2,
    )
    assert greedy.tolist() == [1]


def test_sampling_is_exact_with_mixed_rows():
    """Rows with different temperatures and top_p in one batch each follow their own setting."""
    torch.manual_seed(1)
    logits = torch.randn(16) * 0.5
    n = 20_000
    rows = logits.expand(2 * n, -1).clone()
    temps = torch.tensor([0.5] * n + [1.5] * n, dtype=torch.float64)
    top_ps = torch.tensor([0.6] * n + [0.95] * n, dtype=torch.float64)
    tokens = sample_tokens(
        rows, temps, top_ps, counter_uniforms([row_seed(3, i) for i in range(2 * n)], 0), candidates=(4,)
    ).numpy()
    for part, (t, p) in zip((tokens[:n], tokens[n:]), ((0.5, 0.6), (1.5, 0.95))):
        expected = nucleus_distribution(logits, t, p)
        counts = np.bincount(part, minlength=16)
        assert counts[expected == 0].sum() == 0
        support = expected > 0
        assert support.sum() >= 3
        assert chisquare(counts[support], expected[support] * n).pvalue > 1e-3


@pytest.mark.parametrize("width,k", [(152_064, 64), (152_064, 1024), (4096, 8), (1000, 3), (24, 2)])
def test_largest_equals_topk(width, k):
    torch.manual_seed(width + k)
    x = torch.randn(6, width)
    x[0] = 0.0  # all tied
    x[1, ::7] = 5.0  # many tied at the top
    rows = torch.tensor([5, 0, 1, 3])
    values, ids = largest(x, k, rows)
    expected, _ = torch.topk(x[rows], k)
    assert torch.equal(values, expected)
    assert torch.equal(x[rows].gather(1, ids), values), "ids point at the values"
    assert all(len(set(r)) == k for r in ids.tolist()), "no id twice"


def test_top_p_one_is_the_full_softmax_in_a_mixed_batch_and_skips_ids_without_text():
    """top_p = 1 (the reference code's setting) draws from the whole vocabulary, no sort;
    rows with a nucleus in the same batch keep theirs."""
    torch.manual_seed(1)
    logits = torch.randn(64) * 1.5
    n = 40_000
    rows = logits.expand(2 * n, -1).clone()
    top_ps = torch.tensor([1.0] * n + [0.8] * n, dtype=torch.float64)
    uniforms = counter_uniforms([row_seed(11, i) for i in range(2 * n)], step=0)
    temperatures = torch.full((2 * n,), 0.9, dtype=torch.float64)
    tokens = sample_tokens(rows, temperatures, top_ps, uniforms, n_valid_ids=48).numpy()
    valid = logits.clone()
    valid[48:] = float("-inf")
    full, nucleus = np.bincount(tokens[:n], minlength=64), np.bincount(tokens[n:], minlength=64)
    assert full[48:].sum() == 0 and nucleus[48:].sum() == 0
    expected_full = nucleus_distribution(valid, 0.9, 1.0)
    assert chisquare(full[:48], expected_full[:48] * n).pvalue > 1e-3
    expected_nucleus = nucleus_distribution(valid, 0.9, 0.8)
    support = expected_nucleus > 0
    assert nucleus[~support].sum() == 0 and support.sum() < 48
    assert chisquare(nucleus[support], expected_nucleus[support] * n).pvalue > 1e-3


def test_top_p_one_draws_do_not_move_with_rounding_noise():
    """A row's token must not depend on the batch it is decoded in, whose logits differ from its own in the last
    bits. Over 152k ids the race's draw survives such noise, where inverting the CDF over the vocabulary would not:
    the rounding of every weight ranked before the drawn id moves its boundary."""
    torch.manual_seed(2)
    vocab, n = 152_064, 256
    base = torch.randn(vocab) * 2.0
    uniforms = counter_uniforms([row_seed(5, i) for i in range(n)], step=3)
    temperatures = torch.full((n,), 0.7, dtype=torch.float64)
    top_ps = torch.ones(n, dtype=torch.float64)
    clean = sample_tokens(base.expand(n, -1).clone(), temperatures, top_ps, uniforms)
    noisy_logits = (base.expand(n, -1) * (1 + 1e-5 * torch.randn(n, vocab))).contiguous()

    def inverse_cdf(logits):
        cdf = torch.cumsum(torch.softmax(logits.double() / 0.7, -1), -1)
        return torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True).squeeze(-1)

    assert (inverse_cdf(base.expand(n, -1)) != inverse_cdf(noisy_logits)).sum() > 5, "the noise must be felt"
    noisy = sample_tokens(noisy_logits.clone(), temperatures, top_ps, uniforms)
    assert torch.equal(clean, noisy)
    assert len(set(clean.tolist())) > n // 2  # and the draws are spread, not one token


def test_block_sums_with_a_shorter_last_block():
    weights = torch.rand(3, 2 * RACE_BLOCK + 5)
    sums = block_sums(weights, RACE_BLOCK)
    assert sums.shape == (3, 3)
    expected = torch.stack([weights[:, :64].sum(-1), weights[:, 64:128].sum(-1), weights[:, 128:].sum(-1)], 1)
    assert torch.allclose(sums, expected)
    assert block_sums(weights[:, :128], RACE_BLOCK).shape == (3, 2)


def test_the_race_is_the_softmax_over_many_blocks_and_a_tail():
    """At top_p 1 the two-stage race (a block by its mass, then an id inside it) draws each id in proportion to its
    weight: 5 blocks of 64 ids and a last one of 17 (10 of them with text), the ids past n_valid_ids never."""
    torch.manual_seed(4)
    width, n_valid, n = 5 * RACE_BLOCK + 17, 330, 60_000
    logits = torch.randn(width)
    rows = logits.expand(n, -1).clone()
    uniforms = counter_uniforms([row_seed(9, i) for i in range(n)], step=1)
    tokens = sample_tokens(
        rows, torch.ones(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64), uniforms, n_valid_ids=n_valid
    ).numpy()
    counts = np.bincount(tokens, minlength=width)
    assert counts[n_valid:].sum() == 0
    expected = torch.softmax(logits[:n_valid].double(), -1).numpy() * n
    small = expected < 5  # chi-square wants 5 expected per cell: the rare ids in one cell
    observed = np.append(counts[:n_valid][~small], counts[:n_valid][small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    assert len(observed) > 280
    assert chisquare(observed, expected).pvalue > 1e-3
    # the last, shorter block is drawn from too
    assert counts[5 * RACE_BLOCK : n_valid].sum() > 0


def test_the_race_depends_on_each_rows_key_alone():
    torch.manual_seed(6)
    weights = torch.rand(8, 3 * RACE_BLOCK + 9) ** 4
    sums = block_sums(weights, RACE_BLOCK)
    keys = torch.tensor([row_seed(1, i) >> 11 for i in range(8)], dtype=torch.int64)
    together = race(weights, sums, keys)
    order = torch.tensor([5, 2, 7])
    assert torch.equal(race(weights[order], sums[order], keys[order]), together[order])
    assert not torch.equal(race(weights, sums, keys + 1), together)  # another key, another draw


def test_the_stream_is_pinned():
    """The draws of fixed logits and seeds, as this version makes them on any machine (the uniforms and the race's
    noise are hashes, not a generator's state). A change here changes every text the evaluator writes, and with them
    the documented tables and figures made from generated texts (README, docs/offline-default.md): regenerate them.
    Rows 0, 2 and 4 are at top_p 1 (the race), rows 1, 3 and 5 at top_p < 1 (the nucleus's inverse CDF)."""
    logits = (torch.sin(torch.arange(6 * 1000, dtype=torch.float32) * 0.37) * 4).view(6, 1000)
    temperatures = torch.tensor([0.7, 0.7, 0.1, 0.1, 1.0, 1.0], dtype=torch.float64)
    top_ps = torch.tensor([1.0, 0.8, 1.0, 0.9, 1.0, 0.5], dtype=torch.float64)
    seeds = [row_seed(7, i) for i in range(6)]
    drawn = {
        step: sample_tokens(logits.clone(), temperatures, top_ps, counter_uniforms(seeds, step)).tolist()
        for step in (2, 3)
    }
    assert drawn == {2: [972, 804, 993, 95, 402, 540], 3: [191, 668, 789, 333, 998, 609]}
