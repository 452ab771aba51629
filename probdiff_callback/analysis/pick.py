"""The one place that decides a run's best checkpoint: for the Trainer (`best_model_checkpoint`, which
`load_best_model_at_end` loads), in the loop and beside training, and for `probdiff select`, `RUN_DIR/best`, W&B's
summary and the end-of-training table, so that all of them name the same checkpoint.

The rule is the Trainer's own (transformers 5's `_determine_best_metric`, checked against the installed release by
tests/test_pick.py): over the evaluated checkpoints in step order, a value replaces the best only where it is strictly
better by `greater_is_better`, so the earliest of equals stays; NaN is never best. The base model is no checkpoint and
is never the pick; a checkpoint whose weights are gone (rotation, a fault) is passed over.

What is ranked depends on `metric_for_best_model`:

- `probdiff_guarded`: the ProbDiff confidence of each checkpoint the run's independent measures do not call damaged
  (guard.py); a checkpoint that fails the guard is NaN, never best. Where no checkpoint passes every test but some
  are not worse than the base model on any measure (each gives up a share of the gain to another on some measure:
  the measures trade off), the pick is among those, and the run says so. Where every checkpoint is materially worse
  than the base model, there is no pick: the base model is the best the run has.
- `probdiff_confidence` (or any other `eval_probdiff_*` / `eval_ref_*` metric): that metric, unguarded.

Re-decided over every step known so far at each result (a later step can change what the run gained on a measure,
and so which checkpoints give up too much of it). Pure functions over history rows and the steps' per-query values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from probdiff_callback.analysis.crosscheck import step_measures
from probdiff_callback.analysis.disagreement import StepValues
from probdiff_callback.analysis.guard import Guard, guard_checkpoints
from probdiff_callback.analysis.report import pct
from probdiff_callback.core.metric import is_finite
from probdiff_callback.runs.run_files import HistoryRow

GUARDED = "probdiff_guarded"
CONFIDENCE = "probdiff_confidence"
GUARDED_KEY = f"eval_{GUARDED}"


def metric_key(metric_for_best_model: str) -> str:
    """The key of the metric in the Trainer's evaluation metrics (`eval_` added, as the Trainer adds it)."""
    return metric_for_best_model if metric_for_best_model.startswith("eval_") else f"eval_{metric_for_best_model}"


def is_guarded(metric_for_best_model: str | None) -> bool:
    return metric_for_best_model is not None and metric_key(metric_for_best_model) == GUARDED_KEY


def best_step(values: Mapping[int, float], greater_is_better: bool = True) -> int | None:
    """The Trainer's rule over `values` (step -> value): in step order, a strictly better value replaces the best
    (the earliest of equals stays), NaN never; None where no value is finite."""
    best, best_value = None, math.nan
    for step in sorted(values):
        value = values[step]
        if not is_finite(value):
            continue
        if best is None or (value > best_value if greater_is_better else value < best_value):
            best, best_value = step, value
    return best


@dataclass(frozen=True)
class Pick:
    """A run's best checkpoint by its metric, and why."""

    metric: str  # metric_for_best_model, as the run names it
    step: int | None  # the best checkpoint's step; None: no checkpoint may be picked
    value: float  # its value of the metric (NaN without a pick)
    values: dict[int, float]  # every evaluated checkpoint's value of the metric now (NaN: failed the guard, or none)
    candidates: dict[int, float]  # those of the checkpoints that can be loaded (on disk, or about to be saved)
    guard: Guard | None = None  # with probdiff_guarded
    among_not_worse_than_base: bool = False  # no checkpoint passed every test: the pick is among those that passed
    # the tests against the base model

    @property
    def guarded(self) -> bool:
        return self.guard is not None

    @property
    def unguarded_for_want_of_measures(self) -> bool:
        """probdiff_guarded on a run without an independent measure: the pick is the confidence pick."""
        return self.guard is not None and not self.guard.measures

    @property
    def none_passes(self) -> bool:
        """Every evaluated checkpoint is materially worse than the base model (probdiff_guarded)."""
        return self.guard is not None and self.step is None and bool(self.guard.checkpoints)

    def failed_steps(self) -> list[int]:
        return [] if self.guard is None else self.guard.failed_steps

    def line(self) -> str:
        """One line on the pick: what guarded it, or that nothing did, or that nothing passed; "" for an unguarded
        metric with a pick, or before any checkpoint was evaluated."""
        if self.guard is None or not self.values:
            return ""
        if not self.guard.measures:
            return (
                "probdiff_guarded: this run has no independent measure (no eval loss on held-out references, no "
                "reference metric): nothing guarded the pick, which is the highest confidence"
            )
        measures = ", ".join(_label(m) for m in self.guard.measures)
        failed = self.failed_steps()
        if self.none_passes:
            return (
                f"probdiff_guarded: no checkpoint passes: every one is materially worse than the base model on "
                f"{measures} ({self._failures(failed)}); no checkpoint is the best, the base model is"
            )
        if self.step is None:
            return ""
        head = f"probdiff_guarded: step {self.step} (confidence {pct(self.value)}), guarded by {measures}"
        if ungraded := self.guard.ungraded:
            head += f" (not graded, no per-query values kept: {', '.join(_label(m) for m in ungraded)})"
        if self.among_not_worse_than_base:
            head += (
                "; no checkpoint passes every test (each gives up a material share of the gain on some measure to "
                "another): the pick is among those not worse than the base model"
            )
        if failed:
            return f"{head}; failed: {self._failures(failed)}"
        return f"{head}; every checkpoint passed"

    def _failures(self, steps: Sequence[int]) -> str:
        assert self.guard is not None
        return "; ".join(f"step {step}: {self.guard.why_failed(step)}" for step in steps)


def _label(measure: str) -> str:
    from probdiff_callback.analysis.disagreement import LABELS

    return LABELS[measure]


def decide(
    rows: Sequence[HistoryRow],
    values: Callable[[int], StepValues],
    metric_for_best_model: str,
    metric_of: Callable[[HistoryRow], float],
    *,
    greater_is_better: bool = True,
    gain_share: float,
    usable: Callable[[HistoryRow], bool] = lambda row: True,
    grades: dict | None = None,
) -> Pick:
    """The pick over `rows` (the run's history so far): `metric_of(row)` is a row's value of an unguarded metric;
    `values(step)` the step's records and per-conversation eval losses (for the guard); `usable(row)`: the row's
    checkpoint is there to load (or about to be saved); `grades`: the guard's p-values kept across decisions."""
    checkpoints = [row for row in rows if row.kind != "baseline" and not row.failed]
    if not is_guarded(metric_for_best_model):
        values_now = {row.global_step: float(metric_of(row)) for row in checkpoints}
        candidates = {s: v for s, v in values_now.items() if usable(_row(checkpoints, s))}
        step = best_step(candidates, greater_is_better)
        return Pick(metric_for_best_model, step, values_now.get(step, math.nan), values_now, candidates)
    guard = guard_checkpoints(step_measures(rows), values, gain_share, grades)
    confidence = {row.global_step: row.confidence for row in checkpoints}

    def among(passes: Callable[[int], bool]) -> tuple[dict[int, float], dict[int, float], int | None]:
        ranked = {s: (c if passes(s) else math.nan) for s, c in confidence.items()}
        candidates = {s: v for s, v in ranked.items() if usable(_row(checkpoints, s))}
        return ranked, candidates, best_step(candidates)

    ranked, candidates, step = among(guard.passed)
    fallback = False
    if step is None and any(is_finite(v) for v in confidence.values()):
        ranked_base, candidates_base, step = among(guard.not_worse_than_base)
        fallback = step is not None
        if fallback:
            ranked, candidates = ranked_base, candidates_base
    return Pick(metric_for_best_model, step, ranked.get(step, math.nan), ranked, candidates, guard, fallback)


def _row(rows: Sequence[HistoryRow], step: int) -> HistoryRow:
    return next(row for row in rows if row.global_step == step)
