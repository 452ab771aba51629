"""Late results: a step's evaluation that arrives while training is further on lands where the loop's would have, at
its own step in the Trainer's log (and every `report_to`).

The metric the Trainer selects by does not exist yet when it evaluates: its metrics get NaN under every ProbDiff key
(`_determine_best_metric` raises on a missing key, and NaN is never best); the best-model record is set when the
result arrives, by the one decision both ways take (`callback/best.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from transformers import Trainer, TrainerState


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


def log_at_step(trainer, step: int, epoch: float | None, metrics: Mapping[str, float]) -> None:
    """A step's metrics through the Trainer's own `log` at that step, placed among that step's entries of the log
    history. A subclass's additions to `log` (trl's training metrics gathered since its last log) stay for the
    Trainer's next log, at its own step."""
    with at_step(trainer.state, step, epoch):
        Trainer.log(trainer, dict(metrics))
    move_into_step_order(trainer.state.log_history)
