"""One training job per run directory: `RUN_DIR/run.lock`, held with `flock` for the life of the job's main process.

Two jobs writing one run directory would interleave checkpoints, history rows and W&B steps. A pid file would
outlive a job killed with -9 and block its resume; an `flock` is released by the kernel when the process ends, however
it ends, so only a live job holds it. Linux honours `flock` across the clients of an NFS mount (a dead node's lock
lasts until the server's lease expires, about 90 s on NFSv4); a file system without it (Lustre mounted without
`-o flock`) gets a warning and no protection. The file's text (host, pid, start, command) only names the holder in
the message. Any exit Python sees (the end, an error, Ctrl-C, a preemption's stop) empties the file, so text found in
an unheld lock names a job that was killed outright, and the next start says so.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from train.recipe import RecipeError

LOCK_FILE = "run.lock"


class RunLock:
    """The held lock of one run directory (`hold_run_dir`); released at `release()` or when the process ends."""

    def __init__(self, path: Path, fd: int, previous: dict | None) -> None:
        self.path, self._fd, self.previous = path, fd, previous

    def release(self) -> None:
        if self._fd < 0:
            return
        os.ftruncate(self._fd, 0)  # empty: released cleanly
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = -1


def holder_text() -> str:
    return json.dumps(
        {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": " ".join(sys.argv),
        }
    )


def read_holder(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 65536).decode("utf-8", errors="replace").strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return {"host": "?", "pid": "?", "started": "?", "command": text[:200]}


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


def hold_run_dir(run_dir: Path) -> RunLock:
    """Take the run directory's lock, or a RecipeError naming the job that holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = read_holder(fd)
        os.close(fd)
        raise RecipeError(in_use_message(run_dir, holder)) from None
    except OSError as err:
        if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        os.close(fd)
        print(f"warning: {path}: this file system does not lock files ({err.strerror}); nothing stops a second job "
              "from training in the same run directory", flush=True)  # fmt: skip
        return RunLock(path, -1, None)
    previous = read_holder(fd)
    if previous is not None:
        print(
            f"{path}: taking over the lock of host {previous.get('host')}, pid {previous.get('pid')} (started "
            f"{previous.get('started')}), which ended without releasing it (killed, or its node lost)",
            flush=True,
        )
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (holder_text() + "\n").encode())
    os.fsync(fd)
    lock = RunLock(path, fd, previous)
    atexit.register(lock.release)
    return lock


def raise_if_held(run_dir: Path) -> None:
    """The in-use error if a live job holds the run directory; read-only (a missing lock file is not created)."""
    path = run_dir / LOCK_FILE
    if not path.is_file():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except BlockingIOError:
        raise RecipeError(in_use_message(run_dir, read_holder(fd))) from None
    finally:
        os.close(fd)


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
