"""The queue's files (`beside/queue.py`), written as training writes them and read as the evaluator reads them: the
queries in their order, a request from a history row and back, each step queued then done, what a resumed run drops,
the training-ended mark, and a damaged file named with what to do."""

from __future__ import annotations

import math

import pytest
from _distributed_eval import held_out_queries

from probdiff_callback.core.queries import Query, load_queries
from probdiff_callback.runs import queue as q
from probdiff_callback.runs.queue import Queue
from probdiff_callback.runs.run_files import HistoryRow


def test_the_queries_file_reads_back_as_the_same_queries_in_their_order(tmp_path):
    queries = [
        Query("b", "second text", "数学计算", "a reference"),  # AlignBench's Chinese name: canonical on reading
        Query("a", "first text"),
        *held_out_queries()[:3],
    ]
    queue = Queue(tmp_path)
    queue.write_spec(q.EvaluatorSpec(model="m", dtype=None), queries)
    assert load_queries(queue.folder / q.QUERIES_FILE) == queries


def test_a_request_carries_its_rows_start_to_the_evaluator_and_back():
    row = HistoryRow(4, 1.5, "evaluate", False, "run/checkpoint-4", eval_loss=2.25)
    request = q.Request.for_row(row, [1.0, math.nan, 3.0], last=True)
    assert (request.weights, request.eval_loss, request.eval_losses, request.last) == (
        "weights",
        2.25,
        [1.0, None, 3.0],
        True,
    )
    assert request.row() == HistoryRow(4, 1.5, "evaluate", False, "run/checkpoint-4", eval_loss=2.25)
    assert request.eval_losses_or_nan()[0] == 1.0 and math.isnan(request.eval_losses_or_nan()[1])
    base = q.Request.for_row(HistoryRow(0, 0.0, "baseline", True), None)
    assert base.weights is None and base.eval_loss is None and math.isnan(base.row().eval_loss)


def test_a_step_is_queued_then_done_and_a_resumed_run_drops_what_came_after(tmp_path):
    queue = Queue(tmp_path)
    for step in (0, 2, 4):
        queue.submit(q.Request(global_step=step, epoch=None, kind="save", weights=None))
    assert [r.global_step for r in queue.pending()] == [0, 2, 4] and queue.done(0) is None
    queue.mark_done(q.Done(global_step=0, status="evaluated", seconds=1.5))
    assert [r.global_step for r in queue.pending()] == [2, 4] and queue.done(0).status == "evaluated"
    queue.mark_ended("completed")
    assert queue.ended() == "completed"
    queue.submit(q.Request(global_step=0, epoch=None, kind="save", weights=None))  # queued again: evaluated again
    assert queue.done(0) is None and queue.ended() is None, "queueing again means training has not ended"
    assert queue.drop_after(2) == [4] and [r.global_step for r in queue.requests()] == [0, 2]


def test_a_request_still_the_steps_is_current_and_one_queued_over_is_not(tmp_path):
    queue = Queue(tmp_path)
    first = q.Request(global_step=2, epoch=None, kind="save", queued_at=1.0)
    queue.submit(first)
    assert queue.is_current(first)
    queue.submit(q.Request(global_step=2, epoch=None, kind="save", queued_at=2.0))  # a training started again
    assert not queue.is_current(first)
    queue.drop_after(0)
    assert not queue.is_current(first)


def test_the_weights_are_links_that_outlive_the_checkpoint(tmp_path):
    checkpoint = tmp_path / "run" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    for name in (
        "adapter_model.safetensors",
        "adapter_config.json",
        "optimizer.pt",
        "model-00001-of-00002.safetensors",
    ):
        (checkpoint / name).write_text(name)
    queue = Queue(tmp_path / "run")
    folder = queue.link_checkpoint(2, checkpoint)
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "model-00001-of-00002.safetensors"
    ]  # fmt: skip
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        (checkpoint / name).unlink()  # rotation deleted the checkpoint
    assert (folder / "adapter_model.safetensors").read_text() == "adapter_model.safetensors"
    assert queue.weights_of(q.Request(global_step=2, epoch=None, kind="save")) == folder
    assert (
        queue.weights_of(q.Request(global_step=0, epoch=None, kind="baseline", base_model=True, weights=None)) is None
    )


def test_a_damaged_queue_file_is_named_with_what_to_do(tmp_path):
    queue = Queue(tmp_path)
    queue.submit(q.Request(global_step=2, epoch=None, kind="save"))
    request_file = next(queue.folder.glob("step-*/request.json"))
    request_file.write_text("{")
    with pytest.raises(ValueError, match=rf"{request_file}: not valid JSON .*; remove the step's folder to drop it"):
        queue.requests()
    request_file.write_text('{"epoch": 1}')
    with pytest.raises(ValueError, match=r"no 'global_step'.*remove the step's folder to drop it"):
        queue.pending()


def test_a_run_without_a_spec_is_not_queued(tmp_path):
    with pytest.raises(q.NotQueued, match="was not started with probdiff.async_eval=true"):
        Queue.existing(tmp_path)
    Queue(tmp_path).write_spec(q.EvaluatorSpec(model="m", dtype=None), [Query("a", "x")])
    assert Queue.existing(tmp_path).read_spec().model == "m"
