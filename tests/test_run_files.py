"""probdiff_callback/runs/run_files.py: a run's history, null <-> NaN in one place, old files readable, atomic
whole-file writes."""

import json
import math

import pytest

from probdiff_callback.core.queries import DataFileError, read_jsonl
from probdiff_callback.core.records import Comparison, Cost, Record, Summary, dumps
from probdiff_callback.runs import run_files
from probdiff_callback.runs.run_files import HistoryRow, RunFiles, read_history, read_records, read_run, write_jsonl

OLD_ROW = (  # a row as versions before vs_base and eval_loss wrote it, its summary as the first version's; null where
    # the value was NaN
    '{"global_step": 4, "epoch": 0.4, "kind": "evaluate", "base_model": false, "checkpoint": "run/checkpoint-4", '
    '"records": "step-4/records.jsonl", "summary": {"n": 2, "n_invalid": 1, "n_truncated": 0, "delta": -0.05, '
    '"confidence": 0.5, "confidence_ci": [0.2, 0.8], "confidence_sweep": {"-0.05": 0.5}, "d_mean": null, '
    '"d_median": null, "d_std": null, "d_quantiles": {"0.5": null}, "logp_response_mean": -2.0, '
    '"logp_revised_mean": null, "by_category": {"Writing": {"n": 2, "confidence": null, "d_mean": null}}, '
    '"len_response_mean": 10.0, "len_revised_mean": 0.0, "length_changed_share": 0.5}, "error": null, "seconds": 1.5}'
)
COMPARISON = Comparison(
    n=2, n_only_a=0, n_only_b=0, delta=-0.05, win=1, tie=1, lose=0, confidence_a=1.0, confidence_b=0.5,
    difference=0.5, difference_ci=[-0.2, 0.9], sign_p=1.0, n_paired=2, d_mean_a=0.1, d_mean_b=-0.2,
    wilcoxon_p=math.nan,
)  # fmt: skip


def record(query_id: str, d: float, logp_revised: float) -> Record:
    return Record(
        id=query_id, category=None, query="q", response="a", revisions=["b"], logp_response=-1.0,
        logp_revised=logp_revised, d=d, n_tokens_response=1, n_tokens_revised=1, confident=False, truncated=False,
    )  # fmt: skip


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_nan_written_as_null(tmp_path):
    assert dumps({"d": math.nan, "x": [1.0, math.inf]}) == '{"d": null, "x": [1.0, null]}'
    write_jsonl(tmp_path / "r.jsonl", [{"d": math.nan}])
    assert read_jsonl(tmp_path / "r.jsonl") == [{"d": None}]


def test_history_rows_read_null_as_nan_and_write_it_back_as_null(tmp_path):
    path = write(tmp_path, "history.jsonl", OLD_ROW + "\n")
    (row,) = read_history(path)
    assert isinstance(row, HistoryRow) and row.global_step == 4 and row.checkpoint == "run/checkpoint-4"
    assert isinstance(row.summary, Summary) and math.isnan(row.summary.d_mean)
    assert math.isnan(row.summary.by_category["Writing"].confidence) and row.cost is None
    assert row.summary.confidence_ci == [0.2, 0.8] and row.vs_base is None and math.isnan(row.eval_loss)
    # keys the first version did not write read as their defaults ...
    assert row.summary.n_capped == 0 and math.isnan(row.summary.confidence_non_degenerate)
    # ... and the row is written back as it was, with its nulls, in its key order, adding none of them; `vs_base`
    # (null: no comparison) as today's rows have it
    assert list(row.to_json().items()) == [*json.loads(OLD_ROW).items(), ("vs_base", None)]
    row.eval_loss, row.vs_base = 2.5, COMPARISON
    assert list(row.to_json())[-2:] == ["vs_base", "eval_loss"]
    assert row.to_json()["vs_base"] == {**COMPARISON.to_json(), "wilcoxon_p": None}
    assert math.isnan(HistoryRow.from_json(row.to_json()).vs_base.wilcoxon_p)
    # the cost, where it was measured, beside the seconds
    row.cost = Cost(answers_seconds=1.0, answer_tokens=7)
    assert list(row.to_json())[8:11] == ["seconds", "cost", "vs_base"]
    assert HistoryRow.from_json(row.to_json()).cost == row.cost
    assert read_history(tmp_path / "missing.jsonl") == [] and read_history(write(tmp_path, "e.jsonl", "")) == []
    with pytest.raises(DataFileError, match=r"bad\.jsonl:2: not a history row"):
        read_history(write(tmp_path, "bad.jsonl", OLD_ROW + '\n{"kind": "evaluate"}\n'))
    no_delta = OLD_ROW.replace('"delta": -0.05, ', "")
    with pytest.raises(DataFileError, match=r"nodelta\.jsonl:1: not a summary: no 'delta'"):
        read_history(write(tmp_path, "nodelta.jsonl", no_delta + "\n"))


def test_read_records_names_the_line_of_a_row_that_is_not_a_record(tmp_path):
    path = tmp_path / "records.jsonl"
    write_jsonl(path, [record("a", 0.5, -0.5).to_json(), {"id": "b", "d": 0.1}])
    with pytest.raises(DataFileError, match=r"records\.jsonl:2: not a record: no 'category', 'query', .*'truncated'"):
        read_records(path)


def test_records_and_history_holding_unicode_line_separators_read_back_whole(tmp_path):
    """A model's answer or an error text may hold U+2028 (dumps writes it unescaped): the files read back as written."""
    answer = record("a", 0.5, -0.5)
    answer.response = "first\u2028second\x85third"
    write_jsonl(tmp_path / "records.jsonl", [answer.to_json()])
    assert read_records(tmp_path / "records.jsonl")[0].response == answer.response
    row = HistoryRow(global_step=2, epoch=1.0, kind="evaluate", error="line one\u2029line two")
    write_jsonl(tmp_path / "history.jsonl", [row.to_json()])
    assert read_history(tmp_path / "history.jsonl") == [row]


def test_run_files_write_each_row_from_memory_and_keep_the_file_whole(tmp_path, monkeypatch):
    files = RunFiles(tmp_path / "run")
    assert files.continue_from(0) == ([], 0) and read_history(files.history_path) == []
    records = [record("a", math.nan, math.nan)]
    base, trained = Summary(n=1, delta=-0.05, confidence=0.0), Summary(n=1, delta=-0.05, confidence=1.0)
    files.add(HistoryRow(0, kind="baseline", base_model=True, summary=base), records)
    files.add(HistoryRow(4, summary=trained, checkpoint=str(tmp_path / "run" / "checkpoint-4")), records)
    read = read_run(tmp_path / "run")
    assert [row.global_step for row in read.rows] == [0, 4]
    assert [row.to_json() for row in read.rows] == [row.to_json() for row in files.rows()]
    assert math.isnan(read.records[4][0].d) and math.isnan(read.records[4][0].logp_revised)
    assert read_jsonl(files.directory / "step-4" / "records.jsonl")[0]["d"] is None  # null in the file
    assert files.baseline_records()[0].id == "a"
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


def test_a_rows_keys_in_their_order_the_optional_ones_only_where_they_hold_a_value():
    row = HistoryRow(0, 0, "baseline", True, eval_loss=math.inf, extra={"later": 1})  # the Trainer's epoch 0: an int
    assert list(row.to_json()) == [
        "global_step", "epoch", "kind", "base_model", "checkpoint", "records", "summary", "error", "seconds",
        "vs_base", "later",
    ]  # fmt: skip
    row.cost, row.eval_loss, row.eval_losses, row.abandoned = Cost(), 1.5, "step-0/eval_losses.json", True
    written = row.to_json()
    assert list(written)[8:] == ["seconds", "cost", "vs_base", "eval_loss", "eval_losses", "abandoned", "later"]
    read = HistoryRow.from_json(json.loads(dumps(written)))
    assert read == row and read.absent == frozenset() and dumps(read) == dumps(row) == dumps(written)
    assert dumps(HistoryRow.from_json({"global_step": 0, "epoch": 0})).startswith('{"global_step": 0, "epoch": 0,')
