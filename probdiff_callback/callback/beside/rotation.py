"""Rotation beside training: no checkpoint deleted before its step's result is logged.

With `save_total_limit` the Trainer deletes the oldest checkpoints at each save; a step still in the queue may become
the best, so the evaluation beside training takes rotation over: the Trainer's limit is set aside while training (and
put back at the end), and the oldest checkpoints beyond it are deleted here, never the newest, the best, nor one whose
step's result has not been logged yet. For a while there can be more checkpoints than the limit.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints

logger = logging.getLogger(__name__)


def rotate(output_dir: str, limit: int | None, best_checkpoint: str | None, unlogged_steps: Iterable[int]) -> None:
    """`save_total_limit` as the Trainer applies it, keeping the checkpoints of `unlogged_steps` (main process)."""
    if limit is None or limit <= 0:
        return
    checkpoints = sort_checkpoints(output_dir)
    if len(checkpoints) <= limit:
        return
    protected = {Path(checkpoints[-1]).name}
    if best_checkpoint is not None:
        protected.add(Path(best_checkpoint).name)
    protected |= {f"{PREFIX_CHECKPOINT_DIR}-{step}" for step in unlogged_steps}
    remaining = len(checkpoints)
    for checkpoint in checkpoints:
        if remaining <= max(limit, len(protected)):
            break
        if Path(checkpoint).name in protected:
            continue
        logger.info(
            f"ProbDiff: deleting {checkpoint} (save_total_limit={limit}; kept: the newest, the best and those awaiting "
            "their evaluation)"
        )
        shutil.rmtree(checkpoint, ignore_errors=True)
        remaining -= 1
