"""The process the script runs in: its rank, its messages, and its CPU threads under a launcher."""

from __future__ import annotations

import os
import re
from pathlib import Path

LAUNCHERS = ("accelerate", "torchrun", "torch.distributed.run", "torch.distributed.launch")


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def say(message: str) -> None:
    """Print once per run (on the main process)."""
    if is_main_process():
        print(message, flush=True)


def launcher_environment() -> dict[str, str] | None:
    """The environment the launcher (`accelerate launch`, `torchrun`) itself was started with (the user's),
    read from /proc: the value a launcher hands its workers cannot tell a user's OMP_NUM_THREADS=1 from the
    launcher's own default."""
    pid = os.getppid()
    for _ in range(4):  # worker <- (torch elastic agent, same process as) accelerate launch / torchrun
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if any(name in cmdline for name in LAUNCHERS):
                raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)
            status = Path(f"/proc/{pid}/status").read_text()
            pid = int(re.search(r"^PPid:\s*(\d+)", status, re.MULTILINE).group(1))  # type: ignore[union-attr]
        except (OSError, AttributeError, ValueError):
            return None
        if pid <= 1:
            return None
    return None


def configure_threads(
    threads: int | None = None,
    environ: dict[str, str] | None = None,
    launcher_environ: dict[str, str] | None = None,
) -> tuple[int, str]:
    """Set torch's CPU thread count; returns (threads, why).

    `accelerate launch` (and `torchrun`) set OMP_NUM_THREADS=1 in their workers when the user did not set
    it, which halves CPU training speed. Unless the recipe (`threads=N`) or the user's own OMP_NUM_THREADS
    says otherwise, the process gets the cores it may run on divided among the local processes.
    """
    import torch

    environ = os.environ if environ is None else environ
    if threads is not None:
        torch.set_num_threads(threads)
        return threads, "threads= in the recipe"
    # set by every `accelerate launch` launcher / by torchrun's elastic agent
    under_launcher = "ACCELERATE_DYNAMO_BACKEND" in environ or "TORCHELASTIC_RUN_ID" in environ
    user_value = environ.get("OMP_NUM_THREADS")
    if user_value is not None:
        if under_launcher:
            launcher = launcher_environment() if launcher_environ is None else launcher_environ
            # Unknown launcher environment: accelerate's own default is "1", anything else came from the user.
            injected = ("OMP_NUM_THREADS" not in launcher) if launcher is not None else user_value == "1"
        else:
            injected = False
        if not injected:
            return torch.get_num_threads(), f"OMP_NUM_THREADS={user_value} set by the user"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = int(environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    count = max(1, cores // max(local, 1))
    torch.set_num_threads(count)
    return count, f"{cores} cores / {local} local process{'es' if local > 1 else ''}"
