"""How many CPU threads torch uses in `probdiff eval` and the training script.

Two traps on CPU machines. `accelerate launch` and `torchrun` set OMP_NUM_THREADS=1 in their workers when the user
did not, which halves training speed on an idle machine. And torch's intra-op threads spin at every barrier: when
other processes hold the cores, a thread that is descheduled stalls all the others, and a decoding step at 2
threads can take several times as long as at 1 (docs/benchmarks.md). So, unless the user (OMP_NUM_THREADS, or
`threads=` in a recipe) says otherwise, a process takes the cores it may run on, less those that other processes
are busy on when it starts, shared among the local processes of its launch; at least 1.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

LAUNCHERS = ("accelerate", "torchrun", "torch.distributed.run", "torch.distributed.launch")
# train/sft.py's own launcher (training/launch.py) names itself to the training processes it starts
LAUNCHER_PID_ENV = "PROBDIFF_LAUNCHER_PID"
LOAD_SAMPLES = 5
LOAD_SAMPLE_INTERVAL_S = 0.05


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def runnable_tasks() -> int | None:
    """Tasks runnable on the machine right now (this process included), from /proc/loadavg; None elsewhere."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None


def busy_cores_elsewhere(own_processes: int = 1) -> int:
    """Cores that other processes keep busy: the fewest runnable tasks over a few samples (a short-lived command
    is not load), less this launch's own processes."""
    samples = []
    for i in range(LOAD_SAMPLES):
        count = runnable_tasks()
        if count is None:
            return 0
        samples.append(count)
        if i < LOAD_SAMPLES - 1:
            time.sleep(LOAD_SAMPLE_INTERVAL_S)
    return max(0, min(samples) - own_processes)


def choose_threads(cores: int, local_processes: int, busy_elsewhere: int) -> int:
    """The cores not busy elsewhere, shared among the local processes; at least 1."""
    return max(1, (cores - busy_elsewhere) // max(local_processes, 1))


def launcher_environment() -> dict[str, str] | None:
    """The environment the launcher (`accelerate launch`, `torchrun`, train/sft.py's) itself was started with (the
    user's), read from /proc: the value a launcher hands its workers cannot tell a user's OMP_NUM_THREADS=1 from the
    launcher's own default."""
    pid = os.getppid()
    for _ in range(4):  # worker <- (torch elastic agent, same process as) accelerate launch / torchrun
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if any(name in cmdline for name in LAUNCHERS) or str(pid) == os.environ.get(LAUNCHER_PID_ENV):
                raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)
            status = Path(f"/proc/{pid}/status").read_text()
            pid = int(re.search(r"^PPid:\s*(\d+)", status, re.MULTILINE).group(1))  # type: ignore[union-attr]
        except (OSError, AttributeError, ValueError):
            return None
        if pid <= 1:
            return None
    return None


def _user_set_threads(environ: dict[str, str], launcher_environ: dict[str, str] | None) -> bool:
    """Whether OMP_NUM_THREADS is the user's own, not a launcher's injected default."""
    if "OMP_NUM_THREADS" not in environ:
        return False
    # set by every `accelerate launch` launcher / by torchrun's elastic agent
    if "ACCELERATE_DYNAMO_BACKEND" not in environ and "TORCHELASTIC_RUN_ID" not in environ:
        return True
    launcher = launcher_environment() if launcher_environ is None else launcher_environ
    # Unknown launcher environment: accelerate's own default is "1", anything else came from the user.
    return ("OMP_NUM_THREADS" in launcher) if launcher is not None else environ["OMP_NUM_THREADS"] != "1"


def configure_threads(
    threads: int | None = None,
    environ: dict[str, str] | None = None,
    launcher_environ: dict[str, str] | None = None,
    busy_elsewhere: int | None = None,
) -> tuple[int, str]:
    """Set torch's CPU thread count (see the module docstring); returns (threads, why)."""
    import torch

    environ = dict(os.environ) if environ is None else environ
    if threads is not None:
        torch.set_num_threads(threads)
        return threads, "threads= in the recipe"
    if _user_set_threads(environ, launcher_environ):
        return torch.get_num_threads(), f"OMP_NUM_THREADS={environ['OMP_NUM_THREADS']} set by the user"
    cores = usable_cores()
    local = int(environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    busy = busy_cores_elsewhere(local) if busy_elsewhere is None else busy_elsewhere
    count = choose_threads(cores, local, busy)
    torch.set_num_threads(count)
    processes = f"{local} local process{'es' if local > 1 else ''}"
    if busy:
        return count, f"{cores} cores, {busy} busy with other processes, / {processes}"
    return count, f"{cores} cores / {processes}"
