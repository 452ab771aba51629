"""The ProbDiff math: d(alpha, q), confidence, its interval, the summary and the comparison.

Pure functions over plain numbers and `Record`s (`records.py`); no model in here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from probdiff_callback.core.categories import canonical_category
from probdiff_callback.core.degenerate import KINDS
from probdiff_callback.core.records import CategorySummary, Comparison, Record, Summary

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
LENGTH_CHANGE_LIMIT = 0.5  # the paper's length bias: revisions that change length by more than half


def discrepancy(logp_revised: float, logp_response: float) -> float:
    """d = log p(x_K | q) - log p(x | q); NaN when either score is NaN (empty text)."""
    return logp_revised - logp_response


def is_confident(d: float, delta: float) -> bool:
    """d >= delta; an invalid (NaN) d is not confident, as in the reference code."""
    return not math.isnan(d) and d >= delta


def confidence(ds: Sequence[float], delta: float) -> float:
    """Share of queries with d >= delta, invalid ones counted as not confident."""
    if len(ds) == 0:
        return math.nan
    return sum(is_confident(d, delta) for d in ds) / len(ds)


def confidence_sweep(ds: Sequence[float], deltas: Iterable[float]) -> dict[str, float]:
    return {delta_key(delta): confidence(ds, delta) for delta in deltas}


def delta_key(delta: float) -> str:
    return f"{delta:g}" if delta != 0 else "0"


# The 97.5% standard-normal quantile: every interval here is a two-sided 95% interval.
Z_95 = 1.959963984540054


def wilson_interval(successes: int, n: int, confidence_level: float = 0.95) -> list[float]:
    """Wilson score interval of a binomial share (Wilson 1927), two-sided: scipy's, whose z for 0.95
    is the 97.5% normal quantile `Z_95`.

    Chosen over the percentile bootstrap, which collapses to [0, 0] or [1, 1] when no or every
    query is confident (where base models sit on translation), and over Clopper-Pearson, which is
    conservative (coverage above 95%, wider); Brown, Cai and DasGupta (2001) recommend Wilson's
    for its near-nominal coverage at small n. At 0 of n the upper end is z^2 / (n + z^2), not 0
    (and the lower end exactly 0; at n of n the upper end exactly 1).
    """
    from scipy.stats import binomtest

    if n == 0:  # no query: no share to bound (binomtest needs at least one trial)
        return [math.nan, math.nan]
    interval = binomtest(successes, n).proportion_ci(confidence_level=confidence_level, method="wilson")
    return [float(interval.low), float(interval.high)]


def confidence_interval(ds: Sequence[float], delta: float) -> list[float]:
    """95% Wilson interval of the confidence, invalid d counted as not confident (as in `confidence`)."""
    return wilson_interval(sum(is_confident(d, delta) for d in ds), len(ds))


def sign_test_p(win: int, lose: int) -> float:
    """Exact two-sided sign test of wins against losses, ties left out: do the queries one model
    wins outnumber those it loses more than chance (each discordant query a fair coin) allows?

    With no win and no loss there is no evidence either way: p = 1.
    """
    from scipy.stats import binomtest

    if win + lose == 0:
        return 1.0
    return float(binomtest(win, win + lose, 0.5).pvalue)


def paired_difference_interval(win: int, lose: int, n: int, z: float = Z_95) -> list[float]:
    """95% interval of (win - lose) / n over n paired queries: Bonett and Price's (2012) adjusted Wald
    interval for a difference of paired proportions.

    (win - lose) / n is confidence_A - confidence_B on the shared queries, a difference of two
    proportions measured on the same queries, so it needs a paired interval. The adjusted Wald
    adds one pseudo-observation to each discordant cell: closed form, deterministic, and not
    degenerate when every query ties (a plain Wald interval is [0, 0] there); Fagerland, Lydersen
    and Laake (2014) recommend it among the intervals for paired proportions.
    """
    if n == 0:
        return [math.nan, math.nan]
    p_win, p_lose = (win + 1) / (n + 2), (lose + 1) / (n + 2)
    difference = p_win - p_lose
    half = z * math.sqrt(max(p_win + p_lose - difference * difference, 0.0) / (n + 2))
    return [max(-1.0, difference - half), min(1.0, difference + half)]


def finite_values(values: Iterable[float | None]) -> np.ndarray:
    """The values that are numbers other than NaN and infinity (None counts as missing)."""
    array = np.array([math.nan if v is None else v for v in values], dtype=np.float64)
    return array[np.isfinite(array)]


def finite_mean(values: Iterable[float | None]) -> float:
    """The mean of the finite values, NaN when there are none."""
    finite = finite_values(values)
    return float(finite.mean()) if finite.size else math.nan


def length_changed_share(records: Sequence[Record]) -> float:
    """Share of queries whose last revision differs in token length from the answer by more than half."""
    changed = [
        abs(r.n_tokens_revised - r.n_tokens_response) > LENGTH_CHANGE_LIMIT * max(r.n_tokens_response, 1)
        for r in records
    ]
    return sum(changed) / len(changed) if changed else math.nan


def confidence_non_degenerate(records: Sequence[Record], delta: float) -> tuple[float, list[float]]:
    """The confidence with degenerate last revisions (`revision_degenerate`, `degenerate.py`) counted as not
    confident, as invalid ones are, over the same queries; and its 95% Wilson interval.

    Beside the paper's confidence, not instead of it: the paper counts only empty texts as invalid, and a loop or an
    echo of the prompt is likely under the model, so it counts as confident there. The gap between the two is the
    share of queries whose confidence rests on a degenerate revision.
    """
    confident = sum(is_confident(r.d, delta) and not r.revision_degenerate for r in records)
    share = confident / len(records) if records else math.nan
    return share, wilson_interval(confident, len(records))


def degenerate_counts(kinds_per_record: Iterable[Sequence[str]]) -> dict[str, int]:
    """How many records show each kind of degeneration (`degenerate.KINDS`), from each record's kinds
    (`response_degenerate` or `revision_degenerate`); a record with both kinds counts under each."""
    shown = list(kinds_per_record)
    return {kind: sum(kind in kinds for kinds in shown) for kind in KINDS}


def summary_of(records: Sequence[Record], delta: float, sweep: Sequence[float]) -> Summary:
    """The summary of a set of records (`records.Summary` says what each field holds); no reference metrics
    (`evaluator.summarise` adds them)."""
    ds = [r.d for r in records]
    finite = finite_values(ds)
    by_category: dict[str, CategorySummary] = {}
    # records written before categories were canonical may hold AlignBench's Chinese names
    record_categories = [canonical_category(r.category) for r in records]
    non_degenerate, non_degenerate_ci = confidence_non_degenerate(records, delta)
    for category in sorted({c for c in record_categories if c is not None}):
        cat_ds = [d for d, c in zip(ds, record_categories) if c == category]
        by_category[category] = CategorySummary(
            n=len(cat_ds), confidence=confidence(cat_ds, delta), d_mean=finite_mean(cat_ds)
        )
    return Summary(
        n=len(records),
        n_invalid=int(sum(math.isnan(d) for d in ds)),
        n_truncated=int(sum(r.truncated for r in records)),
        # answers / last revisions that hit max_new_tokens without a stop token, scored cut short
        n_capped=int(sum(bool(r.response_capped) for r in records)),
        n_revision_capped=int(sum(bool(r.revision_capped) for r in records)),
        n_revision_truncated=int(sum(r.revision_truncated for r in records)),
        # answers / last revisions that loop or echo the refinement prompt (degenerate.py), and per kind
        n_degenerate=int(sum(bool(r.response_degenerate) for r in records)),
        n_revision_degenerate=int(sum(bool(r.revision_degenerate) for r in records)),
        revision_degenerate_kinds=degenerate_counts(r.revision_degenerate for r in records),
        delta=delta,
        confidence=confidence(ds, delta),
        confidence_ci=confidence_interval(ds, delta),
        confidence_non_degenerate=non_degenerate,
        confidence_non_degenerate_ci=non_degenerate_ci,
        confidence_sweep=confidence_sweep(ds, sorted(set(sweep) | {delta}, reverse=True)),
        d_mean=float(finite.mean()) if finite.size else math.nan,
        d_median=float(np.median(finite)) if finite.size else math.nan,
        d_std=float(finite.std(ddof=1)) if finite.size > 1 else math.nan,
        d_quantiles={f"{q:g}": (float(np.quantile(finite, q)) if finite.size else math.nan) for q in QUANTILES},
        logp_response_mean=finite_mean(r.logp_response for r in records),
        logp_revised_mean=finite_mean(r.logp_revised for r in records),
        by_category=by_category,
        len_response_mean=finite_mean(r.n_tokens_response for r in records),
        len_revised_mean=finite_mean(r.n_tokens_revised for r in records),
        length_changed_share=length_changed_share(records),
    )


def compare(records_a: Sequence[Record], records_b: Sequence[Record], delta: float) -> Comparison:
    """The paper's pairwise comparison on the queries both sets share.

    Each model's d is thresholded on its own: A wins a query where A is confident and B is
    not, loses in the reverse case, ties otherwise. The paper's wording ("predefined thresholds
    for d(alpha, q) and d(theta, q)") also reads as thresholding d_A - d_B; we threshold each d
    because each is a difference of one model's own log-probabilities (their scales need not
    agree across models), and because then (win - lose) / n is exactly confidence_A -
    confidence_B on these queries, the numbers the paper reports per model.

    Tests: `sign_p`, an exact sign test of wins against losses (does one model win more queries
    than it loses?), with `difference_ci`, a 95% interval on (win - lose) / n; `wilcoxon_p`, a
    Wilcoxon signed-rank test of d_A against d_B over the queries where both are valid (is d
    shifted?), a different question: d can shift without any query crossing delta, and many
    queries can cross delta with a small shift.
    """
    from scipy.stats import wilcoxon

    by_id_b = {str(r.id): r for r in records_b}  # a file written elsewhere may hold numbers
    shared = [(a, by_id_b[str(a.id)]) for a in records_a if str(a.id) in by_id_b]
    if not shared:
        raise ValueError("the two result sets share no query id; compare results on the same queries")
    win = tie = lose = 0
    pairs = []
    for a, b in shared:
        ca, cb = is_confident(a.d, delta), is_confident(b.d, delta)
        win += ca and not cb
        lose += cb and not ca
        tie += ca == cb
        if math.isfinite(a.d) and math.isfinite(b.d):
            pairs.append((a.d, b.d))
    p_value = math.nan
    if pairs and any(x != y for x, y in pairs):
        p_value = float(wilcoxon([x for x, _ in pairs], [y for _, y in pairs]).pvalue)
    n = len(shared)
    return Comparison(
        n=n,
        n_only_a=len(records_a) - n,
        n_only_b=len(records_b) - n,
        delta=delta,
        win=win,
        tie=tie,
        lose=lose,
        confidence_a=confidence([a.d for a, _ in shared], delta),
        confidence_b=confidence([b.d for _, b in shared], delta),
        difference=(win - lose) / n,
        difference_ci=paired_difference_interval(win, lose, n),
        sign_p=sign_test_p(win, lose),
        n_paired=len(pairs),
        d_mean_a=finite_mean(p[0] for p in pairs),
        d_mean_b=finite_mean(p[1] for p in pairs),
        wilcoxon_p=p_value,
    )


def compare_to_base(
    records: Sequence[Record], base_records: Sequence[Record] | None, delta: float
) -> Comparison | None:
    """`compare(records, base_records, delta)`, or None without base records."""
    if not records or not base_records:
        return None
    return compare(records, base_records, delta)


def is_finite(value: object) -> bool:
    """A real number that is neither NaN nor infinite (None, text and booleans are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
