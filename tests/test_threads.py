"""CPU threads: a launcher's injected OMP_NUM_THREADS=1 is replaced, the user's value kept, and cores that other
processes keep busy are left to them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from probdiff_callback.runtime import threads
from probdiff_callback.runtime.threads import busy_cores_elsewhere, choose_threads, configure_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_accelerate_default_is_replaced_and_the_users_value_kept(restore_threads):
    cores = len(os.sched_getaffinity(0))
    launched = {"ACCELERATE_DYNAMO_BACKEND": "NO", "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "1"}
    count, why = configure_threads(environ=launched, launcher_environ={"PATH": "/bin"}, busy_elsewhere=0)
    assert count == cores and torch.get_num_threads() == cores and why == f"{cores} cores / 1 local process"
    torch.set_num_threads(1)
    count, why = configure_threads(environ=launched, launcher_environ={"OMP_NUM_THREADS": "1"})  # the user's own
    assert count == 1 and "set by the user" in why
    count, _ = configure_threads(environ={**launched, "LOCAL_WORLD_SIZE": "2"}, launcher_environ={}, busy_elsewhere=0)
    assert count == max(1, cores // 2)
    torchrun = {"TORCHELASTIC_RUN_ID": "1", "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}
    count, why = configure_threads(environ=torchrun, launcher_environ={"PATH": "/bin"}, busy_elsewhere=0)
    assert count == max(1, cores // 2) and "2 local processes" in why
    torch.set_num_threads(1)
    count, why = configure_threads(environ={"OMP_NUM_THREADS": "1"})  # no launcher: the value is the user's
    assert count == 1 and "set by the user" in why
    count, why = configure_threads(threads=1, environ=launched)
    assert count == 1 and torch.get_num_threads() == 1 and "recipe" in why


def test_busy_cores_are_left_to_the_processes_that_hold_them(restore_threads):
    assert choose_threads(cores=2, local_processes=1, busy_elsewhere=0) == 2
    assert choose_threads(cores=2, local_processes=1, busy_elsewhere=1) == 1
    assert choose_threads(cores=2, local_processes=1, busy_elsewhere=5) == 1  # never below 1
    assert choose_threads(cores=16, local_processes=2, busy_elsewhere=4) == 6
    assert choose_threads(cores=2, local_processes=2, busy_elsewhere=0) == 1
    count, why = configure_threads(environ={}, busy_elsewhere=1)
    cores = len(os.sched_getaffinity(0))
    assert count == max(1, cores - 1) and why == f"{cores} cores, 1 busy with other processes, / 1 local process"


def test_load_is_the_fewest_runnable_tasks_less_our_own(monkeypatch):
    samples = iter([4, 2, 3, 9, 2])  # a short-lived command at one sample is not load
    monkeypatch.setattr(threads, "runnable_tasks", lambda: next(samples))
    monkeypatch.setattr(threads, "LOAD_SAMPLE_INTERVAL_S", 0.0)
    assert busy_cores_elsewhere(own_processes=1) == 1
    monkeypatch.setattr(threads, "runnable_tasks", lambda: 1)
    assert busy_cores_elsewhere(own_processes=2) == 0  # a sibling rank that was not running: no negative load
    monkeypatch.setattr(threads, "runnable_tasks", lambda: None)  # no /proc/loadavg (macOS)
    assert busy_cores_elsewhere() == 0


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile("/proc/loadavg"), reason="reads Linux's /proc/loadavg")
def test_a_busy_process_is_seen():
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 60  # until the kernel's count of runnable tasks has it (its next sample)
        while busy_cores_elsewhere() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert busy_cores_elsewhere() >= 1
    finally:
        spinner.kill()
        spinner.wait()
