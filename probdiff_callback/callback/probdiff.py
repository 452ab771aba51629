"""ProbDiffCallback: the model being trained evaluated with ProbDiff at every evaluation or checkpoint.

The callback decides when a step is evaluated (`schedule`) and hands it to its way of evaluating, chosen once:
`InLoop` (`in_loop`: training waits while every rank evaluates its share) or, with `async_eval`, `BesideTraining`
(`probdiff_callback.beside`: the step is queued for an evaluator process and its result logged when it arrives).
Both land their results through `outputs` (the Trainer's metrics, W&B, the resolution line, the disagreement alarm).
Beside them: `eval_losses` (each held-out conversation's eval loss, tapped from the Trainer's own evaluation, for the
alarm's paired test) and `preemption` (a signal's stop).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import Any, Protocol

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from probdiff_callback.callback.beside.spec import whole_weights_problem
from probdiff_callback.callback.beside.training import BesideTraining
from probdiff_callback.callback.best import TrainerBest
from probdiff_callback.callback.eval_losses import EvalLossTap, ExampleLosses, PerExampleLossUnavailable
from probdiff_callback.callback.in_loop import InLoop
from probdiff_callback.callback.outputs import TrainerOutputs
from probdiff_callback.callback.schedule import (
    EvaluationSchedule,
    checkpoint_to_come,
    is_scheduled_save,
    place_before_early_stopping,
    select_queries,
    selection_setup_problem,
)
from probdiff_callback.callback.trainer_evaluation import EvaluationOutcome
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.queries import queries_from
from probdiff_callback.runs.run_files import EvaluationKind, HistoryRow, write_selection

__all__ = ["EvaluationOutcome", "ProbDiffCallback", "select_queries"]

logger = logging.getLogger(__name__)


class EvaluationWay(Protocol):
    """How the callback's scheduled steps are evaluated: `InLoop` or `BesideTraining`. Every rank calls the same
    methods at the same hooks."""

    evaluated: dict[int, dict[str, float]]  # step -> its metrics, for the steps whose result is known

    def begin(self, args: TrainingArguments, state: TrainerState) -> None:
        """Training begins (or resumes at `state.global_step`): take the run's history over."""

    def known(self, step: int) -> bool:
        """The step is evaluated (or on its way): the schedule does not take it again."""

    def history(self) -> list[HistoryRow]:
        """The run's history rows so far (main process)."""

    def evaluate(
        self, row: HistoryRow, eval_losses: list[float] | None, control: TrainerControl | None, saved_now: bool = False
    ) -> None:
        """An evaluation step: the step of `row`, with each held-out conversation's eval loss where the Trainer has
        them (`control`: whether a checkpoint of the step is to come; `saved_now`: it is on disk, this is its save)."""

    def evaluated_before(self, step: int, eval_loss: float, eval_losses: list[float] | None) -> None:
        """The Trainer evaluated a step this way took earlier."""

    def metrics_at_evaluation(self, step: int) -> dict[str, float]:
        """The ProbDiff metrics the Trainer gets at its evaluation of a step this way took."""

    def between_steps(self, args: TrainingArguments, state: TrainerState) -> None:
        """Between two training steps."""

    def saved(self, args: TrainingArguments, state: TrainerState) -> None:
        """The Trainer saved this step's checkpoint (before anything is evaluated at that save)."""

    def after_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, stopping: bool) -> None:
        """After a save and what was evaluated at it (`stopping`: training stops for a stop signal)."""

    def end(self, args: TrainingArguments, state: TrainerState, stopped: bool) -> None:
        """Training ends, or stops for a stop signal (`stopped`)."""

    def summary(self) -> str | None:
        """What evaluating cost the run, for its end."""


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
        self.schedule = EvaluationSchedule(self.config.every, self.config.at_end)
        self.outputs = TrainerOutputs(trainer, self.config, self.queries)
        self.best = TrainerBest(trainer, self.config, self.outputs)  # the Trainer's best, decided for both ways
        # the way of evaluating, chosen once; `evaluate_model` evaluates in the loop whatever the way
        self.in_loop = InLoop(trainer, self.tokenizer, self.config, self.queries, self.outputs, self.best, preemption)
        beside = self.config.async_eval
        self.way: EvaluationWay = (
            BesideTraining(trainer, self.config, self.queries, self.outputs, self.best) if beside else self.in_loop
        )
        self.baseline_due = False  # the baseline waits for the Trainer's evaluation at step 0 (eval_on_start)
        self._eval_loss_tap: EvalLossTap | None = None  # on the model when training begins
        self._example_losses_unavailable = False  # the eval batches cannot give each conversation's loss (said once)

    @property
    def evaluated(self) -> dict[int, dict[str, float]]:
        """The metrics of every step evaluated so far, by global step (with async_eval: those that arrived)."""
        return self.way.evaluated

    @property
    def categories(self) -> list[str]:
        return self.outputs.categories

    def cost_summary(self) -> str | None:
        """What the evaluations cost the run, measured (for its end)."""
        return self.way.summary()

    def _is_main(self) -> bool:
        return self.trainer.state.is_world_process_zero

    def setup_problem(self, args: TrainingArguments) -> str | None:
        """Why training cannot start with this callback (a selection its metric cannot drive; async_eval under ZeRO-3
        without whole weights at a save), or None. Checked when training begins; train/sft.py asks before, so that its
        user reads one line instead of a traceback from every rank."""
        callbacks = self.trainer.callback_handler.callbacks
        if problem := selection_setup_problem(args, self.config, callbacks):
            return problem
        return whole_weights_problem(self.trainer.accelerator) if self.config.async_eval else None

    # ---- hooks: when to evaluate ----
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        place_before_early_stopping(self.trainer.callback_handler, self)
        if self._eval_loss_tap is None:  # each conversation's eval loss, from the Trainer's own evaluation passes
            self._eval_loss_tap = EvalLossTap(self.trainer.model, self.trainer.accelerator.gather_for_metrics)
        if problem := self.setup_problem(args):
            raise ValueError(problem)
        if (notice := self.outputs.reference_plan.notice()) and self._is_main():
            logger.info(f"ProbDiff: {notice}")
        self.outputs.resolution_said = False
        self.schedule.resume(args, state)
        self.way.begin(args, state)
        # what the run selects by, for `probdiff select`; the pick over the history taken over (a resumed run's)
        if self._is_main():
            folder = self.outputs.files_directory
            write_selection(folder, args.metric_for_best_model, args.greater_is_better, self.config.alarm_gain_share)
        self.best.decide(self.way.history() if self._is_main() else None)
        self.best.apply()
        self.baseline_due = self.config.baseline and state.global_step == 0 and not self.way.known(0)
        # With eval_on_start the Trainer evaluates step 0 next: the baseline runs in that on_evaluate, so its row is
        # written once, with the base model's eval loss. The numbers are the same either way: the evaluation draws
        # from its own seeds and leaves the training RNG as it found it.
        if self.baseline_due and not args.eval_on_start:
            self._evaluate(self._row(state, "baseline"))

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # Between steps: a log now resets no log the Trainer has planned (its `on_log` clears `should_log`, which the
        # step's end sets)
        self.way.between_steps(args, state)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        # The Trainer loads the best model before on_train_end, so the last step's weights are evaluated here,
        # when DefaultFlowCallback (which runs first) has decided this is the end.
        if (
            self.config.at_end
            and control.should_training_stop
            and not self._stopping()
            and not self.way.known(state.global_step)
            and not control.should_evaluate
            and not (args.eval_strategy == "no" and control.should_save)
        ):
            self._evaluate(
                self._row(state, "end", checkpoint=checkpoint_to_come(args, state, control)), control=control
            )

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
        if step == 0 and self.baseline_due:
            self._evaluate(self._row(state, "baseline", eval_loss=eval_loss), losses, control)
        elif not self.way.known(step):
            if not self.schedule.is_due(state, control, self._stopping()):
                return
            checkpoint = checkpoint_to_come(args, state, control)
            self._evaluate(self._row(state, "evaluate", checkpoint=checkpoint, eval_loss=eval_loss), losses, control)
        else:  # evaluated already: at the end of training, or the row of a resumed run
            self.way.evaluated_before(step, eval_loss, None if losses is None else losses.losses)
        # beside training the step's own metrics arrive later: NaN, never the best, until then
        metrics.update(self.way.metrics_at_evaluation(step))
        # the Trainer compares the step's metric with its best next: the state at the pick over the other steps
        self.best.before_trainer_compares(step, metrics)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.way.saved(args, state)
        if self._stopping() and not is_scheduled_save(args, state):
            return  # the preemption's own checkpoint: an uninterrupted run neither saves nor evaluates here
        if (
            not self.way.known(state.global_step)
            and args.eval_strategy == "no"
            and self.schedule.is_due(state, control, self._stopping())
        ):
            # abandoned at once when stopping: on resume
            checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            self._evaluate(self._row(state, "save", checkpoint=checkpoint), control=control, saved_now=True)
        self.way.after_save(args, state, control, self._stopping())

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # Only when the loaded weights are still the last step's (see on_step_end), and not on a preemption's stop.
        if (
            self.config.at_end
            and not args.load_best_model_at_end
            and not self._stopping()
            and not self.way.known(state.global_step)
        ):
            self._evaluate(self._row(state, "end"))
        self.way.end(args, state, stopped=self._stopping())
        if args.load_best_model_at_end and not self._stopping():
            self.best.at_train_end(self.trainer.model)

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
            if not metrics or "eval_loss" not in metrics or self._example_losses_unavailable:
                return None
            self._example_losses_unavailable = True
            if self._is_main():
                logger.warning(
                    f"ProbDiff: no eval loss per conversation ({why}); the disagreement alarm cannot grade changes of "
                    "the eval loss"
                )
            return None
        return losses if metrics and "eval_loss" in metrics else None

    def _stopping(self) -> bool:
        """The run stops for a preemption (the same answer on every rank)."""
        return self.preemption is not None and self.preemption.stopping

    # ---- one step ----
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
        """The step of `row` handed to the way of evaluating."""
        if row.kind == "baseline":
            self.baseline_due = False
        self.way.evaluate(row, None if example_losses is None else example_losses.losses, control, saved_now)

    def evaluate_model(self, *, base_model: bool = False) -> EvaluationOutcome:
        """Evaluate the current weights on the query subset, on all ranks, in the loop (whatever the way); every
        rank returns the same records (in query order), summary, metrics and error."""
        return self.in_loop.evaluate_model(base_model=base_model)
