"""A lock that one live process holds and that names its holder: one training job per run directory
(`training/run_lock.py`), one evaluator per run's queue (`watch/lock.py`).

A pid file would outlive a process killed with -9 and block what comes next (a resume, the next evaluator);
`filelock.FileLock` takes an `flock` on Linux, which the kernel releases when the process ends, however it ends, so
only a live process holds it (filelock closes its descriptor in a forked child, so a child that outlives a killed job,
a data loader's worker, does not keep the lock either). Linux honours `flock` across the clients of an NFS mount (a
dead node's lock lasts until the server's lease expires, about 90 s on NFSv4; on NFSv3, until its `statd` recovers).
Where a file system has no `flock` (Lustre mounted with `noflock`), filelock would fall back to a marker file that only
a process on the same host can prove stale, so a lost node's marker would block the resume: the fallback is off here,
and such a file system gets a warning and no protection. Mounts that make `flock` node-local (NFS `nolock` or
`local_lock`, Lustre `localflock`) cannot be told apart from real locks: docs/configuration.md#across-machines.

The lock never waits (a second process stops at once), is one per process, and keeps its file. The file's text (host,
pid, start, command) only names the holder in the refusal; filelock hands the locked file to `on_acquired` and never
truncates or deletes it on Linux. Any exit Python sees (the end, an error, Ctrl-C, a preemption's stop) empties the
file, so text found in an unheld lock names a process that was killed outright (`HeldLock.previous`).
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
from typing import TextIO

from filelock import FileLock, Timeout

NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # the file system does not lock files


class LockHeld(Exception):
    """Another live process holds the lock at `path`; `holder` names it ({host, pid, started, command}), None when the
    file names no one (the holder has not written its text yet)."""

    def __init__(self, path: Path, holder: dict | None) -> None:
        super().__init__(f"{path} is held by {holder or 'another process'}")
        self.path, self.holder = path, holder


class HeldLock:
    """A lock this process holds (`hold`); released at `release()` or when the process ends. `lock` is None where the
    file system does not lock files; `previous` names a holder killed without releasing it."""

    def __init__(self, path: Path, lock: FileLock | None = None, fd: int = -1, previous: dict | None = None) -> None:
        self.path, self.lock, self.fd, self.previous = path, lock, fd, previous

    def release(self) -> None:
        if self.lock is None or not self.lock.is_locked:
            return
        os.ftruncate(self.fd, 0)  # empty: released cleanly (the locked file's descriptor, open until the release)
        self.lock.release()


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
    """The holder a lock file's text names; None for an empty file; text that is not ours becomes the command."""
    text = text.strip()
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"host": "?", "pid": "?", "started": "?", "command": text[:200]}


def read_holder(path: Path) -> dict | None:
    try:
        return parse_holder(path.read_text(encoding="utf-8", errors="replace"))
    except FileNotFoundError:
        return None


def file_lock(path: Path, on_acquired=None) -> FileLock:
    """Never waits, one per process, the file kept, no marker-file fallback."""
    return FileLock(
        path, timeout=0, thread_local=False, fallback_to_soft=False, preserve_lock_file=True, on_acquired=on_acquired
    )


def hold(path: Path, unprotected: str, warn_to: TextIO | None = None) -> HeldLock:
    """Take the lock at `path` and write this process's text into it, or raise `LockHeld` naming the live holder.

    Where the file system does not lock files, warns on `warn_to` (stderr by default) that nothing stops
    `unprotected` (e.g. "a second job from training in the same run directory") and returns an unheld lock."""
    held = HeldLock(path)

    def name_the_holder(fd: int) -> None:  # the lock is held: text left there names a process killed outright
        os.lseek(fd, 0, os.SEEK_SET)
        held.fd, held.previous = fd, parse_holder(os.read(fd, 65536).decode("utf-8", errors="replace"))
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (holder_text() + "\n").encode())
        os.fsync(fd)

    held.lock = file_lock(path, on_acquired=name_the_holder)
    try:
        held.lock.acquire()
    except Timeout:
        raise LockHeld(path, read_holder(path)) from None
    except OSError as err:
        if err.errno not in NO_LOCKS:
            raise
        print(
            f"warning: {path}: this file system does not lock files ({err.strerror}); nothing stops {unprotected}",
            file=warn_to or sys.stderr,
            flush=True,
        )
        return HeldLock(path)
    atexit.register(held.release)  # after filelock's own exit handler is registered: runs first, empties the file
    return held


def raise_if_held(path: Path) -> None:
    """`LockHeld` if a live process holds the lock at `path`; a missing lock file is not created, and a file system
    that does not lock files holds nothing."""
    if not path.is_file():
        return
    try:
        with file_lock(path):
            pass
    except Timeout:
        raise LockHeld(path, read_holder(path)) from None
    except OSError as err:
        if err.errno not in NO_LOCKS:
            raise
