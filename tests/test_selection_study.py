"""The selection study of docs/agreement.md (`bench/selection_study.py`) from its record, numbers only (no text of the
paper's data: tests/data/selection_study.json, which the study adds each measured run to): the tables the docs
publish are what the study's own functions compute from them, and what the docs say of the guarded pick's fallback
holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import selection_study  # bench/, on the tests' pythonpath

FIXTURE = Path(__file__).with_name("data") / "selection_study.json"
AGREEMENT = Path(__file__).resolve().parents[1] / "docs" / "agreement.md"


@pytest.fixture(scope="module")
def study() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def picks(study) -> dict:
    """Each run's picks, computed once for the module's tests (the guard's tests are the study's costly part)."""
    return selection_study.all_picks(study)


def run_count(runs: int, docs: bool) -> str:
    """How the docs and the README count the study's runs: all of them once all 18 are in."""
    if runs == 18:
        return "**All 18 runs**" if docs else "18 runs"
    return f"**So far: {runs} of the 18 runs**" if docs else f"{runs} of 18 runs so far"


def published(table: str) -> str:
    start, end = selection_study.MARKERS[table]
    text = AGREEMENT.read_text(encoding="utf-8")
    return text[text.index(start) + len(start) : text.index(end)].strip("\n")


def test_the_docs_tables_are_what_the_study_computes(study, picks):
    assert published("picks") == selection_study.study_table(study, picks)
    assert published("times") == selection_study.times_table(study)
    assert run_count(len(study), docs=True) in AGREEMENT.read_text(encoding="utf-8")


def test_the_readme_quotes_the_study_as_it_stands(study, picks):
    """The README's two lines on the study: its run count and each way's damaged picks, as the record has them."""
    damaged = selection_study.damaged_picks(study, picks)
    readme = " ".join((AGREEMENT.parents[1] / "README.md").read_text(encoding="utf-8").split())
    assert (
        f"{run_count(len(study), docs=False)}, 64 test queries no pick saw) it made {damaged['probdiff_guarded']} "
        f"damaged pick{'s' if damaged['probdiff_guarded'] != 1 else ''} where the last checkpoint made "
        f"{damaged['last']}, the lowest eval loss {damaged['lowest eval loss']} and the highest confidence "
        f"{damaged['highest confidence']}"
    ) in readme


def test_where_no_checkpoint_passes_the_guard_the_base_model_beats_every_checkpoint_on_the_test_set(study, picks):
    """What the docs say of the guarded pick's fallback: every high-learning-rate run falls back to the base model, and
    there even the oracle checkpoint is significantly worse than the base model on the test set; wherever the guard
    passes no checkpoint (a deranged run too: summarization-s1-deranged), the base model beats the run's best
    checkpoint on the test set."""
    fell_back = []
    for name, values in study.items():
        none_passes, oracle = picks[name]["probdiff_guarded"] == 0, picks[name]["oracle"]  # 0: the base model
        if name.endswith("-high-lr"):
            assert none_passes and selection_study.judged(values, oracle)[2], name
        if none_passes:
            fell_back.append(name)
            base, best = selection_study.judged(values, 0)[0], selection_study.judged(values, oracle)[0]
            assert (base < best) if selection_study.LOWER_IS_BETTER[values["measure"]] else (base > best), name
    assert len(fell_back) > sum(name.endswith("-high-lr") for name in study), "a deranged run falls back too"
