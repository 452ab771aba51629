"""Where an independent measure moves against ProbDiff: found from the steps, said by `probdiff select`, the callback
(console and W&B) and, through the selection, the end of a training run."""

from __future__ import annotations

import pytest
from _runs import GOOD, MIXED, POOR, write_run

from probdiff_callback.analysis.disagreement import find_disagreements, format_disagreements
from probdiff_callback.callback import alerts
from probdiff_callback.cli import main
from probdiff_callback.runs.run_files import RunFiles, history_path, read_history, write_jsonl


def step(number: int, confidence: float, rouge_l: float | None = None, loss: float | None = None, kind="evaluate"):
    metrics = {} if rouge_l is None else {"rougeL": rouge_l}
    return {
        "step": number,
        "kind": kind,
        "confidence": confidence,
        "d_mean": 0.0,
        "eval_loss": loss,
        "metrics": metrics,
    }


def test_confidence_up_from_the_baseline_while_rouge_falls_is_a_disagreement():
    steps = [step(0, 0.25, 30.0, kind="baseline"), step(10, 0.5, 28.0), step(20, 0.375, 35.0)]
    found = find_disagreements(steps, picked_step=20)
    assert [(d.earlier, d.later, d.at_pick) for d in found] == [(0, 10, False)]
    assert (
        found[0].sentence()
        == "step 10: confidence rose from 25.0% at step 0 (before training) to 50.0%, but ROUGE-L fell from 30.00 to "
        "28.00"
    )


def test_the_pick_is_checked_against_the_baseline_and_the_step_each_measure_prefers():
    steps = [
        step(0, 0.25, 25.0, loss=3.0, kind="baseline"),
        step(10, 0.5, 35.0, loss=2.5),  # ROUGE-L and the loss prefer step 10
        step(20, 0.75, 30.0, loss=3.1),  # ProbDiff prefers step 20
    ]
    found = find_disagreements(steps, picked_step=20)
    assert [(d.earlier, d.later, d.at_pick) for d in found] == [(0, 20, True), (10, 20, True)]
    assert [w.measure for w in found[0].worse] == ["eval_loss"]  # ROUGE-L rose from the baseline: no complaint
    assert [w.measure for w in found[1].worse] == ["rougeL", "eval_loss"]
    text = format_disagreements(found, "runs/x")
    assert "step 20 (the checkpoint ProbDiff picks): confidence rose from 50.0% at step 10 to 75.0%" in text
    assert "ROUGE-L fell from 35.00 to 30.00 and eval loss rose from 2.5000 to 3.1000" in text
    assert "runs/x/probdiff/step-<N>/" in text


def test_agreeing_measures_equal_confidence_and_missing_measures_say_nothing():
    agree = [step(0, 0.25, 25.0, 3.0, kind="baseline"), step(10, 0.5, 30.0, 2.9), step(20, 0.75, 31.0, 2.8)]
    assert find_disagreements(agree, picked_step=20) == []
    assert format_disagreements([]) == ""
    flat = [step(0, 0.5, 30.0, kind="baseline"), step(10, 0.5, 20.0)]  # confidence did not rise
    assert find_disagreements(flat, picked_step=10) == []
    blind = [step(0, 0.25, kind="baseline"), step(10, 0.75)]  # no reference metric, no eval loss
    assert find_disagreements(blind, picked_step=10) == []
    within_print = [step(0, 0.25, 30.0, kind="baseline"), step(10, 0.5, 29.995)]  # prints as 30.00 both times
    assert find_disagreements(within_print, picked_step=10) == []


def write_disagreeing_run(run):
    """Confidence 1/8 -> 5/8 -> 8/8 while ROUGE-L falls and the eval loss rises: ProbDiff picks step 20."""
    write_run(run, {0: POOR, 10: MIXED, 20: GOOD}, checkpoints=(10, 20))
    rows = read_history(history_path(run))
    for row, (loss, rouge_l) in zip(rows, ((2.0, 30.0), (2.2, 26.5), (2.4, 21.25))):
        reference = {"overall": {"rougeL": rouge_l}, "n_scored": {"rougeL": 8}, "by_category": {}}
        row.eval_loss, row.summary = loss, dict(row.summary, reference=reference)
    write_jsonl(history_path(run), [row.to_json() for row in rows])


def test_probdiff_select_says_it_with_the_steps_and_figures(tmp_path, capsys):
    run = tmp_path / "run"
    write_disagreeing_run(run)
    assert main(["select", str(run)]) == 0
    printed = capsys.readouterr().out
    assert "!! ProbDiff DISAGREES with a measure that does not come from the model's own judgement" in printed
    # these records have no per-query scores and no per-conversation eval losses: not graded, so in the alarm
    assert (
        "!!   step 10: confidence rose from 12.5% at step 0 (before training) to 62.5%, but ROUGE-L fell from 30.00 to "
        "26.50, not graded (no per-query ROUGE-L at step 0), and eval loss rose from 2.0000 to 2.2000, not graded "
        "(no eval loss per conversation at step 0)" in printed
    )
    assert (
        "step 20 (the checkpoint ProbDiff picks): confidence rose from 12.5% at step 0 (before training) to 100.0%"
        in printed
    )
    assert "ROUGE-L fell from 30.00 to 21.25" in printed


def test_the_callback_warns_once_per_disagreement_and_alerts_wandb(tmp_path, monkeypatch, caplog):
    run = tmp_path / "run"
    write_disagreeing_run(run)
    sent = []
    monkeypatch.setattr(alerts, "alert_wandb", lambda title, text: sent.append((title, text)))
    files = RunFiles(run)
    files.continue_from(resumed_step=20)  # the rows in memory, as the callback holds them
    history_file = history_path(run)
    history_file.rename(history_file.with_suffix(".moved"))  # the check reads nothing: it works from memory
    announcer = alerts.DisagreementAlerts()
    with caplog.at_level("WARNING"):
        announcer.announce(files.rows(), str(run), to_wandb=True)
        announcer.announce(files.rows(), str(run), to_wandb=True)  # the next evaluation, nothing new
    assert len(sent) == 1 and sent[0][0] == "ProbDiff disagrees with an independent measure"
    assert "step 20 (the checkpoint ProbDiff picks)" in sent[0][1]
    assert sum("ProbDiff DISAGREES" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.slow  # a W&B run of its own: seconds to start and finish
def test_alert_wandb_puts_the_text_in_the_run_summary(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(dir=str(tmp_path), project="probdiff-test")
    try:
        alerts.alert_wandb("ProbDiff disagrees with an independent measure", "first")
        alerts.alert_wandb("ProbDiff disagrees with an independent measure", "second")
        assert run.summary["probdiff/disagreement"] == "first\nsecond"
    finally:
        run.finish()
