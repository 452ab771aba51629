"""analysis/guard.py and the guarded pick (analysis/pick.py): a checkpoint fails where an independent measure calls it
materially worse (the alarm's rule) beyond chance after Holm's correction over its tests; at every boundary: passes;
fails against the base model; fails on the share of the gain; a later result that changes the gain re-decides; no
checkpoint passes; no independent measure."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _records import make_record

from probdiff_callback.analysis.guard import guard_checkpoints, holm
from probdiff_callback.analysis.pick import decide
from probdiff_callback.core.records import ReferenceSummary, Summary
from probdiff_callback.runs.run_files import HistoryRow

N = 32  # queries and held-out conversations per step


def per_query(mean: float, seed: int, spread: float = 4.0) -> list[float]:
    """N sentence-level scores around `mean` (the same queries at every step: a shared part per query, seeded)."""
    shared = np.random.default_rng(0).normal(0, 10, N)  # how hard each query is: the same at every step
    noise = np.random.default_rng(seed).normal(0, spread, N)
    return list(mean + shared + noise)


class Run:
    """A run's history and per-query values: each step with its confidence, per-query ROUGE-L and/or eval losses."""

    def __init__(self) -> None:
        self.rows: list[HistoryRow] = []
        self.records: dict[int, list] = {}
        self.losses: dict[int, list[float]] = {}

    def add(self, step: int, confidence: float, rouge: list[float] | None = None, loss: list[float] | None = None):
        kind = "baseline" if step == 0 else "evaluate"
        reference = None
        if rouge is not None:
            reference = ReferenceSummary(overall={"rougeL": float(np.mean(rouge))}, n_scored={}, by_category={})
            self.records[step] = [make_record(f"q{i}", ref={"rougeL": v}) for i, v in enumerate(rouge)]
        summary = Summary(confidence=confidence, n=N, delta=-0.05, reference=reference)
        eval_loss = float(np.mean(loss)) if loss is not None else math.nan
        if loss is not None:
            self.losses[step] = loss
        self.rows.append(HistoryRow(step, kind=kind, base_model=step == 0, summary=summary, eval_loss=eval_loss))
        return self

    def values(self, step: int):
        return self.records.get(step), self.losses.get(step)

    def pick(self, gain_share: float = 0.25):
        return decide(self.rows, self.values, "probdiff_guarded", lambda r: r.confidence, gain_share=gain_share)


def losses(mean: float, seed: int) -> list[float]:
    shared = np.random.default_rng(1).normal(0, 0.3, N)
    return list(mean + shared + np.random.default_rng(seed).normal(0, 0.05, N))


def test_holm_rejects_step_down():
    assert holm([0.01, 0.04, 0.03]) == [True, False, False]  # 0.01 < 0.05/3; 0.03 is not < 0.05/2
    assert holm([0.001, 0.02, 0.04]) == [True, True, True]  # 0.001 < 0.0167, 0.02 < 0.025, 0.04 < 0.05
    assert holm([0.2, 0.001]) == [False, True]
    assert holm([]) == []


def test_checkpoints_better_than_the_base_model_pass_and_the_pick_is_the_highest_confidence():
    run = Run().add(0, 0.3, per_query(20, 0)).add(10, 0.5, per_query(24, 1)).add(20, 0.75, per_query(25, 2))
    pick = run.pick()
    assert pick.step == 20 and pick.failed_steps() == []
    assert pick.line().startswith("probdiff_guarded: step 20 (confidence 75.0%), guarded by ROUGE-L; every")


def test_a_checkpoint_significantly_worse_than_the_base_model_fails_and_the_pick_moves():
    run = Run().add(0, 0.3, per_query(20, 0)).add(10, 0.5, per_query(22, 1)).add(20, 0.9, per_query(8, 2))
    pick = run.pick()
    assert pick.failed_steps() == [20] and pick.step == 10
    assert math.isnan(pick.values[20]) and pick.values[10] == 0.5
    against_base = [c for c in pick.guard.checkpoints[20].failures if c.against_base]
    assert [c.measure for c in against_base] == ["rougeL"] and against_base[0].p < 0.05 / 2
    assert "step 20: ROUGE-L" in pick.line() and "against the base model's" in pick.line()


def test_a_checkpoint_worse_than_the_base_model_within_noise_passes():
    # ROUGE-L 19.5 against 20: worse, material by size, but no paired test calls a half point over 32 queries real
    run = Run().add(0, 0.3, per_query(20, 0)).add(10, 0.9, per_query(19.5, 1))
    assert run.pick().step == 10


def test_a_checkpoint_giving_up_more_than_the_share_of_the_gain_fails_and_less_passes():
    # the gain on ROUGE-L: 30 - 20 = 10; step 20 gives up 6 of it (60%): fails at a gain share of 0.25, not at 0.75
    run = Run().add(0, 0.3, per_query(20, 0)).add(10, 0.5, per_query(30, 1)).add(20, 0.9, per_query(24, 2))
    assert run.pick(gain_share=0.25).step == 10
    (failure,) = run.pick(gain_share=0.25).guard.checkpoints[20].failures
    assert not failure.against_base and failure.against == 10
    assert run.pick(gain_share=0.75).step == 20


def test_a_later_result_that_changes_the_gain_re_decides_the_pick():
    run = Run().add(0, 0.3, per_query(20, 0)).add(10, 0.9, per_query(24, 1))
    assert run.pick().step == 10  # the best checkpoint on ROUGE-L so far: nothing given up
    run.add(20, 0.5, per_query(34, 2))  # a later step gains 14: step 10 now gives up 10 of it (71%)
    pick = run.pick()
    assert pick.failed_steps() == [10] and pick.step == 20


def test_no_checkpoint_passes_when_all_are_materially_worse_than_the_base_model():
    run = Run().add(0, 0.3, per_query(20, 0), losses(2.0, 0))
    run.add(10, 1.0, per_query(2, 1), losses(9.0, 1)).add(20, 0.9, per_query(5, 2), losses(6.0, 2))
    pick = run.pick()
    assert pick.step is None and pick.none_passes and pick.failed_steps() == [10, 20]
    assert pick.line().startswith("probdiff_guarded: no checkpoint passes: every one is materially worse than")
    assert "no checkpoint is the best, the base model is" in pick.line()


def test_checkpoints_that_only_trade_off_gains_leave_the_pick_among_those_not_worse_than_the_base_model():
    # step 10 is best on ROUGE-L, step 20 on the loss; each gives up most of the other's gain: both fail every test
    # together, neither is worse than the base model
    run = Run().add(0, 0.3, per_query(20, 0), losses(3.0, 0))
    run.add(10, 0.5, per_query(35, 1), losses(2.5, 1)).add(20, 0.8, per_query(22, 2), losses(1.0, 2))
    pick = run.pick()
    assert pick.failed_steps() == [10, 20] and pick.among_not_worse_than_base and pick.step == 20
    assert "the pick is among those not worse than the base model" in pick.line()


def test_without_an_independent_measure_the_guarded_pick_is_the_confidence_pick_and_says_so():
    run = Run().add(0, 0.3).add(10, 0.9).add(20, 0.5)
    pick = run.pick()
    assert pick.step == 10 and pick.guard.measures == ()
    assert "nothing guarded the pick, which is the highest confidence" in pick.line()


def test_holm_keeps_a_checkpoint_tested_on_several_measures_from_failing_at_one_uncorrected_p():
    """A checkpoint 2.2 points worse on ROUGE-L than the base model at p between 0.05/m and 0.05 would fail uncorrected
    and passes corrected: the correction is what keeps several measures from failing clean checkpoints by chance."""
    run = Run().add(0, 0.3, per_query(20, 0), losses(2.0, 0)).add(10, 0.6, per_query(17.8, 4), losses(1.9, 4))
    comparisons = run.pick().guard.checkpoints[10].comparisons
    assert len(comparisons) == 2  # ROUGE-L and the loss against the base model (no other checkpoint): m = 2
    (rouge,) = [c for c in comparisons if c.measure == "rougeL"]
    assert 0.05 / 2 < rouge.p < 0.05 and rouge.material and not rouge.failed
    assert run.pick().step == 10
    # what `probdiff select` says under the alarm the change raises at the pick (each change tested alone)
    assert run.pick().guard.passed_all_the_same(10) == (
        f"the guard passed step 10 all the same: ROUGE-L {rouge.value:.2f} against the base model's {rouge.other:.2f} "
        f"(p = {rouge.p:.2g}) is beyond chance tested alone, as the alarm above tests it, but not among the "
        "checkpoint's 2 comparisons tested together (Holm's procedure: the smallest p must be below 0.05/2 = 0.025), "
        "which keeps the chance of failing a sound checkpoint at 5%"
    )
    clean = Run().add(0, 0.3, per_query(20, 0), losses(2.0, 0)).add(10, 0.6, per_query(24, 1), losses(1.9, 1))
    assert clean.pick().guard.passed_all_the_same(10) == ""  # nothing worse beyond chance: nothing to explain


@pytest.mark.parametrize("gain_share", [-0.1, 1.5])
def test_a_gain_share_outside_zero_to_one_is_refused(gain_share):
    with pytest.raises(ValueError, match="alarm_gain_share"):
        guard_checkpoints([], lambda step: (None, None), gain_share)


def test_a_pair_of_steps_is_tested_once_across_decisions(monkeypatch):
    """The callback decides again at every result: with the grades it keeps, each pair of steps' paired test runs
    once, and the later decisions are the same."""
    from probdiff_callback.analysis import disagreement

    calls = []
    real = disagreement.paired_permutation_p
    monkeypatch.setattr(disagreement, "paired_permutation_p", lambda *a: calls.append(a) or real(*a))
    run = Run().add(0, 0.3, per_query(20, 0)).add(10, 0.9, per_query(8, 1)).add(20, 0.5, per_query(24, 2))
    grades: dict = {}
    first = decide(run.rows, run.values, "probdiff_guarded", lambda r: r.confidence, gain_share=0.25, grades=grades)
    tested = len(calls)
    again = decide(run.rows, run.values, "probdiff_guarded", lambda r: r.confidence, gain_share=0.25, grades=grades)
    assert tested > 0 and len(calls) == tested
    assert again.step == first.step == 20 and again.failed_steps() == first.failed_steps() == [10]
