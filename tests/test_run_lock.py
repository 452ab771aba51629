"""Two jobs, one run directory: the second stops at once naming the first's host and pid, on one process or two; a
lock left by a job killed with -9 does not block the resume. (With train/sft.py's real jobs: e2e/test_sft_runs.py's
Ctrl-C test and e2e/test_faults.py's step 2.)"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from probdiff_callback.training.recipe import RecipeError
from probdiff_callback.training.run_lock import LOCK_FILE, hold_run_dir, raise_if_held

HOLD = "from pathlib import Path; import os, sys, time\n" + (
    "from probdiff_callback.training.run_lock import hold_run_dir\n"
    "lock = hold_run_dir(Path(sys.argv[1]))\n"
    "if len(sys.argv) > 2 and os.fork() == 0:\n"  # a child that outlives the job (a data loader's worker)
    "    os.write(1, b'forked %d\\n' % os.getpid()); time.sleep(60); os._exit(0)\n"
    "os.write(1, b'locked\\n'); time.sleep(600)\n"  # one write each: the two processes share the pipe
)


def holder(run_dir: Path, forks: bool = False) -> tuple[subprocess.Popen, int | None]:
    """The job holding `run_dir`, and the pid of the child it forked (once that runs)."""
    command = [sys.executable, "-c", HOLD, str(run_dir), *(["fork"] if forks else [])]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    said = sorted(process.stdout.readline().split() for _ in range(2 if forks else 1))
    assert [words[0] for words in said] == (["forked", "locked"] if forks else ["locked"])
    return process, int(said[0][1]) if forks else None


@pytest.mark.slow
def test_a_held_run_directory_names_its_holder_and_a_dead_holder_is_taken_over(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert raise_if_held(run_dir) is None and not run_dir.exists(), "the read-only check creates nothing"
    first, _ = holder(run_dir)
    try:
        for attempt in (hold_run_dir, raise_if_held):
            with pytest.raises(RecipeError) as err:
                attempt(run_dir)
            text = str(err.value)
            assert f"{run_dir} is in use by another training job: host {socket.gethostname()}, pid {first.pid}" in text
            assert f"stop it (kill {first.pid} on {socket.gethostname()})" in text and "run_name=" in text
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    lock = hold_run_dir(run_dir)  # the kernel released the dead job's lock
    taken = capsys.readouterr().out
    assert f"taking over the lock of host {socket.gethostname()}, pid {first.pid}" in taken
    assert "ended without releasing it" in taken
    lock.release()
    assert (run_dir / LOCK_FILE).read_text() == "", "released cleanly: an empty file"
    hold_run_dir(run_dir).release()
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_a_child_that_outlives_a_killed_job_does_not_keep_its_lock(tmp_path):
    """filelock closes the lock's descriptor in a forked child; an inherited one would hold the lock until the child
    exits (a data loader's worker outliving the kill -9 of its job)."""
    job, child = holder(tmp_path, forks=True)
    job.send_signal(signal.SIGKILL)
    job.wait()
    try:
        hold_run_dir(tmp_path).release()  # at once: the child still sleeps
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_file_system_without_locks_is_said_and_not_protected(tmp_path, monkeypatch, capsys):
    """Lustre without `-o flock`: one warning, training goes on; filelock's fallback, a marker file that only its own
    host can prove stale, stays off (a lost node's marker would block the resume)."""

    def no_flock(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    lock = hold_run_dir(tmp_path)
    assert "this file system does not lock files (Function not implemented)" in capsys.readouterr().out
    assert lock.lock is None and (tmp_path / LOCK_FILE).read_text() == "", "no marker written"
    raise_if_held(tmp_path)
    hold_run_dir(tmp_path).release()
