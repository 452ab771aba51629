"""The process the script runs in: its rank and its messages."""

from __future__ import annotations

import os


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def say(message: str) -> None:
    """Print once per run (on the main process)."""
    if is_main_process():
        print(message, flush=True)
