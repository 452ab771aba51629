"""Where an independent measure moves against ProbDiff, in words: the end of a run, `probdiff select` and W&B say it.

A correlation over a few steps hides the one case a user must not miss: confidence goes up while a measure that does
not come from the model's own judgement (a reference metric of the answers, the eval loss on held-out references)
gets worse. Two places matter, and each is checked for every measure the run has:

- from the baseline to a checkpoint: confidence rose, the measure got worse;
- at the checkpoint ProbDiff picks: another evaluated step had a lower confidence and a better measure.

Each change is then graded (`grade_disagreements`) by a paired test over the same queries: the queries' sentence-level
reference metric at the two steps, or the held-out conversations' eval loss (`significance.paired_permutation_p`).
Only a disagreement with a significant change, or one that cannot be graded (a run without per-query values), is an
alarm; the rest are listed quietly, as within noise.

Pure functions over `agreement.step_measures` entries and the steps' per-query values; callers print
`format_disagreements`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from probdiff_callback.analysis.report import pct
from probdiff_callback.core.metric import is_finite
from probdiff_callback.core.records import Record
from probdiff_callback.core.reference_metrics import METRIC_LABELS
from probdiff_callback.core.significance import SIGNIFICANCE_LEVEL, paired_permutation_p

LOSS = "eval_loss"
LABELS = {**METRIC_LABELS, LOSS: "eval loss"}
# A change smaller than the figures' printed resolution is not called a change: reference metrics print with two
# decimals on a 0-100 scale, the eval loss with four.
TOLERANCE = {LOSS: 1e-4, **{name: 0.01 for name in METRIC_LABELS}}


@dataclass(frozen=True)
class Grade:
    """A paired test of one measure between two steps, or why there is none."""

    p: float | None  # two-sided p of the paired permutation test; None when not graded (NaN would break equality)
    n: int  # the pairs: queries (a reference metric) or held-out conversations (the eval loss)
    unit: str  # "queries" or "conversations"
    why_not: str | None = None  # why it could not be graded

    @property
    def significant(self) -> bool:
        return self.p is not None and self.p < SIGNIFICANCE_LEVEL

    @property
    def within_noise(self) -> bool:
        return self.p is not None and not self.p < SIGNIFICANCE_LEVEL

    def words(self) -> str:
        if self.p is None:
            return f"not graded ({self.why_not})"
        return f"{'significant' if self.significant else 'within noise'} (p = {self.p:.2g}, {self.n} {self.unit})"


@dataclass(frozen=True)
class Worse:
    measure: str  # a reference metric name or "eval_loss"
    before: float
    after: float
    grade: Grade | None = None  # None: not graded yet (`grade_disagreements`)

    def words(self) -> str:
        verb = "rose" if self.measure == LOSS else "fell"
        spec = ".4f" if self.measure == LOSS else ".2f"
        change = f"{LABELS[self.measure]} {verb} from {self.before:{spec}} to {self.after:{spec}}"
        return change if self.grade is None else f"{change}, {self.grade.words()}"


@dataclass(frozen=True)
class Disagreement:
    """Between `earlier` and `later` (evaluated steps), confidence rose and each measure in `worse` got worse."""

    earlier: int
    later: int
    confidence: tuple[float, float]  # at earlier, at later
    worse: tuple[Worse, ...]
    earlier_is_baseline: bool = False
    at_pick: bool = False  # `later` is the step ProbDiff picks

    @property
    def within_noise(self) -> bool:
        """Every change was graded, and none is significant: listed quietly, not an alarm."""
        return all(w.grade is not None and w.grade.within_noise for w in self.worse)

    def sentence(self) -> str:
        where = f"step {self.later}" + (" (the checkpoint ProbDiff picks)" if self.at_pick else "")
        since = f"step {self.earlier}" + (" (before training)" if self.earlier_is_baseline else "")
        low, high = self.confidence
        joint = ", and " if any(w.grade is not None for w in self.worse) else " and "
        return f"{where}: confidence rose from {pct(low)} at {since} to {pct(high)}, but " + joint.join(
            w.words() for w in self.worse
        )


def _worse(measure: str, before: object, after: object) -> Worse | None:
    if not (is_finite(before) and is_finite(after)):
        return None
    change = after - before if measure == LOSS else before - after  # type: ignore[operator]
    return Worse(measure, float(before), float(after)) if change > TOLERANCE[measure] else None  # type: ignore[arg-type]


def _value(step: Mapping, measure: str) -> object:
    return step.get(LOSS) if measure == LOSS else step["metrics"].get(measure)


def _measures(steps: Sequence[Mapping]) -> list[str]:
    names = [name for name in METRIC_LABELS if any(is_finite(s["metrics"].get(name)) for s in steps)]
    return names + ([LOSS] if any(is_finite(s.get(LOSS)) for s in steps) else [])


def _between(earlier: Mapping, later: Mapping, measures: Sequence[str], **flags: bool) -> Disagreement | None:
    """A Disagreement if confidence rose from `earlier` to `later` while some measure got worse."""
    low, high = earlier["confidence"], later["confidence"]
    if not (is_finite(low) and is_finite(high) and high > low):
        return None
    worse = tuple(w for m in measures if (w := _worse(m, _value(earlier, m), _value(later, m))) is not None)
    if not worse:
        return None
    return Disagreement(earlier["step"], later["step"], (low, high), worse, **flags)


def find_disagreements(steps: Sequence[Mapping], picked_step: int | None) -> list[Disagreement]:
    """The disagreements of a run, in step order, the pick's last.

    `steps`: `agreement.step_measures(rows)`; the baseline is the step of kind "baseline" (if any).
    `picked_step`: the step whose checkpoint ProbDiff picks, or None.
    """
    measures = _measures(steps)
    if not measures:
        return []
    by_step = {s["step"]: s for s in steps}
    baseline = next((s for s in steps if s.get("kind") == "baseline"), None)
    found: list[Disagreement] = []
    if baseline is not None:
        for step in steps:
            if step is not baseline and step["step"] != picked_step:
                found += [d for d in [_between(baseline, step, measures, earlier_is_baseline=True)] if d]
    pick = by_step.get(picked_step) if picked_step is not None else None
    if pick is not None:
        # At the pick: against the baseline, then against the step each measure prefers among the others.
        earlier_steps = [baseline] if baseline is not None else []
        for measure in measures:
            others = [s for s in steps if s is not pick and s is not baseline and is_finite(_value(s, measure))]
            if others:
                best = (min if measure == LOSS else max)(others, key=lambda s: _value(s, measure))
                if best not in earlier_steps:
                    earlier_steps.append(best)
        for earlier in earlier_steps:
            flags = {"at_pick": True, "earlier_is_baseline": earlier is baseline}
            found += [d for d in [_between(earlier, pick, measures, **flags)] if d]
    return found


# --- grading: a paired test over the same queries -------------------------------------------------------------------
# A step's per-query values: (its records, its per-conversation eval losses), each None where the step has none.
StepValues = tuple[Sequence[Record] | None, Sequence[float] | None]


def _reference_scores(records: Sequence[Record], measure: str) -> dict[str, float]:
    """Query id -> the answer's sentence-level score, for the records that have one."""
    return {
        str(r.id): float(value)
        for r in records
        if is_finite(value := (r.ref or {}).get(measure))  # type: ignore[arg-type]
    }


def _reference_pairs(
    measure: str, earlier: int, later: int, records: tuple[Sequence[Record] | None, Sequence[Record] | None]
) -> tuple[list[float], list[float]] | str:
    """(before, after) over the queries scored at both steps, or why there are none."""
    scores = []
    for step, step_records in zip((earlier, later), records):
        if step_records is None:
            return f"no records of step {step} on disk"
        scores.append(_reference_scores(step_records, measure))
        if not scores[-1]:
            return f"no per-query {LABELS[measure]} at step {step}"
    shared = [query for query in scores[0] if query in scores[1]]
    if not shared:
        return f"no query has a {LABELS[measure]} at both steps"
    return [scores[0][q] for q in shared], [scores[1][q] for q in shared]


def _loss_pairs(
    earlier: int, later: int, losses: tuple[Sequence[float] | None, Sequence[float] | None]
) -> tuple[list[float], list[float]] | str:
    """(before, after) over the held-out conversations with a loss at both steps, or why there are none."""
    for step, step_losses in zip((earlier, later), losses):
        if step_losses is None:
            return f"no eval loss per conversation at step {step}"
    before, after = losses
    assert before is not None and after is not None
    if len(before) != len(after):
        return f"the eval sets differ: {len(before)} conversations at step {earlier}, {len(after)} at step {later}"
    pairs = [(b, a) for b, a in zip(before, after) if is_finite(b) and is_finite(a)]
    if not pairs:
        return "no conversation has an eval loss at both steps"
    return [b for b, _ in pairs], [a for _, a in pairs]


def grade_change(measure: str, earlier: int, later: int, values: Callable[[int], StepValues]) -> Grade:
    """The paired permutation test of `measure` between two steps, over the queries (or conversations) both have."""
    unit = "conversations" if measure == LOSS else "queries"
    if measure == LOSS:
        pairs = _loss_pairs(earlier, later, (values(earlier)[1], values(later)[1]))
    else:
        pairs = _reference_pairs(measure, earlier, later, (values(earlier)[0], values(later)[0]))
    if isinstance(pairs, str):
        return Grade(None, 0, unit, why_not=pairs)
    before, after = pairs
    return Grade(paired_permutation_p(before, after), len(before), unit)


def grade_disagreements(found: Sequence[Disagreement], values: Callable[[int], StepValues]) -> list[Disagreement]:
    """`found`, each change graded by a paired test over the same queries; `values(step)` gives a step's records and
    per-conversation eval losses (read once per step here)."""
    cached = functools.cache(values)
    return [
        dataclasses.replace(
            d,
            worse=tuple(
                dataclasses.replace(w, grade=grade_change(w.measure, d.earlier, d.later, cached)) for w in d.worse
            ),
        )
        for d in found
    ]


# --- in words -----------------------------------------------------------------------------------------------------
def format_alarm(found: Sequence[Disagreement], run_dir: object = "RUN_DIR") -> str:
    """A block a user cannot miss, or "" without disagreements."""
    if not found:
        return ""
    lines = ["!! ProbDiff DISAGREES with a measure that does not come from the model's own judgement:"]
    lines += [f"!!   {d.sentence()}" for d in found]
    lines.append(
        "!! Confidence may be rewarding something else than quality here (length, style, the model's own taste): "
        f"read the answers in {run_dir}/probdiff/step-<N>/ before trusting the pick."
    )
    return "\n".join(lines)


def format_within_noise(found: Sequence[Disagreement]) -> str:
    """The disagreements whose every change a paired test puts within noise, listed quietly; "" without any."""
    if not found:
        return ""
    lines = [
        "ProbDiff and an independent measure moved apart, within noise (a paired test over the same queries finds no "
        f"change beyond chance, p >= {SIGNIFICANCE_LEVEL:g}):"
    ]
    return "\n".join(lines + [f"  {d.sentence()}" for d in found])


def format_disagreements(found: Sequence[Disagreement], run_dir: object = "RUN_DIR") -> str:
    """The alarm for the disagreements that are not within noise, then the quiet list of those that are; "" when
    ProbDiff and the independent measures do not disagree."""
    loud = [d for d in found if not d.within_noise]
    quiet = [d for d in found if d.within_noise]
    return "\n".join(block for block in (format_alarm(loud, run_dir), format_within_noise(quiet)) if block)
