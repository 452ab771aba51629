"""One evaluator per run: `queue/evaluator.lock`, held with `filelock` for the life of `probdiff watch`.

Two evaluators of one queue would evaluate the same step twice and both write the history. `filelock.FileLock` takes
an `flock` on Linux, which the kernel releases when the process ends, however it ends, so only a live evaluator holds
the lock and a killed one never blocks the next (train/run_lock.py holds the run directory the same way, and says why
in more detail). The file's text (host, pid, start, command) names the holder in the refusal; a clean exit empties
it. A file system without `flock` gets a warning and no protection.

Training reads `evaluator_holder` at its start: an evaluator you started is used as it is, and the history is left
to it.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import socket
import sys
import time
from pathlib import Path

from filelock import FileLock, Timeout

from probdiff_callback.runs.queue import LOCK_FILE

NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # the file system does not lock files


class EvaluatorBusy(ValueError):
    """The run already has an evaluator; the message names it."""


def holder_text() -> str:
    return json.dumps(
        {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": " ".join(sys.argv),
        }
    )


def parse_holder(text: str) -> dict | None:
    text = text.strip()
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"host": "?", "pid": "?", "started": "?", "command": text[:200]}


def busy_message(queue: Path, holder: dict | None) -> str:
    who = "another evaluator" if holder is None else (
        f"another evaluator: host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')} "
        f"(`{holder.get('command')}`)"
    )  # fmt: skip
    stop = "" if holder is None else f" (kill {holder.get('pid')} on {holder.get('host')})"
    return (
        f"{queue / LOCK_FILE}: the run {queue.parent.parent} is evaluated by {who}. One evaluator per run: it takes "
        f"every queued step; wait for it, or stop it{stop} and start `probdiff watch` again"
    )


def _lock(path: Path, on_acquired=None) -> FileLock:
    """Never waits (a second evaluator stops at once), one per process, the file kept."""
    return FileLock(
        path, timeout=0, thread_local=False, fallback_to_soft=False, preserve_lock_file=True, on_acquired=on_acquired
    )


class EvaluatorLock:
    """The held lock of one run's queue (`hold_evaluator`); released at `release()` or when the process ends."""

    def __init__(self, path: Path) -> None:
        self.path, self.lock, self.fd = path, None, -1

    def release(self) -> None:
        if self.lock is None or not self.lock.is_locked:
            return
        os.ftruncate(self.fd, 0)  # empty: released cleanly
        self.lock.release()


def hold_evaluator(queue: Path) -> EvaluatorLock:
    """Take the queue's evaluator lock, or an `EvaluatorBusy` naming the evaluator that holds it."""
    path = queue / LOCK_FILE
    held = EvaluatorLock(path)

    def name_the_holder(fd: int) -> None:
        held.fd = fd
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (holder_text() + "\n").encode())
        os.fsync(fd)

    held.lock = _lock(path, on_acquired=name_the_holder)
    try:
        held.lock.acquire()
    except Timeout:
        raise EvaluatorBusy(busy_message(queue, evaluator_holder(queue))) from None
    except OSError as err:
        if err.errno not in NO_LOCKS:
            raise
        print(
            f"warning: {path}: this file system does not lock files ({err.strerror}); nothing stops a second "
            "evaluator from taking the same steps",
            file=sys.stderr,
            flush=True,
        )
        return EvaluatorLock(path)
    atexit.register(held.release)
    return held


def evaluator_holder(queue: Path) -> dict | None:
    """Who holds the queue's evaluator lock ({host, pid, started, command}), or None when no live evaluator does (a
    missing lock file is not created)."""
    path = queue / LOCK_FILE
    if not path.is_file():
        return None
    try:
        with _lock(path):
            return None
    except Timeout:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            text = ""
        return parse_holder(text) or {"host": "?", "pid": "?", "started": "?", "command": "?"}
    except OSError as err:
        if err.errno not in NO_LOCKS:
            raise
        return None
