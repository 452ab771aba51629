"""One evaluator per run: the queue's `evaluator.lock`, held for the life of `probdiff watch`.

Two evaluators of one queue would evaluate the same step twice and both write the history. The lock is
`runtime/held_lock.py`'s (training/run_lock.py holds the run directory the same way): only a live evaluator holds it, a
killed one never blocks the next, and its text names the holder in the refusal. `evaluator_holder` says which
evaluator, if any, is evaluating a run's queue.
"""

from __future__ import annotations

from probdiff_callback.beside.queue import Queue
from probdiff_callback.runtime import held_lock
from probdiff_callback.runtime.held_lock import HeldLock, LockHeld

UNKNOWN_HOLDER = {"host": "?", "pid": "?", "started": "?", "command": "?"}


class EvaluatorBusy(ValueError):
    """The run already has an evaluator; the message names it."""


def describe_holder(holder: dict) -> str:
    """`host H, pid P, started S (`command`)`: who holds the lock, as messages name it."""
    started = holder.get("started")
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {started} (`{holder.get('command')}`)"


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


def evaluator_holder(queue: Queue) -> dict | None:
    """Who holds the queue's evaluator lock ({host, pid, started, command}), or None when no live evaluator does (a
    missing lock file is not created)."""
    try:
        held_lock.raise_if_held(queue.lock_path)
    except LockHeld as busy:
        return busy.holder or dict(UNKNOWN_HOLDER)
    return None
