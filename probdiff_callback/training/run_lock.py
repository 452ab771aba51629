"""One training job per run directory: `RUN_DIR/run.lock`, held for the life of the job's main process.

Two jobs writing one run directory would interleave checkpoints, history rows and W&B steps. The lock is
`runtime/held_lock.py`'s (why filelock, why a job killed with -9 does not block its resume, NFS and Lustre): a second
job stops at once naming the first, and a job that takes over the lock of one killed outright says so.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from probdiff_callback.runtime import held_lock
from probdiff_callback.runtime.held_lock import HeldLock, LockHeld, read_holder
from probdiff_callback.training.recipe import RecipeError

LOCK_FILE = "run.lock"
SHARED_WAIT_SECONDS = 5.0  # a network file system may show another host's new file a moment later


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


def hold_run_dir(run_dir: Path) -> HeldLock:
    """Take the run directory's lock, or a RecipeError naming the job that holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    try:
        held = held_lock.hold(path, "a second job from training in the same run directory", warn_to=sys.stdout)
    except LockHeld as busy:
        raise RecipeError(in_use_message(run_dir, busy.holder)) from None
    previous = held.previous
    if previous is not None:
        print(
            f"{path}: taking over the lock of host {previous.get('host')}, pid {previous.get('pid')} (started "
            f"{previous.get('started')}), which ended without releasing it (killed, or its node lost)",
            flush=True,
        )
    return held


def raise_if_held(run_dir: Path) -> None:
    """The in-use error if a live job holds the run directory; a missing lock file is not created."""
    try:
        held_lock.raise_if_held(run_dir / LOCK_FILE)
    except LockHeld as busy:
        raise RecipeError(in_use_message(run_dir, busy.holder)) from None


def not_shared_message(run_dir: Path, machines: list[int]) -> str:
    which = f"machine {machines[0]}" if len(machines) == 1 else f"machines {', '.join(map(str, machines))}"
    return (
        f"{run_dir} is not shared between the machines: {which} cannot see the lock machine 0 wrote there "
        f"({LOCK_FILE}). Every machine writes its part of each checkpoint there and reads the checkpoints back to "
        "resume, and the run's history and lock live there: put output_dir on a file system every machine mounts "
        "(NFS, Lustre), at the same path"
    )


def sees(path: Path, holder: dict) -> bool:
    """Whether this process reads `holder` in the lock file at `path` (waiting up to SHARED_WAIT_SECONDS for it)."""
    deadline = time.monotonic() + SHARED_WAIT_SECONDS
    while read_holder(path) != holder:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def hold_on_every_rank(run_dir: Path, world_size: int) -> HeldLock | None:
    """The main process takes the lock; every rank stops with its error (one broadcast), none hangs waiting. On
    several processes every rank must then read the lock's text the main process wrote: a run directory each machine
    has on a disk of its own stops here, on every rank, with one error."""
    from probdiff_callback.training import is_main_process

    lock, error, holder = None, None, None
    if is_main_process():
        try:
            lock = hold_run_dir(run_dir)
            holder = read_holder(lock.path)
        except RecipeError as err:
            error = str(err)
    if world_size > 1:
        from accelerate.utils import broadcast_object_list, gather_object

        message = [error, holder]
        broadcast_object_list(message, from_process=0)
        error, holder = message
        if error is None and holder is not None:  # None: a file system without locks (hold_run_dir warned)
            machine = int(os.environ.get("GROUP_RANK", "0"))
            blind = {machine for machine, ok in gather_object([(machine, sees(run_dir / LOCK_FILE, holder))]) if not ok}
            error = not_shared_message(run_dir, sorted(blind)) if blind else None
    if error is not None:
        raise RecipeError(error)  # train/sft.py prints it on the main process only
    return lock
