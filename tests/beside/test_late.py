"""Late results (`beside/late.py`): a late entry placed among the Trainer's log history by its step (the best-model
record is tests/test_pick.py's)."""

from __future__ import annotations

from probdiff_callback.callback.beside.late import move_into_step_order


def test_a_late_entry_goes_among_the_log_history_by_its_step():
    history = [{"step": 0, "a": 1}, {"step": 2, "loss": 1}, {"step": 3, "loss": 1}, {"step": 2, "late": 1}]
    move_into_step_order(history)
    assert history == [{"step": 0, "a": 1}, {"step": 2, "loss": 1}, {"step": 2, "late": 1}, {"step": 3, "loss": 1}]
