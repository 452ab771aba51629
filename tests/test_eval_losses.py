"""Each held-out conversation's eval loss, kept per step beside the Trainer's mean, and used by the alarm's paired test;
and the resolution line the callback logs at the start of training. (On 2 processes, DDP and ZeRO-3: tests/e2e/
test_distributed.py.)"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from _distributed_eval import build_trainer as sft_trainer
from _distributed_eval import eval_losses_by_a_pass_of_their_own, held_out_queries, probdiff_config

from probdiff_callback.analysis.disagreement import grade_change
from probdiff_callback.analysis.report import resolution_line
from probdiff_callback.callback.eval_losses import EvalLossTap, PerExampleLossUnavailable, row_losses
from probdiff_callback.callback.probdiff import ProbDiffCallback
from probdiff_callback.runs.run_files import read_run

N_EVAL = 5  # odd: 2 ranks with batches of 2 pad their last batch


def build_trainer(model_path: str | Path, output_dir: str | Path, n_eval: int = N_EVAL, **training_args):
    """The tests' SFT run (LoRA on the tiny model) for one step, with `n_eval` held-out blog conversations for the
    eval loss, evaluated at the start and every step."""
    settings = dict(max_steps=1, eval_strategy="steps", eval_steps=1, eval_on_start=True, save_strategy="no")
    return sft_trainer(model_path, output_dir, eval_rows=range(8, 8 + n_eval), **{**settings, **training_args})


def add_callback(trainer) -> None:
    trainer.add_callback(ProbDiffCallback(trainer, held_out_queries(), probdiff_config(n_queries=3)))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


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


def test_the_tap_keeps_each_rows_loss_of_evaluation_forwards_only(tiny_model):
    """Eval mode, no gradients, labels given: an evaluation's forward, kept (gathered, in order); a forward in
    training mode, with gradients, or without labels (ProbDiff's generation and scoring): not."""
    model, _ = tiny_model
    batch = {"input_ids": torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), "attention_mask": torch.ones(2, 4, dtype=int)}
    batch["labels"] = batch["input_ids"].clone()
    gathered = []
    tap = EvalLossTap(model, gather=lambda t: gathered.append(t) or t)
    try:
        with torch.no_grad():
            expected = row_losses(model(**batch).logits, batch["labels"]).tolist()  # the first forward: kept
            model(input_ids=batch["input_ids"])  # no labels
            model.train()
            model(**batch)  # training mode
        model.eval()
        model(**batch)  # gradients on
        assert tap.take().losses == pytest.approx(expected) and len(gathered) == 1
        assert tap.take().losses == []  # taken: a fresh start
    finally:
        tap.remove()
        model.eval()


def test_packed_or_padding_free_batches_are_refused_with_the_reason(tiny_model):
    model, _ = tiny_model
    packed = {"input_ids": torch.tensor([[1, 2, 3, 4]]), "position_ids": torch.tensor([[0, 1, 0, 1]])}
    packed["labels"] = packed["input_ids"].clone()
    tap = EvalLossTap(model, gather=lambda t: t)
    try:
        with torch.no_grad():
            model(**packed)
        with pytest.raises(PerExampleLossUnavailable, match="padding-free or packed"):
            tap.take()
        assert tap.take().losses == []  # said for that evaluation only
    finally:
        tap.remove()


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
    assert said == [resolution_line(3, baseline.summary.confidence)]  # once, from the baseline's confidence
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
def test_the_per_conversation_losses_do_not_depend_on_the_eval_batch_size_and_equal_a_pass_of_their_own(
    tmp_path, tiny_model_path
):
    trainer = build_trainer(tiny_model_path, tmp_path / "run")
    tap = EvalLossTap(trainer.model, trainer.accelerator.gather_for_metrics)
    by_batch = {}
    for batch_size in (1, 2, 4):  # padded to the batch's longest conversation: more padding, the same losses
        trainer.args.per_device_eval_batch_size = batch_size
        assert len(trainer.get_eval_dataloader()) == math.ceil(N_EVAL / batch_size)
        trainer.evaluate()
        by_batch[batch_size] = tap.take().losses
    tap.remove()
    assert len(by_batch[1]) == N_EVAL
    assert by_batch[2] == pytest.approx(by_batch[1], abs=1e-5)
    assert by_batch[4] == pytest.approx(by_batch[1], abs=1e-5)
    # SFTTrainer evaluates through trl's fused LM head (log-probs in chunks, no logits): float32 rounding apart
    assert by_batch[4] == pytest.approx(eval_losses_by_a_pass_of_their_own(trainer), rel=1e-5)
