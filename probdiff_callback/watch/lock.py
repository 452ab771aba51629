"""One evaluator per run: the queue's `evaluator.lock`, held for the life of `probdiff watch`.

Two evaluators of one queue would evaluate the same step twice and both write the history. The lock is
`runtime/held_lock.py`'s (training/run_lock.py holds the run directory the same way): only a live evaluator holds it, a
killed one never blocks the next, and its text names the holder in the refusal. Who holds it is the queue's to say
(`runs/queue.py`'s `evaluator_holder`), since training asks it too.
"""

from __future__ import annotations

from probdiff_callback.runs.queue import Queue, describe_holder
from probdiff_callback.runtime import held_lock
from probdiff_callback.runtime.held_lock import HeldLock, LockHeld


class EvaluatorBusy(ValueError):
    """The run already has an evaluator; the message names it."""


def busy_message(queue: Queue, holder: dict | None) -> str:
    who = "another evaluator" if holder is None else f"another evaluator: {describe_holder(holder)}"
    stop = "" if holder is None else f" (kill {holder.get('pid')} on {holder.get('host')})"
    return (
        f"{queue.lock_path}: the run {queue.run_dir} is evaluated by {who}. One evaluator per run: it takes every "
        f"queued step; wait for it, or stop it{stop} and start `probdiff watch` again"
    )


def hold_evaluator(queue: Queue) -> HeldLock:
    """Take the queue's evaluator lock, or an `EvaluatorBusy` naming the evaluator that holds it."""
    try:
        return held_lock.hold(queue.lock_path, "a second evaluator from taking the same steps")
    except LockHeld as busy:
        raise EvaluatorBusy(busy_message(queue, busy.holder)) from None
