"""probdiff_callback/runs/run_files.py: a run's history, null <-> NaN in one place, old files readable, atomic
whole-file writes."""

import json
import math

import pytest

from probdiff_callback.core.queries import DataFileError, read_jsonl
from probdiff_callback.runs import run_files
from probdiff_callback.runs.run_files import HistoryRow, RunFiles, read_history, read_run, to_json, write_jsonl

OLD_ROW = (  # a row as versions before vs_base and eval_loss wrote it; null where the value was NaN
    '{"global_step": 4, "epoch": 0.4, "kind": "evaluate", "base_model": false, "checkpoint": "run/checkpoint-4", '
    '"records": "step-4/records.jsonl", "summary": {"confidence": 0.5, "confidence_ci": [0.2, 0.8], "d_mean": null, '
    '"by_category": {"Writing": {"n": 2, "confidence": null}}}, "error": null, "seconds": 1.5}'
)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_nan_written_as_null(tmp_path):
    assert to_json({"d": math.nan, "x": [1.0, math.inf]}) == '{"d": null, "x": [1.0, null]}'
    write_jsonl(tmp_path / "r.jsonl", [{"d": math.nan}])
    assert read_jsonl(tmp_path / "r.jsonl") == [{"d": None}]


def test_history_rows_read_null_as_nan_and_write_it_back_as_null(tmp_path):
    path = write(tmp_path, "history.jsonl", OLD_ROW + "\n")
    (row,) = read_history(path)
    assert isinstance(row, HistoryRow) and row.global_step == 4 and row.checkpoint == "run/checkpoint-4"
    assert math.isnan(row.summary["d_mean"]) and math.isnan(row.summary["by_category"]["Writing"]["confidence"])
    assert row.summary["confidence_ci"] == [0.2, 0.8] and row.vs_base is None and math.isnan(row.eval_loss)
    # written back with its nulls and in its key order; `vs_base` (null: no comparison) as today's rows have it
    assert list(row.to_json().items()) == [*json.loads(OLD_ROW).items(), ("vs_base", None)]
    row.eval_loss, row.vs_base = 2.5, {"win": 1, "wilcoxon_p": math.nan}
    assert list(row.to_json())[-2:] == ["vs_base", "eval_loss"]
    assert row.to_json()["vs_base"] == {"win": 1, "wilcoxon_p": None}
    assert math.isnan(HistoryRow.from_json(row.to_json()).vs_base["wilcoxon_p"])
    assert read_history(tmp_path / "missing.jsonl") == [] and read_history(write(tmp_path, "e.jsonl", "")) == []
    with pytest.raises(DataFileError, match=r"bad\.jsonl:2: not a history row"):
        read_history(write(tmp_path, "bad.jsonl", OLD_ROW + '\n{"kind": "evaluate"}\n'))


def test_run_files_write_each_row_from_memory_and_keep_the_file_whole(tmp_path, monkeypatch):
    files = RunFiles(tmp_path / "run")
    assert files.continue_from(0) == ([], 0) and read_history(files.history_path) == []
    records = [{"id": "a", "d": math.nan, "logp_response": -1.0, "logp_revised": None}]
    files.add(HistoryRow(0, kind="baseline", base_model=True, summary={"confidence": 0.0}), records)
    files.add(HistoryRow(4, summary={"confidence": 1.0}, checkpoint=str(tmp_path / "run" / "checkpoint-4")), records)
    read = read_run(tmp_path / "run")
    assert [row.global_step for row in read.rows] == [0, 4]
    assert [row.to_json() for row in read.rows] == [row.to_json() for row in files.rows()]
    assert math.isnan(read.records[4][0]["d"]) and math.isnan(read.records[4][0]["logp_revised"])
    assert files.baseline_records()[0]["id"] == "a"
    # the checkpoint is named before it is saved; saving it writes the row beside it and leaves the history alone
    (tmp_path / "run" / "checkpoint-4").mkdir()
    written = []
    real = run_files.write_jsonl
    monkeypatch.setattr(run_files, "write_jsonl", lambda path, rows: written.append(path) or real(path, rows))
    files.link_checkpoint(4, str(tmp_path / "run" / "checkpoint-4"))
    assert written == []
    assert json.loads((tmp_path / "run" / "checkpoint-4" / "probdiff.json").read_text()) == files.row(4).to_json()
    files.set_eval_loss(4, 2.0)
    files.set_eval_loss(4, 3.0)  # a later evaluation of other weights does not replace it
    assert written == [files.history_path] and read_history(files.history_path)[1].eval_loss == 2.0
    assert not list(files.directory.glob(".history.jsonl.tmp*"))  # written to a temp file, then renamed
