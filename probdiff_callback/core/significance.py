"""How much a run's queries can see: a paired test of a measure between two steps, and the smallest change in
confidence that a paired comparison of two steps over n queries could call significant.

Pure functions over plain numbers (scipy); docs/callback.md#what-n-queries-can-see states the methods.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np

SIGNIFICANCE_LEVEL = 0.05  # two-sided, for every test here
# The paired permutation test is exact (every sign pattern) up to 2^16 patterns, else drawn at random from a fixed
# seed: 9,999 draws put p within about 0.002 of the exact value near 0.05, in well under a second for 1,000 pairs.
EXACT_PERMUTATION_MAX_N = 16
# scipy's own tolerance for null statistics equal to the observed one but for rounding (relative, permutation_test's)
TIE_TOLERANCE = np.finfo(np.float64).eps * 100
PERMUTATION_DRAWS = 9_999
PERMUTATION_SEED = 0


# --- a measure at two steps, over the same queries ------------------------------------------------------------------
def paired_permutation_p(before: Sequence[float], after: Sequence[float]) -> float:
    """Two-sided p of a paired permutation test of the mean difference `after - before`: under "the two steps do not
    differ", each query's difference is as likely to have either sign, so the observed mean is compared with the means
    of every sign pattern (at random beyond `EXACT_PERMUTATION_MAX_N` pairs; the p-value then counts the observed
    pattern, (k + 1) / (draws + 1), and never reaches 0).

    The mean difference is what the alarm's figures state (a corpus ROUGE is the mean of its sentences', the eval loss
    the mean of its conversations'), so the test asks exactly whether that mean moved; the Wilcoxon signed-rank test
    would ask about ranks, which differ from the mean on the many zero and tied scores of sentence-level ROUGE-2.
    NaN without a pair; 1 when no pair differs.
    """
    if len(before) != len(after):
        raise ValueError(f"paired values: {len(before)} before and {len(after)} after; pair them by query first")
    differences = np.asarray(after, dtype=np.float64) - np.asarray(before, dtype=np.float64)
    if differences.size == 0:
        return math.nan
    if not np.any(differences != 0):
        return 1.0
    return sign_flip_p(differences)


def sign_flip_p(differences: np.ndarray) -> float:
    """The two-sided p of the paired permutation test over nonzero-length `differences`, as scipy's
    `permutation_test(..., permutation_type="samples", alternative="two-sided")` computes it: twice the smaller tail
    of the sign patterns' means against the observed mean, ties within scipy's tolerance counted; every pattern up to
    `EXACT_PERMUTATION_MAX_N` pairs, else `PERMUTATION_DRAWS` patterns drawn from a fixed seed with the observed one
    counted, (k + 1) / (draws + 1). Here the patterns are numpy arrays, a thousand at a time: scipy builds them in
    Python (0.5 s for the exact test of 16 pairs, 0.05 s for the drawn one of 32), and the guard grades every measure
    of every step pair at each evaluation. tests/test_disagreement.py checks the two agree."""
    n = differences.size
    observed = float(np.mean(differences))
    tolerance = abs(TIE_TOLERANCE * observed)
    exact = n <= EXACT_PERMUTATION_MAX_N
    patterns = 2**n if exact else PERMUTATION_DRAWS
    rng = np.random.default_rng(PERMUTATION_SEED)
    lower = upper = 0 if exact else 1  # drawn: the observed pattern is one of them
    for first in range(0, patterns, 1_000):
        rows = min(1_000, patterns - first)
        if exact:  # row r flips pair i where bit i of its pattern number is set
            flipped = ((np.arange(first, first + rows)[:, None] >> np.arange(n)) & 1).astype(bool)
        else:
            flipped = rng.random((rows, n)) < 0.5
        means = np.mean(np.where(flipped, -differences, differences), axis=1)
        lower += int(np.count_nonzero(means <= observed + tolerance))
        upper += int(np.count_nonzero(means >= observed - tolerance))
    return min(2 * min(lower, upper) / (patterns + (0 if exact else 1)), 1.0)


# --- what n queries can see ---------------------------------------------------------------------------------------
@cache
def _sign_test_cutoffs(max_discordant: int, alpha: float) -> np.ndarray:
    """For m = 0..max_discordant discordant queries, the largest count t of the minority side at which the exact
    two-sided sign test (`metric.sign_test_p`) gives p < alpha, i.e. 2 * P(Binomial(m, 1/2) <= t) < alpha; -1 where
    no split of m is significant."""
    from scipy.stats import binom

    m = np.arange(max_discordant + 1)
    t = binom.ppf(alpha / 2, m, 0.5) - 1  # ppf: the smallest j with P(X <= j) >= alpha / 2
    # ppf is computed numerically: step over the edge where rounding put it one off
    too_far = 2 * binom.cdf(t, m, 0.5) >= alpha
    t[too_far] -= 1
    one_short = 2 * binom.cdf(t + 1, m, 0.5) < alpha
    t[one_short] += 1
    return t.astype(np.int64)


def power_of_paired_comparison(n: int, before: float, after: float, alpha: float = SIGNIFICANCE_LEVEL) -> float:
    """The probability that the exact sign test on the discordant queries (confident at one step and not at the other,
    as `metric.compare` counts them) calls two steps of confidence `before` and `after` different at `alpha`, over n
    queries whose outcomes at the two steps are independent.

    Under independence a query is confident only at the later step with probability after * (1 - before) and only at
    the earlier one with before * (1 - after); the number of discordant queries m is binomial over n, and given m the
    wins are binomial over m. Exact: the sum over m of P(m) times the probability that the wins fall in the sign test's
    rejection region.
    """
    from scipy.stats import binom

    if n <= 0:
        return 0.0
    p_win, p_lose = after * (1 - before), before * (1 - after)
    discordant = p_win + p_lose
    if discordant <= 0:
        return 0.0
    m = np.arange(n + 1)
    cutoff = _sign_test_cutoffs(1 << n.bit_length(), alpha)[: n + 1]  # sizes in powers of two: few cached arrays
    share_win = p_win / discordant
    reject_given_m = binom.cdf(cutoff, m, share_win) + binom.sf(m - cutoff - 1, m, share_win)
    reject_given_m[cutoff < 0] = 0.0
    return float(np.sum(binom.pmf(m, n, discordant) * reject_given_m))


@dataclass(frozen=True)
class Resolution:
    """What a paired comparison of two steps over `n` queries can see, from a confidence of `baseline`."""

    n: int
    baseline: float
    smallest_rise: float | None  # the smallest rise a paired comparison could call significant; None: none up to 100%
    smallest_fall: float | None  # the same for a fall (a positive number); None: none down to 0%

    @property
    def within_noise(self) -> float | None:
        """The change below which either direction is within noise: the larger of the two (or the one that exists)."""
        found = [x for x in (self.smallest_rise, self.smallest_fall) if x is not None]
        return max(found) if found else None


def _smallest_change(n: int, baseline: float, direction: int, power: float, alpha: float) -> float | None:
    """The smallest change k/n in `direction` (+1 a rise, -1 a fall) whose paired comparison reaches `power`."""
    room = (1 - baseline) if direction > 0 else baseline
    for k in range(1, math.floor(room * n + 1e-9) + 1):
        if power_of_paired_comparison(n, baseline, baseline + direction * k / n, alpha) >= power:
            return k / n
    return None


def resolution(n: int, baseline: float, power: float = 0.5, alpha: float = SIGNIFICANCE_LEVEL) -> Resolution:
    """The smallest changes in confidence, from `baseline` up and down in steps of one query (1/n), that the exact
    sign test over n queries calls significant at `alpha` at least with probability `power` (one half by default: the
    change that "could" be called significant, half the time), the steps' outcomes independent."""
    if not 0 <= baseline <= 1:
        raise ValueError(f"baseline confidence {baseline!r}: a share between 0 and 1")
    return Resolution(
        n,
        baseline,
        _smallest_change(n, baseline, +1, power, alpha),
        _smallest_change(n, baseline, -1, power, alpha),
    )


def queries_needed(
    baseline: float,
    change: float = 0.10,
    power: float = 0.5,
    alpha: float = SIGNIFICANCE_LEVEL,
    max_n: int = 100_000,
) -> int | None:
    """The smallest n at which a paired comparison could call a change of `change` (a share, e.g. 0.10 for 10 points)
    significant in each direction that fits between 0 and 1 from `baseline` (with probability `power`, as
    `resolution`); None if it takes more than `max_n` queries or neither direction fits."""
    targets = [baseline + s * change for s in (+1, -1) if 0 <= baseline + s * change <= 1]
    if not targets:
        return None
    for n in range(1, max_n + 1):  # the power is not monotone in n (the test is discrete): the first n that reaches it
        if all(power_of_paired_comparison(n, baseline, target, alpha) >= power for target in targets):
            return n
    return None
