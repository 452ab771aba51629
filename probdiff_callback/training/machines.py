"""Training across machines, as the training processes see it: which machine this is, how many there are, and what a
lost machine looks like to the others.

torchrun gives every training process its machine's rank and the number of machines (GROUP_RANK and
GROUP_WORLD_SIZE; `accelerate launch --machine_rank/--num_machines` passes them on). A machine whose launcher dies
sends its training processes SIGTERM (callback/preemption.py: every rank saves and stops, exit status 75). A machine
lost whole (kill -9 of everything on it, a crash) closes its connections: the other machines' next collective fails at
once with the backend's error, which `lost_peer` recognizes (gloo's "Connection closed by peer [address]:port").
A machine that vanishes without closing them (power, network) is noticed by that collective's timeout, the
Trainer's `ddp_timeout` (1800 s by default).
"""

from __future__ import annotations

import os
import re

# The backends' errors for a peer that went away (gloo's transport; NCCL's, where the process survives its watchdog)
PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited or there was a network error"
)
PEER_ADDRESS = re.compile(r"peer \[([^\]]+)\]")


def machine_rank() -> int:
    return int(os.environ.get("GROUP_RANK", "0"))


def machine_count() -> int:
    return int(os.environ.get("GROUP_WORLD_SIZE", "1"))


def lost_peer(err: BaseException) -> str | None:
    """Which machine a collective's error says is gone, in words ("machine 1", "the machine at 10.0.0.2"); None for
    an error that is not a lost peer."""
    text = str(err)
    if not isinstance(err, RuntimeError) or not PEER_LOST.search(text):
        return None
    if machine_count() == 2:
        return f"machine {1 - machine_rank()}"
    address = PEER_ADDRESS.search(text)
    return f"the machine at {address.group(1)}" if address else "another machine"


def is_local_main_process() -> bool:
    """The first training process on this machine (LOCAL_RANK 0): the one that speaks for a machine whose main
    process may be the one lost."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0
