"""Late results (`beside/late.py`): the best-model record as in-order arrivals would have set it, and a late entry
placed among the Trainer's log history by its step."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from transformers import TrainingArguments

from probdiff_callback.beside.late import move_into_step_order, record_best_at


def args_for(metric: str = "probdiff_confidence", save_strategy: str = "steps") -> TrainingArguments:
    return TrainingArguments(
        output_dir="unused", metric_for_best_model=metric, save_strategy=save_strategy, eval_strategy="steps",
        use_cpu=True, report_to="none",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("arrivals", "greater", "best"),
    [
        ([(2, 0.5), (4, 0.75), (6, 0.75)], True, (4, 0.75)),  # in order: an equal value later does not replace
        ([(6, 0.75), (4, 0.75), (2, 0.5)], True, (4, 0.75)),  # out of order: the earlier of equals still wins
        ([(2, math.nan), (4, 0.25)], True, (4, 0.25)),  # NaN (a failed evaluation) never
        ([(2, 1.5), (4, 1.2), (6, 1.4)], False, (4, 1.2)),  # a loss: lower is better
    ],
)
def test_a_late_result_records_the_best_as_in_order_arrivals_would(arrivals, greater, best):
    args = args_for("probdiff_confidence" if greater else "probdiff_d_mean")
    args.greater_is_better = greater
    state = SimpleNamespace(best_metric=None, best_global_step=None)
    key = args.metric_for_best_model
    for step, value in arrivals:
        record_best_at(state, args, {f"eval_{key}": value}, step)
    assert (state.best_global_step, state.best_metric) == best


def test_a_late_entry_goes_among_the_log_history_by_its_step():
    history = [{"step": 0, "a": 1}, {"step": 2, "loss": 1}, {"step": 3, "loss": 1}, {"step": 2, "late": 1}]
    move_into_step_order(history)
    assert history == [{"step": 0, "a": 1}, {"step": 2, "loss": 1}, {"step": 2, "late": 1}, {"step": 3, "loss": 1}]
