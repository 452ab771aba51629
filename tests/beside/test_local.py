"""The evaluator training starts on its node (`beside/local.py`): no rank of the training, its own devices and threads,
started again when it dies with work left, a few times, then the user is told."""

from __future__ import annotations

import logging
import sys

import probdiff_callback.callback.beside.local as local
from probdiff_callback.callback.beside.local import (
    LocalEvaluator,
    evaluator_command,
    evaluator_environment,
    helpers_after_training,
)
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.runs import queue as q
from probdiff_callback.runs.queue import Queue

LOG = "probdiff_callback"


def exiting(code: int):
    """An evaluator command that exits at once with `code`."""
    return lambda run_dir, subdir, helpers=0: [sys.executable, "-c", f"exit({code})"]


def test_the_evaluator_is_no_rank_of_the_training_and_gets_its_own_devices(tmp_path):
    training = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_PORT": "29500",
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "TORCHELASTIC_RUN_ID": "x",
        "PROBDIFF_LAUNCHER_PID": "12",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PATH": "/usr/bin",
    }
    env = evaluator_environment(training, "7", 4)
    assert env == {
        "CUDA_VISIBLE_DEVICES": "7",
        "OMP_NUM_THREADS": "4",
        "MKL_NUM_THREADS": "4",
        "HF_HUB_OFFLINE": "1",
        "PATH": "/usr/bin",
    }
    assert evaluator_environment(training, None, 1)["CUDA_VISIBLE_DEVICES"] == ""  # the CPU
    assert evaluator_command(tmp_path, "probdiff")[-3:] == ["watch", str(tmp_path), "--started-by-training"]
    assert evaluator_command(tmp_path, "pd")[-2:] == ["--subdir", "pd"]
    assert evaluator_command(tmp_path, "pd", helpers=1)[-4:] == ["--subdir", "pd", "--helpers-after-training", "1"]
    # on the CPU, as many helpers as the threads training frees hold (2 processes of 2 threads: 4 of 1, 2 of 2)
    assert [helpers_after_training(None, 2, 2, t) for t in (1, 2, 3, 8)] == [4, 2, 1, 0]
    assert helpers_after_training("7", 2, 2, 1) == 0  # on GPUs, none


def test_an_evaluator_that_keeps_dying_is_started_again_a_few_times_then_the_user_is_told(
    tmp_path, monkeypatch, caplog
):
    queue = Queue(tmp_path)
    queue.submit(q.Request(global_step=0, epoch=0.0, kind="baseline", base_model=True, weights=None))
    monkeypatch.setattr(local, "evaluator_command", exiting(3))
    evaluator = LocalEvaluator(queue, ProbDiffConfig(async_eval=True), threads=1)
    caplog.set_level(logging.INFO, logger=LOG)
    evaluator.start()
    for _ in range(local.MAX_RESTARTS + 2):
        evaluator.process.wait(30) if evaluator.process is not None else None
        evaluator.check()
    restarts = [r.message for r in caplog.records if "starting it again" in r.message]
    assert len(restarts) == local.MAX_RESTARTS
    assert restarts[0].endswith("exited with status 3 while step 0 awaits evaluation (its last line: -); starting "
                                "it again (1 of 3)")  # fmt: skip
    assert evaluator.gave_up and evaluator.process is None
    assert f"training goes on without it: run `probdiff watch {tmp_path}` to evaluate the queue" in caplog.text


def test_an_evaluator_that_finished_is_started_again_for_what_was_queued_after(tmp_path, monkeypatch, caplog):
    queue = Queue(tmp_path)
    monkeypatch.setattr(local, "evaluator_command", exiting(0))
    evaluator = LocalEvaluator(queue, ProbDiffConfig(async_eval=True), threads=1)
    evaluator.start()
    evaluator.process.wait(30)
    queue.submit(q.Request(global_step=4, epoch=1.0, kind="end"))  # queued after it ended
    evaluator.check()
    assert evaluator.failures == 0 and evaluator.process is not None
    evaluator.stop()
