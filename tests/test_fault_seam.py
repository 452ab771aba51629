"""tests/_faults.py, the fault seam: plans read or named wrong, and the moments of a run's files where its places act
(in this process, with an out-of-memory fault in place of a signal). The processes the e2e tests start meet every
place: tests/e2e/test_faults.py."""

from __future__ import annotations

import os

import pytest
import torch
from _faults import inject, planned_faults

from probdiff_callback.runs import run_files
from probdiff_callback.runs.run_files import HistoryRow, RunFiles, read_history


def test_a_bad_fault_plan_is_named():
    with pytest.raises(ValueError, match="'answers:2' is not <place>"):
        planned_faults("answers:2")
    assert planned_faults("answers-done:2=oom, records-written") == [
        ("answers-done", 2, "OOM"),
        ("records-written", 1, "KILL"),
    ]


def test_production_code_does_not_know_the_seam():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for folder in ("probdiff_callback", "train"):
        for directory, _, files in os.walk(os.path.join(root, folder)):
            for name in [f for f in files if f.endswith(".py")]:
                text = open(os.path.join(directory, name), encoding="utf-8").read()
                assert "PROBDIFF_FAULT" not in text and "_faults" not in text, os.path.join(directory, name)


def add_steps(directory, steps: int) -> RunFiles:
    files = RunFiles(directory)
    files.continue_from(0)
    for step in range(steps):
        files.add(HistoryRow(step, kind="baseline" if step == 0 else "evaluate"), [{"id": "a", "d": 0.5}])
    return files


def test_records_written_acts_after_the_records_and_before_the_history_row(tmp_path, monkeypatch):
    inject("records-written:2=OOM", monkeypatch.setattr)
    with pytest.raises(torch.OutOfMemoryError, match="records-written"):
        add_steps(tmp_path, 3)
    assert [row.global_step for row in read_history(tmp_path / "probdiff/history.jsonl")] == [0]
    assert (tmp_path / "probdiff/step-1/records.jsonl").is_file()


def test_history_tmp_written_acts_between_the_temporary_file_and_the_rename(tmp_path, monkeypatch):
    inject("history-tmp-written:3=OOM", monkeypatch.setattr)  # visit 1: continue_from's empty history
    with pytest.raises(torch.OutOfMemoryError, match="history-tmp-written"):
        add_steps(tmp_path, 3)
    assert [row.global_step for row in read_history(tmp_path / "probdiff/history.jsonl")] == [0]
    assert list((tmp_path / "probdiff").glob(".history.jsonl.tmp*"))


def test_the_wrapping_lasts_as_long_as_the_patch(tmp_path, monkeypatch):
    wrapped = (RunFiles, "add"), (run_files, "write_atomic"), (os, "replace")
    with monkeypatch.context() as armed:
        inject("records-written:1=OOM", armed.setattr)
        assert all(hasattr(getattr(owner, name), "__wrapped__") for owner, name in wrapped)
    assert not any(hasattr(getattr(owner, name), "__wrapped__") for owner, name in wrapped)
    add_steps(tmp_path, 2)  # unarmed: nothing acts


def test_a_fault_once_acts_only_in_the_first_process_to_reach_it(tmp_path, monkeypatch):
    """PROBDIFF_FAULT_ONCE: the process started again after the fault (an evaluator restarted by training) inherits the
    plan, and goes on."""
    monkeypatch.setenv("PROBDIFF_FAULT_ONCE", str(tmp_path / "acted"))
    with monkeypatch.context() as first:
        inject("records-written=OOM", first.setattr)
        with pytest.raises(torch.OutOfMemoryError, match="records-written"):
            add_steps(tmp_path / "first", 1)
    assert (tmp_path / "acted").is_file()
    inject("records-written=OOM", monkeypatch.setattr)  # the same plan, as a started-again process has it
    add_steps(tmp_path / "again", 2)
    assert len(read_history(tmp_path / "again/probdiff/history.jsonl")) == 2
