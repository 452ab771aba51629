"""Late results: a step's evaluation that arrives while training is further on lands where the loop's would have, at
its own step in the Trainer's log (and every `report_to`).

The metric the Trainer selects by does not exist yet when it evaluates: its metrics get NaN under every ProbDiff key
(`_determine_best_metric` raises on a missing key, and NaN is never best); the best-model record is set when the
result arrives, by the one decision both ways take (`callback/best.py`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping


def move_into_step_order(log_history: list[dict], entry_index: int = -1) -> None:
    """The entry logged last put among the others by its step (after those of the same step)."""
    entry = log_history.pop(entry_index)
    position = next((i for i, e in enumerate(log_history) if e.get("step", 0) > entry["step"]), len(log_history))
    log_history.insert(position, entry)


def log_at_step(trainer, step: int, epoch: float | None, metrics: Mapping[str, float]) -> None:
    """A step's metrics logged at that step as the Trainer's `log` logs (an entry of its log history, placed among
    that step's entries; then every callback's `on_log`, W&B's and the other `report_to`'s, which read the step and
    epoch from the state they are given: a copy of the Trainer's at `step`). The Trainer's own state is not touched,
    and a subclass's additions to `log` (trl's training metrics gathered since its last log) stay for the Trainer's
    next log, at its own step."""
    logs = {**metrics, **({"epoch": epoch} if epoch is not None else {})}
    trainer.state.log_history.append({**logs, "step": step})
    move_into_step_order(trainer.state.log_history)
    at_step = copy.copy(trainer.state)
    at_step.global_step, at_step.epoch = step, epoch
    trainer.control = trainer.callback_handler.on_log(trainer.args, at_step, trainer.control, logs)
