"""core/records.py: the record, summary, comparison and cost as types; their JSON form (null <-> NaN, the fields'
order, unknown keys kept, missing keys defaulted and not written back); docs/cli.md's tables made from them; and a run
directory written before them (tests/data/old_run) still read by `probdiff select`, `plot` and `crosscheck` as then."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from pathlib import Path

import pytest
from _records import make_record

from probdiff_callback.cli import main
from probdiff_callback.core.metric import compare, summary_of
from probdiff_callback.core.records import Comparison, Cost, Record, Summary, dumps, markdown_table
from probdiff_callback.runs.run_files import read_history, read_records

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
OLD_RUN = Path(__file__).with_name("data") / "old_run"
TABLES = {"Record": Record, "Summary": Summary, "Cost": Cost}


# ---- the JSON form ----
def test_a_record_is_written_in_its_fields_order_with_null_for_nan_and_read_back_as_nan():
    record = make_record("q1", None, category="blog", answer_temperature=None, ref={"rouge1": None, "rougeL": 12.5})
    written = record.to_json()
    assert list(written) == [f.name for f in dataclasses.fields(Record) if f.name != "extra"][:18] + ["ref"]
    assert written["d"] is None and written["logp_revised"] is None and written["answer_temperature"] is None
    assert "responses" not in written and "reference" not in written  # keys only some evaluations have
    read = Record.from_json(json.loads(dumps(written)))
    assert math.isnan(read.d) and math.isnan(read.logp_revised)  # a number: NaN, never None
    assert read.answer_temperature is None and read.ref == {"rouge1": None, "rougeL": 12.5}  # None where it may be
    assert read.to_json() == written


def test_keys_this_version_does_not_know_are_kept_after_its_own():
    written = {**make_record("q1", 0.5).to_json(), "judge": "GPT-4", "score": 7}
    read = Record.from_json(written)
    assert read.extra == {"judge": "GPT-4", "score": 7}
    assert read.to_json() == written and list(read.to_json())[-2:] == ["judge", "score"]


def test_an_older_files_missing_keys_read_as_defaults_and_are_not_written_back():
    older = {k: v for k, v in make_record("q1", 0.5).to_json().items() if "degenerate" not in k and "capped" not in k}
    read = Record.from_json(older)
    assert read.response_degenerate == [] and read.revision_degenerate == [] and read.response_capped is None
    only_some = {"responses", "revisions_by_sample", "d_samples", "reference", "ref"}  # absent from today's files too
    assert read.absent - only_some == {
        "response_capped",
        "revision_capped",
        "response_degenerate",
        "revision_degenerate",
    }
    assert read.to_json() == older  # rewriting an older file invents nothing
    read.revision_degenerate = ["echo"]  # a value given since is written
    assert read.to_json()["revision_degenerate"] == ["echo"]
    summary = Summary.from_json({"n": 2, "delta": -0.05, "confidence": 0.5})
    assert summary.n_capped == 0 and math.isnan(summary.d_mean) and all(map(math.isnan, summary.confidence_ci))
    assert summary.to_json() == {"n": 2, "delta": -0.05, "confidence": 0.5}
    assert Record.absent == frozenset() and make_record().absent == frozenset()  # an object made here lacks nothing


def test_a_missing_required_key_is_named():
    with pytest.raises(ValueError, match=r"not a record: no 'query', 'd'$"):
        Record.from_json({k: v for k, v in make_record().to_json().items() if k not in ("query", "d")})
    with pytest.raises(ValueError, match=r"not a summary: no 'delta'"):
        Summary.from_json({"n": 1, "confidence": 1.0})
    with pytest.raises(ValueError, match="not a comparison: a JSON object is expected, not list"):
        Comparison.from_json([])


def test_a_summary_and_a_comparison_round_trip_nested_types_and_all():
    records = [make_record(i, d, category=c) for i, (c, d) in enumerate([("x", 0.2), ("x", None), ("y", -0.3)])]
    summary = summary_of(records, -0.05, [0.0])
    read = Summary.from_json(json.loads(dumps(summary)))
    assert read.by_category["x"].n == 2 and read.by_category["y"].d_mean == pytest.approx(-0.3)
    assert dumps(read) == dumps(summary) and read.to_json() == summary.to_json()
    comparison = compare(records, [make_record(i, 0.1) for i in range(3)], -0.05)
    assert Comparison.from_json(json.loads(dumps(comparison))).to_json() == comparison.to_json()
    assert dumps({"summary": summary, "costs": [Cost(answer_tokens=3)]}) == (
        f'{{"summary": {dumps(summary.to_json())}, "costs": [{dumps(Cost(answer_tokens=3).to_json())}]}}'
    )


# ---- cost ----
def test_costs_of_ranks_side_by_side_take_the_slowest_stage_and_sum_the_tokens():
    a = Cost(answers_seconds=2.0, revisions_seconds=1.0, scoring_seconds=0.5, answer_tokens=10, revision_tokens=4)
    b = Cost(answers_seconds=1.0, revisions_seconds=3.0, reference_seconds=0.2, answer_tokens=7, revision_tokens=9)
    merged = Cost.merged([a, b])
    assert merged == Cost(
        answers_seconds=2.0, revisions_seconds=3.0, scoring_seconds=0.5, reference_seconds=0.2,
        answer_tokens=17, revision_tokens=13,
    )  # fmt: skip
    assert merged.seconds == pytest.approx(5.7) and merged.generated_tokens == 30
    assert Cost.merged([a]) == a and Cost.merged([]) == Cost()
    # parts run one after the other add up
    assert (a + b).answers_seconds == 3.0 and (a + b).generated_tokens == 30 and sum([a, b], Cost()) == a + b


def test_the_memory_of_ranks_and_parts_is_the_highest_and_older_costs_read_without_it():
    a = Cost(answer_tokens=1, peak_memory_bytes=10, memory_before_bytes=4, peak_memory_before_bytes=7)
    b = Cost(answer_tokens=2, peak_memory_bytes=12, memory_before_bytes=3)
    for both in (Cost.merged([a, b]), a + b, sum([a, b], Cost())):
        assert (both.peak_memory_bytes, both.memory_before_bytes, both.peak_memory_before_bytes) == (12, 4, 7)
    assert (Cost() + Cost()).peak_memory_bytes is None  # a CPU's evaluations have none
    older = {"answers_seconds": 1.5, "revisions_seconds": 0.5, "scoring_seconds": 0.25, "reference_seconds": 0.0,
             "answer_tokens": 3, "revision_tokens": 4}  # fmt: skip
    read = Cost.from_json(older)
    assert read.peak_memory_bytes is None and read.to_json() == older  # written back as it was
    assert Cost.from_json(json.loads(dumps(a))) == a


# ---- docs/cli.md ----
def _generated(text: str, name: str) -> tuple[int, int]:
    start, end = f"<!-- generated: {name} -->\n", f"<!-- end: {name} -->"
    assert start in text and end in text, f"docs/cli.md lacks the markers of the {name} table"
    return text.index(start) + len(start), text.index(end)


def test_the_docs_tables_are_made_from_the_types():
    """Set PROBDIFF_UPDATE_DOCS=1 to rewrite the tables after changing a field or its help."""
    text = DOCS.read_text(encoding="utf-8")
    for name, cls in TABLES.items():
        start, end = _generated(text, name)
        table = markdown_table(cls) + "\n"
        if os.environ.get("PROBDIFF_UPDATE_DOCS") == "1":
            text = text[:start] + table + text[end:]
            DOCS.write_text(text, encoding="utf-8")
        else:
            assert text[start:end] == table, (
                f"the {name} table in docs/cli.md is not the type's own: rerun with PROBDIFF_UPDATE_DOCS=1"
            )
    assert "| `revision_degenerate` |" in text and "| `length_changed_share` |" in text


# ---- a run directory written before the types ----
@pytest.fixture
def old_run(tmp_path, monkeypatch):
    """A copy of tests/data/old_run, from a working directory where its rows' checkpoint paths name nothing."""
    run = tmp_path / "run"
    shutil.copytree(OLD_RUN, run, ignore=shutil.ignore_patterns("expected"))
    monkeypatch.chdir(tmp_path)
    return run


@pytest.mark.parametrize("command", ["select", "plot", "crosscheck"])
def test_a_run_written_before_the_types_prints_what_it_printed_then(command, old_run, capsys):
    assert main([command, str(old_run)]) == 0
    printed = capsys.readouterr().out.replace(str(old_run), "RUN_DIR")
    assert printed == (OLD_RUN / "expected" / f"{command}.txt").read_text(encoding="utf-8")
    if command == "crosscheck":
        written = (old_run / "probdiff" / "crosscheck.json").read_text(encoding="utf-8")
        assert written == (OLD_RUN / "expected" / "crosscheck.json").read_text(encoding="utf-8")
    if command == "plot":
        assert (old_run / "probdiff" / "probdiff.png").stat().st_size > 0


def test_a_run_written_before_the_types_reads_and_is_rewritten_as_it_was(old_run):
    history = old_run / "probdiff" / "history.jsonl"
    rows = read_history(history)
    older = next(row for row in rows if row.global_step == 12)  # hand-edited to an older version's keys
    assert older.summary.n_revision_degenerate == 0 and "n_revision_degenerate" in older.summary.absent
    assert older.eval_losses is None and older.cost is None
    assert [dumps(row.to_json()) for row in rows] == history.read_text(encoding="utf-8").splitlines()
    records = read_records(old_run / "probdiff" / "step-12" / "records.jsonl")
    assert all(r.revision_degenerate == [] and r.answer_temperature is None for r in records)
    lines = (old_run / "probdiff" / "step-12" / "records.jsonl").read_text(encoding="utf-8").splitlines()
    assert [dumps(r) for r in records] == lines
