"""This process's parent, as a training process sees its launcher: its command line, and the signal the kernel sends
this process when it dies (Linux's `prctl(PR_SET_PDEATHSIG)`, which no library in the stack wraps)."""

from __future__ import annotations

import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def set_parent_death_signal(signum: int) -> bool:
    """Have the kernel send `signum` to this process when its parent dies; False off Linux or when refused."""
    if sys.platform != "linux":
        return False
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum) == 0


def parent_command() -> str:
    """The parent's command line, "" when it is gone or cannot be read."""
    import psutil

    try:
        parent = psutil.Process().parent()
        return "" if parent is None else " ".join(parent.cmdline())
    except psutil.Error:
        return ""
