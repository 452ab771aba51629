"""Kept for the imports of earlier versions (`config.py` takes `DEFAULT_SUBDIR` from here): a run's files have one
owner, `run_files`."""

from __future__ import annotations

import os

from probdiff_callback import run_files
from probdiff_callback.run_files import DEFAULT_SUBDIR, HISTORY_FILE, history_path, probdiff_dir

__all__ = ["DEFAULT_SUBDIR", "HISTORY_FILE", "history_path", "probdiff_dir", "read_history"]


def read_history(path: str | os.PathLike) -> list[dict]:
    """The rows of a history file in their JSON form (null for NaN), as tests and scripts compare them."""
    return [row.to_json() for row in run_files.read_history(path)]
