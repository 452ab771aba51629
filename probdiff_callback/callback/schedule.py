"""When the callback evaluates, and on what: the fixed query subset, which of the Trainer's evaluations (or saves) it
runs at (`EvaluationSchedule`, which a resumed run continues), the Trainer's own save schedule, and the callback's
place before early stopping."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from transformers import EarlyStoppingCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.queries import Query, fixed_subset

logger = logging.getLogger(__name__)


def select_queries(queries: Sequence[Query], n_queries: int | None, seed: int) -> list[Query]:
    """The fixed subset evaluated at every step: `n_queries` drawn once with `seed`, in their order."""
    if not queries:
        raise ValueError("ProbDiffCallback needs at least one held-out query")
    ids = [q.id for q in queries]
    if len(set(ids)) != len(ids):
        raise ValueError("query ids must be unique: evaluations are compared query by query")
    return fixed_subset(queries, n_queries, seed)


class EvaluationSchedule:
    """Every `every`-th trigger (an evaluation, or a save when the run does not evaluate), and the last one with
    `at_end`. A resumed run counts on from the triggers before its step, so it picks the steps an uninterrupted run
    picks."""

    def __init__(self, every: int, at_end: bool) -> None:
        self.every, self.at_end, self.triggers = every, at_end, 0

    def resume(self, args: TrainingArguments, state: TrainerState) -> None:
        self.triggers = triggers_before(args, state)

    def is_due(self, state: TrainerState, control: TrainerControl, stopping: bool) -> bool:
        """Whether this trigger is evaluated; `stopping`: a preemption ends the run (its last step is no end)."""
        self.triggers += 1
        final = (control.should_training_stop and not stopping) or state.global_step >= state.max_steps > 0
        return self.triggers % self.every == 0 or (final and self.at_end)


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


def checkpoint_to_come(args: TrainingArguments, state: TrainerState, control: TrainerControl) -> str | None:
    """The checkpoint the Trainer saves right after this hook, named in the step's row from the start (readers
    check that it exists). With `save_strategy="best"` the Trainer decides after on_evaluate: on_save names it."""
    if not control.should_save:
        return None
    return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")


def place_before_early_stopping(handler, callback) -> None:
    """Early stopping reads the metric in its own `on_evaluate`: `callback` has to run before it."""
    callbacks = list(handler.callbacks)
    if callback not in callbacks:
        return
    early = [i for i, cb in enumerate(callbacks) if isinstance(cb, EarlyStoppingCallback)]
    mine = callbacks.index(callback)
    if early and early[0] < mine:
        callbacks.insert(early[0], callbacks.pop(mine))
        # A new list, not an in-place edit: the handler may be iterating over the old one right now.
        handler.callbacks = callbacks
        logger.info("ProbDiff: moved ProbDiffCallback before EarlyStoppingCallback so early stopping sees its metric")


def selection_setup_problem(
    args: TrainingArguments, config: ProbDiffConfig, callbacks: Sequence[object] = ()
) -> str | None:
    """Selecting checkpoints by a ProbDiff metric needs that metric at every evaluation (the rule is the config's, so
    a recipe states it the same way); with `async_eval` it arrives after the evaluation, so what decides at the
    evaluation itself (`save_strategy="best"`, an `EarlyStoppingCallback` among `callbacks`) cannot use it. Why
    not, or None."""
    problem = config.selection_problem(args.metric_for_best_model) if args.eval_strategy != "no" else None
    if problem is None and config.async_eval:
        problem = beside_selection_problem(args, callbacks)
    return problem


def check_selection_setup(args: TrainingArguments, config: ProbDiffConfig, callbacks: Sequence[object] = ()) -> None:
    """`selection_setup_problem` as a ValueError."""
    if (problem := selection_setup_problem(args, config, callbacks)) is not None:
        raise ValueError(problem)


def beside_selection_problem(args: TrainingArguments, callbacks: Sequence[object]) -> str | None:
    """Why `metric_for_best_model` cannot decide at the Trainer's evaluation with async_eval, or None."""
    metric = args.metric_for_best_model or ""
    if not metric.removeprefix("eval_").startswith(("probdiff_", "ref_")):
        return None
    later = "with async_eval=true it arrives after the evaluation, from the evaluator"
    if args.save_strategy == "best":
        return (
            f'metric_for_best_model={metric} with save_strategy="best" needs the metric at the evaluation, but '
            f'{later}: use save_strategy="steps" (the best checkpoint is still kept and loaded), or async_eval=false'
        )
    if any(isinstance(callback, EarlyStoppingCallback) for callback in callbacks):
        return (
            f"EarlyStoppingCallback on metric_for_best_model={metric} needs the metric at the evaluation, but {later}: "
            "stop early on eval_loss, or set async_eval=false"
        )
    return None
