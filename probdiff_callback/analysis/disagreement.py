"""Where an independent measure moves against ProbDiff, in words: the end of a run, `probdiff select` and W&B say it.

A correlation over a few steps hides the one case a user must not miss: confidence goes up while a measure that does
not come from the model's own judgement (a reference metric of the answers, the eval loss on held-out references)
gets worse. Two places matter, and each is checked for every measure the run has:

- from the baseline to a checkpoint: confidence rose, the measure got worse;
- at the checkpoint ProbDiff picks: another evaluated step had a lower confidence and a better measure; and against
  the base model whichever way confidence went (the pick is what a user takes, even below the base model).

Each change is then graded (`grade_disagreements`) by a paired test over the same queries: the queries' sentence-level
reference metric at the two steps, or the held-out conversations' eval loss (`significance.paired_permutation_p`),
and judged (`judge_disagreements`) by its size against what training gained on the measure (materiality.py): only a
material change at the pick is an alarm (the pick significantly worse than the base model, or giving up more than a
share of the run's gain), with the checkpoints the measures favour and their confidence; other significant changes are
notes, with their sizes; the rest are listed quietly, as within noise.

Pure functions over `agreement.step_measures` entries and the steps' per-query values; callers print
`format_disagreements`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from probdiff_callback.analysis.materiality import Standing, Verdict, share_of_gain, verdict
from probdiff_callback.analysis.report import pct
from probdiff_callback.core.config import DEFAULT_ALARM_GAIN_SHARE
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


def figure_spec(measure: str) -> str:
    return ".4f" if measure == LOSS else ".2f"


@dataclass(frozen=True)
class Worse:
    measure: str  # a reference metric name or "eval_loss"
    before: float
    after: float
    grade: Grade | None = None  # None: not graded yet (`grade_disagreements`)
    standing: Standing | None = None  # the measure over the run; None: not judged yet (`judge_disagreements`)
    verdict: Verdict | None = None

    @property
    def settled_verdict(self) -> Verdict:
        """The verdict; unjudged, as before sizes: noise when graded within noise, else an alarm."""
        if self.verdict is not None:
            return self.verdict
        return "noise" if self.grade is not None and self.grade.within_noise else "alarm"

    def size(self) -> str:
        """The later value against the best checkpoint (as a share of what training gained) and the base model."""
        standing, spec = self.standing, figure_spec(self.measure)
        if standing is None:
            return ""
        parts = []
        if standing.best is not None:
            behind = standing.worse_by(standing.best, self.after)
            if behind <= 0:
                parts.append("the best checkpoint on it")
            else:
                best = f"step {standing.best_step}: {standing.best:{spec}}"
                parts.append(f"{behind:{spec}} worse than the best checkpoint ({best})")
                if (share := share_of_gain(behind, standing.gain)) is not None:
                    parts[-1] += f", {pct(share)} of the {standing.gain:{spec}} training gained on it"
                elif standing.gain is not None:
                    parts[-1] += ", and training gained nothing on it"
        if standing.base is None:
            parts.append("no base model evaluated to set it against")
        else:
            behind_base = standing.worse_by(standing.base, self.after)
            side = "worse" if behind_base > 0 else "better"
            parts.append(
                f"{abs(behind_base):{spec}} {side} than the base model" if behind_base else "level with the base model"
            )
        return "[" + "; ".join(parts) + "]"

    def words(self) -> str:
        verb = "rose" if self.measure == LOSS else "fell"
        spec = figure_spec(self.measure)
        change = f"{LABELS[self.measure]} {verb} from {self.before:{spec}} to {self.after:{spec}}"
        if self.grade is None:
            return change
        sized = self.settled_verdict != "noise" and self.standing is not None
        return f"{change}, {self.grade.words()}" + (f" {self.size()}" if sized else "")


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
    def verdict(self) -> Verdict:
        """An alarm if any change is one, else a note if any is one, else noise (materiality.py)."""
        verdicts = {w.settled_verdict for w in self.worse}
        return "alarm" if "alarm" in verdicts else "note" if "note" in verdicts else "noise"

    @property
    def within_noise(self) -> bool:
        """Every change was graded, and none is significant: listed quietly, not an alarm."""
        return self.verdict == "noise"

    def sentence(self) -> str:
        where = f"step {self.later}" + (" (the checkpoint ProbDiff picks)" if self.at_pick else "")
        since = f"step {self.earlier}" + (" (before training)" if self.earlier_is_baseline else "")
        low, high = self.confidence
        joint = ", and " if any(w.grade is not None for w in self.worse) else " and "
        moved = (
            f"confidence rose from {pct(low)} at {since} to {pct(high)}, but "
            if high > low
            else f"confidence went from {pct(low)} at {since} to {pct(high)} (ProbDiff does not put the pick above "
            "it either), and "
        )
        return f"{where}: {moved}" + joint.join(w.words() for w in self.worse)


def _worse(measure: str, before: object, after: object) -> Worse | None:
    if not (is_finite(before) and is_finite(after)):
        return None
    change = after - before if measure == LOSS else before - after  # type: ignore[operator]
    return Worse(measure, float(before), float(after)) if change > TOLERANCE[measure] else None  # type: ignore[arg-type]


def measure_value(step: Mapping, measure: str) -> object:
    return step.get(LOSS) if measure == LOSS else step["metrics"].get(measure)


def measures_of(steps: Sequence[Mapping]) -> list[str]:
    names = [name for name in METRIC_LABELS if any(is_finite(s["metrics"].get(name)) for s in steps)]
    return names + ([LOSS] if any(is_finite(s.get(LOSS)) for s in steps) else [])


def _between(
    earlier: Mapping, later: Mapping, measures: Sequence[str], rise_needed: bool = True, **flags: bool
) -> Disagreement | None:
    """A Disagreement if confidence rose from `earlier` to `later` (or, without `rise_needed`, whichever way it went)
    while some measure got worse."""
    low, high = earlier["confidence"], later["confidence"]
    if not (is_finite(low) and is_finite(high) and (high > low or not rise_needed)):
        return None
    worse = tuple(
        w for m in measures if (w := _worse(m, measure_value(earlier, m), measure_value(later, m))) is not None
    )
    if not worse:
        return None
    return Disagreement(earlier["step"], later["step"], (low, high), worse, **flags)


def find_disagreements(steps: Sequence[Mapping], picked_step: int | None) -> list[Disagreement]:
    """The disagreements of a run, in step order, the pick's last.

    `steps`: `agreement.step_measures(rows)`; the baseline is the step of kind "baseline" (if any).
    `picked_step`: the step whose checkpoint ProbDiff picks, or None.
    """
    measures = measures_of(steps)
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
            others = [s for s in steps if s is not pick and s is not baseline and is_finite(measure_value(s, measure))]
            if others:
                best = (min if measure == LOSS else max)(others, key=lambda s: measure_value(s, measure))
                if best not in earlier_steps:
                    earlier_steps.append(best)
        for earlier in earlier_steps:
            # The pick against the base model whichever way confidence went: a user takes the pick (RUN_DIR/best) even
            # where ProbDiff puts the base model above every checkpoint, so damage to it is said either way.
            flags = {"at_pick": True, "earlier_is_baseline": earlier is baseline}
            found += [d for d in [_between(earlier, pick, measures, earlier is not baseline, **flags)] if d]
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


# --- judging: the size against what training gained (materiality.py) -----------------------------------------------
def standings(steps: Sequence[Mapping]) -> dict[str, Standing]:
    """Each measure of the run: the base model's value and the best checkpoint's (the earliest of equals), with their
    confidence. `steps`: `agreement.step_measures(rows)`."""
    baseline = next((s for s in steps if s.get("kind") == "baseline"), None)
    found = {}
    for measure in measures_of(steps):
        lower_is_better = measure == LOSS
        checkpoints = [s for s in steps if s is not baseline and is_finite(measure_value(s, measure))]
        best = (min if lower_is_better else max)(checkpoints, key=lambda s: measure_value(s, measure), default=None)
        base = measure_value(baseline, measure) if baseline is not None else None
        found[measure] = Standing(
            lower_is_better=lower_is_better,
            base=float(base) if is_finite(base) else None,  # type: ignore[arg-type]
            base_confidence=baseline["confidence"] if baseline is not None and is_finite(base) else None,
            best_step=None if best is None else best["step"],
            best=None if best is None else float(measure_value(best, measure)),  # type: ignore[arg-type]
            best_confidence=None if best is None else best["confidence"],
        )
    return found


def judge_disagreements(
    found: Sequence[Disagreement], steps: Sequence[Mapping], gain_share: float
) -> list[Disagreement]:
    """`found` (graded), each change with its measure's standing over the run and its verdict: an alarm only for a
    material change at the pick (`materiality.verdict`; `gain_share`: probdiff.alarm_gain_share)."""
    by_measure = standings(steps)

    def judged(d: Disagreement, w: Worse) -> Worse:
        standing = by_measure[w.measure]
        p = None if w.grade is None else w.grade.p
        given_up = standing.worse_by(w.before, w.after)
        call = verdict(
            at_pick=d.at_pick,
            against_base=d.earlier_is_baseline,
            given_up=given_up,
            gain=standing.gain,
            p=p,
            gain_share=gain_share,
        )
        return dataclasses.replace(w, standing=standing, verdict=call)

    return [dataclasses.replace(d, worse=tuple(judged(d, w) for w in d.worse)) for d in found]


def disagreements_of(
    steps: Sequence[Mapping], picked_step: int | None, values: Callable[[int], StepValues], gain_share: float
) -> list[Disagreement]:
    """A run's disagreements found, graded and judged: what `format_disagreements` says."""
    graded = grade_disagreements(find_disagreements(steps, picked_step), values)
    return judge_disagreements(graded, steps, gain_share)


# --- in words -----------------------------------------------------------------------------------------------------
def _rule(gain_share: float) -> str:
    return (
        "at the checkpoint ProbDiff picks, the measure is worse than the base model, or gives up more than "
        f"{100 * gain_share:g}% of what training gained on it against another checkpoint"
    )


def _favoured(found: Sequence[Disagreement]) -> dict[str, tuple[float | None, list[str]]]:
    """For the alarming changes at the pick: the steps their measures favour (the best checkpoint on the measure, and
    the base model where no checkpoint beat it), each with its confidence and the measures' figures there."""
    favoured: dict[str, tuple[float | None, list[str]]] = {}
    seen: set[str] = set()
    for w, pick in ((w, d.later) for d in found for w in d.worse if w.settled_verdict == "alarm"):
        s, spec = w.standing, figure_spec(w.measure)
        if s is None or w.measure in seen:
            continue
        seen.add(w.measure)
        options = [(f"step {s.best_step}", s.best_confidence, s.best, s.best_step != pick)]
        options.append(("the base model", s.base_confidence, s.base, s.gain is not None and s.gain <= 0))
        for where, confidence, value, eligible in options:
            if eligible and value is not None and s.worse_by(value, w.after) > 0:
                figure = f"{LABELS[w.measure]} {value:{spec}} against the pick's {w.after:{spec}}"
                favoured.setdefault(where, (confidence, []))[1].append(figure)
    return favoured


def format_favoured(found: Sequence[Disagreement]) -> list[str]:
    """What the independent measures favour instead of the pick, and what each costs in ProbDiff confidence."""
    pick = next((d for d in found if d.at_pick), None)
    if pick is None or not (favoured := _favoured(found)):
        return []
    pick_confidence = pick.confidence[1]
    lines = [
        f"!! The independent measures favour instead (the pick: step {pick.later}, confidence {pct(pick_confidence)}):"
    ]
    for where, (confidence, figures) in favoured.items():
        cost = f"confidence {pct(confidence)}"
        if is_finite(confidence) and (points := 100 * (pick_confidence - confidence)):  # type: ignore[operator]
            cost += f", {abs(points):.1f} points {'below' if points > 0 else 'above'} the pick's"
        lines.append(f"!!   {where}: {', '.join(figures)}; {cost}")
    return lines


def format_alarm(
    found: Sequence[Disagreement], run_dir: object = "RUN_DIR", gain_share: float = DEFAULT_ALARM_GAIN_SHARE
) -> str:
    """A block a user cannot miss, or "" without disagreements: the material disagreements at the pick, what the
    independent measures favour instead and at what confidence."""
    if not found:
        return ""
    lines = [
        "!! ProbDiff DISAGREES with a measure that does not come from the model's own judgement, by a material amount "
        f"({_rule(gain_share)}, beyond chance or not graded):"
    ]
    lines += [f"!!   {d.sentence()}" for d in found]
    lines += format_favoured(found)
    lines.append(
        "!! Confidence may be rewarding something else than quality here (length, style, the model's own taste): "
        f"read the answers in {run_dir}/probdiff/step-<N>/ before trusting the pick."
    )
    return "\n".join(lines)


def format_notes(found: Sequence[Disagreement], gain_share: float = DEFAULT_ALARM_GAIN_SHARE) -> str:
    """The disagreements with a significant change that is not an alarm (not material, or not at the pick), with their
    sizes; "" without any."""
    if not found:
        return ""
    lines = [
        "ProbDiff and an independent measure moved apart beyond chance, not materially at the pick (an alarm: "
        f"{_rule(gain_share)}; probdiff.alarm_gain_share):"
    ]
    return "\n".join(lines + [f"  {d.sentence()}" for d in found])


def format_within_noise(found: Sequence[Disagreement]) -> str:
    """The disagreements whose every change a paired test puts within noise, listed quietly; "" without any."""
    if not found:
        return ""
    lines = [
        "ProbDiff and an independent measure moved apart, within noise (a paired test over the same queries finds no "
        f"change beyond chance, p >= {SIGNIFICANCE_LEVEL:g}):"
    ]
    return "\n".join(lines + [f"  {d.sentence()}" for d in found])


def format_disagreements(
    found: Sequence[Disagreement], run_dir: object = "RUN_DIR", gain_share: float = DEFAULT_ALARM_GAIN_SHARE
) -> str:
    """The alarm for the material disagreements, then the notes (significant, not material), then the quiet list of
    those within noise; "" when ProbDiff and the independent measures do not disagree."""
    blocks = (
        format_alarm([d for d in found if d.verdict == "alarm"], run_dir, gain_share),
        format_notes([d for d in found if d.verdict == "note"], gain_share),
        format_within_noise([d for d in found if d.verdict == "noise"]),
    )
    return "\n".join(block for block in blocks if block)
