"""Every step the evaluation beside training has taken on, on the training side: one stage per step, in one table.

    held -> queued -> done -> logged        (held -> lost: the checkpoint it waited for was not saved)

- `held`: scheduled at the Trainer's evaluation, its request waits for the Trainer's save of that step (the weights
  come from that checkpoint, or are in the queue already and the save only names the checkpoint);
- `queued`: the request is in the queue and the evaluator has not marked it done;
- `done`: the evaluator wrote the step's row (evaluated or failed), not logged to the Trainer yet (also a row a resumed
  run finds that the Trainer's log lacks);
- `logged`: the result is in the Trainer's log, its metrics known here;
- `lost`: held for a checkpoint the Trainer did not save: not evaluated (said when it is found).

Every rank keeps the same table: the main process reads the queue and hands what it found to the others. Rotation keeps
the checkpoints of the steps not logged yet; the end waits for them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from probdiff_callback.runs.queue import Request


class Stage(Enum):
    HELD = "held"
    QUEUED = "queued"
    DONE = "done"
    LOGGED = "logged"
    LOST = "lost"


@dataclass
class QueuedStep:
    stage: Stage
    checkpoint: str | None = None  # the Trainer's checkpoint of the step, where one is saved
    request: Request | None = None  # held: the request to queue at the save
    weights_ready: bool = False  # held: its weights are in the queue already (else linked from the checkpoint)
    metrics: dict[str, float] | None = None  # what the Trainer gets: logged, or a row a resumed run kept


class QueuedSteps:
    """Step -> `QueuedStep`; a step is in the table from the moment it is scheduled (the schedule takes it once)."""

    def __init__(self) -> None:
        self._steps: dict[int, QueuedStep] = {}

    def __contains__(self, step: int) -> bool:
        return step in self._steps

    def __getitem__(self, step: int) -> QueuedStep:
        return self._steps[step]

    def set(self, step: int, stage: Stage, **fields) -> QueuedStep:
        """The step at `stage` (a new entry, or the old one moved on with `fields` changed)."""
        entry = self._steps.get(step) or QueuedStep(stage)
        entry.stage = stage
        for name, value in fields.items():
            setattr(entry, name, value)
        self._steps[step] = entry
        return entry

    def at(self, *stages: Stage) -> list[int]:
        """The steps at any of `stages`, in order."""
        return sorted(s for s, entry in self._steps.items() if entry.stage in stages)

    def unlogged(self) -> list[int]:
        """The steps whose result the Trainer has not got yet (held, queued or done)."""
        return self.at(Stage.HELD, Stage.QUEUED, Stage.DONE)

    def awaited(self) -> list[int]:
        """The steps in the queue whose result is not logged yet (queued or done): what the end waits for."""
        return self.at(Stage.QUEUED, Stage.DONE)

    @property
    def evaluated(self) -> dict[int, dict[str, float]]:
        """Step -> its metrics, for the steps whose result is known (logged, or a row a resumed run kept)."""
        return {s: dict(entry.metrics) for s, entry in sorted(self._steps.items()) if entry.metrics is not None}


def describe_steps(steps: Iterable[int]) -> str:
    """`step 4` or `steps 3, 4`."""
    ordered = sorted(steps)
    return f"step{'s' if len(ordered) != 1 else ''} {', '.join(map(str, ordered))}"


def several(steps: Iterable[int]) -> bool:
    return len(list(steps)) != 1
