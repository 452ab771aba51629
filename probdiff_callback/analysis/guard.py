"""The guard of the guarded pick (`metric_for_best_model="probdiff_guarded"`): which checkpoints the run's independent
measures call damaged, by the alarm's own rule (materiality.py).

A checkpoint fails where, on a measure that does not come from the model's own judgement (the eval loss on held-out
references; BLEU and chrF, or ROUGE-1/2/L, of its answers), it is

- significantly worse than the base model, or
- significantly worse than the measure's best other checkpoint, by more than `gain_share` of what training gained on
  the measure (without a baseline the gain is unknown and any significant loss counts, as in the alarm).

Each of those comparisons is the alarm's paired test over the same queries or conversations
(`disagreement.grade_change`). A checkpoint is tested on every measure against two steps, so up to 2 x 5 tests
(translation: BLEU, chrF and the loss; summarization: ROUGE-1/2/L and the loss): at p < 0.05 each, a clean checkpoint
would fail one of them by chance far more often than 5% of the time. Holm's step-down procedure over the checkpoint's
tests keeps that chance at 5% (family-wise, whatever the dependence between the measures): the smallest p must be
below 0.05 / m, the next below 0.05 / (m - 1), and so on, m being the comparisons made. A comparison the checkpoint is
not worse in can never fail it; it still counts in m. A change that cannot be graded (a run written before per-query
values were kept) does not fail a checkpoint: the guard acts on tests, not on sizes alone (the alarm still names it).

Pure functions over `crosscheck.step_measures` entries and the steps' per-query values (`disagreement.StepValues`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from probdiff_callback.analysis.disagreement import (
    LABELS,
    LOSS,
    TOLERANCE,
    StepValues,
    figure_spec,
    grade_change,
    measure_value,
    measures_of,
    standings,
)
from probdiff_callback.analysis.materiality import Standing, check_gain_share, gives_up_too_much, share_of_gain
from probdiff_callback.core.metric import is_finite
from probdiff_callback.core.significance import SIGNIFICANCE_LEVEL


@dataclass(frozen=True)
class Comparison:
    """One test of a checkpoint on one measure, against the base model or the measure's best other checkpoint."""

    measure: str
    against: int  # the step compared with
    against_base: bool
    value: float  # the checkpoint's
    other: float  # the step compared with's
    worse_by: float  # how much worse the checkpoint is (negative: better)
    p: float | None  # the paired test's two-sided p; None: not graded (or not worse: no test needed)
    material: bool  # by its size: worse than the base model at all, or more than the share of the gain given up
    failed: bool = False  # after Holm's procedure: significantly and materially worse

    @property
    def worse(self) -> bool:
        """Worse beyond the figures' printed resolution (only then is the change tested)."""
        return self.worse_by > TOLERANCE[self.measure]

    def words(self, standing: Standing | None = None) -> str:
        spec = figure_spec(self.measure)
        where = "the base model" if self.against_base else f"step {self.against}"
        p = "not graded" if self.p is None else f"p = {self.p:.2g}"
        share = ""
        if not self.against_base and standing is not None:
            given = share_of_gain(self.worse_by, standing.gain)
            share = f", {100 * given:.0f}% of the gain" if given is not None else ""
        return f"{LABELS[self.measure]} {self.value:{spec}} against {where}'s {self.other:{spec}} ({p}{share})"


@dataclass(frozen=True)
class CheckpointGuard:
    step: int
    comparisons: tuple[Comparison, ...]

    @property
    def passed(self) -> bool:
        return not any(c.failed for c in self.comparisons)

    @property
    def failures(self) -> tuple[Comparison, ...]:
        return tuple(c for c in self.comparisons if c.failed)


@dataclass(frozen=True)
class Guard:
    """The guard over a run's evaluated checkpoints (the steps after the baseline)."""

    checkpoints: dict[int, CheckpointGuard]
    measures: tuple[str, ...]  # the independent measures the run has; empty: nothing guards the pick
    standings: dict[str, Standing]
    gain_share: float

    @property
    def ungraded(self) -> tuple[str, ...]:
        """The measures on which a checkpoint was worse but the change could not be graded (no per-query values)."""
        found = {c.measure for check in self.checkpoints.values() for c in check.comparisons if c.p is None and c.worse}
        return tuple(m for m in self.measures if m in found)

    def passed(self, step: int) -> bool:
        """Whether the step's checkpoint passes (a step the guard did not see, the baseline, passes)."""
        check = self.checkpoints.get(step)
        return check is None or check.passed

    def not_worse_than_base(self, step: int) -> bool:
        """Whether the step's checkpoint passes the tests against the base model (its other failures aside)."""
        check = self.checkpoints.get(step)
        return check is None or not any(c.against_base for c in check.failures)

    @property
    def failed_steps(self) -> list[int]:
        return sorted(step for step, check in self.checkpoints.items() if not check.passed)

    def why_failed(self, step: int) -> str:
        """The step's failed comparison with the smallest p, in words, and how many more failed ("" where it
        passed)."""
        check = self.checkpoints.get(step)
        if check is None or check.passed:
            return ""
        first, *more = sorted(check.failures, key=lambda c: (c.p if c.p is not None else 1.0, not c.against_base))
        words = first.words(self.standings.get(first.measure))
        return words + (f" and {len(more)} more" if more else "")

    def passed_all_the_same(self, step: int) -> str:
        """Why a checkpoint that passed has a material change beyond chance tested alone (as the alarm tests each
        change, so it can alarm at a guarded pick), in words; "" where it failed or has no such change."""
        check = self.checkpoints.get(step)
        if check is None or not check.passed:
            return ""
        alone = [c for c in check.comparisons if c.material and c.p is not None and c.p < SIGNIFICANCE_LEVEL]
        if not alone:
            return ""
        first = min(alone, key=lambda c: c.p or 0.0)  # every p here is a number below the level
        m = len(check.comparisons)
        more = f" (and {len(alone) - 1} more)" if len(alone) > 1 else ""
        return (
            f"the guard passed step {step} all the same: {first.words(self.standings.get(first.measure))}{more} is "
            f"beyond chance tested alone, as the alarm above tests it, but not among the checkpoint's {m} comparisons "
            f"tested together (Holm's procedure: the smallest p must be below {SIGNIFICANCE_LEVEL:g}/{m} = "
            f"{SIGNIFICANCE_LEVEL / m:.2g}), which keeps the chance of failing a sound checkpoint at "
            f"{100 * SIGNIFICANCE_LEVEL:g}%"
        )


def holm(ps: Sequence[float], alpha: float = SIGNIFICANCE_LEVEL) -> list[bool]:
    """Holm's step-down procedure: which of the p-values are rejected, keeping the family-wise error at `alpha`."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    rejected = [False] * len(ps)
    for rank, i in enumerate(order):
        if not ps[i] < alpha / (len(ps) - rank):
            break
        rejected[i] = True
    return rejected


def _comparisons(
    step: Mapping,
    others: Sequence[Mapping],
    baseline: Mapping | None,
    measures: Sequence[str],
    by_measure: Mapping[str, Standing],
    grade: Callable[[str, int, int], float | None],
    gain_share: float,
) -> list[Comparison]:
    """The checkpoint's comparisons on each measure: against the base model and against the measure's best other
    checkpoint, each graded where the checkpoint is worse (beyond the figures' printed resolution)."""
    found = []
    for measure in measures:
        value = measure_value(step, measure)
        if not is_finite(value):
            continue
        standing = by_measure[measure]
        candidates = [s for s in others if is_finite(measure_value(s, measure))]
        rivals: list[tuple[Mapping, bool]] = [] if baseline is None else [(baseline, True)]
        if candidates:
            rivals.append(
                ((min if measure == LOSS else max)(candidates, key=lambda s: measure_value(s, measure)), False)
            )
        for rival, against_base in rivals:
            other = measure_value(rival, measure)
            if not is_finite(other):
                continue
            worse_by = standing.worse_by(float(other), float(value))  # type: ignore[arg-type]
            worse = worse_by > TOLERANCE[measure]
            material = worse and (against_base or gives_up_too_much(worse_by, standing.gain, gain_share))
            p = grade(measure, rival["step"], step["step"]) if worse else None
            found.append(
                Comparison(measure, rival["step"], against_base, float(value), float(other), worse_by, p, material)  # type: ignore[arg-type]
            )
    return found


def _decided(comparisons: list[Comparison]) -> tuple[Comparison, ...]:
    """The comparisons with `failed` set by Holm's procedure over all of them (one the checkpoint is not worse in, or
    that could not be graded, has p = 1)."""
    ps = [1.0 if c.p is None or not c.worse else c.p for c in comparisons]
    rejected = holm(ps)
    return tuple(
        Comparison(**{**c.__dict__, "failed": c.material and is_rejected})
        for c, is_rejected in zip(comparisons, rejected)
    )


def guard_checkpoints(
    steps: Sequence[Mapping],
    values: Callable[[int], StepValues],
    gain_share: float,
    grades: dict[tuple[str, int, int], float] | None = None,
) -> Guard:
    """Which evaluated checkpoints pass the guard. `steps`: `crosscheck.step_measures(rows)` (the baseline is the step
    of kind "baseline"); `values(step)`: the step's records and per-conversation eval losses. `grades`: the p-values
    of earlier decisions over the same run, kept by the caller (a step's values do not change once written, so a test
    runs once per pair of steps, not at every decision); a change that could not be graded is not kept."""
    check_gain_share(gain_share)
    measures = tuple(measures_of(steps))
    by_measure = standings(steps)
    baseline = next((s for s in steps if s.get("kind") == "baseline"), None)
    checkpoints = [s for s in steps if s is not baseline]
    cached = functools.cache(values)
    kept = {} if grades is None else grades

    def grade(measure: str, earlier: int, later: int) -> float | None:
        key = (measure, earlier, later)
        if key not in kept:
            p = grade_change(measure, earlier, later, cached).p
            if p is None:
                return None
            kept[key] = p
        return kept[key]

    guards = {}
    for step in checkpoints:
        others = [s for s in checkpoints if s is not step]
        found = _comparisons(step, others, baseline, measures, by_measure, grade, gain_share)
        guards[step["step"]] = CheckpointGuard(step["step"], _decided(found))
    return Guard(guards, measures, by_measure, gain_share)
