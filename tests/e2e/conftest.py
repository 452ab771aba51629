"""What the end-to-end tests share: the uninterrupted runs that stopped-and-continued runs are compared with."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from _launch import SETTINGS, run_sft
from _once import made_once


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory, tiny_model_path) -> Callable[[int], tuple[Path, str]]:
    """`uninterrupted(processes)`: the run of `_launch.SETTINGS` to its end on that many processes, started as the
    README does (`python train/sft.py`), once per session whichever worker asks first (`_once.made_once`); (its run
    directory, its stdout). Tests only read it."""

    def run(processes: int) -> tuple[Path, str]:
        def make(cwd: Path) -> None:
            result = run_sft([*SETTINGS, "output_dir=run"], cwd, processes=processes)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            (cwd / "stdout.txt").write_text(result.stdout)

        cwd = made_once(tmp_path_factory, f"uninterrupted-{processes}", make)
        return cwd / "run", (cwd / "stdout.txt").read_text()

    return run
