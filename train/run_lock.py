"""One training job per run directory: `RUN_DIR/run.lock`, held with `filelock` for the life of the job's main process.

Two jobs writing one run directory would interleave checkpoints, history rows and W&B steps. A pid file would
outlive a job killed with -9 and block its resume; `filelock.FileLock` takes an `flock` on Linux, which the kernel
releases when the process ends, however it ends, so only a live job holds it (filelock closes its descriptor in a
forked child, so a child that outlives a killed job does not keep the lock either). Linux honours `flock` across the
clients of an NFS mount (a dead node's lock lasts until the server's lease expires, about 90 s on NFSv4). Where a file
system has no `flock` (Lustre mounted without `-o flock`), filelock would fall back to a marker file that only a
process on the same host can prove stale, so a lost node's marker would block the resume: the fallback is off here,
and such a file system gets a warning and no protection, as before.

The file's text (host, pid, start, command) only names the holder in the message; filelock hands the locked file to
`on_acquired` and never truncates or deletes it on Linux. Any exit Python sees (the end, an error, Ctrl-C, a
preemption's stop) empties the file, so text found in an unheld lock names a job that was killed outright, and the next
start says so.
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

from train.recipe import RecipeError

LOCK_FILE = "run.lock"
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # the file system does not lock files


class RunLock:
    """The held lock of one run directory (`hold_run_dir`); released at `release()` or when the process ends."""

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
    text = text.strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return {"host": "?", "pid": "?", "started": "?", "command": text[:200]}


def read_holder(path: Path) -> dict | None:
    try:
        return parse_holder(path.read_text(encoding="utf-8", errors="replace"))
    except FileNotFoundError:
        return None


def in_use_message(run_dir: Path, holder: dict | None) -> str:
    who = "another training job" if holder is None else (
        f"another training job: host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')} "
        f"(`{holder.get('command')}`)"
    )  # fmt: skip
    kill = "" if holder is None else f" (kill {holder.get('pid')} on {holder.get('host')})"
    return (
        f"{run_dir} is in use by {who}. Wait for it to finish, stop it{kill} and continue with resume=true, or "
        "choose another run_name="
    )


def run_dir_lock(path: Path, on_acquired=None) -> FileLock:
    """The run directory's lock: never waits (a second job stops at once), one per process, the file kept."""
    return FileLock(
        path, timeout=0, thread_local=False, fallback_to_soft=False, preserve_lock_file=True, on_acquired=on_acquired
    )


def hold_run_dir(run_dir: Path) -> RunLock:
    """Take the run directory's lock, or a RecipeError naming the job that holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    held = RunLock(path)

    def name_the_holder(fd: int) -> None:  # the lock is held: the text left there names a job killed outright
        os.lseek(fd, 0, os.SEEK_SET)
        held.fd, held.previous = fd, parse_holder(os.read(fd, 65536).decode("utf-8", errors="replace"))
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (holder_text() + "\n").encode())
        os.fsync(fd)

    held.lock = run_dir_lock(path, on_acquired=name_the_holder)
    try:
        held.lock.acquire()
    except Timeout:
        raise RecipeError(in_use_message(run_dir, read_holder(path))) from None
    except OSError as err:
        if err.errno not in NO_LOCKS:
            raise
        print(f"warning: {path}: this file system does not lock files ({err.strerror}); nothing stops a second job "
              "from training in the same run directory", flush=True)  # fmt: skip
        return RunLock(path)
    previous = held.previous
    if previous is not None:
        print(
            f"{path}: taking over the lock of host {previous.get('host')}, pid {previous.get('pid')} (started "
            f"{previous.get('started')}), which ended without releasing it (killed, or its node lost)",
            flush=True,
        )
    atexit.register(held.release)  # after filelock's own exit handler is registered: runs first, empties the file
    return held


def raise_if_held(run_dir: Path) -> None:
    """The in-use error if a live job holds the run directory; a missing lock file is not created."""
    path = run_dir / LOCK_FILE
    if not path.is_file():
        return
    lock = run_dir_lock(path)
    try:
        with lock:
            pass
    except Timeout:
        raise RecipeError(in_use_message(run_dir, read_holder(path))) from None
    except OSError as err:
        if err.errno not in NO_LOCKS:
            raise


def hold_on_every_rank(run_dir: Path, world_size: int) -> RunLock | None:
    """The main process takes the lock; every rank stops with its error (one broadcast), none hangs waiting."""
    from train import is_main_process

    lock, error = None, None
    if is_main_process():
        try:
            lock = hold_run_dir(run_dir)
        except RecipeError as err:
            error = str(err)
    if world_size > 1:
        from accelerate.utils import broadcast_object_list

        holder = [error]
        broadcast_object_list(holder, from_process=0)
        error = holder[0]
    if error is not None:
        raise RecipeError(error)  # train/sft.py prints it on the main process only
    return lock
