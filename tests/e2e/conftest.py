"""What the end-to-end tests share: the uninterrupted runs that stopped-and-continued runs are compared with."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from _launch import SETTINGS, run_sft


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory, tiny_model_path) -> Callable[[int], tuple[Path, str]]:
    """`uninterrupted(processes)`: the run of `_launch.SETTINGS` to its end on that many processes, started as the
    README does (`python train/sft.py`), once per session; (its run directory, its stdout)."""
    runs: dict[int, tuple[Path, str]] = {}

    def run(processes: int) -> tuple[Path, str]:
        if processes not in runs:
            cwd = tmp_path_factory.mktemp(f"uninterrupted-{processes}")
            result = run_sft([*SETTINGS, "output_dir=run"], cwd, processes=processes)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            runs[processes] = (cwd / "run", result.stdout)
        return runs[processes]

    return run
