"""Degenerate texts: answers or revisions that are repetition loops, and revisions that echo the refinement prompt.

A small model asked to rewrite its answer often loops ("a culinary delight that is a culinary delight that is …")
or copies the prompt's scaffolding ("#Rewritten Response# #Given Prompt#: #Given Response#: …"). Such a text is
highly likely under the model, so d comes out large and the query counts as confident, although nothing was
rewritten. The paper's rule counts only empty texts as invalid; these checks flag the others, so that they can be
counted beside the confidence (`metric.summarize`), not to change it.

Two checks, both pure functions of the text:

- repetition: the share of repeated n-grams (seq-rep-n of Welleck et al. 2019, "Neural Text Generation with
  Unlikelihood Training": 1 - distinct n-grams / n-grams) over words, with each CJK character a word of its own so
  that Chinese and Japanese are measured as English is, in the whole text and in each window of 128 words; a loop
  when it passes one half. n is 8, longer than most stems that lists and refrains share; a loop repeats its
  n-grams whatever its period;
- echo: the revision holds a label of the refinement prompt (`#Given Prompt#`, `#RESPONSE#`, …, derived from the
  template: the line before each placeholder and the cue after the last) or one of its instruction lines, which
  neither the query nor the answer held. The reference prompt itself forbids those labels in the rewrite.

The thresholds were set on smollm2's MT-Bench revisions and checked against the reference data's human and GPT-4
texts; docs/method.md gives the figures.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Literal

from probdiff_callback.core.prompts import PLACEHOLDER_PATTERN

DegenerateKind = Literal["repetition", "echo"]
KINDS: tuple[DegenerateKind, ...] = ("repetition", "echo")

NGRAM = 8
REPEATED_SHARE_LIMIT = 0.5  # a text (or a window of it) whose n-grams are more than half repeats is a loop
MIN_NGRAMS = 8  # shorter texts have too few n-grams for a share to mean anything
WINDOW, WINDOW_STRIDE = 128, 16  # words: a loop that sets in late in a long text shows in a window of it
MIN_INSTRUCTION_WORDS = 5  # template lines this long are instructions, echoed only by copying them

# Ideographs, kana and hangul: one word per character (these scripts put no spaces between words).
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_WORD = re.compile(rf"[{_CJK}]|[^\W_{_CJK}]+|[^\w\s]+|_+")
_LABEL_MARKER = re.compile(r"[^\w\s:]")  # a label such as #Given Prompt# or [Answer] carries one


def words(text: str) -> list[str]:
    """The text's words: runs of letters and digits, single CJK characters, runs of punctuation."""
    return _WORD.findall(text)


def repeated_ngram_share(units: Sequence[str], n: int = NGRAM) -> float:
    """1 - distinct n-grams / n-grams (seq-rep-n); 0 for a sequence shorter than n."""
    grams = [tuple(units[i : i + n]) for i in range(len(units) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def loop_share(text: str) -> float:
    """The largest repeated n-gram share of the whole text and of its `WINDOW`-word windows: the whole text for a
    loop with a long period, a window for one that fills only the end of a long answer."""
    units = words(text)
    if len(units) - NGRAM + 1 < MIN_NGRAMS:
        return 0.0
    starts = [*range(0, len(units) - WINDOW, WINDOW_STRIDE), max(len(units) - WINDOW, 0)]
    return max(repeated_ngram_share(units), *(repeated_ngram_share(units[s : s + WINDOW]) for s in starts))


def is_repetition_loop(text: str) -> bool:
    return loop_share(text) > REPEATED_SHARE_LIMIT


def _literal_lines(template: str) -> list[list[str]]:
    """The template's text between its placeholders, each piece as its non-empty stripped lines."""
    return [
        [line.strip() for line in piece.splitlines() if line.strip()] for piece in PLACEHOLDER_PATTERN.split(template)
    ]


def prompt_labels(template: str) -> tuple[str, ...]:
    """The labels of a refinement template: the last line before each placeholder and the last line after the last
    one (the cue the rewrite follows), without their trailing colon: `#Given Prompt#`, `#Rewritten Response#`."""
    pieces = _literal_lines(template)
    labels = [lines[-1].rstrip(":").strip() for lines in pieces if lines]
    return tuple(dict.fromkeys(label for label in labels if any(c.isalpha() for c in label)))


def prompt_instructions(template: str) -> tuple[str, ...]:
    """The template's instruction lines (at least `MIN_INSTRUCTION_WORDS` words), as written."""
    lines = [line for piece in _literal_lines(template) for line in piece]
    return tuple(line for line in lines if len(line.split()) >= MIN_INSTRUCTION_WORDS)


def _holds(text: str, phrase: str, label: bool) -> bool:
    """Whether `text` holds `phrase`, case aside; a label without a marker (`Response`) only at a line's start
    followed by a colon, since the bare word is ordinary prose."""
    if label and not _LABEL_MARKER.search(phrase):
        return re.search(rf"(?im)^\s*{re.escape(phrase)}\s*:", text) is not None
    return phrase.casefold() in text.casefold()


def echoed_prompt(revision: str, templates: Iterable[str], given: Iterable[str] = ()) -> list[str]:
    """The labels and instruction lines of the refinement `templates` that `revision` holds and none of the `given`
    texts (the query, the answer) held: what the revision copied from a refinement prompt."""
    given = list(given)
    phrases: dict[str, bool] = {}  # phrase -> whether it is a label
    for template in templates:
        phrases.update(dict.fromkeys(prompt_labels(template), True))
        for line in prompt_instructions(template):
            phrases.setdefault(line, False)
    return [
        phrase
        for phrase, label in phrases.items()
        if _holds(revision, phrase, label) and not any(_holds(text, phrase, label) for text in given)
    ]


def answer_degenerate(answer: str) -> list[DegenerateKind]:
    """["repetition"] for a looping answer, else [] (an answer never saw the refinement prompt)."""
    return ["repetition"] if is_repetition_loop(answer) else []


def revision_degenerate(revision: str, templates: Iterable[str], query: str, answer: str) -> list[DegenerateKind]:
    """The kinds of degeneration, in `KINDS` order, of a revision of `answer` to `query` made with one of the
    refinement `templates` (the one an evaluation used; for texts made elsewhere, every shipped one)."""
    kinds: list[DegenerateKind] = []
    if is_repetition_loop(revision):
        kinds.append("repetition")
    if echoed_prompt(revision, templates, given=(query, answer)):
        kinds.append("echo")
    return kinds


def merge_kinds(kinds_by_sample: Iterable[Sequence[str]]) -> list[DegenerateKind]:
    """The kinds any sample shows, in `KINDS` order (a query is degenerate when any of its samples is)."""
    seen = {kind for kinds in kinds_by_sample for kind in kinds}
    return [kind for kind in KINDS if kind in seen]
