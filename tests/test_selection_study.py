"""The selection study of docs/agreement.md (`bench/selection_study.py`) from its record, numbers only (no text of the
paper's data: tests/data/selection_study.json, which the study adds each measured run to): the tables the docs
publish are what the study's own functions compute from them, and what the docs say of the guarded pick's fallback
holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import selection_study  # bench/, on the tests' pythonpath

from probdiff_callback.analysis.pick import GUARDED
from probdiff_callback.analysis.select import run_pick
from probdiff_callback.runs.run_files import HistoryRow

FIXTURE = Path(__file__).with_name("data") / "selection_study.json"
AGREEMENT = Path(__file__).resolve().parents[1] / "docs" / "agreement.md"


@pytest.fixture(scope="module")
def study() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def published(table: str) -> str:
    start, end = selection_study.MARKERS[table]
    text = AGREEMENT.read_text(encoding="utf-8")
    return text[text.index(start) + len(start) : text.index(end)].strip("\n")


def test_the_docs_tables_are_what_the_study_computes(study):
    assert published("picks") == selection_study.study_table(study)
    assert published("times") == selection_study.times_table(study)
    assert f"**So far: {len(study)} of the 18 runs**" in AGREEMENT.read_text(encoding="utf-8")


def test_the_readme_quotes_the_study_as_it_stands(study):
    """The README's two lines on the study: its run count and each way's damaged picks, as the record has them."""
    damaged = selection_study.damaged_picks(study)
    readme = " ".join((AGREEMENT.parents[1] / "README.md").read_text(encoding="utf-8").split())
    assert (
        f"{len(study)} of 18 runs so far, 64 test queries no pick saw) it made {damaged['probdiff_guarded']} damaged "
        f"pick{'s' if damaged['probdiff_guarded'] != 1 else ''} where the last checkpoint made {damaged['last']}, the "
        f"lowest eval loss {damaged['lowest eval loss']} and the highest confidence {damaged['highest confidence']}"
    ) in readme


def test_where_no_checkpoint_passes_the_guard_the_base_model_beats_every_checkpoint_on_the_test_set(study):
    """What the docs say of the guarded pick's fallback: every high-learning-rate run falls back to the base model, and
    there even the oracle checkpoint is significantly worse than the base model on the test set; wherever the guard
    passes no checkpoint (a deranged run too: summarization-s1-deranged), the base model beats the run's best
    checkpoint on the test set."""
    fell_back = []
    for name, values in study.items():
        rows = [HistoryRow.from_json(row) for row in values["rows"]]
        guarded = run_pick(rows, "", selection_study.per_query_values(values), GUARDED, on_disk_only=False)
        oracle = selection_study.picks_of(values)["oracle"]
        if name.endswith("-high-lr"):
            assert guarded.none_passes and selection_study.judged(values, oracle)[2], name
        if guarded.none_passes:
            fell_back.append(name)
            base, best = selection_study.judged(values, 0)[0], selection_study.judged(values, oracle)[0]
            assert (base < best) if selection_study.LOWER_IS_BETTER[values["measure"]] else (base > best), name
    assert len(fell_back) > sum(name.endswith("-high-lr") for name in study), "a deranged run falls back too"
