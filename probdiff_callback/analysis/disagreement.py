"""Where an independent measure moves against ProbDiff, in words: the end of a run, `probdiff select` and W&B say it.

A correlation over a few steps hides the one case a user must not miss: confidence goes up while a measure that does
not come from the model's own judgement (a reference metric of the answers, the eval loss on held-out references)
gets worse. Two places matter, and each is checked for every measure the run has:

- from the baseline to a checkpoint: confidence rose, the measure got worse;
- at the checkpoint ProbDiff picks: another evaluated step had a lower confidence and a better measure.

Pure functions over `agreement.step_measures` entries; callers print `format_disagreements`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from probdiff_callback.analysis.report import pct
from probdiff_callback.core.metric import is_finite
from probdiff_callback.core.reference_metrics import METRIC_LABELS

LOSS = "eval_loss"
LABELS = {**METRIC_LABELS, LOSS: "eval loss"}
# A change smaller than the figures' printed resolution is not called a change: reference metrics print with two
# decimals on a 0-100 scale, the eval loss with four.
TOLERANCE = {LOSS: 1e-4, **{name: 0.01 for name in METRIC_LABELS}}


@dataclass(frozen=True)
class Worse:
    measure: str  # a reference metric name or "eval_loss"
    before: float
    after: float

    def words(self) -> str:
        verb = "rose" if self.measure == LOSS else "fell"
        spec = ".4f" if self.measure == LOSS else ".2f"
        return f"{LABELS[self.measure]} {verb} from {self.before:{spec}} to {self.after:{spec}}"


@dataclass(frozen=True)
class Disagreement:
    """Between `earlier` and `later` (evaluated steps), confidence rose and each measure in `worse` got worse."""

    earlier: int
    later: int
    confidence: tuple[float, float]  # at earlier, at later
    worse: tuple[Worse, ...]
    earlier_is_baseline: bool = False
    at_pick: bool = False  # `later` is the step ProbDiff picks

    def sentence(self) -> str:
        where = f"step {self.later}" + (" (the checkpoint ProbDiff picks)" if self.at_pick else "")
        since = f"step {self.earlier}" + (" (before training)" if self.earlier_is_baseline else "")
        low, high = self.confidence
        return f"{where}: confidence rose from {pct(low)} at {since} to {pct(high)}, but " + " and ".join(
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


def format_disagreements(found: Sequence[Disagreement], run_dir: object = "RUN_DIR") -> str:
    """A block a user cannot miss, or "" when ProbDiff and the independent measures do not disagree."""
    if not found:
        return ""
    lines = ["!! ProbDiff DISAGREES with a measure that does not come from the model's own judgement:"]
    lines += [f"!!   {d.sentence()}" for d in found]
    lines.append(
        "!! Confidence may be rewarding something else than quality here (length, style, the model's own taste): "
        f"read the answers in {run_dir}/probdiff/step-<N>/ before trusting the pick."
    )
    return "\n".join(lines)
