"""The evaluation's data as typed objects: a query's `Record`, a step's `Summary`, the `Comparison` of two steps and
an evaluation's `Cost`.

Their JSON form is `json_form.JsonRecord`'s, one rule for every typed file of the package: the keys in the fields'
order; NaN as null and back (None kept where a field admits it: `answer_temperature` of texts generated elsewhere, a
`ref` score that could not be computed); an older file's missing keys defaulted and not written back; unknown keys kept
in `extra`; the keys only some evaluations have (`omit_default`) left out while they hold their defaults. `dumps`
(from there) writes any value holding these objects.

A field's `help` (its metadata) is its documentation: `markdown_table` makes docs/cli.md's tables from it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from probdiff_callback.core.json_form import JsonRecord, json_field
from probdiff_callback.core.json_form import dumps as dumps  # re-exported: the package imports them from here
from probdiff_callback.core.json_form import nan_to_none as nan_to_none


def _field(default: Any = dataclasses.MISSING, *, help: str, **kw: Any) -> Any:
    """A documented field (`markdown_table`); `omit_default`: left out of the JSON form while it holds its default."""
    return json_field(default, help=help, **kw)


def _extra() -> Any:
    return field(default_factory=dict, repr=False, compare=False)


# --- one query --------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Record(JsonRecord):
    """One query's evaluation: a row of `records.jsonl` (`probdiff eval`, `score`) and of a training run's step files.

    With `n_samples > 1`, `response`, `revisions` and the token counts are the first sample's, `logp_*` and `d` the
    means over the samples (of those with a value), the flags true when they hold for any sample, and the degenerate
    kinds those any sample shows.
    """

    id: str = _field(help="the query's id as loaded")
    category: str | None = _field(help="the query's category as loaded (null: none)")
    query: str = _field(help="the query's text, before any cut")
    response: str = _field(help="the answer (`score`: the given `response`)")
    revisions: list[str] = _field(help="its revisions, one per round (`score`: `[revised]`)")
    logp_response: float = _field(
        help="mean per-token log-probability of the answer after the query's chat prompt; `null` for an empty text"
    )
    logp_revised: float = _field(help="the same for the last revision")
    d: float = _field(help="`logp_revised − logp_response`; `null` when a text is empty")
    n_tokens_response: int = _field(help="the answer's length in tokens")
    n_tokens_revised: int = _field(help="the last revision's length in tokens")
    confident: bool = _field(help="`d ≥ delta` (`false` for a `null` d)")
    truncated: bool = _field(help="the query was longer than `max_prompt_tokens` and was cut in the middle")
    answer_temperature: float | None = _field(
        None,
        help="the temperature the answer was sampled at: `answer_temperature`, or the query category's from "
        "`answer_temperature_by_category` (`score`: `null`)",
    )
    response_capped: bool | None = _field(
        None,
        help="the answer ended at `max_new_tokens` without an end-of-turn token and was scored cut short "
        "(`score`: `null`)",
    )
    revision_capped: bool | None = _field(None, help="the same for the last revision (`score`: `null`)")
    revision_truncated: bool = _field(
        False,
        help="a refinement request (query + answer + prompt) was cut in the middle to `max_prompt_tokens` "
        "(`score`: `false`)",
    )
    response_degenerate: list[str] = _field(
        help="the kinds of degeneration the answer shows, `[]` for none: `repetition` (a loop: more than half its "
        "8-grams repeated, in the whole text or a 128-word window). Scored as written: see "
        "[method.md](method.md#known-limits-of-the-metric)",
        default_factory=list,
    )
    revision_degenerate: list[str] = _field(
        help="the same for the last revision, and `echo` (it holds a label or an instruction line of the refinement "
        "prompt that the query and the answer did not; `score`: of any shipped prompt)",
        default_factory=list,
    )
    responses: list[str] | None = _field(
        None, help="with `n_samples > 1` only: each sample's answer", omit_default=True
    )
    revisions_by_sample: list[list[str]] | None = _field(
        None, help="with `n_samples > 1` only: each sample's revisions", omit_default=True
    )
    d_samples: list[float] | None = _field(None, help="with `n_samples > 1` only: each sample's d", omit_default=True)
    reference: str | None = _field(
        None,
        help="`eval` only, where the query has a reference answer and its category a reference metric: the reference",
        omit_default=True,
    )
    ref: dict[str, float | None] | None = _field(
        None,
        help="beside `reference`: the answer's sentence scores (`bleu`, `chrf` for translation; `rouge1`, `rouge2`, "
        "`rougeL` for summarization, `null` for an empty reference)",
        omit_default=True,
    )
    extra: dict[str, Any] = _extra()


# --- one step ---------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class CategorySummary(JsonRecord):
    n: int = _field(help="queries of the category")
    confidence: float = _field(help="their confidence")
    d_mean: float = _field(help="their mean d")
    extra: dict[str, Any] = _extra()


@dataclass(kw_only=True)
class ReferenceSummary(JsonRecord):
    overall: dict[str, float] = _field(help="each reference metric over every scored answer")
    n_scored: dict[str, int] = _field(help="how many answers each metric scored")
    by_category: dict[str, dict[str, float | int | str]] = _field(
        help="per category: `n` and its metrics (translation: `bleu`, `chrf` and BLEU's `tokenize`; summarization: "
        "`rouge1`, `rouge2`, `rougeL` and `n_unscored`)"
    )
    extra: dict[str, Any] = _extra()


@dataclass(kw_only=True)
class Summary(JsonRecord):
    """The summary of one evaluation's records (`metric.summary_of`, with `reference` from `evaluator.summarise`):
    `summary.json`, and each step's in a training run's history. NaN where a number cannot be computed (no valid
    d)."""

    n: int = _field(help="queries")
    n_invalid: int = _field(0, help="queries whose d is `null` (an empty text)")
    n_truncated: int = _field(0, help="queries cut to `max_prompt_tokens`")
    n_capped: int = _field(0, help="answers cut by `max_new_tokens`")
    n_revision_capped: int = _field(0, help="last revisions cut by `max_new_tokens`")
    n_revision_truncated: int = _field(0, help="refinement requests cut to `max_prompt_tokens`")
    n_degenerate: int = _field(0, help="answers that loop")
    n_revision_degenerate: int = _field(0, help="last revisions that loop or echo the refinement prompt")
    revision_degenerate_kinds: dict[str, int] = _field(
        help="the degenerate last revisions per kind", default_factory=dict
    )
    delta: float = _field(help="the threshold")
    confidence: float = _field(help="the share of queries with d ≥ delta (a fraction)")
    confidence_ci: list[float] = _field(help="its Wilson 95% interval", default_factory=lambda: [math.nan, math.nan])
    confidence_non_degenerate: float = _field(
        math.nan,
        help="the confidence with the degenerate revisions counted as not confident, beside the paper's `confidence`",
    )
    confidence_non_degenerate_ci: list[float] = _field(
        help="its Wilson 95% interval", default_factory=lambda: [math.nan, math.nan]
    )
    confidence_sweep: dict[str, float] = _field(
        help="the confidence at each threshold of `sweep`", default_factory=dict
    )
    d_mean: float = _field(math.nan, help="the mean of the valid d")
    d_median: float = _field(math.nan, help="their median")
    d_std: float = _field(math.nan, help="their standard deviation")
    d_quantiles: dict[str, float] = _field(help="their 5, 25, 50, 75 and 95% quantiles", default_factory=dict)
    logp_response_mean: float = _field(math.nan, help="the mean of `logp_response`")
    logp_revised_mean: float = _field(math.nan, help="the mean of `logp_revised`")
    by_category: dict[str, CategorySummary] = _field(
        help="per category: `n`, `confidence`, `d_mean`", default_factory=dict
    )
    len_response_mean: float = _field(math.nan, help="the answers' mean length in tokens")
    len_revised_mean: float = _field(math.nan, help="the last revisions' mean length in tokens")
    length_changed_share: float = _field(
        math.nan, help="revisions whose token length changed by more than half (the paper's length bias)"
    )
    reference: ReferenceSummary | None = _field(
        None,
        help="on queries with references: the corpus metrics overall and by category, and how many answers each scored",
        omit_default=True,
    )
    extra: dict[str, Any] = _extra()


@dataclass(kw_only=True)
class Comparison(JsonRecord):
    """The paper's pairwise comparison of two sets of records on the queries they share (`metric.compare`): A wins a
    query where A is confident and B is not. A training run's rows hold each step's against the baseline
    (`vs_base`)."""

    n: int = _field(help="queries both sets hold")
    n_only_a: int = _field(help="queries only A holds")
    n_only_b: int = _field(help="queries only B holds")
    delta: float = _field(help="the threshold")
    win: int = _field(help="A confident, B not")
    tie: int = _field(help="both or neither confident")
    lose: int = _field(help="B confident, A not")
    confidence_a: float = _field(help="A's confidence on the shared queries")
    confidence_b: float = _field(help="B's confidence on the shared queries")
    difference: float = _field(help="(win − lose) / n: `confidence_a − confidence_b`")
    difference_ci: list[float] = _field(help="its 95% interval (Bonett and Price's adjusted Wald)")
    sign_p: float = _field(help="exact two-sided sign test of wins against losses")
    n_paired: int = _field(help="shared queries where both d are valid")
    d_mean_a: float = _field(help="A's mean d over those")
    d_mean_b: float = _field(help="B's mean d over those")
    wilcoxon_p: float = _field(help="Wilcoxon signed-rank test of d_A against d_B over those (`null` when all equal)")
    extra: dict[str, Any] = _extra()


# --- what an evaluation cost ------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Cost(JsonRecord):
    """Where an evaluation's time went, measured by the evaluator itself (on a CUDA model the clock waits for the
    device, so a stage's GPU work counts in it), and on a CUDA model its memory: read by the cost line, `bench/` and
    the GPU kit. On several ranks each stage's seconds are the slowest rank's, the tokens the sum and the memory the
    highest rank's (`Cost.merged`)."""

    answers_seconds: float = _field(0.0, help="seconds generating the answers")
    revisions_seconds: float = _field(0.0, help="seconds generating the revisions, every round")
    scoring_seconds: float = _field(0.0, help="seconds scoring the answers and last revisions")
    reference_seconds: float = _field(0.0, help="seconds computing the reference metrics (BLEU, chrF, ROUGE)")
    answer_tokens: int = _field(0, help="tokens generated for the answers (before the end-of-turn token)")
    revision_tokens: int = _field(0, help="tokens generated for the revisions, every round")
    peak_memory_bytes: int | None = _field(
        None,
        help="on a CUDA device only (left out on a CPU): the most memory tensors held on the model's device during "
        "the evaluation (`torch.cuda.max_memory_allocated`; the evaluator resets the device's peak when an "
        "evaluation begins and when it ends)",
        omit_default=True,
    )
    memory_before_bytes: int | None = _field(
        None, help="on a CUDA device only: what tensors held on it when the evaluation began", omit_default=True
    )
    peak_memory_before_bytes: int | None = _field(
        None,
        help="on a CUDA device only: the most they held before the evaluation began, since the end of the previous "
        "one in the process (or its start): in the training loop, the peak of the training steps in between",
        omit_default=True,
    )
    extra: dict[str, Any] = _extra()

    @property
    def seconds(self) -> float:
        return self.answers_seconds + self.revisions_seconds + self.scoring_seconds + self.reference_seconds

    @property
    def generated_tokens(self) -> int:
        return self.answer_tokens + self.revision_tokens

    @classmethod
    def merged(cls, costs: Sequence[Cost]) -> Cost:
        """The cost of ranks that ran side by side: each stage as long as its slowest rank, the tokens summed."""
        if not costs:
            return cls()
        return cls(
            answers_seconds=max(c.answers_seconds for c in costs),
            revisions_seconds=max(c.revisions_seconds for c in costs),
            scoring_seconds=max(c.scoring_seconds for c in costs),
            reference_seconds=max(c.reference_seconds for c in costs),
            answer_tokens=sum(c.answer_tokens for c in costs),
            revision_tokens=sum(c.revision_tokens for c in costs),
            **_highest_memory(costs),
        )

    def __add__(self, other: Cost) -> Cost:
        """The cost of two parts run one after the other (the texts written on one process, scored on all): every
        figure summed, but the memory: the higher of the two."""
        return Cost(
            answers_seconds=self.answers_seconds + other.answers_seconds,
            revisions_seconds=self.revisions_seconds + other.revisions_seconds,
            scoring_seconds=self.scoring_seconds + other.scoring_seconds,
            reference_seconds=self.reference_seconds + other.reference_seconds,
            answer_tokens=self.answer_tokens + other.answer_tokens,
            revision_tokens=self.revision_tokens + other.revision_tokens,
            **_highest_memory([self, other]),
        )


MEMORY_FIELDS = ("peak_memory_bytes", "memory_before_bytes", "peak_memory_before_bytes")


def _highest_memory(costs: Sequence[Cost]) -> dict[str, int | None]:
    """Each memory field's highest value among `costs` (None where none has one)."""
    highest = {}
    for name in MEMORY_FIELDS:
        values = [getattr(c, name) for c in costs if getattr(c, name) is not None]
        highest[name] = max(values) if values else None
    return highest


# --- the docs ---------------------------------------------------------------------------------------------
def markdown_table(cls: type) -> str:
    """A Markdown table of a record type's documented fields (docs/cli.md; tests/test_records.py keeps it current)."""
    lines = ["| field | |", "| --- | --- |"]
    for f in dataclasses.fields(cls):
        if "help" in f.metadata:
            lines.append(f"| `{f.name}` | {f.metadata['help'].replace('|', chr(92) + '|')} |")
    return "\n".join(lines)
