"""ProbDiffCallback: the model being trained evaluated with ProbDiff at every evaluation or checkpoint.

The callback decides when to evaluate; the rest lives beside it: `evaluator` (the evaluation), `distributed`
(shares across ranks), `unwrap` (the model ready to generate mid-training), `run_files` (the history, step records
and checkpoint summaries), `outputs` (metrics, W&B) and `cost` (what evaluating adds to the run's time).
"""

from __future__ import annotations

import logging
import math
import os
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import EarlyStoppingCallback, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from probdiff_callback import distributed, outputs, reference_metrics
from probdiff_callback.analysis.disagreement import Disagreement, format_disagreements
from probdiff_callback.config import ProbDiffConfig
from probdiff_callback.distributed import model_for_evaluation
from probdiff_callback.evaluator import evaluate
from probdiff_callback.faults import ABANDONED
from probdiff_callback.metric import compare_to_base, summarize
from probdiff_callback.outputs import CostReport
from probdiff_callback.queries import Query, fixed_subset, queries_from
from probdiff_callback.run_files import HistoryRow, Record, RunFiles

logger = logging.getLogger(__name__)


@dataclass
class EvaluationOutcome:
    records: list[dict]
    summary: dict | None
    error: str | None
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    abandoned: bool = False  # given up for a preemption: not a failure, the resumed run evaluates the step


def select_queries(queries: Sequence[Query], n_queries: int | None, seed: int) -> list[Query]:
    """The fixed subset evaluated at every step: `n_queries` drawn once with `seed`, in their order."""
    if not queries:
        raise ValueError("ProbDiffCallback needs at least one held-out query")
    ids = [q.id for q in queries]
    if len(set(ids)) != len(ids):
        raise ValueError("query ids must be unique: evaluations are compared query by query")
    return fixed_subset(queries, n_queries, seed)


def triggers_before(args: TrainingArguments, state: TrainerState) -> int:
    """The evaluations (or saves, when the run does not evaluate) the Trainer made before `state.global_step`: a
    resumed run counts on from there, so `every` picks the steps an uninterrupted run picks."""
    strategy, interval = (
        (args.eval_strategy, state.eval_steps) if args.eval_strategy != "no" else (args.save_strategy, state.save_steps)
    )
    if strategy == "steps" and interval:
        return state.global_step // int(interval)
    if strategy == "epoch":
        return int(state.epoch or 0)
    return 0


def is_scheduled_save(args: TrainingArguments, state: TrainerState) -> bool:
    """Whether the Trainer saves at this step by its schedule (and not only because a preemption asked)."""
    if state.global_step >= state.max_steps > 0:
        return True
    if args.save_strategy == "steps" and state.save_steps:
        return state.global_step % int(state.save_steps) == 0
    if args.save_strategy == "epoch":
        return abs((state.epoch or 0) - round(state.epoch or 0)) < 1e-6
    return False


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
        self._disagreements_said: set[Disagreement] = set()
        self._cost = CostReport()

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
        self._place_before_early_stopping()
        self._check_selection_setup(args)
        self._show_reference_notice()
        kept, self._baseline_records = distributed.broadcast(self.trainer.accelerator, self._history_to_continue(state))
        self.evaluated = {row.global_step: self._metrics(row.summary, row.vs_base) for row in kept if not row.abandoned}
        self._triggers = triggers_before(args, state)
        self._finish_abandoned(state, [row for row in kept if row.abandoned])
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
            self._run(state, kind="end", checkpoint=self._checkpoint_to_come(args, state, control))
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
            checkpoint = self._checkpoint_to_come(args, state, control)
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

    def _say_disagreements(self) -> None:
        """As soon as an independent measure moves against ProbDiff: a warning on the console and a W&B alert."""
        from probdiff_callback.analysis.select import disagreements

        if not self._is_main():
            return
        found = disagreements(self._files.rows(), self._output_dir)
        new = [d for d in found if d not in self._disagreements_said]
        if not new:
            return
        self._disagreements_said.update(new)
        text = format_disagreements(new, self._output_dir)
        logger.warning(text)
        if "wandb" in (self.trainer.args.report_to or []):
            try:
                outputs.alert_wandb("ProbDiff disagrees with an independent measure", text)
            except Exception:  # the console has it; a failed alert is not worth the run
                logger.exception("ProbDiff: sending the disagreement to W&B failed")

    @staticmethod
    def _checkpoint_to_come(args: TrainingArguments, state: TrainerState, control: TrainerControl) -> str | None:
        """The checkpoint the Trainer saves right after this hook, named in the step's row from the start (readers
        check that it exists). With `save_strategy="best"` the Trainer decides after on_evaluate: on_save names it."""
        if not control.should_save:
            return None
        return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")

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

    def _finish_abandoned(self, state: TrainerState, rows: list[HistoryRow]) -> None:
        """Evaluate the steps whose evaluation a preemption abandoned: the resumed step (its weights are the
        checkpoint's) and a baseline of the base model. Others stay failed, and the log says why."""
        for row in rows:
            if row.global_step == state.global_step or row.base_model:
                logger.warning(f"ProbDiff: evaluating step {row.global_step}, abandoned when the run was stopped")
                outcome = self._run(state, kind=row.kind, base_model=row.base_model, checkpoint=row.checkpoint,
                                    eval_loss=row.eval_loss, step=row.global_step, epoch=row.epoch)  # fmt: skip
                if row.global_step == state.global_step and row.kind != "baseline":
                    self._update_best_model(outcome.metrics)
            else:
                logger.warning(
                    f"ProbDiff: step {row.global_step}'s evaluation was abandoned when the run stopped and its "
                    f"weights are gone (resumed at step {state.global_step}): it stays failed"
                )
                self.evaluated[row.global_step] = self._metrics(None, None)

    def _update_best_model(self, metrics: dict[str, float]) -> None:
        """The Trainer's best-model record as the uninterrupted run would have set it at this step."""
        metric = self.trainer.args.metric_for_best_model or ""
        determine = getattr(self.trainer, "_determine_best_metric", None)
        key = metric if metric.startswith("eval_") else f"eval_{metric}"
        if determine is not None and key in metrics:
            determine(metrics=metrics, trial=None)

    # ---- setup ----
    def _place_before_early_stopping(self) -> None:
        handler = self.trainer.callback_handler
        callbacks = list(handler.callbacks)
        if self not in callbacks:
            return
        early = [i for i, cb in enumerate(callbacks) if isinstance(cb, EarlyStoppingCallback)]
        mine = callbacks.index(self)
        if early and early[0] < mine:
            callbacks.insert(early[0], callbacks.pop(mine))
            # A new list, not an in-place edit: the handler may be iterating over the old one right now.
            handler.callbacks = callbacks
            logger.info(
                "ProbDiff: moved ProbDiffCallback before EarlyStoppingCallback so early stopping sees its metric"
            )

    def _check_selection_setup(self, args: TrainingArguments) -> None:
        metric = args.metric_for_best_model or ""
        if metric.removeprefix("eval_").startswith(("probdiff_", "ref_")) and args.eval_strategy != "no":
            if self.config.every != 1:
                raise ValueError(
                    f"metric_for_best_model={metric!r} needs ProbDiff at every evaluation, but "
                    f"every={self.config.every}: set every=1 and space evaluations with eval_steps instead"
                )

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
        accelerator = self.trainer.accelerator
        sharded = distributed.is_zero3(accelerator) and not self.config.gather_params
        started = time.perf_counter()

        def evaluate_share(queries: list[Query]) -> list[dict]:
            with model_for_evaluation(
                self.trainer, gather_params=self.config.gather_params, base_model=base_model
            ) as model:
                return evaluate(
                    model,
                    self.tokenizer,
                    queries,
                    self.config,
                    progress=self.config.progress and accelerator.is_main_process,
                    synced_gpus=sharded,
                    sync_n_chunks=distributed.max_over_ranks(accelerator.device) if sharded else None,
                    should_stop=self._asked_to_stop if self.preemption is not None else None,
                )

        records, error = distributed.evaluate_sharded(accelerator, self.queries, evaluate_share)
        summary = None
        if error is not None and ABANDONED in error:
            return EvaluationOutcome([], None, error, time.perf_counter() - started, abandoned=True)
        if error is None:
            try:  # deterministic on the gathered records: every rank fails alike or not at all
                if self.reference_plan.active:
                    records = reference_metrics.score_records(records, self.queries)
                summary = summarize(records, self.config.delta, self.config.sweep)
                reference = reference_metrics.summarize_references(records)
                if reference is not None:
                    summary["reference"] = reference
            except Exception:
                error, records = f"summary: {traceback.format_exc()}", []
        seconds = time.perf_counter() - started
        return EvaluationOutcome(records, summary, error, seconds, metrics=self._metrics(summary, None))

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
