"""The callback's metrics for the Trainer: `eval_probdiff_*` from an evaluation's summary and `eval_probdiff_vs_base_*`
from its comparison with the base model. A failed evaluation gets NaN under every key, never a missing key: the
Trainer raises KeyError in `_determine_best_metric` on one that is missing."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from probdiff_callback.core.metric import delta_key
from probdiff_callback.core.records import Comparison, Summary

METRIC_PREFIX = "eval_probdiff_"
# The scalars of a summary, by the name of their metric: NaN under each for a failed evaluation
SCALARS = (
    "confidence",
    "confidence_ci_low",
    "confidence_ci_high",
    "d_mean",
    "d_median",
    "logp_response",
    "logp_revised",
    "n_invalid",
    "n_revision_degenerate",
    "confidence_non_degenerate",
)


def metric_name(part: str) -> str:
    """A metric key safe for W&B and TensorBoard (categories may hold spaces or slashes)."""
    return METRIC_PREFIX + "".join(c if c.isalnum() or c in "-._" else "_" for c in part)


def metrics_from_summary(
    summary: Summary | None, sweep: Sequence[float], categories: Sequence[str]
) -> dict[str, float]:
    """The eval_probdiff_* metrics of a summary; NaN everywhere for a failed evaluation (a missing key would
    make the Trainer raise KeyError in `_determine_best_metric`)."""
    nan = math.nan
    if summary is None:
        names = [*SCALARS, *(f"confidence_at_{delta_key(d)}" for d in sweep), *(f"confidence_{c}" for c in categories)]
        return {metric_name(name): nan for name in names}
    # summaries hold NaN, not null (records.py reads a stored one back that way)
    scalars = (
        summary.confidence,
        summary.confidence_ci[0],
        summary.confidence_ci[1],
        summary.d_mean,
        summary.d_median,
        summary.logp_response_mean,
        summary.logp_revised_mean,
        summary.n_invalid,
        # revisions that loop or echo the refinement prompt, and the confidence counting them as not confident
        summary.n_revision_degenerate,
        summary.confidence_non_degenerate,
    )
    metrics = {metric_name(name): float(value) for name, value in zip(SCALARS, scalars)}
    for key, value in summary.confidence_sweep.items():
        metrics[metric_name(f"confidence_at_{key}")] = float(value)
    for category in categories:  # a category this subset lacks has no confidence
        own = summary.by_category.get(category)
        metrics[metric_name(f"confidence_{category}")] = nan if own is None else float(own.confidence)
    return metrics


TRAINER_PREFIX = "eval_probdiff_vs_base_"


def vs_base_metrics(result: Comparison | None) -> dict[str, float]:
    """eval_probdiff_vs_base_{win,tie,lose,wilcoxon_p}; NaN where there is no comparison (the
    baseline itself, a failed evaluation), so the keys are the same at every evaluation."""
    values = (math.nan,) * 4 if result is None else (result.win, result.tie, result.lose, result.wilcoxon_p)
    return {TRAINER_PREFIX + key: float(value) for key, value in zip(("win", "tie", "lose", "wilcoxon_p"), values)}


def logged_steps(log_history: Iterable[Mapping]) -> set[int]:
    """The steps whose ProbDiff metrics the Trainer's log holds (either way of evaluating)."""
    return {e["step"] for e in log_history if "eval_probdiff_confidence" in e and "step" in e}
