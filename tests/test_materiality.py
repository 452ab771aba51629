"""analysis/materiality.py: whether a disagreement matters. The rule at each of its boundaries (the share of the gain
just below and above the setting, significant and not, the pick better and worse than the base model, graded and not),
then the same rule through a run's steps: the sizes each line states and what the alarm says the measures favour."""

from __future__ import annotations

import pytest
from _records import make_record
from _runs import GOOD, POOR, write_run

from probdiff_callback.analysis.disagreement import disagreements_of, format_disagreements, standings
from probdiff_callback.analysis.materiality import Standing, check_gain_share, share_of_gain, verdict
from probdiff_callback.cli import main
from probdiff_callback.core.config import DEFAULT_ALARM_GAIN_SHARE, ConfigError, ProbDiffConfig
from probdiff_callback.core.significance import SIGNIFICANCE_LEVEL

SHARE = DEFAULT_ALARM_GAIN_SHARE
SIGNIFICANT, NOT_SIGNIFICANT = SIGNIFICANCE_LEVEL / 2, SIGNIFICANCE_LEVEL  # p = 0.05 is not below 0.05


def judge(*, at_pick=True, against_base=False, given_up=1.0, gain: float | None = 10.0, p=SIGNIFICANT, share=SHARE):
    return verdict(at_pick=at_pick, against_base=against_base, given_up=given_up, gain=gain, p=p, gain_share=share)


# ---- the rule, at its boundaries ----
def test_a_significant_give_up_alarms_just_above_the_share_and_is_a_note_at_or_below_it():
    assert judge(given_up=2.6, gain=10.0) == "alarm"  # 26% of the gain
    assert judge(given_up=2.5, gain=10.0) == "note"  # exactly a quarter is not more than a quarter
    assert judge(given_up=2.4, gain=10.0) == "note"
    assert judge(given_up=2.4, gain=10.0, share=0.2) == "alarm"  # the setting moves the boundary


def test_significant_or_not_decides_before_the_size():
    for given_up in (2.4, 2.6, 100.0):
        assert judge(given_up=given_up, p=NOT_SIGNIFICANT) == "noise"
        assert judge(given_up=given_up, against_base=True, p=NOT_SIGNIFICANT) == "noise"
    assert judge(given_up=2.6, p=SIGNIFICANCE_LEVEL - 1e-9) == "alarm"


def test_worse_than_the_base_model_alarms_whatever_its_size_and_better_than_it_by_the_share():
    assert judge(against_base=True, given_up=0.001, gain=10.0) == "alarm"  # damage, however small, if significant
    assert judge(against_base=True, given_up=0.001, gain=10.0, share=1.0) == "alarm"
    # a pick better than the base model (given up 2.6 of a gain of 10: still 7.4 above it) alarms by the share alone
    assert judge(against_base=False, given_up=2.6, gain=10.0) == "alarm"
    assert judge(against_base=False, given_up=2.4, gain=10.0) == "note"


def test_away_from_the_pick_nothing_alarms():
    assert judge(at_pick=False, against_base=True) == "note"
    assert judge(at_pick=False, given_up=9.0, gain=10.0) == "note"
    assert judge(at_pick=False, p=NOT_SIGNIFICANT) == "noise"


def test_without_a_gain_the_base_model_decides_and_without_a_baseline_a_significant_change_alarms():
    # no checkpoint beat the base model: nothing to give up against a checkpoint; the line against the base decides
    assert judge(given_up=5.0, gain=0.0) == "note"
    assert judge(given_up=5.0, gain=-1.0) == "note"
    assert judge(given_up=5.0, gain=-1.0, against_base=True) == "alarm"
    # no baseline evaluated: no gain to size it against, so it alarms as every significant change did before sizes
    assert judge(given_up=0.001, gain=None) == "alarm"


def test_a_change_that_cannot_be_graded_is_judged_by_its_size_alone():
    assert judge(p=None, against_base=True) == "alarm"
    assert judge(p=None, given_up=2.6, gain=10.0) == "alarm"
    assert judge(p=None, given_up=2.4, gain=10.0) == "note"
    assert judge(p=None, at_pick=False, against_base=True) == "note"


def test_the_share_is_checked_with_a_clear_message():
    assert check_gain_share(0.0) == 0.0 and check_gain_share(1.0) == 1.0
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"alarm_gain_share=.*between 0 and 1"):
            judge(share=bad)
    with pytest.raises(ConfigError, match=r"alarm_gain_share=1.5: a share of the gain, in \[0, 1\]"):
        ProbDiffConfig(alarm_gain_share=1.5)
    assert ProbDiffConfig().alarm_gain_share == SHARE == 0.25


def test_the_gain_and_its_share_in_each_direction():
    loss = Standing(lower_is_better=True, base=3.0, base_confidence=0.5, best_step=30, best=2.5, best_confidence=0.6)
    rouge = Standing(lower_is_better=False, base=10.0, base_confidence=0.5, best_step=6, best=8.0, best_confidence=0.6)
    assert loss.gain == pytest.approx(0.5) and loss.worse_by(2.5, 2.6) == pytest.approx(0.1)
    assert rouge.gain == pytest.approx(-2.0) and rouge.worse_by(8.0, 7.0) == pytest.approx(1.0)
    assert share_of_gain(0.1, loss.gain) == pytest.approx(0.2)
    assert share_of_gain(1.0, rouge.gain) is None and share_of_gain(1.0, None) is None
    assert Standing(True, None, None, 30, 2.5, 0.6).gain is None


# ---- through a run's steps ----
# ROUGE-L of 8 queries: the base model at 20, the best checkpoint (step 10) at 30, the pick (step 20, most confident)
# 30 - `given_up` on every query; the eval loss stays out of it (no per-conversation values are needed).
def steps(pick_rouge: float, base_rouge: float = 20.0) -> list[dict]:
    def step(number, confidence, rouge, kind="evaluate"):
        return {"step": number, "kind": kind, "confidence": confidence, "eval_loss": None, "metrics": {"rougeL": rouge}}

    return [step(0, 0.25, base_rouge, "baseline"), step(10, 0.5, 30.0), step(20, 0.75, pick_rouge)]


def per_query(run: list[dict], noisy: bool = False):
    """Each step's 8 queries scored at its ROUGE-L: every query alike (a shift is significant, p = 2/256), or
    spread by ±10 (noisy: the same shift within noise)."""
    spread = [10.0, -10.0, 10.0, -10.0, -10.0, 10.0, -10.0, 10.0]
    values = {}
    for s in run:
        shift = [spread[i] if noisy and s["step"] == 20 else 0.0 for i in range(8)]
        records = [make_record(f"q{i}", ref={"rougeL": s["metrics"]["rougeL"] + shift[i]}) for i in range(8)]
        values[s["step"]] = (records, None)
    return values.__getitem__


def judged(pick_rouge: float, noisy: bool = False, base_rouge: float = 20.0, share: float = SHARE):
    run = steps(pick_rouge, base_rouge)
    return disagreements_of(run, 20, per_query(run, noisy), share)


def test_a_run_just_below_and_above_the_share_of_its_gain():
    # the gain is 30 - 20 = 10: the pick gives up 2.4 (a note) or 2.6 (an alarm) against step 10
    (below,) = judged(27.6)
    (above,) = judged(27.4)
    assert (below.earlier, below.later, below.verdict, above.verdict) == (10, 20, "note", "alarm")
    assert below.worse[0].grade.p == pytest.approx(2 / 256)
    assert (
        "ROUGE-L fell from 30.00 to 27.40, significant (p = 0.0078, 8 queries) [2.60 worse than the best checkpoint "
        "(step 10: 30.00), 26.0% of the 10.00 training gained on it; 7.40 better than the base model]"
        in format_disagreements([above])
    )
    (noisy,) = judged(27.4, noisy=True)  # the same mean, spread over the queries: within noise
    assert noisy.verdict == "noise" and "[" not in format_disagreements([noisy])  # noise states no size


def test_a_run_whose_pick_is_worse_than_the_base_model_alarms_and_says_what_the_measures_favour():
    found = judged(19.0)  # below the base model's 20: against it and against step 10
    assert [(d.earlier, d.verdict) for d in found] == [(0, "alarm"), (10, "alarm")]
    text = format_disagreements(found, "runs/x")
    assert text.startswith("!! ProbDiff DISAGREES") and "1.00 worse than the base model]" in text
    assert (
        "!! The independent measures favour instead (the pick: step 20, confidence 75.0%):\n"
        "!!   step 10: ROUGE-L 30.00 against the pick's 19.00; confidence 50.0%, 25.0 points below the pick's\n"
        "!! Confidence may be rewarding" in text
    )
    (noise_only,) = [d for d in judged(19.0, noisy=True) if d.earlier == 0]
    assert noise_only.verdict == "noise"


def test_where_no_checkpoint_beat_the_base_model_the_alarm_names_the_base_model():
    found = judged(25.0, base_rouge=35.0)  # base 35, best checkpoint 30, pick 25
    assert [(d.earlier, d.later, d.verdict) for d in found] == [(0, 10, "note"), (0, 20, "alarm"), (10, 20, "note")]
    assert standings(steps(25.0, 35.0))["rougeL"].gain == pytest.approx(-5.0)
    text = format_disagreements(found)
    assert (
        "[5.00 worse than the best checkpoint (step 10: 30.00), and training gained nothing on it; 10.00 worse" in text
    )
    assert "!!   the base model: ROUGE-L 35.00 against the pick's 25.00; confidence 25.0%, 50.0 points below" in text
    assert "beyond chance, not materially at the pick" in text  # the lines not against the base are notes


def test_probdiff_select_takes_the_share_and_refuses_one_that_is_not(tmp_path, capsys):
    write_run(tmp_path / "run", {0: POOR, 10: GOOD}, checkpoints=(10,))
    assert main(["select", str(tmp_path / "run"), "--alarm-gain-share", "0.1"]) == 0
    assert main(["select", str(tmp_path / "run"), "--alarm-gain-share", "1.5"]) == 2
    assert "probdiff select: error: alarm_gain_share=1.5: the share of what training gained" in capsys.readouterr().err


def test_the_pick_is_held_against_the_base_model_even_where_probdiff_ranks_the_base_model_higher():
    run = steps(19.0)
    run[0]["confidence"] = 0.875  # the base model above every checkpoint, by ProbDiff too
    found = disagreements_of(run, 20, per_query(run), SHARE)
    assert [(d.earlier, d.later, d.verdict) for d in found] == [(0, 20, "alarm"), (10, 20, "alarm")]
    text = format_disagreements(found)
    assert (
        "step 20 (the checkpoint ProbDiff picks): confidence went from 87.5% at step 0 (before training) to 75.0% "
        "(ProbDiff does not put the pick above it either), and ROUGE-L fell from 20.00 to 19.00, significant" in text
    )
    # away from the pick a rise is still needed: step 10 (50.0%, below the base model's 87.5%) has no line of its own
    assert all(d.later == 20 for d in found)
