"""probdiff_callback/runtime/parent.py: the parent's command line and the kernel's signal at its death."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from probdiff_callback.runtime.parent import parent_command, set_parent_death_signal

CHILD = (
    "import os, signal, sys, time\n"
    "from probdiff_callback.runtime.parent import parent_command, set_parent_death_signal\n"
    "print(repr(parent_command()), flush=True)\n"
    "signal.signal(signal.SIGUSR1, lambda *_: (print('parent died', flush=True), os._exit(0)))\n"
    "assert set_parent_death_signal(signal.SIGUSR1)\n"
    "print('armed', flush=True)\n"
    "time.sleep(60)\n"
)


def test_the_parent_command_is_this_process_s_parent():
    assert parent_command() == " ".join(psutil.Process().parent().cmdline())


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_gets_the_signal_when_its_parent_dies(tmp_path):
    """A middle process starts the child, which names it, and is killed -9: the child hears of it from the kernel."""
    middle_code = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {CHILD!r}])\ntime.sleep(60)\n"
    middle = subprocess.Popen([sys.executable, "-c", middle_code], stdout=subprocess.PIPE, text=True)
    try:
        assert middle.stdout.readline().strip() == repr(" ".join([sys.executable, "-c", middle_code]))
        assert middle.stdout.readline().strip() == "armed"
        child = psutil.Process(middle.pid).children()[0]
        middle.kill()
        assert middle.stdout.readline().strip() == "parent died"  # the child's stdout is the pipe too
        started = time.time()
        while child.is_running() and child.status() != psutil.STATUS_ZOMBIE and time.time() - started < 10:
            time.sleep(0.05)
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    finally:
        middle.kill()
        middle.wait()


def test_signal_0_clears_the_parent_death_signal():
    assert set_parent_death_signal(0) == (sys.platform == "linux")  # 0: no signal, as a process starts
