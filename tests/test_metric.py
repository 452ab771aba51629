import math

import pytest

from probdiff_callback.metric import (
    bootstrap_interval,
    compare,
    confidence,
    confidence_sweep,
    discrepancy,
    is_confident,
    length_changed_share,
    summarize,
)

NAN = math.nan


def record(id_, d, category=None, n_resp=10, n_rev=10, logp=-1.0):
    return {"id": id_, "category": category, "d": d, "logp_response": logp, "logp_revised": None if d is None else logp + d,
            "n_tokens_response": n_resp, "n_tokens_revised": n_rev, "truncated": False}


def test_discrepancy_and_threshold():
    assert discrepancy(-1.25, -1.0) == pytest.approx(-0.25)
    assert math.isnan(discrepancy(NAN, -1.0))
    assert is_confident(-0.05, -0.05) and is_confident(0.3, -0.05)
    assert not is_confident(-0.0500001, -0.05)
    assert not is_confident(NAN, -0.05)


def test_confidence_and_sweep_on_hand_numbers():
    ds = [0.1, -0.01, -0.03, -0.07, -0.2, NAN]
    assert confidence(ds, -0.05) == pytest.approx(3 / 6)
    assert confidence_sweep(ds, [0, -0.02, -0.05, -0.1]) == pytest.approx({"0": 1 / 6, "-0.02": 2 / 6, "-0.05": 3 / 6, "-0.1": 4 / 6})
    assert math.isnan(confidence([], -0.05))


def test_bootstrap_interval_brackets_the_estimate():
    ds = [0.1] * 30 + [-0.5] * 70
    low, high = bootstrap_interval(ds, -0.05, 2000, seed=0)
    assert low < 0.3 < high and 0.18 < low and high < 0.42
    assert bootstrap_interval([0.2] * 5, -0.05) == [1.0, 1.0]


def test_summary_counts_invalid_and_categories():
    records = [record("a", 0.1, "x"), record("b", -0.1, "x"), record("c", None, "y", n_resp=0), record("d", 0.0, "y", n_rev=30)]
    s = summarize(records, -0.05, [0, -0.02, -0.05, -0.1], 200)
    assert s["n"] == 4 and s["n_invalid"] == 1 and s["n_truncated"] == 0
    assert s["confidence"] == pytest.approx(0.5)
    assert s["d_mean"] == pytest.approx(0.0)
    assert s["d_median"] == pytest.approx(0.0)
    assert s["by_category"] == {"x": {"n": 2, "confidence": 0.5, "d_mean": pytest.approx(0.0)},
                                "y": {"n": 2, "confidence": 0.5, "d_mean": pytest.approx(0.0)}}
    assert s["confidence_sweep"]["-0.1"] == pytest.approx(0.75)
    # "c": 0 -> 10 tokens and "d": 10 -> 30 tokens changed length by more than half
    assert s["length_changed_share"] == pytest.approx(0.5)
    assert length_changed_share([record("a", 0.0, n_resp=10, n_rev=15)]) == 0.0


def test_compare_win_tie_lose():
    a = [record(1, 0.0), record(2, -0.2), record(3, 0.1), record(4, None), record(5, -0.3)]
    b = [record(1, -0.1), record(2, 0.0), record(3, 0.2), record(4, 0.0), record(6, 0.0)]
    result = compare(a, b, -0.05)
    # 1: A confident, B not -> win; 2: lose; 3: both -> tie; 4: A invalid, B confident -> lose
    assert (result["win"], result["tie"], result["lose"]) == (1, 1, 2)
    assert result["n"] == 4 and result["n_only_a"] == 1 and result["n_only_b"] == 1
    assert result["n_paired"] == 3
    with pytest.raises(ValueError, match="share no query id"):
        compare([record("x", 0.0)], [record("y", 0.0)], -0.05)


def test_compare_paired_test_detects_a_consistent_shift():
    a = [record(i, 0.01 * i) for i in range(30)]
    b = [record(i, 0.01 * i - 0.1) for i in range(30)]
    assert compare(a, b, -0.05)["wilcoxon_p"] < 1e-4
