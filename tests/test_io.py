import json
import math
from pathlib import Path

import pytest

from probdiff_callback.core.queries import DataFileError, load_pairs, load_queries, read_jsonl
from probdiff_callback.runs import run_files
from probdiff_callback.runs.run_files import HistoryRow, RunFiles, read_history, read_run, to_json, write_jsonl

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "data" / "probdiff-reference"


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_jsonl_and_json_list_detected_by_content(tmp_path):
    rows = [{"instruction": "a"}, {"question": "b", "question_id": 7, "category": "math"}]
    lines = write(tmp_path, "q.json", "\n".join(json.dumps(r) for r in rows) + "\n")
    listed = write(tmp_path, "q.jsonl", json.dumps(rows, indent=2))
    for path in (lines, listed):
        queries = load_queries(path)
        assert [(q.id, q.text, q.category) for q in queries] == [("0", "a", None), ("7", "b", "math")]


def test_query_fields_and_turns(tmp_path):
    rows = [
        {"id": "x", "query": "from query"},
        {"user": "from user", "assistant": "ignored"},
        {"conversations": [{"from": "user", "value": "from conversations"}, {"from": "assistant", "value": "no"}]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "from messages"}]},
        {"turns": ["first turn", "second turn"], "question_id": 81},
    ]
    path = write(tmp_path, "q.jsonl", "\n".join(json.dumps(r) for r in rows))
    assert [q.text for q in load_queries(path)] == [
        "from query",
        "from user",
        "from conversations",
        "from messages",
        "first turn",
    ]
    assert load_queries(path)[4].id == "81"


def test_bad_row_names_file_and_line(tmp_path):
    path = write(tmp_path, "bad.jsonl", '{"query": "ok"}\n\n{"answer": "no query here"}\n')
    with pytest.raises(DataFileError, match=r"bad\.jsonl:3: no query found.*keys here: answer"):
        load_queries(path)
    path = write(tmp_path, "broken.jsonl", '{"query": "ok"}\n{"query": "unterminated\n')
    with pytest.raises(DataFileError, match=r"broken\.jsonl:2: not valid JSON"):
        load_queries(path)
    path = write(tmp_path, "list.json", '[\n  {"query": "ok"},\n  {"query": ""}\n]')
    with pytest.raises(DataFileError, match=r"list\.json:3: no query found"):
        load_queries(path)
    path = write(tmp_path, "dup.jsonl", '{"id": 1, "query": "a"}\n{"id": 1, "query": "b"}\n')
    with pytest.raises(DataFileError, match=r"dup\.jsonl:2: id '1' repeats line 1"):
        load_queries(path)
    path = write(tmp_path, "scalar.jsonl", '{"query": "a"}\n"just a string"\n')
    with pytest.raises(DataFileError, match=r"scalar\.jsonl:2: expected a JSON object"):
        load_queries(path)
    with pytest.raises(DataFileError, match="holds no rows"):
        load_queries(write(tmp_path, "empty.jsonl", "\n"))


def test_pairs_need_all_three_texts(tmp_path):
    path = write(
        tmp_path,
        "p.jsonl",
        json.dumps({"id": "a", "query": "q", "response": "r", "revised": "v"})
        + "\n"
        + json.dumps({"id": "b", "query": "q", "response": "r"})
        + "\n",
    )
    with pytest.raises(DataFileError, match=r"p\.jsonl:2: missing or non-string revised"):
        load_pairs(path)


def test_nan_written_as_null(tmp_path):
    assert to_json({"d": math.nan, "x": [1.0, math.inf]}) == '{"d": null, "x": [1.0, null]}'
    write_jsonl(tmp_path / "r.jsonl", [{"d": math.nan}])
    assert read_jsonl(tmp_path / "r.jsonl") == [{"d": None}]


# ---- a run's history (run_files): null <-> NaN in one place, old files readable, atomic whole-file writes ----
OLD_ROW = (  # a row as versions before vs_base and eval_loss wrote it; null where the value was NaN
    '{"global_step": 4, "epoch": 0.4, "kind": "evaluate", "base_model": false, "checkpoint": "run/checkpoint-4", '
    '"records": "step-4/records.jsonl", "summary": {"confidence": 0.5, "confidence_ci": [0.2, 0.8], "d_mean": null, '
    '"by_category": {"Writing": {"n": 2, "confidence": null}}}, "error": null, "seconds": 1.5}'
)


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


@pytest.mark.skipif(not REFERENCE.is_dir(), reason="the paper's data is only on development machines (../shared)")
@pytest.mark.parametrize(
    "relative, count, first_category",
    # AlignBench's Chinese category names load under their canonical English label (see `canonical_category`)
    [
        ("redbook/test.json", 100, None),
        ("alignbench/data_release.jsonl", 683, "Professional"),
        ("mtbench/question.jsonl", 80, "writing"),
        ("alpaca_eval/test.json", 805, None),
        ("redbook/train.json", 469, None),
    ],
)
def test_paper_files_load_as_they_are(relative, count, first_category):
    queries = load_queries(REFERENCE / relative)
    assert len(queries) == count
    assert queries[0].category == first_category
    assert all(q.text.strip() for q in queries)
