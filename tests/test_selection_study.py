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
    others = {damaged[way] for way in ("last", "lowest eval loss", "highest confidence")}
    assert len(others) == 1, f"the README's sentence says the three other ways made as many damaged picks: {damaged}"
    readme = " ".join((AGREEMENT.parents[1] / "README.md").read_text(encoding="utf-8").split())
    assert (
        f"{len(study)} of 18 runs so far, 64 test queries no pick saw) it made {damaged['probdiff_guarded']} damaged "
        f"pick{'s' if damaged['probdiff_guarded'] != 1 else ''} where the last checkpoint, the lowest eval loss and "
        f"the highest confidence made {others.pop()} each"
    ) in readme


def test_where_no_checkpoint_passes_the_guard_the_test_set_finds_every_checkpoint_damaged(study):
    """What the docs say of the guarded pick's fallback: the runs where the guard passed no checkpoint (the pick is the
    base model) are the high-learning-rate runs, and on the test set even their oracle checkpoint is significantly
    worse than the base model."""
    fell_back = []
    for name, values in study.items():
        rows = [HistoryRow.from_json(row) for row in values["rows"]]
        guarded = run_pick(rows, "", selection_study.per_query_values(values), GUARDED, on_disk_only=False)
        if guarded.none_passes:
            fell_back.append(name)
            assert selection_study.judged(values, selection_study.picks_of(values)["oracle"])[2], name
    assert fell_back == [name for name in study if name.endswith("-high-lr")]
