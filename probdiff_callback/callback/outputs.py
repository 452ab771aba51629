"""Where an evaluation's results land, whichever way it ran (in the loop or beside training): the Trainer's metrics,
W&B's histogram and table, the resolution line (once per training start) and the disagreement alarm; and the main
process's values handed to every rank. Both ways of evaluating get the same `TrainerOutputs`."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

from probdiff_callback.analysis.pick import GUARDED_KEY, Pick, is_guarded
from probdiff_callback.analysis.report import resolution_line
from probdiff_callback.callback.alerts import DisagreementAlerts
from probdiff_callback.callback.metrics import metrics_from_summary, vs_base_metrics
from probdiff_callback.callback.ranks import broadcast
from probdiff_callback.callback.wandb_records import WandbRecords
from probdiff_callback.core import reference_metrics
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.metric import is_finite
from probdiff_callback.core.queries import Query
from probdiff_callback.core.records import Comparison, Record, Summary
from probdiff_callback.runs.run_files import HistoryRow, probdiff_dir

logger = logging.getLogger(__name__)


class TrainerOutputs:
    def __init__(self, trainer, config: ProbDiffConfig, queries: Sequence[Query]) -> None:
        self.trainer, self.config, self.n_queries = trainer, config, len(queries)
        self.categories = sorted({q.category for q in queries if q.category is not None})
        self.reference_plan = reference_metrics.plan_references(queries)
        self._wandb = WandbRecords(config.wandb_table_rows)
        self._alerts = DisagreementAlerts()
        self.resolution_said = False

    @property
    def files_directory(self):
        """The run's ProbDiff folder (`OUTPUT_DIR/<output_subdir>`)."""
        return probdiff_dir(self.trainer.args.output_dir, self.config.output_subdir)

    @property
    def is_main(self) -> bool:
        return self.trainer.state.is_world_process_zero

    def broadcast(self, value):
        """The main process's `value` on every rank (every rank calls it)."""
        return broadcast(self.trainer.accelerator, value)

    def metrics(self, summary: Summary | None, vs_base: Comparison | None) -> dict[str, float]:
        """Every metric of one evaluation for the Trainer: eval_probdiff_*, eval_ref_* (where the queries have
        reference metrics) and eval_probdiff_vs_base_* (when the baseline is evaluated); NaN under every key for a
        failed or missing evaluation."""
        metrics = metrics_from_summary(summary, self.config.sweep, self.categories)
        reference = None if summary is None else summary.reference
        metrics.update(reference_metrics.trainer_metrics(reference, self.reference_plan))
        if self.config.baseline:
            metrics.update(vs_base_metrics(vs_base))
        if is_guarded(self.trainer.args.metric_for_best_model):
            metrics[GUARDED_KEY] = math.nan  # the guard's decision sets it (callback/best.py)
        return metrics

    @property
    def to_wandb_too(self) -> bool:
        return "wandb" in (self.trainer.args.report_to or [])

    def to_wandb(self, step: int, records: Sequence[Record] | Callable[[], Sequence[Record]]) -> None:
        """The step's histogram of d and its rows of the records table (main process; `records` may be a function
        that reads them, called only when the run reports to W&B). The scalars went through `trainer.log`: a failure
        here is logged, not raised."""
        if not self.to_wandb_too:
            return
        try:
            self._wandb.log(step, records() if callable(records) else records)
        except Exception:
            logger.exception(f"ProbDiff: logging the histogram and table of step {step} to W&B failed")

    def pick_to_wandb(self, pick: Pick, run_dir: object) -> None:
        """The run's pick in W&B's summary, where the run page shows it (main process): its step, its checkpoint (or
        none, when no checkpoint may be picked) and the line that says why."""
        if not self.to_wandb_too:
            return
        try:
            import wandb

            if wandb.run is None:
                return
            checkpoint = None if pick.step is None else f"{run_dir}/checkpoint-{pick.step}"
            wandb.run.summary["probdiff/best_step"] = pick.step
            wandb.run.summary["probdiff/best_checkpoint"] = checkpoint or "none: the base model"
            wandb.run.summary["probdiff/pick"] = pick.line() or f"{pick.metric}: step {pick.step}"
        except Exception:
            logger.exception("ProbDiff: writing the pick to W&B's summary failed")

    def say_resolution(self, baseline_confidence: float | None) -> None:
        """Once per training start (main process): how small a change in confidence these queries can show."""
        if not self.resolution_said and self.is_main:
            confidence = baseline_confidence if is_finite(baseline_confidence) else None
            logger.info(resolution_line(self.n_queries, confidence))
        self.resolution_said = True

    def say_disagreements(self, rows: Sequence[HistoryRow], picked: int | None) -> None:
        """The disagreement alarm over the history so far, at the run's pick `picked` (main process): each
        disagreement once."""
        if self.is_main:
            run_dir, config = self.trainer.args.output_dir, self.config
            self._alerts.announce(
                rows, str(run_dir), self.to_wandb_too, config.output_subdir, config.alarm_gain_share, picked
            )
