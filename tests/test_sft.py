"""train/sft.py's entry point in this process: a configuration or data error stops with one `error:` line and exit
status 2 before anything is written. (Whole runs, as a user starts them: e2e/test_sft_runs.py; a setup error in a
process of its own, through this same entry point: e2e/test_launcher_signals.py.)"""

from __future__ import annotations

import pytest

from probdiff_callback.training import sft
from probdiff_callback.training.recipe import TASKS


@pytest.fixture
def in_a_new_directory(tmp_path, monkeypatch, sft_in_this_process):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def stops(args: list[str], capsys) -> str:
    """The error `train/sft.py args` stops with (exit status 2, one line on stderr, nothing on stdout)."""
    assert sft.main(args) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_configuration_errors_stop_with_one_line_and_exit_2(in_a_new_directory, capsys):
    error = stops(["recipe=blog", "lerning_rate=1e-4"], capsys)
    assert "unknown key 'lerning_rate'" in error and "did you mean 'learning_rate'" in error
    assert "wrong type for 'max_steps'" in stops(["recipe=blog", "max_steps=ten"], capsys)
    assert "ProbDiff setting 'delta': got 'abc'" in stops(["recipe=blog", "model=tiny", "probdiff.delta=abc"], capsys)
    missing = stops(["recipe=nope"], capsys)
    assert "recipe='nope' is not a recipe" in missing and all(name in missing for name in TASKS)
    assert not (in_a_new_directory / "runs").exists()  # a run that stops on its config leaves no directory behind


def test_data_errors_stop_with_one_line_and_exit_2(in_a_new_directory, capsys):
    tmp_path = in_a_new_directory
    error = stops(["recipe=alignbench", f"train_file={tmp_path}/missing.jsonl", "report_to=none"], capsys)
    assert error.startswith(f"error: train_file={tmp_path}/missing.jsonl: no such file")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n')
    assert f"{bad}:2" in stops(["recipe=blog", "model=tiny", f"heldout_file={bad}", "report_to=none"], capsys)
    assert not (tmp_path / "runs").exists()  # nor on its data
