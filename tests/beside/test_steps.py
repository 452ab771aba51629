"""Each queued step's one stage on the training side (`beside/steps.py`)."""

from __future__ import annotations

from probdiff_callback.callback.beside.steps import QueuedSteps, Stage, describe_steps
from probdiff_callback.runs.queue import Request


def test_each_step_moves_through_its_stages_and_the_views_follow():
    steps = QueuedSteps()
    held = Request(global_step=3, epoch=None, kind="evaluate")
    steps.set(0, Stage.QUEUED)
    steps.set(2, Stage.DONE, checkpoint="run/checkpoint-2", metrics={"m": 0.5})  # a row a resumed run kept
    steps.set(3, Stage.HELD, request=held, weights_ready=False)
    steps.set(5, Stage.HELD, request=Request(global_step=5, epoch=None, kind="evaluate"))
    assert 3 in steps and 4 not in steps
    assert steps.unlogged() == [0, 2, 3, 5] and steps.awaited() == [0, 2]
    steps.set(3, Stage.QUEUED, request=None)
    steps.set(0, Stage.LOGGED, metrics={"m": 0.25})
    steps.set(5, Stage.LOST, request=None)
    assert steps.awaited() == [2, 3] and steps.unlogged() == [2, 3] and steps.at(Stage.LOST) == [5]
    assert steps[2].checkpoint == "run/checkpoint-2", "moving on keeps what was set before"
    assert steps.evaluated == {0: {"m": 0.25}, 2: {"m": 0.5}}


def test_steps_are_said_as_a_list():
    assert describe_steps([4]) == "step 4" and describe_steps([20, 3]) == "steps 3, 20"
