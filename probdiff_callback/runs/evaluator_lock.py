"""One evaluator per run: `queue/evaluator.lock`, held for the life of `probdiff watch`.

Two evaluators of one queue would evaluate the same step twice and both write the history. The lock is
`runtime/held_lock.py`'s (train/run_lock.py holds the run directory the same way): only a live evaluator holds it, a
killed one never blocks the next, and its text names the holder in the refusal.

`evaluator_holder` says which evaluator, if any, is evaluating a run's queue.
"""

from __future__ import annotations

from pathlib import Path

from probdiff_callback.runs.queue import LOCK_FILE
from probdiff_callback.runtime import held_lock
from probdiff_callback.runtime.held_lock import HeldLock, LockHeld

UNKNOWN_HOLDER = {"host": "?", "pid": "?", "started": "?", "command": "?"}


class EvaluatorBusy(ValueError):
    """The run already has an evaluator; the message names it."""


def describe_holder(holder: dict) -> str:
    """`host H, pid P, started S (`command`)`: who holds the lock, as messages name it."""
    started = holder.get("started")
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {started} (`{holder.get('command')}`)"


def busy_message(queue: Path, holder: dict | None) -> str:
    who = "another evaluator" if holder is None else f"another evaluator: {describe_holder(holder)}"
    stop = "" if holder is None else f" (kill {holder.get('pid')} on {holder.get('host')})"
    return (
        f"{queue / LOCK_FILE}: the run {queue.parent.parent} is evaluated by {who}. One evaluator per run: it takes "
        f"every queued step; wait for it, or stop it{stop} and start `probdiff watch` again"
    )


def hold_evaluator(queue: Path) -> HeldLock:
    """Take the queue's evaluator lock, or an `EvaluatorBusy` naming the evaluator that holds it."""
    try:
        return held_lock.hold(queue / LOCK_FILE, "a second evaluator from taking the same steps")
    except LockHeld as busy:
        raise EvaluatorBusy(busy_message(queue, busy.holder)) from None


def evaluator_holder(queue: Path) -> dict | None:
    """Who holds the queue's evaluator lock ({host, pid, started, command}), or None when no live evaluator does (a
    missing lock file is not created)."""
    try:
        held_lock.raise_if_held(queue / LOCK_FILE)
    except LockHeld as busy:
        return busy.holder or dict(UNKNOWN_HOLDER)
    return None
