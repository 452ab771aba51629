"""analysis/disagreement.py: where an independent measure moves against ProbDiff, found from the steps and graded by a
paired test over the same queries (a significant change is an alarm: the loud block, the W&B alert; a change within
noise is listed quietly, and every line says which it is, with its p-value); said by `probdiff select`, the callback
(console and W&B) and, through the selection, the end of a training run."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from _records import make_record
from _runs import DELTA, GOOD, MIXED, POOR, write_run

from probdiff_callback.analysis.disagreement import (
    Disagreement,
    Worse,
    find_disagreements,
    format_disagreements,
    grade_disagreements,
)
from probdiff_callback.analysis.pick import CONFIDENCE
from probdiff_callback.analysis.select import select_checkpoints
from probdiff_callback.callback import alerts
from probdiff_callback.cli import main
from probdiff_callback.core import significance
from probdiff_callback.core.metric import is_confident
from probdiff_callback.core.records import ReferenceSummary
from probdiff_callback.core.significance import paired_permutation_p, sign_flip_p
from probdiff_callback.runs.run_files import (
    RunFiles,
    history_path,
    read_history,
    read_records,
    step_eval_losses_path,
    step_records_path,
    write_atomic,
    write_jsonl,
)


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
    assert find_disagreements(flat, picked_step=None) == []
    # ...but the pick is held against the base model whichever way confidence went
    (at_pick,) = find_disagreements(flat, picked_step=10)
    assert (
        "confidence went from 50.0% at step 0 (before training) to 50.0% (ProbDiff does not put" in at_pick.sentence()
    )
    blind = [step(0, 0.25, kind="baseline"), step(10, 0.75)]  # no reference metric, no eval loss
    assert find_disagreements(blind, picked_step=10) == []
    within_print = [step(0, 0.25, 30.0, kind="baseline"), step(10, 0.5, 29.995)]  # prints as 30.00 both times
    assert find_disagreements(within_print, picked_step=10) == []


def write_disagreeing_run(run):
    """Confidence 1/8 -> 5/8 -> 8/8 while ROUGE-L falls and the eval loss rises: ProbDiff picks step 20."""
    write_run(run, {0: POOR, 10: MIXED, 20: GOOD}, checkpoints=(10, 20))
    rows = read_history(history_path(run))
    for row, (loss, rouge_l) in zip(rows, ((2.0, 30.0), (2.2, 26.5), (2.4, 21.25))):
        row.eval_loss = loss
        row.summary.reference = ReferenceSummary(overall={"rougeL": rouge_l}, n_scored={"rougeL": 8}, by_category={})
    write_jsonl(history_path(run), [row.to_json() for row in rows])


def test_probdiff_select_says_it_with_the_steps_and_figures(tmp_path, capsys):
    run = tmp_path / "run"
    write_disagreeing_run(run)
    assert main(["select", str(run), "--by", "probdiff_confidence"]) == 0
    printed = capsys.readouterr().out
    alarm, notes = printed.split("!! Confidence may be rewarding")
    assert "!! ProbDiff DISAGREES with a measure that does not come from the model's own judgement" in alarm
    # these records have no per-query scores and no per-conversation eval losses: not graded, so judged by size alone:
    # the pick worse than the base model is an alarm...
    assert (
        "!!   step 20 (the checkpoint ProbDiff picks): confidence rose from 12.5% at step 0 (before training) to "
        "100.0%, but ROUGE-L fell from 30.00 to 21.25, not graded (no per-query ROUGE-L at step 0) [5.25 worse than "
        "the best checkpoint (step 10: 26.50), and training gained nothing on it; 8.75 worse than the base model]"
        in alarm
    )
    # ...a step that is not the pick is a note, with its size
    assert (
        "\n  step 10: confidence rose from 12.5% at step 0 (before training) to 62.5%, but ROUGE-L fell from 30.00 to "
        "26.50, not graded (no per-query ROUGE-L at step 0) [the best checkpoint on it; 3.50 worse than the base "
        "model], and eval loss rose from 2.0000 to 2.2000, not graded (no eval loss per conversation at step 0) [the "
        "best checkpoint on it; 0.2000 worse than the base model]" in notes
    )
    assert "step 10: confidence" not in alarm


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


# ---- the alarm graded by a paired test over the same queries: a significant change alarms, noise is listed ----
# Eight queries' sentence-level ROUGE-L and six held-out conversations' eval losses at steps 0, 10 and 20.
ROUGE_L = {
    0: [30.0, 32.0, 28.0, 31.0, 29.0, 33.0, 27.0, 30.0],
    10: [33.0, 28.0, 30.0, 26.0, 33.0, 30.0, 28.0, 28.0],  # step 0 + (3, -4, 2, -5, 4, -3, 1, -2): mean -0.5, noise
    20: [25.0, 26.0, 24.0, 26.0, 22.0, 28.0, 21.0, 25.0],  # step 0 - (5, 6, 4, 5, 7, 5, 6, 5): every query falls
}
LOSSES = {
    0: [2.0, 2.1, 1.9, 2.2, 2.0, 1.8],
    10: [2.3, 1.9, 2.0, 1.95, 2.2, 1.7],  # step 0 + (0.3, -0.2, 0.1, -0.25, 0.2, -0.1): mean +0.008, noise
    20: [2.3, 2.45, 2.1, 2.5, 2.35, 2.1],  # every conversation rises
}


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def write_graded_run(run: Path, *, with_per_query: bool = True) -> None:
    """Confidence 1/8 -> 5/8 -> 8/8 (ProbDiff picks step 20). From step 0 to 10, ROUGE-L and the eval loss move the
    wrong way within noise; at step 20 every query's ROUGE-L falls and every conversation's loss rises."""
    write_run(run, {0: POOR, 10: MIXED, 20: GOOD}, checkpoints=(10, 20))
    rows = read_history(history_path(run))
    for row in rows:
        step = row.global_step
        records = read_records(run / "probdiff" / row.records)
        if with_per_query:
            for record, score in zip(records, ROUGE_L[step]):
                record.ref = {"rougeL": score}
            write_jsonl(run / "probdiff" / row.records, records)
            path = step_eval_losses_path(run, step)
            write_atomic(path, '{"losses": [' + ", ".join(map(str, LOSSES[step])) + "]}\n")
            row.eval_losses = f"step-{step}/eval_losses.json"
        row.eval_loss = mean(LOSSES[step])
        row.summary.reference = ReferenceSummary(
            overall={"rougeL": mean(ROUGE_L[step])}, n_scored={"rougeL": 8}, by_category={}
        )
    write_jsonl(history_path(run), [row.to_json() for row in rows])


def exact_sign_flip_p(differences: list[float]) -> float:
    """The two-sided paired permutation p by brute force: every sign pattern's mean against the observed one."""
    d = np.asarray(differences)
    observed = d.mean()
    signs = np.array(list(itertools.product((1, -1), repeat=len(d))))  # every pattern, one row each
    means = (signs * d).mean(axis=1)
    tolerance = 1e-12
    low = np.mean(means <= observed + tolerance)
    high = np.mean(means >= observed - tolerance)
    return min(1.0, 2 * min(low, high))


# ---- the test itself ----
def test_the_paired_permutation_p_is_every_sign_pattern_counted():
    noise = [b - a for a, b in zip(ROUGE_L[0], ROUGE_L[10])]
    falls = [b - a for a, b in zip(ROUGE_L[0], ROUGE_L[20])]
    assert paired_permutation_p(ROUGE_L[0], ROUGE_L[10]) == pytest.approx(exact_sign_flip_p(noise))
    assert paired_permutation_p(ROUGE_L[0], ROUGE_L[20]) == pytest.approx(exact_sign_flip_p(falls))
    # all 8 differences negative: only that pattern and its mirror image reach the observed mean, 2 of 256
    assert paired_permutation_p(ROUGE_L[0], ROUGE_L[20]) == pytest.approx(2 / 256)
    assert paired_permutation_p(ROUGE_L[0], ROUGE_L[10]) > 0.5
    assert paired_permutation_p([1.0, 2.0], [1.0, 2.0]) == 1.0  # nothing moved
    assert np.isnan(paired_permutation_p([], []))
    with pytest.raises(ValueError, match="pair them by query"):
        paired_permutation_p([1.0], [1.0, 2.0])


def test_the_sign_flip_p_is_scipys_permutation_test(monkeypatch):
    """Exactly scipy's `permutation_test` over every sign pattern (its slower way), ties included: sentence-level
    ROUGE's many zero and equal differences, and differences that only rounding tells apart. Drawn beyond 16 pairs (a
    random stream of its own): as scipy's drawn p, within the spread of 9,999 draws of the exact one (every pattern
    of 18 and 20 pairs by the exact path, which scipy's equals above: scipy's own takes seconds there)."""
    from scipy.stats import permutation_test

    def scipys(differences: np.ndarray, draws: float) -> float:
        result = permutation_test((differences,), lambda d, axis: np.mean(d, axis=axis), permutation_type="samples",
                                  vectorized=True, n_resamples=draws, alternative="two-sided", rng=0)  # fmt: skip
        return min(float(result.pvalue), 1.0)

    rng = np.random.default_rng(3)
    cases = [rng.normal(0.3, 1, n) for n in (2, 5, 9, 16)]
    cases += [np.round(rng.normal(0, 1, n), 1) * (rng.random(n) < 0.6) for n in (6, 12, 16)]  # zeros and ties
    cases += [np.array([0.1, 0.2, -0.3, 0.1 + 0.2, -0.3]), np.full(7, 0.25)]  # equal means but for rounding
    for differences in cases:
        assert sign_flip_p(differences) == pytest.approx(scipys(differences, np.inf), abs=1e-12), differences
    assert sign_flip_p(np.array([0.7])) == 1.0  # one pair (scipy refuses it): never significant
    for differences in (rng.normal(0.4, 1, 18), np.round(rng.normal(0.2, 1, 20), 1)):  # 2^18, 2^20 patterns
        drawn = sign_flip_p(differences)
        with monkeypatch.context() as every_pattern:
            every_pattern.setattr(significance, "EXACT_PERMUTATION_MAX_N", 20)
            exact = sign_flip_p(differences)
        assert drawn == pytest.approx(exact, abs=0.01) and drawn != exact
        assert scipys(differences, 9_999) == pytest.approx(exact, abs=0.01)


def test_beyond_sixteen_pairs_the_sign_patterns_are_drawn_and_stay_close_to_the_exact_p():
    rng = np.random.default_rng(1)
    before = rng.normal(20, 5, 18)
    after = before + rng.normal(-1.2, 2.5, 18)  # 2^18 patterns: drawn, 9,999 of them
    drawn = paired_permutation_p(before, after)
    assert drawn == paired_permutation_p(before, after)  # a fixed seed: the same p every time
    assert drawn == pytest.approx(exact_sign_flip_p(list(after - before)), abs=0.01)
    assert significance.PERMUTATION_DRAWS == 9_999


# ---- a run's disagreements, graded ----
def test_a_significant_drop_is_an_alarm_and_a_drop_within_noise_is_listed_quietly(tmp_path):
    run = tmp_path / "run"
    write_graded_run(run)
    found = select_checkpoints(run, metric=CONFIDENCE).disagreements
    assert [(d.earlier, d.later, d.at_pick, d.within_noise) for d in found] == [
        (0, 10, False, True),
        (0, 20, True, False),
        (10, 20, True, False),
    ]
    grades = {(d.earlier, d.later, w.measure): w.grade for d in found for w in d.worse}
    assert all(g is not None and g.why_not is None for g in grades.values())
    noise_rouge, noise_loss = grades[(0, 10, "rougeL")], grades[(0, 10, "eval_loss")]
    assert (noise_rouge.n, noise_rouge.unit, noise_loss.n, noise_loss.unit) == (8, "queries", 6, "conversations")
    assert noise_rouge.within_noise and noise_rouge.p == pytest.approx(paired_permutation_p(ROUGE_L[0], ROUGE_L[10]))
    assert noise_loss.within_noise and noise_loss.p == pytest.approx(paired_permutation_p(LOSSES[0], LOSSES[10]))
    assert grades[(0, 20, "rougeL")].significant and grades[(0, 20, "rougeL")].p == pytest.approx(2 / 256)
    assert grades[(0, 20, "eval_loss")].significant and grades[(0, 20, "eval_loss")].p == pytest.approx(2 / 64)
    assert grades[(10, 20, "rougeL")].significant


def test_probdiff_select_prints_the_grade_and_p_on_every_line(tmp_path, capsys):
    run = tmp_path / "run"
    write_graded_run(run)
    assert main(["select", str(run), "--by", "probdiff_confidence"]) == 0
    printed = capsys.readouterr().out
    alarm, quiet = printed.split("!! Confidence may be rewarding")
    p_noise_rouge = paired_permutation_p(ROUGE_L[0], ROUGE_L[10])
    p_noise_loss = paired_permutation_p(LOSSES[0], LOSSES[10])
    assert (
        "!!   step 20 (the checkpoint ProbDiff picks): confidence rose from 12.5% at step 0 (before training) to "
        "100.0%, but ROUGE-L fell from 30.00 to 24.62, significant (p = 0.0078, 8 queries) [4.88 worse than the best "
        "checkpoint (step 10: 29.50), and training gained nothing on it; 5.38 worse than the base model], and eval "
        "loss rose from 2.0000 to 2.3000, significant (p = 0.031, 6 conversations) [0.2917 worse than the best "
        "checkpoint (step 10: 2.0083), and training gained nothing on it; 0.3000 worse than the base model]" in alarm
    )
    assert "step 10: confidence" not in alarm  # the noise is not in the alarm...
    assert (
        "ProbDiff and an independent measure moved apart, within noise (a paired test over the same queries finds no "
        "change beyond chance, p >= 0.05):\n"
        "  step 10: confidence rose from 12.5% at step 0 (before training) to 62.5%, but ROUGE-L fell from 30.00 to "
        f"29.50, within noise (p = {p_noise_rouge:.2g}, 8 queries), and eval loss rose from 2.0000 to 2.0083, within "
        f"noise (p = {p_noise_loss:.2g}, 6 conversations)" in quiet
    )  # ...but listed, quietly, after it


def test_only_noise_prints_no_alarm(tmp_path, capsys):
    run = tmp_path / "run"
    write_graded_run(run)
    rows = read_history(history_path(run))
    write_jsonl(history_path(run), [row.to_json() for row in rows if row.global_step != 20])  # stop at step 10
    assert main(["select", str(run), "--by", "probdiff_confidence"]) == 0
    printed = capsys.readouterr().out
    assert "!!" not in printed and "DISAGREES" not in printed
    assert "within noise (p = " in printed and "step 10 (the checkpoint ProbDiff picks)" in printed


def test_without_per_query_values_a_change_is_not_graded_and_stays_an_alarm(tmp_path, capsys):
    run = tmp_path / "run"
    write_graded_run(run, with_per_query=False)  # a run written before per-query values were kept
    found = select_checkpoints(run, metric=CONFIDENCE).disagreements
    assert found and not any(d.within_noise for d in found)
    reasons = {w.grade.why_not for d in found for w in d.worse}
    assert reasons == {
        "no per-query ROUGE-L at step 0",
        "no per-query ROUGE-L at step 10",
        "no eval loss per conversation at step 0",
        "no eval loss per conversation at step 10",
    }
    assert main(["select", str(run), "--by", "probdiff_confidence"]) == 0
    assert "ROUGE-L fell from 30.00 to 29.50, not graded (no per-query ROUGE-L at step 0)" in capsys.readouterr().out


def test_pairs_are_matched_by_query_id_and_conversation_position():
    # the later step's records in another order, one query missing; the eval sets differ in size at step 3
    records = {
        1: [make_record("a", ref={"rougeL": 10.0}), make_record("b", ref={"rougeL": 20.0}), make_record("c", ref={})],
        2: [make_record("b", ref={"rougeL": 18.0}), make_record("a", ref={"rougeL": 9.0})],
    }
    losses = {1: [1.0, float("nan"), 2.0], 2: [1.5, 1.0, 2.5], 3: [1.0]}
    found = [
        Disagreement(1, 2, (0.25, 0.5), (Worse("rougeL", 15.0, 13.5), Worse("eval_loss", 1.5, 2.0))),
        Disagreement(1, 3, (0.25, 0.5), (Worse("eval_loss", 1.5, 1.0),)),
    ]
    graded = grade_disagreements(found, lambda step: (records.get(step), losses.get(step)))
    rouge, loss = (w.grade for w in graded[0].worse)
    assert (rouge.n, rouge.p) == (2, pytest.approx(paired_permutation_p([10.0, 20.0], [9.0, 18.0])))
    assert (loss.n, loss.p) == (2, pytest.approx(paired_permutation_p([1.0, 2.0], [1.5, 2.5])))  # the NaN left out
    assert graded[1].worse[0].grade.why_not == "the eval sets differ: 3 conversations at step 1, 1 at step 3"


# ---- the callback: the alarm during training ----
def test_the_callback_alerts_wandb_only_for_significant_changes_and_logs_the_noise_quietly(
    tmp_path, monkeypatch, caplog
):
    run = tmp_path / "run"
    write_graded_run(run)
    sent = []
    monkeypatch.setattr(alerts, "alert_wandb", lambda title, text: sent.append((title, text)))
    files = RunFiles(run)
    files.continue_from(resumed_step=20)  # the rows in memory, as the callback holds them
    announcer = alerts.DisagreementAlerts()
    with caplog.at_level(logging.INFO, logger=alerts.logger.name):
        announcer.announce(files.rows(), str(run), to_wandb=True)
        announcer.announce(files.rows(), str(run), to_wandb=True)  # the next evaluation: nothing new
    assert len(sent) == 1
    assert "significant (p = 0.0078, 8 queries)" in sent[0][1] and "step 10: confidence" not in sent[0][1]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(warnings) == 1 and "step 10: confidence" not in warnings[0] and "ProbDiff DISAGREES" in warnings[0]
    notes, noise = infos  # significant from step 10 to the pick, where training gained nothing: a note, as are sizes
    assert "beyond chance, not materially at the pick" in notes and "confidence rose from 62.5% at step 10" in notes
    assert "step 10: confidence rose" in noise and "within noise (p = " in noise


# ---- the trust study's two runs ----
# The trust study's two runs (docs/agreement.md), numbers only: `python bench/trust_study.py --alarm-fixture`.
STUDY = Path(__file__).with_name("data") / "trust_study_alarm.json"
AGREEMENT = Path(__file__).resolve().parents[1] / "docs" / "agreement.md"


def write_study_run(run: Path, values: dict) -> None:
    """The run's files from the fixture's numbers; its records get stand-ins for the texts it leaves out."""
    for step, records in values["records"].items():
        texts = {"query": "", "response": "", "revisions": [""], "truncated": False}
        whole = [{**texts, **r, "confident": is_confident(r["d"], DELTA)} for r in records]
        write_jsonl(step_records_path(run, int(step)), whole)
    for step, losses in values["eval_losses"].items():
        write_atomic(step_eval_losses_path(run, int(step)), json.dumps({"losses": losses}) + "\n")
    write_jsonl(history_path(run), values["rows"])


def quoted_in_the_docs(kind: str) -> list[str]:
    """The lines docs/agreement.md quotes under "The <kind> run:"."""
    text = AGREEMENT.read_text(encoding="utf-8")
    start = text.index(f"The {kind} run:\n\n```\n") + len(f"The {kind} run:\n\n```\n")
    return text[start : text.index("```", start)].splitlines()


def study_selection(kind: str, tmp_path: Path):
    write_study_run(tmp_path / kind, json.loads(STUDY.read_text(encoding="utf-8"))[kind])
    return select_checkpoints(tmp_path / kind, metric=CONFIDENCE)


@pytest.mark.parametrize("kind", ["clean", "broken"])
def test_the_study_runs_graded_lines_are_the_ones_the_docs_quote(kind, tmp_path, capsys):
    write_study_run(tmp_path / kind, json.loads(STUDY.read_text(encoding="utf-8"))[kind])
    assert main(["select", str(tmp_path / kind), "--by", "probdiff_confidence"]) == 0
    printed = capsys.readouterr().out.replace(f"{tmp_path}/", "")
    first = min(printed.find(h) for h in ("!! ProbDiff DISAGREES", "ProbDiff and an independent") if h in printed)
    lines = printed[first:].splitlines()
    assert lines == quoted_in_the_docs(kind)
    # what the docs conclude: the broken run alarms, the clean run does not
    alarms = [line for line in lines if line.startswith("!!   step") and "confidence rose" in line]
    assert len(alarms) == {"clean": 0, "broken": 1}[kind]


def test_the_study_clean_runs_pick_gives_up_three_percent_of_its_eval_loss_gain_a_note(tmp_path):
    found = study_selection("clean", tmp_path).disagreements
    assert [d.verdict for d in found] == ["noise", "noise", "noise", "note"]  # the last: step 30 against the pick
    loss = next(w for d in found for w in d.worse if d.verdict == "note" and w.measure == "eval_loss")
    assert loss.grade.significant and loss.verdict == "note"
    given_up = loss.standing.worse_by(loss.before, loss.after)
    assert given_up == pytest.approx(0.0163, abs=1e-4)
    assert given_up / loss.standing.gain == pytest.approx(0.030, abs=0.001)  # far below the default quarter
    assert loss.standing.worse_by(loss.standing.base, loss.after) < 0  # better than the base model


def test_the_study_broken_runs_pick_significantly_below_the_base_models_rouge2_alarms(tmp_path):
    found = study_selection("broken", tmp_path).disagreements
    (alarm,) = [d for d in found if d.verdict == "alarm"]
    assert (alarm.earlier, alarm.later, alarm.earlier_is_baseline) == (0, 18, True)
    (rouge2,) = alarm.worse
    assert rouge2.measure == "rouge2" and rouge2.grade.significant
    assert rouge2.standing.gain < 0  # no checkpoint beat the base model's ROUGE-2: the share is not what decides
    # whatever share is set, the damage alarms; and the clean run stays quiet up to a share of 3%
    assert [
        d.verdict
        for d in select_checkpoints(tmp_path / "broken", alarm_gain_share=1.0, metric=CONFIDENCE).disagreements
    ].count("alarm") == 1
    clean = study_selection("clean", tmp_path)
    for share, alarms in ((0.031, 0), (0.029, 1)):
        judged = select_checkpoints(tmp_path / "clean", alarm_gain_share=share, metric=CONFIDENCE).disagreements
        assert [d.verdict for d in judged].count("alarm") == alarms, share
    assert clean.alarm_gain_share == 0.25


# A pair nobody had seen when the rule and its default were set: another split of XSum (`prepare.py --seed 1`), 30
# steps evaluated every 10 on 16 documents at 128 new tokens, a clean run and one at learning rate 2e-2, which breaks
# the model (eval loss 3.16 -> 11.7-34.4, answers "for for for ..."; its confidence 100% at the pick). Numbers only,
# from bench/trust_study.py's `alarm_values`; docs/agreement.md quotes the lines.
EXTRA_PAIR = Path(__file__).with_name("data") / "alarm_extra_pair.json"


@pytest.mark.parametrize(
    "kind, docs, alarms, notes",
    [("clean", "seed-1 clean", 0, 1), ("highlr", "seed-1 high-learning-rate", 1, 2)],
)
def test_on_a_pair_nobody_had_seen_the_damaged_run_alarms_and_the_clean_run_does_not(
    kind, docs, alarms, notes, tmp_path, capsys
):
    run = tmp_path / f"s1-{kind}"
    write_study_run(run, json.loads(EXTRA_PAIR.read_text(encoding="utf-8"))[kind])
    verdicts = [d.verdict for d in select_checkpoints(run, metric=CONFIDENCE).disagreements]
    assert (verdicts.count("alarm"), verdicts.count("note")) == (alarms, notes)
    assert main(["select", str(run), "--by", "probdiff_confidence"]) == 0
    printed = capsys.readouterr().out.replace(f"{tmp_path}/", "")
    first = min(printed.find(h) for h in ("!! ProbDiff DISAGREES", "ProbDiff and an independent") if h in printed)
    assert printed[first:].splitlines() == quoted_in_the_docs(docs)


# The trust study's two runs again (2026-11-28: the same training, ProbDiff's texts drawn by today's sampler), numbers
# only from `bench/trust_study.py --alarm-fixture`: the base model above every checkpoint in the broken run.
RERUN = Path(__file__).with_name("data") / "trust_study_rerun_alarm.json"


@pytest.mark.parametrize("kind, alarms", [("clean", 0), ("broken", 1)])
def test_the_study_rerun_alarms_in_the_broken_run_only(kind, alarms, tmp_path, capsys):
    write_study_run(tmp_path / kind, json.loads(RERUN.read_text(encoding="utf-8"))[kind])
    verdicts = [d.verdict for d in select_checkpoints(tmp_path / kind, metric=CONFIDENCE).disagreements]
    assert verdicts.count("alarm") == alarms
    assert main(["select", str(tmp_path / kind), "--by", "probdiff_confidence"]) == 0
    printed = capsys.readouterr().out.replace(f"{tmp_path}/", "")
    first = min(printed.find(h) for h in ("!! ProbDiff DISAGREES", "ProbDiff and an independent") if h in printed)
    assert printed[first:].splitlines() == quoted_in_the_docs(f"rerun's {kind}")
