"""Rotation beside training (`beside/rotation.py`): the Trainer's limit, never deleting the newest, the best, or a
checkpoint whose step awaits its result."""

from __future__ import annotations

from probdiff_callback.callback.beside.rotation import rotate
from probdiff_callback.runs.checkpoints import checkpoints


def test_rotation_keeps_the_newest_the_best_and_every_checkpoint_awaiting_its_result(tmp_path):
    for step in range(1, 8):
        (tmp_path / f"checkpoint-{step}").mkdir()
    best = str(tmp_path / "checkpoint-2")
    rotate(str(tmp_path), 2, best, unlogged_steps=[3, 6])
    assert [c.name for c in checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-3", "checkpoint-6", "checkpoint-7"]
    rotate(str(tmp_path), 2, best, unlogged_steps=[])  # the results arrived: the limit applies, best and newest kept
    assert [c.name for c in checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-7"]
