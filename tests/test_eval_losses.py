"""Each held-out conversation's eval loss, kept per step beside the Trainer's mean, on 1 and 2 processes, and used by
the alarm's paired test; and the resolution line the callback logs at the start of training."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from _distributed_eval_losses import N_EVAL, add_callback, build_trainer

from probdiff_callback.analysis.disagreement import grade_change
from probdiff_callback.analysis.report import resolution_line
from probdiff_callback.callback.eval_losses import (
    PerExampleLossUnavailable,
    losses_over,
    per_example_eval_losses,
    row_losses,
)
from probdiff_callback.runs.run_files import read_run

SCRIPT = Path(__file__).with_name("_distributed_eval_losses.py")
LAUNCH_TIMEOUT_S = 420


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- the loss of a row ----
def test_each_rows_loss_is_the_models_own_loss_of_that_row_alone(tiny_model):
    model, tokenizer = tiny_model
    texts = ["The river runs to the sea.", "Three rivers: the Yangtze, the Yellow River and the Pearl River."]
    encoded = [tokenizer(t)["input_ids"] for t in texts]
    width = max(map(len, encoded))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids in encoded])
    attention_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in encoded])
    labels = input_ids.clone()
    labels[attention_mask == 0] = -100
    labels[:, :3] = -100  # a prompt without loss, as the assistant-only loss leaves it
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        per_row = row_losses(logits, labels)
        for row, ids in enumerate(encoded):
            alone = model(input_ids=torch.tensor([ids]), labels=labels[row : row + 1, : len(ids)]).loss
            assert per_row[row].item() == pytest.approx(alone.item(), abs=1e-5)
    no_loss_token = torch.full_like(labels[:1], -100)
    assert math.isnan(row_losses(logits[:1], no_loss_token)[0].item())


def test_packed_or_padding_free_batches_are_refused_with_the_reason(tiny_model):
    model, _ = tiny_model
    packed = {"input_ids": torch.tensor([[1, 2, 3, 4]]), "position_ids": torch.tensor([[0, 1, 0, 1]])}
    packed["labels"] = packed["input_ids"].clone()
    with pytest.raises(PerExampleLossUnavailable, match="padding-free or packed"):
        losses_over(model, [packed], torch.device("cpu"), gather=lambda t: t)
    with pytest.raises(PerExampleLossUnavailable, match="no `labels`"):
        losses_over(model, [{"input_ids": torch.tensor([[1, 2]])}], torch.device("cpu"), gather=lambda t: t)


# ---- one process ----
@pytest.mark.slow  # a training run
def test_one_process_keeps_each_conversations_loss_says_the_resolution_and_the_alarm_uses_them(
    tmp_path, tiny_model_path, caplog
):
    run = tmp_path / "run"
    # one conversation per eval batch: the mean of the kept losses is then the Trainer's eval loss itself
    trainer = build_trainer(tiny_model_path, run, max_steps=2, per_device_eval_batch_size=1)
    add_callback(trainer)
    with caplog.at_level(logging.INFO, logger="probdiff_callback"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ProbDiff resolution:")]
    baseline = read_run(run).rows[0]
    assert said == [resolution_line(3, baseline.summary["confidence"])]  # once, from the baseline's confidence
    assert "within noise" in said[0]

    rows = read_run(run)
    assert [(row.global_step, row.eval_losses) for row in rows.rows] == [
        (step, f"step-{step}/eval_losses.json") for step in (0, 1, 2)
    ]
    for row in rows.rows:
        losses = rows.eval_losses[row.global_step]
        assert len(losses) == N_EVAL and all(math.isfinite(x) for x in losses)
        assert sum(losses) / len(losses) == pytest.approx(row.eval_loss, rel=1e-5)  # float32 sums
    assert rows.eval_losses[0] != rows.eval_losses[2]  # training moved them

    grade = grade_change("eval_loss", 0, 2, lambda step: (rows.records.get(step), rows.eval_losses.get(step)))
    assert grade.why_not is None and grade.n == N_EVAL and grade.unit == "conversations" and 0 < grade.p <= 1


@pytest.mark.slow  # two training runs
def test_the_per_conversation_losses_do_not_depend_on_the_eval_batch_size(tmp_path, tiny_model_path):
    trainer = build_trainer(tiny_model_path, tmp_path / "run")
    by_batch = {}
    for batch_size in (1, 2, 4):  # padded to the batch's longest conversation: more padding, the same losses
        trainer.args.per_device_eval_batch_size = batch_size
        assert len(trainer.get_eval_dataloader()) == math.ceil(N_EVAL / batch_size)
        by_batch[batch_size] = per_example_eval_losses(trainer, trainer.get_eval_dataloader()).losses
    assert len(by_batch[1]) == N_EVAL
    assert by_batch[2] == pytest.approx(by_batch[1], abs=1e-5)
    assert by_batch[4] == pytest.approx(by_batch[1], abs=1e-5)


# ---- two processes ----
LAUNCHERS = {"ddp": ["--multi_gpu"], "zero3": ["--use_deepspeed", "--zero_stage", "3"]}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher")
@pytest.mark.parametrize("mode", ["ddp", "zero3"])
def test_two_processes_gather_every_conversation_once_in_order(mode, tmp_path, tiny_model_path):
    if mode == "zero3":
        pytest.importorskip("deepspeed", reason="ZeRO-3 runs need the deepspeed extra: pip install -e '.[deepspeed]'")
    command = [
        "accelerate", "launch", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", *LAUNCHERS[mode], str(SCRIPT), "--mode", mode, "--model", str(tiny_model_path),
        "--out", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": str(SCRIPT.parents[1])}
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the 2-process run did not finish in {LAUNCH_TIMEOUT_S}s (a hang?)\n{(err.stderr or b'')[-4000:]}")
    assert done.returncode == 0, f"launch failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert [seen["world_size"] for seen in ranks] == [2, 2]
    run = read_run(tmp_path / "run")
    # every rank holds all 5 (the padding of the last batches dropped), in the eval dataset's order; under ZeRO-3 the
    # forward passes gather the sharded parameters on both ranks in step
    assert ranks[0]["final_losses"] == ranks[1]["final_losses"]
    assert ranks[0]["final_losses"] == pytest.approx(run.eval_losses[1], abs=1e-5)  # step 1: the final weights
    # step 0 is the base model: the same values as one process computes
    single = build_trainer(tiny_model_path, tmp_path / "single")
    expected = per_example_eval_losses(single, single.get_eval_dataloader()).losses
    assert len(run.eval_losses[0]) == N_EVAL
    assert run.eval_losses[0] == pytest.approx(expected, abs=1e-5)
