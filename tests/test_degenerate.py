"""Degenerate answers and revisions (`core/degenerate.py`): the checks on their own, on a record, in the summary and
in what `probdiff eval` prints."""

from __future__ import annotations

import math

import pytest

from probdiff_callback.analysis.report import degenerate_note, format_summary
from probdiff_callback.callback.metrics import metrics_from_summary
from probdiff_callback.core import degenerate
from probdiff_callback.core.degenerate import (
    echoed_prompt,
    is_repetition_loop,
    prompt_labels,
    repeated_ngram_share,
    revision_degenerate,
    words,
)
from probdiff_callback.core.evaluator import build_record
from probdiff_callback.core.metric import summary_of
from probdiff_callback.core.prompts import REFINEMENT_PROMPTS, REWRITER, SIMPLE, PreparedQuery
from probdiff_callback.core.queries import Query
from probdiff_callback.core.records import Record, Summary

ALL_TEMPLATES = tuple(REFINEMENT_PROMPTS.values())
LOOP = "Paris is a culinary delight " + "that is a culinary delight " * 30
ECHO = "#Rewritten Response# #Given Prompt#: #Given Response#: Paris is a city in France."
ANSWER = (
    "Paris is the capital of France. It is known for its museums, such as the Louvre, its cafes and its long "
    "history as a centre of art and politics. Visitors often walk along the Seine and climb the Eiffel Tower."
)


def test_words_split_latin_runs_and_every_cjk_character():
    assert words("Hello, world_x 42!") == ["Hello", ",", "world", "_", "x", "42", "!"]
    assert words("我爱Paris。") == ["我", "爱", "Paris", "。"]


def test_repeated_ngram_share_is_seq_rep_n():
    assert repeated_ngram_share(list("abcdefgh"), 2) == 0.0
    assert repeated_ngram_share(list("abababab"), 2) == pytest.approx(1 - 2 / 7)  # ab, ba distinct of 7 bigrams
    assert repeated_ngram_share(list("abc"), 8) == 0.0  # shorter than n: no n-gram, no share


def test_a_loop_is_flagged_and_ordinary_prose_is_not():
    assert is_repetition_loop(LOOP)
    assert not is_repetition_loop(ANSWER)
    assert is_repetition_loop("天气很好。" * 20) and not is_repetition_loop(
        "今天天气很好，我们去公园散步，然后回家吃饭。"
    )


def test_a_short_repeat_is_too_short_to_judge():
    text = "yes yes yes yes yes yes yes yes yes yes"  # 10 words: 3 eight-grams, all the same, fewer than MIN_NGRAMS
    assert repeated_ngram_share(words(text)) > degenerate.REPEATED_SHARE_LIMIT and not is_repetition_loop(text)


def test_labels_come_from_the_templates():
    assert prompt_labels(REWRITER) == ("#Given Prompt#", "#Given Response#", "#Rewritten Response#")
    assert prompt_labels(SIMPLE) == ("#INSTRUCTION#", "#RESPONSE#", "#Your Response#")
    assert prompt_labels("Improve the answer.\nQuestion: {instruction}\nAnswer: {response}\nBetter answer:") == (
        "Question",
        "Answer",
        "Better answer",
    )


def test_an_echo_is_a_label_the_query_and_answer_did_not_hold():
    assert echoed_prompt(ECHO, [REWRITER]) == ["#Given Prompt#", "#Given Response#", "#Rewritten Response#"]
    assert echoed_prompt("#rewritten response#\nfine", [REWRITER]) == ["#Rewritten Response#"]  # case aside
    assert echoed_prompt(ECHO, [REWRITER], given=[ECHO]) == []  # the answer held them already: nothing copied
    assert echoed_prompt("I want you to act as a Response Rewriter. Sure.", [REWRITER]) == [
        "I want you to act as a Response Rewriter."
    ]
    assert echoed_prompt(ANSWER, ALL_TEMPLATES) == []


def test_a_plain_word_label_counts_only_as_a_label():
    template = "Question: {instruction}\nAnswer: {response}\nBetter answer:"
    assert echoed_prompt("The answer is 4, as the question asks.", [template]) == []
    assert echoed_prompt("Better answer: 4", [template]) == ["Better answer"]
    assert echoed_prompt("4\nQuestion: what is 2 + 2?", [template]) == ["Question"]


def test_revision_degenerate_names_each_kind():
    assert revision_degenerate(LOOP, [REWRITER], "q", ANSWER) == ["repetition"]
    assert revision_degenerate(ECHO, [REWRITER], "q", ANSWER) == ["echo"]
    assert revision_degenerate(ECHO + " " + LOOP, [REWRITER], "q", ANSWER) == ["repetition", "echo"]
    assert revision_degenerate(ANSWER, [REWRITER], "q", ANSWER) == []


def _record(response: str, revision: str, d: float, **kwargs) -> Record:
    prepared = PreparedQuery(Query("q1", "Describe Paris."), "Describe Paris.", False, [1, 2])
    return build_record(prepared, [response], [[revision]], [(-2.0, 40)], [(-2.0 + d, 40)], -0.05, **kwargs)


def test_records_carry_the_flags():
    assert _record(ANSWER, LOOP, 1.3).revision_degenerate == ["repetition"]
    assert _record(LOOP, ANSWER, -1.0).response_degenerate == ["repetition"]
    clean = _record(ANSWER, ANSWER, 0.0)
    assert clean.response_degenerate == [] and clean.revision_degenerate == []
    # the template the revisions were made with decides what an echo is
    assert _record(ANSWER, "#RESPONSE#: Paris.", 0.5).revision_degenerate == ["echo"]  # default: every template
    only_rewriter = _record(ANSWER, "#RESPONSE#: Paris.", 0.5, refinement_templates=(REWRITER,))
    assert only_rewriter.revision_degenerate == []


def test_a_query_is_degenerate_when_any_sample_is():
    prepared = PreparedQuery(Query("q1", "Describe Paris."), "Describe Paris.", False, [1, 2])
    scores = [(-2.0, 40), (-2.0, 40)]
    record = build_record(prepared, [ANSWER, ANSWER], [[ANSWER], [ECHO, LOOP]], scores, scores, -0.05)
    assert record.revision_degenerate == ["repetition"]  # the last revision of the second sample


def test_the_summary_counts_them_and_keeps_the_papers_confidence():
    records = [
        _record(ANSWER, LOOP, 1.29),
        _record(ANSWER, ECHO, 0.91),
        _record(ANSWER, ANSWER, 0.2),
        _record(LOOP, ANSWER, -1.0),
    ]
    older = {k: v for k, v in _record(ANSWER, ANSWER, 0.1).to_json().items() if "degenerate" not in k}
    records.append(Record.from_json(older))  # read from a file written before the check
    summary = summary_of(records, -0.05, [-0.05])
    assert summary.confidence == pytest.approx(4 / 5)  # the paper's rule: degenerate revisions count
    assert summary.n_degenerate == 1 and summary.n_revision_degenerate == 2
    assert summary.revision_degenerate_kinds == {"repetition": 1, "echo": 1}
    assert summary.confidence_non_degenerate == pytest.approx(2 / 5)
    low, high = summary.confidence_non_degenerate_ci
    assert low < 2 / 5 < high
    printed = format_summary(summary)
    assert "degenerate         answers 1, revisions 2 (repetition 1, echo 1)" in printed
    assert "w/o degenerate   40.0%" in printed
    metrics = metrics_from_summary(summary, [-0.05], [])
    assert metrics["eval_probdiff_n_revision_degenerate"] == 2
    assert metrics["eval_probdiff_confidence_non_degenerate"] == pytest.approx(2 / 5)
    failed = metrics_from_summary(None, [-0.05], [])
    assert math.isnan(failed["eval_probdiff_n_revision_degenerate"])
    assert math.isnan(failed["eval_probdiff_confidence_non_degenerate"])


def test_the_note_says_what_the_confidence_means_when_most_are_degenerate():
    some = summary_of(
        [_record(ANSWER, LOOP, 1.29), _record(ANSWER, ANSWER, 0.2), _record(ANSWER, ANSWER, 0.1)], -0.05, []
    )
    note = degenerate_note(some)
    assert "1 of 3 revisions are degenerate (repetition 1;" in note and "gives 66.7% instead of 100.0%" in note
    assert "most revisions degenerate" not in note
    most = summary_of(
        [_record(ANSWER, LOOP, 1.29), _record(ANSWER, ECHO, 0.9), _record(ANSWER, ANSWER, 0.1)], -0.05, []
    )
    assert "With most revisions degenerate, the confidence measures" in degenerate_note(most)


def without_counts(summary: Summary) -> Summary:
    """`summary` as a history written before degenerate texts were counted holds it."""
    return Summary.from_json({k: v for k, v in summary.to_json().items() if "degenerate" not in k})


def test_a_summary_without_the_counts_still_prints():
    summary = without_counts(summary_of([_record(ANSWER, ANSWER, 0.2)], -0.05, []))
    assert "degenerate" not in format_summary(summary)


def test_the_training_table_has_a_degenerate_cell_beside_the_capped_one():
    from probdiff_callback.runs.run_files import HistoryRow
    from probdiff_callback.training.report import probdiff_table

    records = [_record(ANSWER, LOOP, 1.29), _record(ANSWER, ECHO, 0.9), _record(LOOP, ANSWER, -1.0)]
    summary = summary_of(records, -0.05, [])
    rows = [HistoryRow(0, kind="baseline", summary=without_counts(summary)), HistoryRow(4, summary=summary)]
    table = probdiff_table(rows, [{"step": 4, "loss": 1.0}], [])
    capped, degenerate = 8, 9  # the columns' places in training/report.py's header
    assert [line[degenerate] for line in table] == ["-", "1/2"]
    assert [line[capped] for line in table] == ["0/0", "0/0"]  # build_record's None caps count as none
