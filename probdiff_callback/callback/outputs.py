"""What an evaluation hands out besides the run's files (`run_files`): the Trainer's metrics, the W&B histogram,
table and alert (main process only), and what evaluating adds to the run's time.

The time report forecasts once the first evaluation during training has run, and measures the total at the end. The
forecast waits for an evaluation of the model in training: the base model's evaluation, before the first step, runs
once, and its answers can be far longer (or shorter) than those of the model being trained.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import TrainerState, TrainingArguments

from probdiff_callback.core.metric import delta_key

logger = logging.getLogger(__name__)

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


class DisagreementAlerts:
    """As soon as an independent measure moves against ProbDiff: a warning on the console and a W&B alert, once per
    disagreement."""

    def __init__(self) -> None:
        self.said: set = set()

    def announce(self, rows, run_dir: str, to_wandb: bool) -> None:
        from probdiff_callback.analysis.disagreement import format_disagreements
        from probdiff_callback.analysis.select import disagreements

        new = [d for d in disagreements(rows, run_dir) if d not in self.said]
        if not new:
            return
        self.said.update(new)
        text = format_disagreements(new, run_dir)
        logger.warning(text)
        if to_wandb:
            try:
                alert_wandb("ProbDiff disagrees with an independent measure", text)
            except Exception:  # the console has it; a failed alert is not worth the run
                logger.exception("ProbDiff: sending the disagreement to W&B failed")


def alert_wandb(title: str, text: str) -> None:
    """A W&B alert (e-mail or Slack, as the user set it up) and the text in the run's summary, where the run page
    shows it."""
    import wandb

    if wandb.run is None:
        return
    previous = wandb.run.summary.get("probdiff/disagreement")
    wandb.run.summary["probdiff/disagreement"] = f"{previous}\n{text}" if previous else text
    wandb.run.alert(title=title, text=text, level=wandb.AlertLevel.WARN)


TRAINER_KEYS = ("win", "tie", "lose", "wilcoxon_p")


TRAINER_PREFIX = "eval_probdiff_vs_base_"


def vs_base_metrics(result: Mapping | None) -> dict[str, float]:
    """eval_probdiff_vs_base_{win,tie,lose,wilcoxon_p}; NaN where there is no comparison (the
    baseline itself, a failed evaluation), so the keys are the same at every evaluation."""
    return {TRAINER_PREFIX + key: _number(None if result is None else result.get(key)) for key in TRAINER_KEYS}


def _number(value) -> float:
    return math.nan if value is None else float(value)


def evaluation_interval(args: TrainingArguments, state: TrainerState) -> int | None:
    """Optimizer steps between the Trainer's evaluations (its saves when it does not evaluate), or None when
    they follow epochs or nothing."""
    if args.eval_strategy == "steps":
        return state.eval_steps or None
    if args.eval_strategy == "no" and args.save_strategy == "steps":
        return state.save_steps or None
    return None


class CostReport:
    def __init__(self) -> None:
        self.before_training = 0.0  # the base model's evaluation (seconds), once before the first step
        self.during_training: list[float] = []  # each evaluation's seconds since training started
        self.training_started_at: float | None = None
        self.start_step = 0
        self.reported = False

    def training_started(self, step: int) -> None:
        self.training_started_at, self.start_step, self.during_training = time.perf_counter(), step, []

    def evaluated(self, seconds: float, before_training: bool = False) -> None:
        """One evaluation's seconds; `before_training` for the base model's, which may run in the Trainer's
        evaluation at step 0 (`eval_on_start`), after training started: its time is then not training time."""
        if before_training or self.training_started_at is None:
            self.before_training += seconds
            if self.training_started_at is not None:
                self.training_started_at += seconds
        else:
            self.during_training.append(seconds)

    def _training_seconds(self) -> float:
        assert self.training_started_at is not None
        return max(time.perf_counter() - self.training_started_at - sum(self.during_training), 0.0)

    def message(self, args: TrainingArguments, state: TrainerState, every: int) -> str | None:
        """The forecast, once, at the first step after an evaluation during training; else None."""
        done = state.global_step - self.start_step
        if self.reported or self.training_started_at is None or not self.during_training or done < 1:
            return None
        self.reported = True
        per_step = self._training_seconds() / done
        text = f"ProbDiff: one evaluation takes {self.during_training[0]:.1f}s"
        if self.before_training:
            text += f" (the base model's took {self.before_training:.1f}s, once)"
        text += f", a training step {per_step:.2f}s"
        interval = evaluation_interval(args, state)
        if interval is None or per_step == 0:
            return text
        share = self.during_training[0] / (per_step * interval * every)
        return f"{text}; evaluating every {interval * every} steps adds about {100 * share:.0f}% to the training time"

    def totals(self) -> str | None:
        """The measured cost of the whole run, for its end; None before training started."""
        if self.training_started_at is None:
            return None
        training, evaluating = self._training_seconds(), sum(self.during_training)
        text = (
            f"ProbDiff cost: {len(self.during_training)} evaluations during training took {evaluating / 60:.1f} min, "
            f"{100 * evaluating / max(training, 1e-9):.0f}% on top of {training / 60:.1f} min of training"
        )
        if self.before_training:
            text += f"; the base model's evaluation {self.before_training / 60:.1f} min before it"
        return text
