"""ProbDiffCallback: the model being trained evaluated with ProbDiff at every evaluation or checkpoint.

The callback decides when to evaluate and hands the outcome on; the rest lives beside it: `schedule` (which queries,
which steps), `trainer_evaluation` (the model in training evaluated across ranks, HF or vLLM writing the texts),
`core.evaluator` (the evaluation), `runs.run_files` (the history, step records and checkpoint summaries), `metrics`
(the Trainer's), `wandb_records`, `alerts` (the disagreement alarm), `cost` (what evaluating adds to the run's time)
and `preemption` (a signal's stop, which abandons an evaluation in progress), `eval_losses` (each held-out
conversation's eval loss, for the alarm's paired test). With `async_eval` the same schedule queues the steps for an
evaluator process instead, and `beside` owns the queue, the evaluator and the late results. It says everything
through `logger` or `trainer.log`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import operator
import os
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

from probdiff_callback.analysis.report import resolution_line
from probdiff_callback.callback.alerts import DisagreementAlerts
from probdiff_callback.callback.beside import BesideTraining
from probdiff_callback.callback.cost import CostReport
from probdiff_callback.callback.eval_losses import EvalLossTap, ExampleLosses, PerExampleLossUnavailable
from probdiff_callback.callback.metrics import metrics_from_summary, vs_base_metrics
from probdiff_callback.callback.ranks import broadcast
from probdiff_callback.callback.schedule import (
    EvaluationSchedule,
    check_selection_setup,
    checkpoint_to_come,
    is_scheduled_save,
    place_before_early_stopping,
    select_queries,
)
from probdiff_callback.callback.trainer_evaluation import EvaluationOutcome, evaluate_trainer_model, start_vllm
from probdiff_callback.callback.wandb_records import WandbRecords
from probdiff_callback.core import reference_metrics
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.evaluator import ABANDONED
from probdiff_callback.core.metric import compare_to_base, is_finite
from probdiff_callback.core.queries import queries_from
from probdiff_callback.core.records import Comparison, Record, Summary
from probdiff_callback.runs.run_files import EvaluationKind, HistoryRow, RunFiles, read_records

__all__ = ["EvaluationOutcome", "ProbDiffCallback", "select_queries"]

logger = logging.getLogger(__name__)


@dataclass
class CallbackState:
    """What the callback has done so far in this run."""

    evaluated: dict[int, dict[str, float]] = field(default_factory=dict)  # global step -> its metrics
    baseline_records: list[Record] | None = None  # what every later step is compared with
    baseline_due: bool = False  # the baseline waits for the Trainer's evaluation at step 0 (eval_on_start)
    abandoned_step: int | None = None  # the step whose evaluation a preemption abandoned
    last_outcome: EvaluationOutcome | None = None
    without_eval_loss: set[int] = field(default_factory=set)  # evaluated steps whose row awaits the Trainer's eval loss
    example_losses_unavailable: bool = False  # the eval batches cannot give each conversation's loss (said once)
    resolution_said: bool = False


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

    With `config.async_eval` the callback never evaluates: it queues each of these steps for an evaluator process
    (`probdiff watch`, started beside training unless `config.evaluator="external"`) and logs the results at their
    own steps when they arrive; the Trainer's metrics at its evaluation hold NaN under the ProbDiff keys until then
    (docs/async.md).

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
        self.reference_plan = reference_metrics.plan_references(self.queries)
        self.schedule = EvaluationSchedule(self.config.every, self.config.at_end)
        self.state = CallbackState()
        self._files = RunFiles(trainer.args.output_dir, self.config.output_subdir)  # written on the main process
        self._wandb = WandbRecords(self.config.wandb_table_rows)
        self._alerts = DisagreementAlerts()
        self._cost = CostReport()
        self._vllm = None  # VLLMGeneration (use_vllm), on the main process: started when training begins
        self._eval_loss_tap: EvalLossTap | None = None  # on the model when training begins
        # async_eval: the queue, the evaluator process and the late results (None: evaluated in the loop)
        self._beside = (
            BesideTraining(trainer, self.config, self.queries, self._metrics) if self.config.async_eval else None
        )

    @property
    def evaluated(self) -> dict[int, dict[str, float]]:
        """The metrics of every step evaluated so far, by global step (with async_eval: those that arrived)."""
        return self.state.evaluated if self._beside is None else self._beside.evaluated

    @property
    def categories(self) -> list[str]:
        return sorted({q.category for q in self.queries if q.category is not None})

    def cost_summary(self) -> str | None:
        """What the evaluations added to the run's time, measured (for the end of the run)."""
        return self._cost.totals() if self._beside is None else self._beside.summary()

    def _is_main(self) -> bool:
        return self.trainer.state.is_world_process_zero

    def _known(self, step: int) -> bool:
        """The step is evaluated (with async_eval: queued or evaluated): the schedule does not take it again."""
        return step in (self.evaluated if self._beside is None else self._beside.known)

    # ---- hooks: when to evaluate ----
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        place_before_early_stopping(self.trainer.callback_handler, self)
        if self._eval_loss_tap is None:  # each conversation's eval loss, from the Trainer's own evaluation passes
            self._eval_loss_tap = EvalLossTap(self.trainer.model, self.trainer.accelerator.gather_for_metrics)
        check_selection_setup(args, self.config, self.trainer.callback_handler.callbacks)
        if (notice := self.reference_plan.notice()) and self._is_main():
            logger.info(f"ProbDiff: {notice}")
        kept = self._begin_in_loop(args, state) if self._beside is None else []
        if self._beside is not None:
            self.state = CallbackState()
            self.schedule.resume(args, state)
            self._beside.begin(args, state)  # says the resolution when the baseline's result arrives
        self.state.baseline_due = self.config.baseline and state.global_step == 0 and not self._known(0)
        # With eval_on_start the Trainer evaluates step 0 next: the baseline runs in that on_evaluate, so its row is
        # written once, with the base model's eval loss. The numbers are the same either way: the evaluation draws
        # from its own seeds and leaves the training RNG as it found it.
        if self.state.baseline_due and not args.eval_on_start:
            self._evaluate(self._row(state, "baseline"))
        elif not self.state.baseline_due and self._beside is None:  # else the baseline's evaluation says it
            baseline = next((row for row in kept if row.kind == "baseline" and not row.failed), None)
            self._say_resolution(None if baseline is None else baseline.confidence)
        self._cost.training_started(state.global_step)

    def _begin_in_loop(self, args: TrainingArguments, state: TrainerState) -> list[HistoryRow]:
        """vLLM started, the history taken over and the resumed step completed; returns the history rows kept."""
        if self.config.use_vllm and self._vllm is None:
            self._vllm = self._start_vllm()
        kept, baseline_records = broadcast(self.trainer.accelerator, self._history_to_continue(state))
        self.state = CallbackState(
            evaluated={row.global_step: self._metrics(row.summary, row.vs_base) for row in kept if not row.abandoned},
            baseline_records=baseline_records,
            without_eval_loss={row.global_step for row in kept if not row.abandoned and not is_finite(row.eval_loss)},
        )
        self.schedule.resume(args, state)
        self._complete_resumed_step(state, kept)
        return kept

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # Late results between steps: a log now resets no log the Trainer has planned (its `on_log` clears
        # `should_log`, which the step's end sets)
        if self._beside is not None:
            self._beside.poll(state)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        message = self._cost.message(args, state, self.config.every)
        if message and self._is_main():
            logger.info(message)
        # The Trainer loads the best model before on_train_end, so the last step's weights are evaluated here,
        # when DefaultFlowCallback (which runs first) has decided this is the end.
        if (
            self.config.at_end
            and control.should_training_stop
            and not self._stopping()
            and not self._known(state.global_step)
            and not control.should_evaluate
            and not (args.eval_strategy == "no" and control.should_save)
        ):
            self._evaluate(
                self._row(state, "end", checkpoint=checkpoint_to_come(args, state, control)), control=control
            )
            self._stop_if_abandoned(state, control)

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        # The Trainer computed the eval loss before calling on_evaluate: it goes into the step's row as written, with
        # each conversation's (`eval_losses`, tapped from the same forward passes) beside it.
        losses = self._example_losses(metrics)
        if metrics is None:
            return
        step = state.global_step
        eval_loss = float(metrics.get("eval_loss", math.nan))
        if step == 0 and self.state.baseline_due:
            self._evaluate(self._row(state, "baseline", eval_loss=eval_loss), losses, control)
        elif not self._known(step):
            if not self.schedule.is_due(state, control, self._stopping()):
                return
            checkpoint = checkpoint_to_come(args, state, control)
            self._evaluate(self._row(state, "evaluate", checkpoint=checkpoint, eval_loss=eval_loss), losses, control)
            self._stop_if_abandoned(state, control)
        elif self._beside is None:  # evaluated already: at the end of training, or the row of a resumed run
            if step not in self.state.without_eval_loss:
                losses = None
            self.state.without_eval_loss.discard(step)
            if self._is_main():
                self._files.set_eval_loss(step, eval_loss, None if losses is None else losses.losses)
        if self._beside is not None:  # the step's own metrics arrive later: NaN, never the best, until then
            metrics.update(self._beside.placeholders(step))
            return
        metrics.update(self.evaluated[step])
        self._say_disagreements()

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        step = state.global_step
        checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        if self._beside is not None:
            self._beside.saved(args, state)  # a step queued at this step's evaluation: its checkpoint's weights
        if self._stopping() and not is_scheduled_save(args, state):
            return  # the preemption's own checkpoint: an uninterrupted run neither saves nor evaluates here
        if (
            not self._known(step)
            and args.eval_strategy == "no"
            and self.schedule.is_due(state, control, self._stopping())
        ):
            # abandoned at once when stopping: on resume
            self._evaluate(self._row(state, "save", checkpoint=checkpoint), control=control, saved_now=True)
            self._stop_if_abandoned(state, control)
        elif self._beside is None and step in self.evaluated and self._is_main() and os.path.isdir(checkpoint):
            self._files.link_checkpoint(step, checkpoint)
        if self._beside is not None:
            self._beside.poll(state)
            self._beside.rotate(args, state)
            if control.should_training_stop and not self._stopping():  # before the Trainer loads the best model
                self._beside.wait(state)
                self._beside.rewrite_trainer_state(checkpoint, state)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # Only when the loaded weights are still the last step's (see on_step_end), and not on a preemption's stop.
        if (
            self.config.at_end
            and not args.load_best_model_at_end
            and not self._stopping()
            and not self._known(state.global_step)
        ):
            self._evaluate(self._row(state, "end"))
        if self._beside is not None:
            self._beside.end(args, state, stopped=self._stopping())
            return
        self._say_disagreements()
        self.close_engine()

    def close_engine(self) -> None:
        """Stop the vLLM server this run started (none for a server you started, or without vLLM)."""
        vllm, self._vllm = self._vllm, None
        if vllm is not None:
            vllm.close()

    def _say_resolution(self, baseline_confidence: float | None) -> None:
        """Once, at the start of training: how small a change in confidence these queries can show."""
        if not self.state.resolution_said and self._is_main():
            logger.info(resolution_line(len(self.queries), baseline_confidence))
        self.state.resolution_said = True

    def on_predict(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if self._eval_loss_tap is not None:  # a prediction's forward passes are no evaluation's
            with contextlib.suppress(PerExampleLossUnavailable):
                self._eval_loss_tap.take()

    def _example_losses(self, metrics: dict[str, float] | None) -> ExampleLosses | None:
        """Each eval conversation's loss from the evaluation the Trainer just ran (the tap's, taken either way);
        None without the Trainer's eval loss, or when the batches do not allow it (said once)."""
        if self._eval_loss_tap is None:
            return None
        try:
            losses = self._eval_loss_tap.take()
        except PerExampleLossUnavailable as why:  # the batches' layout: the same on every rank
            if not metrics or "eval_loss" not in metrics or self.state.example_losses_unavailable:
                return None
            self.state.example_losses_unavailable = True
            if self._is_main():
                logger.warning(
                    f"ProbDiff: no eval loss per conversation ({why}); the disagreement alarm cannot grade changes of "
                    "the eval loss"
                )
            return None
        return losses if metrics and "eval_loss" in metrics else None

    def _say_disagreements(self) -> None:
        if self._is_main():
            to_wandb = "wandb" in (self.trainer.args.report_to or [])
            self._alerts.announce(self._files.rows(), self.trainer.args.output_dir, to_wandb, self.config.output_subdir)

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
        if self.state.abandoned_step == state.global_step:
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
                outcome = self._run(dataclasses.replace(row, error=None, abandoned=False))
                if row.global_step == state.global_step and row.kind != "baseline":
                    self._update_best_model(outcome.metrics)
                continue
            why = (
                f"{ABANDONED} when the run stopped, and resuming from step {state.global_step} cannot run it: the "
                "weights of its step are gone"
            )
            logger.warning(f"ProbDiff: step {row.global_step}'s evaluation was {why}; it stays failed")
            self.evaluated[row.global_step] = self._metrics(None, None)
            if self._is_main():
                self._files.add(dataclasses.replace(row, error=why, abandoned=False), None)

    @staticmethod
    def _logged(state: TrainerState, row: HistoryRow) -> bool:
        return any(e.get("step") == row.global_step and "eval_probdiff_confidence" in e for e in state.log_history)

    def _update_best_model(self, metrics: dict[str, float]) -> None:
        """The Trainer's best-model record as the uninterrupted run would have set it at this step."""
        record_best_metric(self.trainer.state, self.trainer.args, metrics)

    # ---- setup ----
    def _history_to_continue(self, state: TrainerState) -> tuple[list[HistoryRow], list[Record] | None]:
        """(history rows up to the step training starts from, the baseline's records); main process only."""
        if not self._is_main():
            return [], None
        kept, dropped = self._files.continue_from(state.global_step)
        if dropped and state.global_step == 0:
            logger.warning(
                f"ProbDiff: a new run in {self.trainer.args.output_dir}: replacing the {dropped} rows of an earlier "
                "history"
            )
        elif dropped:
            logger.warning(
                f"ProbDiff: resumed at step {state.global_step}; dropped {dropped} history rows of later steps "
                "(they are trained and evaluated again)"
            )
        return kept, self._files.baseline_records()

    def _start_vllm(self):
        """The vLLM of this run on the main process (None on the others); a failure to start stops training on every
        rank with the same message, before the first step."""
        vllm, error = None, None
        if self._is_main():
            try:
                vllm = start_vllm(self.trainer, self.tokenizer, self.config)
            except Exception as err:  # noqa: BLE001 - every rank raises it below
                error = f"{type(err).__name__}: {err}"
        error = broadcast(self.trainer.accelerator, error)
        if error is not None:
            raise RuntimeError(f"ProbDiff: use_vllm=true: {error}")
        return vllm

    # ---- one evaluation ----
    @staticmethod
    def _row(
        state: TrainerState, kind: EvaluationKind, checkpoint: str | None = None, eval_loss: float = math.nan
    ) -> HistoryRow:
        """The row of the step being evaluated, before its evaluation fills it."""
        return HistoryRow(state.global_step, state.epoch, kind, kind == "baseline", checkpoint, eval_loss=eval_loss)

    def _evaluate(
        self,
        row: HistoryRow,
        example_losses: ExampleLosses | None = None,
        control: TrainerControl | None = None,
        saved_now: bool = False,
    ) -> None:
        """The step of `row` evaluated in the loop (`_run`), or with async_eval queued for the evaluator (`control`: the
        Trainer's, which says whether a checkpoint of the step is to come; `saved_now`: it is on disk, this is its
        on_save)."""
        if self._beside is None:
            self._run(row, example_losses)
            return
        self._beside.queue(row, example_losses, self.trainer.args, control, saved_now)
        if row.kind == "baseline":
            self.state.baseline_due = False

    def _run(self, row: HistoryRow, example_losses: ExampleLosses | None = None) -> EvaluationOutcome:
        """Evaluate for `row` (its step, kind and checkpoint), then hand the outcome, with the step's eval loss of
        each conversation where the Trainer evaluated it, to the Trainer, W&B and the run's files."""
        outcome = self.evaluate_model(base_model=row.base_model)
        self.state.last_outcome = outcome
        if outcome.abandoned:
            return self._record_abandoned(row, outcome, example_losses)
        if row.kind == "baseline":
            self.state.baseline_due = False
            if outcome.error is None:
                self.state.baseline_records = outcome.records
            self._say_resolution(None if outcome.summary is None else outcome.summary.confidence)
        else:
            row.vs_base = compare_to_base(outcome.records, self.state.baseline_records, self.config.delta)
        outcome.metrics = self._metrics(outcome.summary, row.vs_base)
        self.evaluated[row.global_step] = outcome.metrics
        if not is_finite(row.eval_loss):
            self.state.without_eval_loss.add(row.global_step)
        seconds = outcome.seconds + (example_losses.seconds if example_losses is not None else 0.0)
        self._cost.evaluated(seconds, outcome.cost, before_training=row.kind == "baseline")
        if outcome.error is not None:
            logger.error(f"ProbDiff evaluation at step {row.global_step} failed; training goes on:\n{outcome.error}")
        # Trainer.evaluate logs its metrics before on_evaluate, so ours need their own log call (W&B,
        # TensorBoard and log_history then get them at this step).
        self.trainer.log(dict(outcome.metrics))
        if self._is_main():
            self._log_to_wandb(row.global_step, outcome.records)
            row.summary, row.error, row.seconds = outcome.summary, outcome.error, round(outcome.seconds, 3)
            row.cost = outcome.cost
            self._files.add(
                row,
                outcome.records if outcome.error is None else None,
                None if example_losses is None else example_losses.losses,
            )
        if outcome.error is not None and self.config.fail_on_error:
            raise RuntimeError(
                f"ProbDiff evaluation at step {row.global_step} failed (fail_on_error=True):\n{outcome.error}"
            )
        return outcome

    def _record_abandoned(
        self, row: HistoryRow, outcome: EvaluationOutcome, example_losses: ExampleLosses | None
    ) -> EvaluationOutcome:
        """Not a failure: no metrics are logged, and the row says the resumed run evaluates the step; it keeps the
        step's eval loss, and each conversation's (the resumed run does not compute them again)."""
        outcome.metrics = self._metrics(None, None)
        self.evaluated[row.global_step] = outcome.metrics
        self.state.abandoned_step = row.global_step
        logger.warning(
            f"ProbDiff: the evaluation of step {row.global_step} was abandoned (the run was asked to stop); it runs "
            "when the run resumes"
        )
        if self._is_main():
            row.error = f"{ABANDONED}: the run was asked to stop; resuming evaluates this step"
            row.abandoned = True
            self._files.add(row, None, None if example_losses is None else example_losses.losses)
        return outcome

    def evaluate_model(self, *, base_model: bool = False) -> EvaluationOutcome:
        """Evaluate the current weights on the query subset, on all ranks; every rank returns the same records
        (in query order), summary, metrics and error."""
        outcome = evaluate_trainer_model(
            self.trainer,
            self.tokenizer,
            self.queries,
            self.config,
            self.reference_plan,
            base_model,
            self._asked_to_stop if self.preemption is not None else None,
            vllm=self._vllm,
        )
        outcome.metrics = self._metrics(outcome.summary, None)
        return outcome

    def _log_to_wandb(self, step: int, records: list[Record]) -> None:
        if "wandb" in (self.trainer.args.report_to or []):
            try:
                self._wandb.log(step, records)
            except Exception:  # the scalars went through trainer.log; the extras are not worth the run
                logger.exception(f"ProbDiff: logging the histogram and table of step {step} to W&B failed")

    def _metrics(self, summary: Summary | None, vs_base: Comparison | None) -> dict[str, float]:
        """Every metric of one evaluation for the Trainer: eval_probdiff_*, eval_ref_* (where the queries have
        reference metrics) and eval_probdiff_vs_base_* (when the baseline is evaluated)."""
        metrics = metrics_from_summary(summary, self.config.sweep, self.categories)
        reference = None if summary is None else summary.reference
        metrics.update(reference_metrics.trainer_metrics(reference, self.reference_plan))
        if self.config.baseline:
            metrics.update(vs_base_metrics(vs_base))
        return metrics


def record_best_metric(state: TrainerState, args: TrainingArguments, metrics: dict[str, float]) -> None:
    """`state.best_metric` and `state.best_global_step` after an evaluation's `metrics`, set as the Trainer sets them
    after its own evaluations (transformers 5): the metric named by `metric_for_best_model` (`eval_` added) beats the
    best so far by `greater_is_better` (NaN never does); the step is kept where checkpoints are saved by steps, epochs
    or best, and the Trainer's next save names its checkpoint `best_model_checkpoint`. Nothing without that metric."""
    name = args.metric_for_best_model
    if name is None:
        return
    key = name if name.startswith("eval_") else f"eval_{name}"
    if key not in metrics:
        return
    if state.best_metric is None:
        state.best_metric = -math.inf if args.greater_is_better else math.inf
    better = operator.gt if args.greater_is_better else operator.lt
    if better(metrics[key], state.best_metric):
        state.best_metric = metrics[key]
        if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST):
            state.best_global_step = state.global_step
