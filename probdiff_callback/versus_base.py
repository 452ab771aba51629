"""The paper's comparison of each evaluation with the base model: win / tie / lose on the same queries.

Both sides are thresholded by their own d (`metric.compare`): a query is won where this step is
confident and the base model is not, lost in the reverse case, tied otherwise. The Wilcoxon
signed-rank test on d comes with it. Pure functions over record lists; the callback logs the result
in the history row (`vs_base`), the Trainer's metrics (`eval_probdiff_vs_base_*`) and W&B.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from probdiff_callback.formatting import fmt
from probdiff_callback.metric import compare

TRAINER_KEYS = ("win", "tie", "lose", "wilcoxon_p")
TRAINER_PREFIX = "eval_probdiff_vs_base_"


def compare_to_base(records: Sequence[dict], base_records: Sequence[dict] | None, delta: float) -> dict | None:
    """`metric.compare(records, base_records, delta)`, or None without base records."""
    if not records or not base_records:
        return None
    return compare(records, base_records, delta)


def trainer_metrics(result: Mapping | None) -> dict[str, float]:
    """eval_probdiff_vs_base_{win,tie,lose,wilcoxon_p}; NaN where there is no comparison (the
    baseline itself, a failed evaluation), so the keys are the same at every evaluation."""
    return {TRAINER_PREFIX + key: _number(None if result is None else result.get(key)) for key in TRAINER_KEYS}


def format_win_tie_lose(result: Mapping | None) -> str:
    """`win/tie/lose` as counts, or `-` without a comparison."""
    if result is None:
        return "-"
    return f"{result['win']}/{result['tie']}/{result['lose']}"


def format_p(result: Mapping | None) -> str:
    if result is None:
        return "-"
    p = result.get("wilcoxon_p")
    return fmt(p, ".3g")


def _number(value) -> float:
    return math.nan if value is None else float(value)
