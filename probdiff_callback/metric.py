"""The ProbDiff math: d(alpha, q), confidence, its interval, the summary and the comparison.

Pure functions over plain numbers and record dicts; no model in here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from probdiff_callback.categories import canonical_category

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


def bootstrap_interval(ds: Sequence[float], delta: float, n_resamples: int = 1000, seed: int = 0) -> list[float]:
    """Percentile 95% bootstrap interval of the confidence, resampling queries."""
    if len(ds) == 0:
        return [math.nan, math.nan]
    hits = np.array([is_confident(d, delta) for d in ds], dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = hits[rng.integers(0, len(hits), size=(n_resamples, len(hits)))].mean(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    return [float(low), float(high)]


def _finite(values: Iterable[float | None]) -> np.ndarray:
    array = np.array([math.nan if v is None else v for v in values], dtype=np.float64)
    return array[np.isfinite(array)]


def _mean(values: Iterable[float | None]) -> float:
    finite = _finite(values)
    return float(finite.mean()) if finite.size else math.nan


def length_changed_share(records: Sequence[dict]) -> float:
    """Share of queries whose last revision differs in token length from the answer by more than half."""
    changed = [
        abs(r["n_tokens_revised"] - r["n_tokens_response"]) > LENGTH_CHANGE_LIMIT * max(r["n_tokens_response"], 1)
        for r in records
    ]
    return sum(changed) / len(changed) if changed else math.nan


def summarize(records: Sequence[dict], delta: float, sweep: Sequence[float], bootstrap_samples: int = 1000, seed: int = 0) -> dict:
    """The summary of a set of records (see the README for each key)."""
    ds = [math.nan if r["d"] is None else r["d"] for r in records]
    finite = _finite(ds)
    by_category: dict[str, dict] = {}
    # records written before categories were canonical may hold AlignBench's Chinese names
    record_categories = [canonical_category(r.get("category")) for r in records]
    for category in sorted({c for c in record_categories if c is not None}):
        cat_ds = [d for d, c in zip(ds, record_categories) if c == category]
        by_category[category] = {"n": len(cat_ds), "confidence": confidence(cat_ds, delta), "d_mean": _mean(cat_ds)}
    return {
        "n": len(records),
        "n_invalid": int(sum(math.isnan(d) for d in ds)),
        "n_truncated": int(sum(bool(r.get("truncated")) for r in records)),
        "delta": delta,
        "confidence": confidence(ds, delta),
        "confidence_ci": bootstrap_interval(ds, delta, bootstrap_samples, seed),
        "confidence_sweep": confidence_sweep(ds, sorted(set(sweep) | {delta}, reverse=True)),
        "d_mean": float(finite.mean()) if finite.size else math.nan,
        "d_median": float(np.median(finite)) if finite.size else math.nan,
        "d_std": float(finite.std(ddof=1)) if finite.size > 1 else math.nan,
        "d_quantiles": {f"{q:g}": (float(np.quantile(finite, q)) if finite.size else math.nan) for q in QUANTILES},
        "logp_response_mean": _mean(r["logp_response"] for r in records),
        "logp_revised_mean": _mean(r["logp_revised"] for r in records),
        "by_category": by_category,
        "len_response_mean": _mean(r["n_tokens_response"] for r in records),
        "len_revised_mean": _mean(r["n_tokens_revised"] for r in records),
        "length_changed_share": length_changed_share(records),
    }


def compare(records_a: Sequence[dict], records_b: Sequence[dict], delta: float) -> dict:
    """The paper's pairwise comparison on the queries both sets share.

    Each model's d is thresholded on its own: A wins a query where A is confident and
    B is not, loses in the reverse case, ties otherwise. The paired test is a Wilcoxon
    signed-rank test on d over the queries where both d are valid.
    """
    from scipy.stats import wilcoxon

    by_id_b = {str(r["id"]): r for r in records_b}
    shared = [(a, by_id_b[str(a["id"])]) for a in records_a if str(a["id"]) in by_id_b]
    if not shared:
        raise ValueError("the two result sets share no query id; compare results on the same queries")
    win = tie = lose = 0
    pairs = []
    for a, b in shared:
        da = math.nan if a["d"] is None else a["d"]
        db = math.nan if b["d"] is None else b["d"]
        ca, cb = is_confident(da, delta), is_confident(db, delta)
        win += ca and not cb
        lose += cb and not ca
        tie += ca == cb
        if math.isfinite(da) and math.isfinite(db):
            pairs.append((da, db))
    p_value = math.nan
    if pairs and any(x != y for x, y in pairs):
        p_value = float(wilcoxon([x for x, _ in pairs], [y for _, y in pairs]).pvalue)
    return {
        "n": len(shared),
        "n_only_a": len(records_a) - len(shared),
        "n_only_b": len(records_b) - len(shared),
        "delta": delta,
        "win": win,
        "tie": tie,
        "lose": lose,
        "n_paired": len(pairs),
        "d_mean_a": _mean(p[0] for p in pairs),
        "d_mean_b": _mean(p[1] for p in pairs),
        "wilcoxon_p": p_value,
    }
