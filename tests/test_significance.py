"""What n queries can see: the power of a paired comparison of two steps' confidence (the exact sign test on the
discordant queries), the smallest change it could call significant, the queries a change of 10 points needs, and the
line that says so in `probdiff eval`'s summary (at the start of training: tests/test_eval_losses.py)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from _records import make_record
from scipy.stats import binom

from probdiff_callback.analysis.report import format_summary, resolution_line
from probdiff_callback.core.metric import sign_test_p, summary_of
from probdiff_callback.core.significance import (
    _sign_test_cutoffs,
    power_of_paired_comparison,
    queries_needed,
    resolution,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "callback.md"


def test_the_rejection_region_is_the_sign_tests():
    cutoffs = _sign_test_cutoffs(64, 0.05)
    for m in range(65):
        significant_minorities = [min(b, m - b) for b in range(m + 1) if sign_test_p(b, m - b) < 0.05]
        assert cutoffs[m] == max(significant_minorities, default=-1), m
    assert list(cutoffs[:9]) == [-1, -1, -1, -1, -1, -1, 0, 0, 0]  # 6 of 6 one way is the first significant split


def test_power_in_cases_worked_by_hand():
    # from 0% to 100%: every query is a win; 6 wins of 6 give p = 2/64 < 0.05, 5 of 5 give 2/32 > 0.05
    assert power_of_paired_comparison(6, 0.0, 1.0) == pytest.approx(1.0)
    assert power_of_paired_comparison(5, 0.0, 1.0) == pytest.approx(0.0)
    # from 0% to 5/6: significant only when all 6 queries win, (5/6)^6
    assert power_of_paired_comparison(6, 0.0, 5 / 6) == pytest.approx((5 / 6) ** 6)
    assert power_of_paired_comparison(16, 0.5, 0.5) < 0.05  # no change: rejected at most alpha of the time
    assert power_of_paired_comparison(0, 0.5, 1.0) == 0.0


def test_power_matches_a_simulation_of_independent_queries():
    rng = np.random.default_rng(0)
    n, before, after, runs = 16, 9 / 16, 15 / 16, 20_000
    earlier = rng.random((runs, n)) < before
    later = rng.random((runs, n)) < after
    wins, losses = (later & ~earlier).sum(axis=1), (earlier & ~later).sum(axis=1)
    # the exact two-sided sign test's p for every simulated run at once (as `sign_test_p`: 1 without a discordant query)
    p = np.minimum(1.0, 2 * binom.cdf(np.minimum(wins, losses), wins + losses, 0.5))
    assert sign_test_p(int(wins[0]), int(losses[0])) == pytest.approx(p[0])
    simulated = np.mean(p < 0.05)
    assert power_of_paired_comparison(n, before, after) == pytest.approx(simulated, abs=0.01)


def test_queries_needed_agrees_with_connors_normal_approximation_at_large_n():
    # Connor (1987): n = (z_a sqrt(psi) + z_b sqrt(psi - delta^2))^2 / delta^2 for McNemar's test; from 50% to 60%
    # with independent outcomes psi = 0.5: 390.1 at 80% power and 192.1 at 50% (z_b = 0). The exact test is a
    # little more conservative than the normal approximation, never less.
    z_a, z_b, psi, delta = 1.959964, 0.841621, 0.5, 0.1
    connor_80 = (z_a * math.sqrt(psi) + z_b * math.sqrt(psi - delta**2)) ** 2 / delta**2
    connor_50 = z_a**2 * psi / delta**2
    assert connor_80 <= queries_needed(0.5, 0.10, power=0.8) <= 1.06 * connor_80
    assert connor_50 <= queries_needed(0.5, 0.10) <= 1.12 * connor_50
    assert queries_needed(0.5, 0.10) == 211  # pinned: the figure the docs and the line quote


def test_resolution_is_the_first_change_called_significant_half_the_time():
    seen = resolution(16, 9 / 16)  # the trust study: 9 of 16 confident before training
    assert (seen.smallest_rise, seen.smallest_fall) == (6 / 16, 7 / 16)
    assert power_of_paired_comparison(16, 9 / 16, 14 / 16) < 0.5 <= power_of_paired_comparison(16, 9 / 16, 15 / 16)
    assert power_of_paired_comparison(16, 9 / 16, 3 / 16) < 0.5 <= power_of_paired_comparison(16, 9 / 16, 2 / 16)
    assert seen.within_noise == 7 / 16
    assert resolution(8, 0.5).within_noise is None  # 8 queries: nothing, even 50% -> 100%, half the time
    assert resolution(16, 15 / 16).smallest_rise is None  # one query of room up: no rise can be significant
    with pytest.raises(ValueError, match="between 0 and 1"):
        resolution(16, 1.5)


def test_the_line_says_what_a_run_cannot_tell_apart_in_one_sentence():
    line = resolution_line(16, 9 / 16)
    assert line == (
        "ProbDiff resolution: with 16 queries and a confidence of 56.2%, a change of less than +37.5/-43.8 points "
        "between two steps is within noise (56.2% cannot be told from 87.5%); a change of ±10 points would need about "
        "213 queries (docs/callback.md#what-n-queries-can-see)"
    )
    assert "every change of confidence between two steps is within noise" in resolution_line(8, 0.5)
    assert "(assumed: no baseline yet)" in resolution_line(16, None)
    assert "no rise from 93.8% could be significant" in resolution_line(16, 15 / 16)


def test_probdiff_eval_summary_has_the_line():
    records = [make_record(i, d) for i, d in enumerate([0.1] * 9 + [-0.5] * 7)]
    printed = format_summary(summary_of(records, -0.05, [0.0]))
    assert printed.splitlines()[-1] == resolution_line(16, 9 / 16, "two models or steps on these queries")
    assert "within noise" in printed.splitlines()[-1]


def test_the_docs_table_is_what_the_functions_say():
    """docs/callback.md's table: each n and confidence, the smallest significant rise/fall; then the queries needed."""
    text = DOCS.read_text(encoding="utf-8")
    table = text[text.index("| queries | from 50% |") :].split("\n\n")[0].splitlines()[2:]
    assert len(table) >= 6
    for line in table:
        cells = [c.strip() for c in line.strip("|").split("|")]
        n = int(cells[0])
        for baseline, cell in zip((0.5, 0.7, 0.9), cells[1:4]):
            seen = resolution(n, baseline)
            rise = "-" if seen.smallest_rise is None else f"+{100 * seen.smallest_rise:.1f}"
            fall = "-" if seen.smallest_fall is None else f"-{100 * seen.smallest_fall:.1f}"
            assert cell == f"{rise} / {fall}", (n, baseline)
    needed = re.search(r"\| queries for ±10 points \| (\d+) \| (\d+) \| (\d+) \|", text)
    assert needed is not None
    assert [int(x) for x in needed.groups()] == [queries_needed(b) for b in (0.5, 0.7, 0.9)]
