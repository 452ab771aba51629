"""What `train/sft.py` is built from, one concern per module: the recipe and its `SFTConfig` (`recipe`), the run
directory and resuming (`run_dir`), one job per run directory (`run_lock`), the conversations and held-out queries
(`data`), the model and its LoRA (`model_setup`), trl's `SFTTrainer` with the ProbDiff and preemption callbacks
(`trainer`), one W&B run across resumes (`wandb_run`) and the end-of-run report (`report`). Training only: the
library around it never imports this package.

The training script runs from a checkout: recipes and data are read from `PROJECT_ROOT`.
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def is_main_process() -> bool:
    """Rank 0 of the launch, known before any distributed state exists (the launcher sets RANK)."""
    return int(os.environ.get("RANK", "0")) == 0


def say(message: str) -> None:
    """Print once per run (on the main process)."""
    if is_main_process():
        print(message, flush=True)
