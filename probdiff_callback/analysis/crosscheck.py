"""`probdiff crosscheck RUN_DIR`: how far ProbDiff followed independent measures over a training run.

Across the evaluated steps (the baseline included): the rank correlations, Spearman's rho and
Kendall's tau with their p-values and n, of ProbDiff's confidence and of its mean d with each
reference metric of the answers (BLEU, chrF, ROUGE; overall and per category) and with the eval
loss. A higher metric and a lower loss mean a better model, so agreement shows as a positive
correlation with a metric and a negative one with the loss.

Per query: at each step, Spearman's rho between the queries' d and their answers' sentence-level
reference score, then over the steps its median and how many steps have rho > 0 and p < 0.05 each
way. Within a step the queries are independent draws; pooling the steps would count each query
several times and mix the steps' shifts into the correlation, so the steps are kept apart.

Pure functions over the history rows and step records (`run_files.read_run` reads them); the CLI prints
`format_crosscheck`, writes the report as JSON and a scatter plot (`plotting.plot_crosscheck`, one point per step).
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Mapping, Sequence

from probdiff_callback.analysis.report import fmt
from probdiff_callback.core.metric import is_finite
from probdiff_callback.core.records import Record
from probdiff_callback.core.reference_metrics import METRIC_LABELS
from probdiff_callback.runs.run_files import HistoryRow, as_row

PROBDIFF_MEASURES = {"confidence": "confidence", "d_mean": "mean d"}
LOSS = "eval_loss"
LABELS = {**METRIC_LABELS, LOSS: "eval loss", **PROBDIFF_MEASURES}
SIGNIFICANCE = 0.05
EXACT_SPEARMAN_MAX_N = 9  # up to 9! = 362,880 orderings


def exact_spearman_p(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Two-sided p of Spearman's rho over every ordering of `ys` against `xs` (ties kept as average
    ranks): the share of the n! orderings whose |rho| reaches the observed one. scipy's `spearmanr`
    p comes from a t approximation that is far off for a handful of steps (it gives p = 0 for
    rho = 1 on 3 points, where the exact p is 1/3).

    The statistic is |rho| with alternative "greater", not rho with "two-sided": scipy's two-sided
    p doubles the smaller tail, which differs from counting |rho| when ties make the orderings'
    rhos asymmetric about 0. It is computed in integers (twice the centred ranks, whose sum of
    squares is the same in every ordering, so |rho| orders as |sum of products| does): the
    comparison with the observed value is exact, with no rounding tolerance.
    """
    import numpy as np
    from scipy.stats import permutation_test, rankdata

    n = len(xs)
    rx = np.rint(2 * rankdata(xs) - (n + 1)).astype(np.int64)  # average ranks are halves: twice them are integers
    ry = np.rint(2 * rankdata(ys) - (n + 1)).astype(np.int64)

    def abs_covariance(y, axis):
        return np.abs(np.sum(rx * y, axis=axis))

    # "pairings" with one sample permutes it against the fixed `rx`; n_resamples=inf: all n! orderings
    result = permutation_test(
        (ry,), abs_covariance, permutation_type="pairings", vectorized=True, n_resamples=np.inf, alternative="greater"
    )
    return float(result.pvalue)


def rank_correlation(xs: Sequence[float | None], ys: Sequence[float | None]) -> dict:
    """Spearman and Kendall (scipy) over the pairs where both values are finite; NaN with fewer
    than 3 pairs or a constant side. Spearman's p is exact (every ordering) up to 9 pairs, scipy's
    t approximation beyond; Kendall's is scipy's (exact for small samples without ties)."""
    from scipy.stats import kendalltau, spearmanr

    pairs = [(float(x), float(y)) for x, y in zip(xs, ys) if is_finite(x) and is_finite(y)]
    result = {"n": len(pairs), "spearman": math.nan, "spearman_p": math.nan, "kendall": math.nan, "kendall_p": math.nan}
    if len(pairs) < 3 or len({x for x, _ in pairs}) < 2 or len({y for _, y in pairs}) < 2:
        return result
    x, y = [p[0] for p in pairs], [p[1] for p in pairs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rho = spearmanr(x, y)
        tau = kendalltau(x, y)
    spearman_p = exact_spearman_p(x, y) if len(pairs) <= EXACT_SPEARMAN_MAX_N else float(rho.pvalue)
    result.update(
        spearman=float(rho.statistic), spearman_p=spearman_p, kendall=float(tau.statistic), kendall_p=float(tau.pvalue)
    )
    return result


# --- the steps ---------------------------------------------------------------------------------
def step_measures(rows: Sequence[HistoryRow | Mapping]) -> list[dict]:
    """One entry per successfully evaluated step: ProbDiff's measures, the overall reference metrics,
    per-category confidence and metrics, and the eval loss (NaN where the step has none)."""
    steps = []
    for row in sorted(map(as_row, rows), key=lambda r: r.global_step):
        summary = row.summary
        if summary is None:
            continue
        reference = summary.reference
        steps.append(
            {
                "step": row.global_step,
                "kind": row.kind,
                "confidence": summary.confidence,
                "d_mean": summary.d_mean,
                LOSS: row.eval_loss,
                "metrics": {} if reference is None else dict(reference.overall),
                "by_category": {
                    category: {
                        "confidence": None if (own := summary.by_category.get(category)) is None else own.confidence,
                        **{k: v for k, v in entry.items() if k in METRIC_LABELS},
                    }
                    for category, entry in ({} if reference is None else reference.by_category).items()
                },
            }
        )
    return steps


def across_steps(steps: Sequence[Mapping]) -> list[dict]:
    """Each ProbDiff measure against each reference metric and the eval loss, over the steps."""
    metrics = [name for name in METRIC_LABELS if any(name in s["metrics"] for s in steps)]
    rows = []
    for ours in PROBDIFF_MEASURES:
        for measure in metrics + [LOSS]:
            values = [s["metrics"].get(measure) if measure != LOSS else s[LOSS] for s in steps]
            if not any(is_finite(v) for v in values):
                continue
            rows.append(
                {
                    "probdiff": ours,
                    "measure": measure,
                    "agrees_if": "negative" if measure == LOSS else "positive",
                    **rank_correlation([s[ours] for s in steps], values),
                }
            )
    return rows


def across_steps_by_category(steps: Sequence[Mapping]) -> list[dict]:
    """Each category's confidence against its own reference metrics, over the steps."""
    categories = sorted({c for s in steps for c in s["by_category"]})
    rows = []
    for category in categories:
        entries = [s["by_category"].get(category, {}) for s in steps]
        for measure in [m for m in METRIC_LABELS if any(m in e for e in entries)]:
            rows.append(
                {
                    "category": category,
                    "probdiff": "confidence",
                    "measure": measure,
                    "agrees_if": "positive",
                    **rank_correlation([e.get("confidence") for e in entries], [e.get(measure) for e in entries]),
                }
            )
    return rows


# --- the queries -------------------------------------------------------------------------------
def per_query(records_by_step: Mapping[int, Sequence[Record]]) -> list[dict]:
    """For each sentence-level metric in the records: Spearman of d with it within each step, and a summary."""
    metrics = [m for m in METRIC_LABELS if any(m in (r.ref or {}) for rs in records_by_step.values() for r in rs)]
    out = []
    for metric in metrics:
        by_step = []
        for step, records in sorted(records_by_step.items()):
            scores = [(r.d, score) for r in records if (score := (r.ref or {}).get(metric)) is not None]
            if not scores:
                continue
            correlation = rank_correlation([d for d, _ in scores], [score for _, score in scores])
            by_step.append(
                {
                    "step": step,
                    "n": correlation["n"],
                    "spearman": correlation["spearman"],
                    "p": correlation["spearman_p"],
                }
            )
        rhos = [s["spearman"] for s in by_step if math.isfinite(s["spearman"])]
        out.append(
            {
                "metric": metric,
                "n_steps": len(by_step),
                "n_steps_with_rho": len(rhos),
                "median_spearman": statistics.median(rhos) if rhos else math.nan,
                "n_positive": sum(r > 0 for r in rhos),
                "n_significant_positive": sum(
                    s["spearman"] > 0 and s["p"] < SIGNIFICANCE for s in by_step if math.isfinite(s["spearman"])
                ),
                "n_significant_negative": sum(
                    s["spearman"] < 0 and s["p"] < SIGNIFICANCE for s in by_step if math.isfinite(s["spearman"])
                ),
                "by_step": by_step,
            }
        )
    return out


# --- the run -----------------------------------------------------------------------------------
def crosscheck(rows: Sequence[HistoryRow | Mapping], records_by_step: Mapping[int, Sequence[Record]]) -> dict:
    """The whole report, JSON-ready."""
    steps = step_measures(rows)
    return {
        "steps": steps,
        "n_steps": len(steps),
        "across_steps": across_steps(steps),
        "across_steps_by_category": across_steps_by_category(steps),
        "per_query": per_query(records_by_step),
        "has_reference_metrics": any(s["metrics"] for s in steps),
    }


# --- output ------------------------------------------------------------------------------------
def format_crosscheck(report: Mapping) -> str:
    steps = report["steps"]
    span = f"steps {steps[0]['step']}-{steps[-1]['step']}" if steps else "no steps"
    lines = [f"ProbDiff against independent measures over {report['n_steps']} evaluated steps ({span})"]
    if not report["has_reference_metrics"]:
        lines.append("(these queries have no reference metric: only the eval loss is compared)")
    lines.append(
        f"  {'ProbDiff':<11} {'measure':<9} {'agrees if':<9} {'n':>3}  "
        f"{'Spearman ρ':>10} {'p':>7}  {'Kendall τ':>9} {'p':>7}"
    )
    for row in report["across_steps"]:
        agrees_if = "ρ > 0" if row["agrees_if"] == "positive" else "ρ < 0"
        lines.append(
            f"  {LABELS[row['probdiff']]:<11} {LABELS[row['measure']]:<9} {agrees_if:<9} {row['n']:>3}  "
            f"{fmt(row['spearman'], '+.2f'):>10} {fmt(row['spearman_p'], '.2g'):>7}  "
            f"{fmt(row['kendall'], '+.2f'):>9} {fmt(row['kendall_p'], '.2g'):>7}"
        )
    if not report["across_steps"]:
        lines.append("  (no reference metric or eval loss in the history)")
    if report["per_query"]:
        lines.append("Per query: Spearman ρ of d with the answer's sentence score, within each step")
        lines.append(
            f"  {'metric':<9} {'steps':>5}  {'median ρ':>8}  {'ρ > 0':>6}  {'p<0.05, ρ>0':>11}  {'p<0.05, ρ<0':>11}"
        )
        for row in report["per_query"]:
            k = row["n_steps_with_rho"]
            lines.append(
                f"  {LABELS[row['metric']]:<9} {row['n_steps']:>5}  {fmt(row['median_spearman'], '+.2f'):>8}  "
                f"{row['n_positive']:>2}/{k:<3}  {row['n_significant_positive']:>7}/{k:<3}  "
                f"{row['n_significant_negative']:>7}/{k:<3}"
            )
    return "\n".join(lines)
