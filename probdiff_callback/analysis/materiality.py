"""Whether a disagreement matters: the size of a change on an independent measure against what training gained on
it, and the rule that makes a graded change an alarm, a note or noise.

A paired test (`disagreement.grade_change`) says whether a change is chance, not whether it matters: the trust study's
clean run gave up 0.016 of eval loss at its pick, significantly (p = 0.003), and 3% of what it gained; the broken run
lost two thirds of the base model's ROUGE-2 (docs/agreement.md). So each change is set against the run itself:

- the base model's value and the best checkpoint's (the best step after the baseline) on the measure;
- what training gained on it: the best checkpoint against the base model (none where no checkpoint beat the base);
- what the step gives up: its change against the earlier step of the disagreement, as a share of that gain.

The rule (`verdict`), for a change at the checkpoint ProbDiff picks (elsewhere a change is never an alarm):

- an alarm where the pick is significantly worse than the base model, or significantly worse than another checkpoint
  by more than `gain_share` of the run's gain on the measure;
- a note for any other significant change: real, but it costs less than that;
- noise where the paired test finds no change beyond chance.

A change that cannot be graded (a run written before per-query values were kept) is judged by its size alone: an alarm
where a significant change of that size would be one. Pure functions over numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from probdiff_callback.core.significance import SIGNIFICANCE_LEVEL

Verdict = Literal["alarm", "note", "noise"]


@dataclass(frozen=True)
class Standing:
    """Where a measure stands over a run: the base model's value and the best checkpoint's, with their confidence."""

    lower_is_better: bool  # the eval loss; a reference metric is better higher
    base: float | None  # None: the run evaluated no baseline
    base_confidence: float | None
    best_step: int | None  # the checkpoint best on the measure; None: no step after the baseline has a value
    best: float | None
    best_confidence: float | None

    def worse_by(self, reference: float, value: float) -> float:
        """How much worse `value` is than `reference` on this measure (negative: better)."""
        return value - reference if self.lower_is_better else reference - value

    @property
    def gain(self) -> float | None:
        """What training gained on the measure: the best checkpoint against the base model (zero or less: nothing);
        None without a baseline or a checkpoint."""
        if self.base is None or self.best is None:
            return None
        return self.worse_by(self.best, self.base)


def check_gain_share(gain_share: float) -> float:
    """`gain_share` if it is a share (0 to 1), else a ValueError that says what it is."""
    if not 0 <= gain_share <= 1:
        raise ValueError(
            f"alarm_gain_share={gain_share!r}: the share of what training gained on a measure that the pick may give "
            "up before the disagreement alarms, between 0 and 1 (0.25: a quarter)"
        )
    return gain_share


def share_of_gain(given_up: float, gain: float | None) -> float | None:
    """`given_up` as a share of what training gained; None where training gained nothing (or nothing is known)."""
    if gain is None or gain <= 0:
        return None
    return given_up / gain


def gives_up_too_much(given_up: float, gain: float | None, gain_share: float) -> bool:
    """Whether giving up `given_up` against a checkpoint is more than `gain_share` of the run's gain.

    Without a baseline the gain is unknown and the size cannot clear the change: it counts as too much, as every
    significant change alarmed before sizes. Where training gained nothing on the measure, there is nothing to give
    up: the pick's change against the base model decides (it is then worse than the base model too)."""
    if gain is None:
        return True
    share = share_of_gain(given_up, gain)
    return share is not None and share > gain_share


def verdict(
    *, at_pick: bool, against_base: bool, given_up: float, gain: float | None, p: float | None, gain_share: float
) -> Verdict:
    """An alarm, a note or noise for one change (`given_up` > 0: how much worse the later step is than the earlier).

    `at_pick`: the later step is the checkpoint ProbDiff picks; `against_base`: the earlier step is the base model;
    `gain`: `Standing.gain`; `p`: the paired test's p-value, None when the change could not be graded."""
    check_gain_share(gain_share)
    if p is not None and not p < SIGNIFICANCE_LEVEL:
        return "noise"
    material = against_base or gives_up_too_much(given_up, gain, gain_share)
    return "alarm" if at_pick and material else "note"
