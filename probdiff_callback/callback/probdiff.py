"""ProbDiffCallback: the model being trained evaluated with ProbDiff at every evaluation or checkpoint.

The callback decides when to evaluate; the rest lives beside it: `schedule` (which queries, which steps),
`distributed` (the model in training evaluated across ranks), `evaluator` (the evaluation), `run_files` (the history,
step records and checkpoint summaries), `outputs` (metrics, W&B, the cost of evaluating) and `preemption` (a
signal's stop, which abandons an evaluation in progress).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from probdiff_callback.callback import distributed, outputs
from probdiff_callback.callback.distributed import EvaluationOutcome, evaluate_in_training, start_training_engine
from probdiff_callback.callback.outputs import CostReport
from probdiff_callback.callback.schedule import (
    check_selection_setup,
    checkpoint_to_come,
    is_scheduled_save,
    place_before_early_stopping,
    select_queries,
    triggers_before,
)
from probdiff_callback.core import reference_metrics
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.evaluator import ABANDONED
from probdiff_callback.core.metric import compare_to_base
from probdiff_callback.core.queries import queries_from
from probdiff_callback.runs.run_files import HistoryRow, Record, RunFiles, read_records

__all__ = ["EvaluationOutcome", "ProbDiffCallback", "select_queries"]

logger = logging.getLogger(__name__)


class ProbDiffCallback(TrainerCallback):
    """A [`~transformers.TrainerCallback`] that evaluates the model being trained with ProbDiff (it answers
    held-out queries, revises its answers and scores both with its own log-probabilities) before the first
    step, at every evaluation (or checkpoint save when the run does not evaluate) and at the end, and hands
    `eval_probdiff_*` metrics to the Trainer, so `metric_for_best_model="probdiff_confidence"` selects
    checkpoints and `EarlyStoppingCallback` can stop on it.

    Usage:

    ```python
    from probdiff_callback import ProbDiffCallback, ProbDiffConfig

    trainer = SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=heldout, processing_class=tokenizer)
    queries = ["Write a post about autumn in Hangzhou", "Name three rivers of China"]  # or None: eval_dataset's
    trainer.add_callback(ProbDiffCallback(trainer, queries, config=ProbDiffConfig(max_new_tokens=256)))
    trainer.train()
    ```

    Args:
        trainer (`Trainer`): the trainer whose model is evaluated (hooks receive neither it nor its accelerator).
        queries (`str`, `list` or `datasets.Dataset`, *optional*): a JSONL/JSON file of queries, a list of
            strings, chats (lists of `{role, content}`) or rows, or a dataset with a `prompt`, `messages` or
            `query` column. Defaults to the trainer's `eval_dataset`; a reference answer in the rows (the
            assistant turn, `completion` or `reference`) adds BLEU/chrF or ROUGE where the task has them.
        config (`ProbDiffConfig`, *optional*): the metric's settings and when and on how many queries it runs.
        tokenizer (*optional*): the chat tokenizer; defaults to the trainer's `processing_class`.
        preemption (`PreemptionCallback`, *optional*): when it is asked to stop, an evaluation in progress is
            abandoned, the Trainer saves a checkpoint and stops, and the step is evaluated when the run resumes.

    On several processes every rank evaluates an equal share and all ranks hand the Trainer the same metrics.
    Added with `trainer.add_callback`, it moves itself before any `EarlyStoppingCallback` when training
    begins, since early stopping reads the metric in its own `on_evaluate`.
    """

    def __init__(
        self, trainer, queries: Any = None, config: ProbDiffConfig | None = None, *, tokenizer=None, preemption=None
    ) -> None:
        self.trainer = trainer
        self.preemption = preemption
        self.config = config if config is not None else ProbDiffConfig()
        tokenizer = tokenizer if tokenizer is not None else getattr(trainer, "processing_class", None)
        self.tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor wraps the tokenizer
        if not callable(getattr(self.tokenizer, "apply_chat_template", None)):
            raise ValueError(
                "ProbDiffCallback needs the chat tokenizer: give `tokenizer=` or build the trainer with "
                "processing_class"
            )
        if queries is None:
            queries = trainer.eval_dataset
            if queries is None or isinstance(queries, dict):
                raise ValueError(
                    "ProbDiffCallback: give `queries=` (a file, a list of prompts or a Dataset); the trainer's "
                    f"eval_dataset is {'a dict of datasets' if queries is not None else 'not set'}"
                )
        all_queries = queries_from(queries)
        self.config.check_categories(q.category for q in all_queries)  # all of them: the subset may miss one
        self.queries = select_queries(all_queries, self.config.n_queries, self.config.seed)
        self.categories = sorted({q.category for q in self.queries if q.category is not None})
        self.reference_plan = reference_metrics.plan_references(self.queries)
        self.evaluated: dict[int, dict[str, float]] = {}  # global step -> its metrics
        self.last_outcome: EvaluationOutcome | None = None
        self.abandoned_step: int | None = None  # the step whose evaluation a preemption abandoned
        self._baseline_records: list[Record] | None = None
        self._baseline_due = False  # the baseline waits for the Trainer's evaluation at step 0 (eval_on_start)
        self._files = RunFiles(trainer.args.output_dir, self.config.output_subdir)  # written on the main process
        self._reference_notice_shown = False
        self._triggers = 0
        self._wandb = outputs.WandbRecords(self.config.wandb_table_rows)
        self._disagreements = outputs.DisagreementAlerts()
        self._cost = CostReport()
        self._engine = None  # vLLM (use_vllm), on the main process: started when training begins

    def cost_summary(self) -> str | None:
        """What the evaluations added to the run's time, measured (for the end of the run)."""
        return self._cost.totals()

    @property
    def _output_dir(self) -> str:
        return self.trainer.args.output_dir

    def _is_main(self) -> bool:
        return self.trainer.state.is_world_process_zero

    # ---- hooks: when to evaluate ----
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        place_before_early_stopping(self.trainer.callback_handler, self)
        check_selection_setup(args, self.config.every)
        if self.config.use_vllm and self._engine is None:
            self._engine = self._start_engine()
        self._show_reference_notice()
        kept, self._baseline_records = distributed.broadcast(self.trainer.accelerator, self._history_to_continue(state))
        self.evaluated = {row.global_step: self._metrics(row.summary, row.vs_base) for row in kept if not row.abandoned}
        self._triggers = triggers_before(args, state)
        self._complete_resumed_step(state, kept)
        self._baseline_due = self.config.baseline and state.global_step == 0 and 0 not in self.evaluated
        # With eval_on_start the Trainer evaluates step 0 next: the baseline runs in that on_evaluate, so its row is
        # written once, with the base model's eval loss. The numbers are the same either way: the evaluation draws
        # from its own seeds and leaves the training RNG as it found it.
        if self._baseline_due and not args.eval_on_start:
            self._run(state, kind="baseline", base_model=True)
        self._cost.training_started(state.global_step)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        message = self._cost.message(args, state, self.config.every)
        if message and self._is_main():
            print(message, flush=True)
        # The Trainer loads the best model before on_train_end, so the last step's weights are evaluated here,
        # when DefaultFlowCallback (which runs first) has decided this is the end.
        if (
            self.config.at_end
            and control.should_training_stop
            and not self._stopping()
            and state.global_step not in self.evaluated
            and not control.should_evaluate
            and not (args.eval_strategy == "no" and control.should_save)
        ):
            self._run(state, kind="end", checkpoint=checkpoint_to_come(args, state, control))
            self._stop_if_abandoned(state, control)

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if metrics is None:
            return
        step = state.global_step
        # The Trainer computed the eval loss before calling on_evaluate: it goes into the step's row as written.
        eval_loss = float(metrics.get("eval_loss", math.nan))
        if step == 0 and self._baseline_due:
            self._run(state, kind="baseline", base_model=True, eval_loss=eval_loss)
        elif step not in self.evaluated:
            if not self._is_due(state, control):
                return
            checkpoint = checkpoint_to_come(args, state, control)
            self._run(state, kind="evaluate", checkpoint=checkpoint, eval_loss=eval_loss)
            self._stop_if_abandoned(state, control)
        elif self._is_main():  # evaluated already: at the end of training, or the row of a resumed run
            self._files.set_eval_loss(step, eval_loss)
        metrics.update(self.evaluated[step])
        self._say_disagreements()

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        step = state.global_step
        checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        if self._stopping() and not is_scheduled_save(args, state):
            return  # the preemption's own checkpoint: an uninterrupted run neither saves nor evaluates here
        if step not in self.evaluated and args.eval_strategy == "no" and self._is_due(state, control):
            self._run(state, kind="save", checkpoint=checkpoint)  # abandoned at once when stopping: owed on resume
            self._stop_if_abandoned(state, control)
        elif step in self.evaluated and self._is_main() and os.path.isdir(checkpoint):
            self._files.link_checkpoint(step, checkpoint)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # Only when the loaded weights are still the last step's (see on_step_end), and not on a preemption's stop.
        if (
            self.config.at_end
            and not args.load_best_model_at_end
            and not self._stopping()
            and state.global_step not in self.evaluated
        ):
            self._run(state, kind="end")
        self._say_disagreements()
        self.close_engine()

    def close_engine(self) -> None:
        """Stop the vLLM server this run started (none for a server you started, or without vLLM)."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()

    def _say_disagreements(self) -> None:
        if self._is_main():
            self._disagreements.announce(
                self._files.rows(), self._output_dir, "wandb" in (self.trainer.args.report_to or [])
            )

    def _is_due(self, state: TrainerState, control: TrainerControl) -> bool:
        """Every `every`-th trigger (evaluation, or save without evaluation), and the last one with `at_end`."""
        self._triggers += 1
        final = (control.should_training_stop and not self._stopping()) or state.global_step >= state.max_steps > 0
        return self._triggers % self.config.every == 0 or (final and self.config.at_end)

    # ---- preemption ----
    def _stopping(self) -> bool:
        """The run stops for a preemption (the same answer on every rank)."""
        return self.preemption is not None and self.preemption.stopping

    def _asked_to_stop(self) -> bool:
        """This process was asked to stop: an evaluation in progress is abandoned (ranks may differ; the gathered
        error tells them all)."""
        return self.preemption is not None and self.preemption.signalled()

    def _stop_if_abandoned(self, state: TrainerState, control: TrainerControl) -> None:
        """An evaluation abandoned for a preemption: the Trainer saves this step and stops, on every rank."""
        if self.abandoned_step == state.global_step:
            control.should_save = True
            control.should_training_stop = True
            if self.preemption is not None:
                self.preemption.stopping = True

    def _complete_resumed_step(self, state: TrainerState, kept: list[HistoryRow]) -> None:
        """What the checkpoint resumed from lacks of its own step's ProbDiff evaluation, done now.

        An evaluation a preemption abandoned runs: the resumed step's (its weights are the checkpoint's) and a
        baseline of the base model; others stay failed, and the log says why. A row evaluated after its checkpoint
        was saved (by an earlier resume that was then killed) is logged again, since the Trainer's log and W&B go
        back to the checkpoint."""
        for row in kept:
            if not row.abandoned and row.global_step == state.global_step > 0 and not self._logged(state, row):
                metrics = self.evaluated[row.global_step]
                self.trainer.log(dict(metrics))
                if self._is_main() and row.records:
                    self._log_to_wandb(row.global_step, read_records(self._files.directory / row.records))
                self._update_best_model(metrics)
        for row in [row for row in kept if row.abandoned]:
            if row.global_step == state.global_step or row.base_model:
                logger.warning(f"ProbDiff: evaluating step {row.global_step}, abandoned when the run was stopped")
                outcome = self._run(state, kind=row.kind, base_model=row.base_model, checkpoint=row.checkpoint,
                                    eval_loss=row.eval_loss, step=row.global_step, epoch=row.epoch)  # fmt: skip
                if row.global_step == state.global_step and row.kind != "baseline":
                    self._update_best_model(outcome.metrics)
            else:
                why = (f"{ABANDONED} when the run stopped, and resuming from step {state.global_step} cannot run it: "
                       "the weights of its step are gone")  # fmt: skip
                logger.warning(f"ProbDiff: step {row.global_step}'s evaluation was {why}; it stays failed")
                self.evaluated[row.global_step] = self._metrics(None, None)
                if self._is_main():
                    row.error, row.abandoned = why, False
                    self._files.add(row, None)

    @staticmethod
    def _logged(state: TrainerState, row: HistoryRow) -> bool:
        return any(e.get("step") == row.global_step and "eval_probdiff_confidence" in e for e in state.log_history)

    def _update_best_model(self, metrics: dict[str, float]) -> None:
        """The Trainer's best-model record as the uninterrupted run would have set it at this step."""
        metric = self.trainer.args.metric_for_best_model or ""
        determine = getattr(self.trainer, "_determine_best_metric", None)
        key = metric if metric.startswith("eval_") else f"eval_{metric}"
        if determine is not None and key in metrics:
            determine(metrics=metrics, trial=None)

    # ---- setup ----

    def _history_to_continue(self, state: TrainerState) -> tuple[list[HistoryRow], list[Record] | None]:
        """(history rows up to the step training starts from, the baseline's records); main process only."""
        if not self._is_main():
            return [], None
        kept, dropped = self._files.continue_from(state.global_step)
        if dropped and state.global_step == 0:
            logger.warning(
                f"ProbDiff: a new run in {self._output_dir}: replacing the {dropped} rows of an earlier history"
            )
        elif dropped:
            logger.warning(
                f"ProbDiff: resumed at step {state.global_step}; dropped {dropped} history rows of later steps "
                "(they are trained and evaluated again)"
            )
        return kept, self._files.baseline_records()

    def _start_engine(self):
        """The vLLM engine of this run on the main process (None on the others); a failure to start stops training
        on every rank with the same message, before the first step."""
        from probdiff_callback.callback.distributed import broadcast

        engine, error = None, None
        if self._is_main():
            try:
                engine = start_training_engine(self.trainer, self.tokenizer, self.config)
            except Exception as err:  # noqa: BLE001 - every rank raises it below
                error = f"{type(err).__name__}: {err}"
        error = broadcast(self.trainer.accelerator, error)
        if error is not None:
            raise RuntimeError(f"ProbDiff: use_vllm=true: {error}")
        return engine

    def _show_reference_notice(self) -> None:
        notice = self.reference_plan.notice()
        if notice and not self._reference_notice_shown and self._is_main():
            print(f"ProbDiff: {notice}", flush=True)
        self._reference_notice_shown = True

    # ---- one evaluation ----
    def _run(
        self,
        state: TrainerState,
        *,
        kind: str,
        base_model: bool = False,
        checkpoint: str | None = None,
        eval_loss: float = math.nan,
        step: int | None = None,
        epoch: float | None = None,
    ) -> EvaluationOutcome:
        outcome = self.evaluate_model(base_model=base_model)
        step = state.global_step if step is None else step
        epoch = state.epoch if epoch is None else epoch
        if outcome.abandoned:
            return self._record_abandoned(step, epoch, kind, base_model, checkpoint, eval_loss, outcome)
        if kind == "baseline":
            self._baseline_due = False
            if outcome.error is None:
                self._baseline_records = outcome.records
        vs_base = None
        if kind != "baseline":
            vs_base = compare_to_base(outcome.records, self._baseline_records, self.config.delta)
        outcome.metrics = self._metrics(outcome.summary, vs_base)
        self.evaluated[step] = outcome.metrics
        self.last_outcome = outcome
        self._cost.evaluated(outcome.seconds, before_training=kind == "baseline")
        if outcome.error is not None:
            logger.error(f"ProbDiff evaluation at step {step} failed; training goes on:\n{outcome.error}")
        # Trainer.evaluate logs its metrics before on_evaluate, so ours need their own log call (W&B,
        # TensorBoard and log_history then get them at this step).
        self.trainer.log(dict(outcome.metrics))
        if self._is_main():
            self._log_to_wandb(step, outcome.records)
            row = HistoryRow(step, epoch, kind, base_model, checkpoint, summary=outcome.summary,
                             error=outcome.error, seconds=round(outcome.seconds, 3), vs_base=vs_base,
                             eval_loss=eval_loss)  # fmt: skip
            self._files.add(row, outcome.records if outcome.error is None else None)
        if outcome.error is not None and self.config.fail_on_error:
            raise RuntimeError(f"ProbDiff evaluation at step {step} failed (fail_on_error=True):\n{outcome.error}")
        return outcome

    def _record_abandoned(
        self, step: int, epoch, kind: str, base_model: bool, checkpoint: str | None, eval_loss: float, outcome
    ) -> EvaluationOutcome:
        """Not a failure: no metrics are logged, and the row says the resumed run evaluates the step."""
        outcome.metrics = self._metrics(None, None)
        self.evaluated[step] = outcome.metrics
        self.last_outcome = outcome
        self.abandoned_step = step
        logger.warning(f"ProbDiff: the evaluation of step {step} was abandoned (the run was asked to stop); "
                       "it runs when the run resumes")  # fmt: skip
        if self._is_main():
            row = HistoryRow(step, epoch, kind, base_model, checkpoint, error=f"{ABANDONED}: the run was asked to "
                             "stop; resuming evaluates this step", eval_loss=eval_loss, abandoned=True)  # fmt: skip
            self._files.add(row, None)
        return outcome

    def evaluate_model(self, *, base_model: bool = False) -> EvaluationOutcome:
        """Evaluate the current weights on the query subset, on all ranks; every rank returns the same records
        (in query order), summary, metrics and error."""
        should_stop = self._asked_to_stop if self.preemption is not None else None
        outcome = evaluate_in_training(
            self.trainer,
            self.tokenizer,
            self.queries,
            self.config,
            self.reference_plan,
            base_model,
            should_stop,
            engine=self._engine,
        )
        outcome.metrics = self._metrics(outcome.summary, None)
        return outcome

    def _log_to_wandb(self, step: int, records: list[Record]) -> None:
        if "wandb" in (self.trainer.args.report_to or []):
            try:
                self._wandb.log(step, records)
            except Exception:  # the scalars went through trainer.log; the extras are not worth the run
                logger.exception(f"ProbDiff: logging the histogram and table of step {step} to W&B failed")

    def _metrics(self, summary: dict | None, vs_base: dict | None) -> dict[str, float]:
        """Every metric of one evaluation for the Trainer: eval_probdiff_*, eval_ref_* (where the queries have
        reference metrics) and eval_probdiff_vs_base_* (when the baseline is evaluated)."""
        metrics = outputs.metrics_from_summary(summary, self.config.sweep, self.categories)
        reference = None if summary is None else summary.get("reference")
        metrics.update(reference_metrics.trainer_metrics(reference, self.reference_plan))
        if self.config.baseline:
            metrics.update(outputs.vs_base_metrics(vs_base))
        return metrics
