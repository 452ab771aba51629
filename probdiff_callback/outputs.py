"""Where an evaluation's results go besides the run's files (`run_files`): the Trainer's metrics, and the W&B
histogram, table and alert (main process only)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from probdiff_callback.metric import delta_key

METRIC_PREFIX = "eval_probdiff_"
WANDB_HISTOGRAM_KEY = "eval/probdiff_d"
WANDB_TABLE_KEY = "eval/probdiff_records"
WANDB_TABLE_COLUMNS = ["step", "id", "category", "query", "response", "revision", "logp_response", "logp_revised", "d"]


def metric_name(part: str) -> str:
    """A metric key safe for W&B and TensorBoard (categories may hold spaces or slashes)."""
    return METRIC_PREFIX + "".join(c if c.isalnum() or c in "-._" else "_" for c in part)


def metrics_from_summary(summary: dict | None, sweep: Sequence[float], categories: Sequence[str]) -> dict[str, float]:
    """The eval_probdiff_* metrics of a summary; NaN everywhere for a failed evaluation (a missing key would
    make the Trainer raise KeyError in `_determine_best_metric`)."""
    nan = math.nan
    if summary is None:
        summary = {
            "confidence": nan, "confidence_ci": [nan, nan], "d_mean": nan, "d_median": nan, "n_invalid": nan,
            "logp_response_mean": nan, "logp_revised_mean": nan, "by_category": {},
            "confidence_sweep": {delta_key(d): nan for d in sweep},
        }  # fmt: skip

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
    }
    for key, value in summary["confidence_sweep"].items():
        metrics[metric_name(f"confidence_at_{key}")] = float(value)
    for category in categories:  # a category this subset lacks has no confidence
        confidence = summary["by_category"].get(category, {}).get("confidence", nan)
        metrics[metric_name(f"confidence_{category}")] = float(confidence)
    return metrics


class WandbRecords:
    """The distribution of d at each evaluated step as a histogram, and the first records of each step in one
    table that grows across steps."""

    def __init__(self, table_rows: int) -> None:
        self.table_rows = table_rows
        self._table = None

    def log(self, step: int, records: Sequence[dict]) -> None:
        import wandb

        if wandb.run is None:
            return
        payload: dict[str, Any] = {"train/global_step": step}
        ds = [r["d"] for r in records if r["d"] is not None and math.isfinite(r["d"])]
        if ds:  # wandb.Histogram raises on NaN; the invalid ones are counted in eval/probdiff_n_invalid
            payload[WANDB_HISTOGRAM_KEY] = wandb.Histogram(ds)
        if self.table_rows and records:
            if self._table is None:
                self._table = wandb.Table(columns=WANDB_TABLE_COLUMNS, log_mode="INCREMENTAL")
            for r in records[: self.table_rows]:
                revision = r["revisions"][-1] if r["revisions"] else ""
                self._table.add_data(
                    step, r["id"], r["category"], r["query"], r["response"], revision,
                    r["logp_response"], r["logp_revised"], r["d"],
                )  # fmt: skip
            payload[WANDB_TABLE_KEY] = self._table
        if len(payload) > 1:
            wandb.log(payload)


def alert_wandb(title: str, text: str) -> None:
    """A W&B alert (e-mail or Slack, as the user set it up) and the text in the run's summary, where the run page
    shows it."""
    import wandb

    if wandb.run is None:
        return
    previous = wandb.run.summary.get("probdiff/disagreement")
    wandb.run.summary["probdiff/disagreement"] = f"{previous}\n{text}" if previous else text
    wandb.run.alert(title=title, text=text, level=wandb.AlertLevel.WARN)
