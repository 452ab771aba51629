"""Reference metrics on the answers ProbDiff already produced: no extra generation, only scoring.

Where a held-out query carries a reference answer (the assistant turn of a prepared held-out
conversation, or a `reference` field), the model's answer is scored against it:

- translation (categories `src-tgt`, e.g. `zh-en`, `en-zh`): BLEU and chrF with sacreBLEU, the
  tool WMT reports with. BLEU uses sacreBLEU's `zh` tokenizer for Chinese targets and its standard
  `13a` tokenizer for every other target; chrF works on characters and needs none. Corpus scores
  per language pair and direction, and overall (BLEU pooled from each direction's n-gram counts,
  so each segment keeps its own target's tokenizer).
- summarization (categories `xsum`, `cnn_dm`): ROUGE-1, ROUGE-2 and ROUGE-L F1 with Google
  Research's `rouge-score` package, the pure-Python implementation written to replicate the
  original ROUGE-1.5.5 Perl script (the ROUGE summarization papers report; Hugging Face
  `evaluate` wraps it), with the Porter stemmer as those papers use it. Its tokenizer keeps only
  ASCII letters and digits, so Chinese text needs a tokenizer of its own; English news (XSum,
  CNN/DM) does not. A reference with no token under that tokenizer is left unscored and counted.

Every score is on sacreBLEU's 0-100 scale (ROUGE F1 is multiplied by 100). Other categories (the
blog, AlignBench) have no reference metric: `plan_references` names them once, and nothing is
computed or logged for them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from probdiff_callback.core.metric import finite_mean
from probdiff_callback.core.queries import Query
from probdiff_callback.core.records import Record, ReferenceSummary

TRANSLATION = "translation"
SUMMARIZATION = "summarization"
METRICS = {TRANSLATION: ("bleu", "chrf"), SUMMARIZATION: ("rouge1", "rouge2", "rougeL")}
METRIC_LABELS = {"bleu": "BLEU", "chrf": "chrF", "rouge1": "ROUGE-1", "rouge2": "ROUGE-2", "rougeL": "ROUGE-L"}
SUMMARIZATION_CATEGORIES = ("xsum", "cnn_dm")
LANGUAGE_PAIR = re.compile(r"^([a-z]{2,3})-([a-z]{2,3})$")
TRAINER_PREFIX = "eval_ref_"


# --- which queries get which metric ------------------------------------------------------------
def metric_family(category: str | None) -> str | None:
    """`translation` for a `src-tgt` category, `summarization` for `xsum`/`cnn_dm`, else None."""
    if category is None:
        return None
    if LANGUAGE_PAIR.match(category):
        return TRANSLATION
    if category in SUMMARIZATION_CATEGORIES:
        return SUMMARIZATION
    return None


def bleu_tokenizer(category: str) -> str:
    """sacreBLEU's tokenizer for the target language of a `src-tgt` category."""
    match = LANGUAGE_PAIR.match(category)
    return "zh" if match is not None and match.group(2) == "zh" else "13a"


@dataclass(frozen=True)
class ReferencePlan:
    """What a query set allows: the metric family of each category with a reference metric, the
    categories without one, and how many queries of a scored category lack a reference text."""

    families: dict[str, str] = field(default_factory=dict)
    without_metric: tuple[str, ...] = ()
    n_missing_reference: int = 0

    @property
    def active(self) -> bool:
        return bool(self.families)

    def metric_names(self) -> list[str]:
        present = set(self.families.values())
        return [name for family in (TRANSLATION, SUMMARIZATION) if family in present for name in METRICS[family]]

    def notice(self) -> str | None:
        """One line for the user about what is not scored, or None when everything is."""
        parts = []
        if self.without_metric:
            names = ", ".join(self.without_metric)
            parts.append(
                f"no reference metric for {names} (reference metrics cover translation `src-tgt` and "
                f"summarization {'/'.join(SUMMARIZATION_CATEGORIES)} categories); nothing is computed or logged for "
                f"{'it' if len(self.without_metric) == 1 else 'them'}"
            )
        if self.n_missing_reference:
            parts.append(
                f"{self.n_missing_reference} queries of a scored category carry no reference answer and are left out"
            )
        return "; ".join(parts) or None


def plan_references(queries: Sequence[Query]) -> ReferencePlan:
    families: dict[str, str] = {}
    without: set[str] = set()
    missing = 0
    for query in queries:
        family = metric_family(query.category)
        if family is None:
            without.add(query.category if query.category is not None else "queries without a category")
        elif query.reference is None:
            missing += 1
        else:
            families[query.category] = family  # type: ignore[index]
    return ReferencePlan(dict(sorted(families.items())), tuple(sorted(without)), missing)


# --- sentence level (one record) -----------------------------------------------------------------
@lru_cache(maxsize=1)
def _rouge_tokenizer():
    from rouge_score import tokenizers

    return tokenizers.DefaultTokenizer(use_stemmer=True)  # what RougeScorer(use_stemmer=True) builds for itself


@lru_cache(maxsize=1)
def _rouge_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(list(METRICS[SUMMARIZATION]), tokenizer=_rouge_tokenizer())


def rouge_tokens(text: str) -> list[str]:
    """`text` as rouge-score's own tokenizer sees it (lowercased ASCII words, stemmed)."""
    return _rouge_tokenizer().tokenize(text)


def sentence_scores(family: str, category: str, hypothesis: str, reference: str) -> dict[str, float | None]:
    """One answer against its reference: {metric: score on 0-100}; None where it cannot be scored."""
    if family == TRANSLATION:
        import sacrebleu

        return {
            "bleu": float(sacrebleu.sentence_bleu(hypothesis, [reference], tokenize=bleu_tokenizer(category)).score),
            "chrf": float(sacrebleu.sentence_chrf(hypothesis, [reference]).score),
        }
    if family == SUMMARIZATION:
        if not rouge_tokens(reference):
            return {name: None for name in METRICS[SUMMARIZATION]}
        scores = _rouge_scorer().score(reference, hypothesis)
        return {name: 100.0 * scores[name].fmeasure for name in METRICS[SUMMARIZATION]}
    raise ValueError(f"unknown metric family {family!r}; use {TRANSLATION} or {SUMMARIZATION}")


def score_records(records: Sequence[Record], queries: Iterable[Query]) -> list[Record]:
    """Copies of `records` with `reference` (the text) and `ref` (sentence scores) added where the
    record's query has a reference and its category a reference metric; others unchanged."""
    by_id = {q.id: q for q in queries}
    out = []
    for record in records:
        query = by_id.get(str(record.id))
        family = metric_family(record.category)
        if query is None or query.reference is None or family is None or record.category is None:
            out.append(record)
            continue
        ref = sentence_scores(family, record.category, record.response, query.reference)
        out.append(dataclasses.replace(record, reference=query.reference, ref=ref))
    return out


# --- corpus level (one evaluation) ---------------------------------------------------------------
def corpus_bleu_chrf(hypotheses: Sequence[str], references: Sequence[str], tokenize: str = "13a") -> dict[str, float]:
    """sacreBLEU's corpus BLEU and chrF (its defaults), as `sacrebleu REF -i HYP -m bleu chrf` computes them."""
    import sacrebleu

    return {
        "bleu": float(sacrebleu.corpus_bleu(hypotheses, [references], tokenize=tokenize).score),
        "chrf": float(sacrebleu.corpus_chrf(hypotheses, [references]).score),
    }


def pooled_bleu(groups: Sequence[tuple[Sequence[str], Sequence[str], str]]) -> float:
    """Corpus BLEU over several groups of (hypotheses, references, tokenizer): the n-gram counts of
    each group, tokenized its own way, summed before the score (sacreBLEU's corpus formula)."""
    import sacrebleu
    from sacrebleu.metrics.bleu import BLEU

    correct, total, sys_len, ref_len = [0] * 4, [0] * 4, 0, 0
    for hypotheses, references, tokenize in groups:
        score = sacrebleu.corpus_bleu(hypotheses, [references], tokenize=tokenize)
        correct = [a + b for a, b in zip(correct, score.counts)]
        total = [a + b for a, b in zip(total, score.totals)]
        sys_len, ref_len = sys_len + score.sys_len, ref_len + score.ref_len
    return float(BLEU.compute_bleu(correct, total, sys_len, ref_len, smooth_method="exp").score)


def summarize_references(records: Sequence[Record]) -> ReferenceSummary | None:
    """The reference metrics of one evaluation, or None when no record carries a reference score.

    `overall` and `by_category[c]` hold each metric; `n_scored` counts the records per metric;
    translation categories also name their BLEU tokenizer.
    """
    scored = [r for r in records if r.ref is not None]
    if not scored:
        return None
    by_category: dict[str, dict[str, float | int | str]] = {}
    overall: dict[str, float] = {}
    n_scored: dict[str, int] = {}
    translation_groups = []
    for category in sorted({r.category for r in scored}):
        rows = [r for r in scored if r.category == category]
        family = metric_family(category)
        entry: dict[str, float | int | str] = {"n": len(rows)}
        if family == TRANSLATION:
            tokenize = bleu_tokenizer(category)
            hypotheses, references = [r.response for r in rows], [r.reference for r in rows]
            entry.update(corpus_bleu_chrf(hypotheses, references, tokenize), tokenize=tokenize)
            translation_groups.append((hypotheses, references, tokenize))
        else:
            for name in METRICS[SUMMARIZATION]:
                entry[name] = finite_mean(r.ref[name] for r in rows)
            entry["n_unscored"] = sum(r.ref["rouge1"] is None for r in rows)
        by_category[category] = entry
    if translation_groups:
        translated = [r for r in scored if metric_family(r.category) == TRANSLATION]
        overall["bleu"] = pooled_bleu(translation_groups)
        hypotheses, references = [r.response for r in translated], [r.reference for r in translated]
        overall["chrf"] = corpus_bleu_chrf(hypotheses, references)["chrf"]
        n_scored.update(bleu=len(translated), chrf=len(translated))
    summaries = [r for r in scored if metric_family(r.category) == SUMMARIZATION]
    if summaries:
        for name in METRICS[SUMMARIZATION]:
            overall[name] = finite_mean(r.ref[name] for r in summaries)
            n_scored[name] = sum(r.ref[name] is not None for r in summaries)
    return ReferenceSummary(overall=overall, n_scored=n_scored, by_category=by_category)


# --- the Trainer's metrics -----------------------------------------------------------------------
def trainer_metric_name(metric: str, category: str | None = None) -> str:
    """`eval_ref_<metric>` or `eval_ref_<metric>_<category>`, safe for W&B and TensorBoard."""
    part = metric if category is None else f"{metric}_{category}"
    return TRAINER_PREFIX + "".join(c if c.isalnum() or c in "-._" else "_" for c in part)


def trainer_metrics(reference: ReferenceSummary | None, plan: ReferencePlan) -> dict[str, float]:
    """The eval_ref_* metrics the plan promises, NaN where this evaluation has none (a missing
    key would make the Trainer raise when `metric_for_best_model` names it)."""
    metrics: dict[str, float] = {}
    if not plan.active:
        return metrics
    overall = {} if reference is None else reference.overall
    by_category = {} if reference is None else reference.by_category
    for name in plan.metric_names():
        value = overall.get(name)
        metrics[trainer_metric_name(name)] = math.nan if value is None else float(value)
    for category, family in plan.families.items():
        for name in METRICS[family]:
            value = by_category.get(category, {}).get(name)
            metrics[trainer_metric_name(name, category)] = math.nan if value is None else float(value)
    return metrics
