import math

import pytest
from _records import make_record
from scipy.stats import binom, multinomial

from probdiff_callback.core.metric import (
    compare,
    confidence,
    confidence_interval,
    confidence_sweep,
    discrepancy,
    is_confident,
    length_changed_share,
    paired_difference_interval,
    sign_test_p,
    summary_of,
    wilson_interval,
)
from probdiff_callback.core.records import CategorySummary

NAN = math.nan


def record(id_, d, category=None, n_resp=10, n_rev=10):
    return make_record(id_, d, category=category, n_tokens_response=n_resp, n_tokens_revised=n_rev)


def test_discrepancy_and_threshold():
    assert discrepancy(-1.25, -1.0) == pytest.approx(-0.25)
    assert math.isnan(discrepancy(NAN, -1.0))
    assert is_confident(-0.05, -0.05) and is_confident(0.3, -0.05)
    assert not is_confident(-0.0500001, -0.05)
    assert not is_confident(NAN, -0.05)


def test_confidence_and_sweep_on_hand_numbers():
    ds = [0.1, -0.01, -0.03, -0.07, -0.2, NAN]
    assert confidence(ds, -0.05) == pytest.approx(3 / 6)
    assert confidence_sweep(ds, [0, -0.02, -0.05, -0.1]) == pytest.approx(
        {"0": 1 / 6, "-0.02": 2 / 6, "-0.05": 3 / 6, "-0.1": 4 / 6}
    )
    assert math.isnan(confidence([], -0.05))


def test_wilson_interval_on_hand_numbers():
    # 30 of 100: center (0.3 + z^2/200) / (1 + z^2/100), as in Brown, Cai and DasGupta (2001)
    assert wilson_interval(30, 100) == pytest.approx([0.218949, 0.395848], abs=1e-6)
    assert confidence_interval([0.1] * 30 + [-0.5] * 69 + [NAN], -0.05) == wilson_interval(30, 100)
    assert all(math.isnan(x) for x in wilson_interval(0, 0))


def test_interval_stays_meaningful_at_0_and_100_percent():
    """A percentile bootstrap gives [0, 0] at 0 of n; Wilson's upper end is z^2 / (n + z^2)."""
    z2 = 1.959963984540054**2
    assert wilson_interval(0, 100) == [0.0, pytest.approx(z2 / (100 + z2))]
    assert wilson_interval(100, 100) == [pytest.approx(100 / (100 + z2)), 1.0]
    assert confidence_interval([0.2] * 5, -0.05) == [pytest.approx(5 / (5 + z2)), 1.0]


@pytest.mark.parametrize("p", [0.0, 0.01, 0.05, 0.3, 0.5, 0.95, 1.0])
def test_wilson_coverage_is_near_95_percent(p):
    """Exact coverage over every outcome of 40 queries (Wilson's dips to ~0.94 near 1%, as published)."""
    n = 40
    intervals = [wilson_interval(k, n) for k in range(n + 1)]
    coverage = sum(binom.pmf(k, n, p) for k, (low, high) in enumerate(intervals) if low <= p <= high)
    assert coverage >= 0.93


def test_summary_counts_invalid_and_categories():
    records = [
        record("a", 0.1, "x"),
        record("b", -0.1, "x"),
        record("c", None, "y", n_resp=0),
        record("d", 0.0, "y", n_rev=30),
    ]
    s = summary_of(records, -0.05, [0, -0.02, -0.05, -0.1])
    assert s.n == 4 and s.n_invalid == 1 and s.n_truncated == 0
    assert s.confidence == pytest.approx(0.5)
    assert s.d_mean == pytest.approx(0.0)
    assert s.d_median == pytest.approx(0.0)
    assert s.by_category == {
        "x": CategorySummary(n=2, confidence=0.5, d_mean=pytest.approx(0.0)),
        "y": CategorySummary(n=2, confidence=0.5, d_mean=pytest.approx(0.0)),
    }
    assert s.confidence_sweep["-0.1"] == pytest.approx(0.75)
    # "c": 0 -> 10 tokens and "d": 10 -> 30 tokens changed length by more than half
    assert s.length_changed_share == pytest.approx(0.5)
    assert length_changed_share([record("a", 0.0, n_resp=10, n_rev=15)]) == 0.0


def test_compare_win_tie_lose():
    a = [record(1, 0.0), record(2, -0.2), record(3, 0.1), record(4, None), record(5, -0.3)]
    b = [record(1, -0.1), record(2, 0.0), record(3, 0.2), record(4, 0.0), record(6, 0.0)]
    result = compare(a, b, -0.05)
    # 1: A confident, B not -> win; 2: lose; 3: both -> tie; 4: A invalid, B confident -> lose
    assert (result.win, result.tie, result.lose) == (1, 1, 2)
    assert result.n == 4 and result.n_only_a == 1 and result.n_only_b == 1
    assert result.n_paired == 3
    with pytest.raises(ValueError, match="share no query id"):
        compare([record("x", 0.0)], [record("y", 0.0)], -0.05)


def test_compare_paired_test_detects_a_consistent_shift():
    a = [record(i, 0.01 * i) for i in range(30)]
    b = [record(i, 0.01 * i - 0.1) for i in range(30)]
    assert compare(a, b, -0.05).wilcoxon_p < 1e-4


def test_sign_test_fits_the_win_lose_split():
    """The issue's case: 0 wins, 10 losses, 30 ties. Wilcoxon on d gave 0.43; a sign test on 0 vs 10 gives 2 / 2^10."""
    a = [record(i, -0.2) for i in range(10)] + [record(i, 0.0) for i in range(10, 40)]
    b = [record(i, 0.0) for i in range(40)]
    result = compare(a, b, -0.05)
    assert (result.win, result.tie, result.lose) == (0, 30, 10)
    assert result.sign_p == pytest.approx(2 / 2**10)
    assert result.difference == pytest.approx(-0.25) == result.confidence_a - result.confidence_b
    low, high = result.difference_ci
    assert low < -0.25 < high < 0
    assert sign_test_p(0, 0) == 1.0 and sign_test_p(5, 5) == pytest.approx(1.0)


def test_paired_difference_interval_on_hand_numbers_and_ties():
    # Bonett and Price: p12 = 1/42, p21 = 11/42, half-width z * sqrt((p12 + p21 - (p12 - p21)^2) / 42)
    assert paired_difference_interval(0, 10, 40) == pytest.approx([-0.382827, -0.093363], abs=1e-6)
    low, high = paired_difference_interval(0, 0, 40)  # all ties: not the degenerate [0, 0] of a plain Wald interval
    assert low == pytest.approx(-high) and 0.05 < high < 0.1
    assert paired_difference_interval(0, 3, 3)[0] >= -1.0 and paired_difference_interval(3, 0, 3)[1] <= 1.0


@pytest.mark.parametrize("p_win,p_lose", [(0.0, 0.0), (0.02, 0.0), (0.0, 0.1), (0.1, 0.3), (0.3, 0.3), (0.6, 0.1)])
def test_paired_difference_interval_coverage(p_win, p_lose):
    """Exact coverage of the true confidence_A - confidence_B over every win/tie/lose outcome of 40 queries."""
    n, truth = 40, p_win - p_lose
    coverage = 0.0
    for win in range(n + 1):
        for lose in range(n + 1 - win):
            low, high = paired_difference_interval(win, lose, n)
            if low <= truth <= high:
                coverage += multinomial.pmf([win, lose, n - win - lose], n, [p_win, p_lose, 1 - p_win - p_lose])
    assert coverage >= 0.94
