"""Late results: a step's evaluation that arrives while training is further on lands where the loop's would have, at
its own step: the Trainer's log (and every `report_to`) and the best-model record.

The metric the Trainer selects by does not exist yet when it evaluates: its metrics get NaN under every ProbDiff key
(`_determine_best_metric` raises on a missing key, and NaN is never best), and the late result sets `best_metric`,
`best_global_step` and `best_model_checkpoint` as the Trainer would have set them had the result come in time.
"""

from __future__ import annotations

import contextlib
import operator
import os
from collections.abc import Iterable, Iterator, Mapping

from transformers import Trainer, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

from probdiff_callback.core.metric import is_finite


@contextlib.contextmanager
def at_step(state: TrainerState, step: int, epoch: float | None) -> Iterator[None]:
    """The Trainer's state at `step` for a call that logs there (`trainer.log` stamps the state's step and epoch)."""
    saved = state.global_step, state.epoch
    state.global_step, state.epoch = step, epoch
    try:
        yield
    finally:
        state.global_step, state.epoch = saved


def move_into_step_order(log_history: list[dict], entry_index: int = -1) -> None:
    """The entry logged last put among the others by its step (after those of the same step)."""
    entry = log_history.pop(entry_index)
    position = next((i for i, e in enumerate(log_history) if e.get("step", 0) > entry["step"]), len(log_history))
    log_history.insert(position, entry)


def log_at_step(trainer, step: int, epoch: float | None, metrics: Mapping[str, float], may_be_best: bool) -> None:
    """A step's metrics through the Trainer's own `log` at that step, placed among that step's entries of the log
    history; then the best-model record (`may_be_best`: not for the baseline, which is no checkpoint; `probdiff
    select` ranks the training steps only). A subclass's additions to `log` (trl's training metrics gathered since its
    last log) stay for the Trainer's next log, at its own step."""
    with at_step(trainer.state, step, epoch):
        Trainer.log(trainer, dict(metrics))
    move_into_step_order(trainer.state.log_history)
    if may_be_best and record_best_at(trainer.state, trainer.args, metrics, step):
        best = os.path.join(trainer.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.best_global_step}")
        if os.path.isdir(best):
            trainer.state.best_model_checkpoint = best


def record_best_at(state: TrainerState, args: TrainingArguments, metrics: Mapping[str, float], step: int) -> bool:
    """`state.best_metric` and `best_global_step` after `metrics` of `step` arrived late, as the Trainer would have set
    them had they come in order: a strictly better value wins, an equal one only from an earlier step (the Trainer
    keeps the first of equals; so does `probdiff select`), NaN never. Returns whether the step is the best now."""
    name = args.metric_for_best_model
    if name is None:
        return False
    value = metrics.get(name if name.startswith("eval_") else f"eval_{name}")
    if not is_finite(value):
        return False
    better = operator.gt if args.greater_is_better else operator.lt
    best, best_step = state.best_metric, state.best_global_step
    tie_earlier = value == best and best_step is not None and step < best_step
    if best is not None and not better(value, best) and not tie_earlier:
        return False
    state.best_metric = value
    if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST):
        state.best_global_step = step
    return True


def logged_steps(log_history: Iterable[Mapping]) -> set[int]:
    """The steps whose ProbDiff metrics the Trainer's log holds."""
    return {e["step"] for e in log_history if "eval_probdiff_confidence" in e and "step" in e}
