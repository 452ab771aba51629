"""The callback's metrics for the Trainer: `eval_probdiff_*` from an evaluation's summary and `eval_probdiff_vs_base_*`
from its comparison with the base model. A failed evaluation gets NaN under every key, never a missing key: the
Trainer raises KeyError in `_determine_best_metric` on one that is missing."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from probdiff_callback.core.metric import delta_key

METRIC_PREFIX = "eval_probdiff_"


def metric_name(part: str) -> str:
    """A metric key safe for W&B and TensorBoard (categories may hold spaces or slashes)."""
    return METRIC_PREFIX + "".join(c if c.isalnum() or c in "-._" else "_" for c in part)


def metrics_from_summary(summary: dict | None, sweep: Sequence[float], categories: Sequence[str]) -> dict[str, float]:
    """The eval_probdiff_* metrics of a summary; NaN everywhere for a failed evaluation (a missing key would
    make the Trainer raise KeyError in `_determine_best_metric`)."""
    nan = math.nan
    if summary is None:
        scalars = ("confidence", "d_mean", "d_median", "n_invalid", "logp_response_mean", "logp_revised_mean")
        scalars += ("n_revision_degenerate", "confidence_non_degenerate")
        summary = dict.fromkeys(scalars, nan) | {
            "confidence_ci": [nan, nan],
            "by_category": {},
            "confidence_sweep": {delta_key(d): nan for d in sweep},
        }

    # summaries hold NaN, not null (run_files reads a stored one back that way)
    metrics = {
        metric_name("confidence"): float(summary["confidence"]),
        metric_name("confidence_ci_low"): float(summary["confidence_ci"][0]),
        metric_name("confidence_ci_high"): float(summary["confidence_ci"][1]),
        metric_name("d_mean"): float(summary["d_mean"]),
        metric_name("d_median"): float(summary["d_median"]),
        metric_name("logp_response"): float(summary["logp_response_mean"]),
        metric_name("logp_revised"): float(summary["logp_revised_mean"]),
        metric_name("n_invalid"): float(summary["n_invalid"]),
        # revisions that loop or echo the refinement prompt, and the confidence counting them as not confident
        metric_name("n_revision_degenerate"): float(summary["n_revision_degenerate"]),
        metric_name("confidence_non_degenerate"): float(summary["confidence_non_degenerate"]),
    }
    for key, value in summary["confidence_sweep"].items():
        metrics[metric_name(f"confidence_at_{key}")] = float(value)
    for category in categories:  # a category this subset lacks has no confidence
        confidence = summary["by_category"].get(category, {}).get("confidence", nan)
        metrics[metric_name(f"confidence_{category}")] = float(confidence)
    return metrics


TRAINER_KEYS = ("win", "tie", "lose", "wilcoxon_p")


TRAINER_PREFIX = "eval_probdiff_vs_base_"


def vs_base_metrics(result: Mapping | None) -> dict[str, float]:
    """eval_probdiff_vs_base_{win,tie,lose,wilcoxon_p}; NaN where there is no comparison (the
    baseline itself, a failed evaluation), so the keys are the same at every evaluation."""
    return {TRAINER_PREFIX + key: _number(None if result is None else result.get(key)) for key in TRAINER_KEYS}


def _number(value) -> float:
    return math.nan if value is None else float(value)
