"""Reference metrics (BLEU, chrF, ROUGE) on answers ProbDiff produced: pure functions, no model."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import sacrebleu
from _records import make_record
from rouge_score import rouge_scorer

from probdiff_callback.analysis.report import format_reference
from probdiff_callback.core.queries import Query, load_queries
from probdiff_callback.core.records import Record, ReferenceSummary
from probdiff_callback.core.reference_metrics import (
    ReferencePlan,
    bleu_tokenizer,
    corpus_bleu_chrf,
    metric_family,
    plan_references,
    pooled_bleu,
    score_records,
    sentence_scores,
    summarize_references,
    trainer_metrics,
)

ROOT = Path(__file__).resolve().parents[1]

# A fixed file pair for the command-line comparison (English target, then Chinese target).
ENGLISH_REFS = [
    "A new cycle path between Olomouc and Prerov will open next month.",
    "Food prices in the Czech Republic rose by three percent in May.",
    "The museum will be closed for renovation until the end of the year.",
    "Heavy rain caused flooding in several villages on Sunday.",
    "The government approved the budget after a long debate.",
]
ENGLISH_HYPS = [
    "A new bike path between Olomouc and Prerov opens next month.",
    "Food prices in Czech Republic rose three percent in May.",
    "The museum is closed for renovations until the end of year.",
    "Heavy rains flooded several villages on Sunday.",
    "",
]
CHINESE_REFS = ["今天北京的天气很好，我们去公园散步。", "政府在长时间辩论后批准了预算。", "博物馆将闭馆整修到年底。"]
CHINESE_HYPS = ["今天北京天气很好，我们去公园散步了。", "政府批准了预算。", "博物馆年底前闭馆。"]


def record(id_: str, category: str, response: str, d: float = 0.0) -> Record:
    return make_record(id_, d, category=category, response=response)


def test_metric_family_and_bleu_tokenizer_follow_the_category():
    assert metric_family("zh-en") == metric_family("en-zh") == metric_family("en-cs") == "translation"
    assert metric_family("xsum") == metric_family("cnn_dm") == "summarization"
    assert metric_family("blog") is None and metric_family("Writing") is None and metric_family(None) is None
    assert bleu_tokenizer("en-zh") == "zh"
    assert bleu_tokenizer("zh-en") == bleu_tokenizer("en-de") == "13a"


def test_load_queries_reads_the_reference_answer(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [
        {
            "id": "a",
            "category": "zh-en",
            "messages": [{"role": "user", "content": "Translate: 你好"}, {"role": "assistant", "content": "Hello"}],
        },
        {"id": "b", "category": "Writing", "question": "Write", "reference": "A poem"},
        {"id": "c", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hey"}]},
        {"id": "d", "query": "no reference here"},
        {
            "id": "e",
            "messages": [
                {"role": "user", "content": "one"},
                {"role": "user", "content": "two"},
                {"role": "assistant", "content": "x"},
            ],
        },
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    queries = load_queries(path)
    assert [q.reference for q in queries] == ["Hello", "A poem", "Hey", None, None]
    assert queries[0] == Query("a", "Translate: 你好", "zh-en", "Hello")
    assert Query("x", "text", "cat").reference is None  # the three-field constructor still works
    shipped = load_queries(ROOT / "data/samples/translation/heldout.jsonl")
    assert all(q.reference for q in shipped) and shipped[0].reference.startswith("A new cycle path")


def test_plan_names_what_is_not_scored_once():
    queries = [
        Query("1", "t", "zh-en", "r"),
        Query("2", "t", "blog", "r"),
        Query("3", "t", "xsum", None),
        Query("4", "t", "Writing", "r"),
        Query("5", "t", None, None),
        Query("6", "t", "xsum", "s"),
    ]
    plan = plan_references(queries)
    assert plan.families == {"xsum": "summarization", "zh-en": "translation"}
    assert plan.without_metric == ("Writing", "blog", "queries without a category")
    assert plan.n_missing_reference == 1
    assert plan.metric_names() == ["bleu", "chrf", "rouge1", "rouge2", "rougeL"]
    notice = plan.notice()
    assert "no reference metric for Writing, blog" in notice and "1 queries of a scored category" in notice
    blog_only = plan_references([Query("1", "t", "blog", "r")])
    assert not blog_only.active and blog_only.metric_names() == [] and "blog" in blog_only.notice()
    assert plan_references([Query("1", "t", "en-de", "r")]).notice() is None


def test_sentence_scores_are_sacrebleu_and_rouge_score():
    hyp, ref = ENGLISH_HYPS[0], ENGLISH_REFS[0]
    scores = sentence_scores("translation", "cs-en", hyp, ref)
    assert scores["bleu"] == pytest.approx(sacrebleu.sentence_bleu(hyp, [ref]).score)
    assert scores["chrf"] == pytest.approx(sacrebleu.sentence_chrf(hyp, [ref]).score)
    zh = sentence_scores("translation", "en-zh", CHINESE_HYPS[0], CHINESE_REFS[0])
    assert zh["bleu"] == pytest.approx(sacrebleu.sentence_bleu(CHINESE_HYPS[0], [CHINESE_REFS[0]], tokenize="zh").score)
    assert zh["bleu"] != pytest.approx(
        sacrebleu.sentence_bleu(CHINESE_HYPS[0], [CHINESE_REFS[0]], tokenize="13a").score
    )
    rouge = sentence_scores("summarization", "xsum", "the cats were sitting on mats", "The cat sat on the mat.")
    expected = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True).score(
        "The cat sat on the mat.", "the cats were sitting on mats"
    )
    assert rouge == pytest.approx({k: 100 * v.fmeasure for k, v in expected.items()})
    assert sentence_scores("translation", "de-en", ref, ref) == {
        "bleu": pytest.approx(100.0),
        "chrf": pytest.approx(100.0),
    }
    # rouge-score's tokenizer drops Chinese: such a reference is not scored (rather than scored 0)
    assert sentence_scores("summarization", "xsum", "总结", "这是一个中文摘要。") == {
        "rouge1": None,
        "rouge2": None,
        "rougeL": None,
    }
    with pytest.raises(ValueError, match="unknown metric family"):
        sentence_scores("blog", "blog", "a", "b")


@pytest.mark.slow
def test_our_corpus_scores_equal_the_sacrebleu_command_line(tmp_path):
    executable = shutil.which("sacrebleu")
    if executable is None:
        pytest.skip("the sacrebleu command is not on PATH: pip install sacrebleu (it installs the command)")
    for name, refs, hyps, tokenize in (
        ("en", ENGLISH_REFS, ENGLISH_HYPS, "13a"),
        ("zh", CHINESE_REFS, CHINESE_HYPS, "zh"),
    ):
        ref_file, hyp_file = tmp_path / f"ref.{name}", tmp_path / f"hyp.{name}"
        ref_file.write_text("\n".join(refs) + "\n", encoding="utf-8")
        hyp_file.write_text("\n".join(hyps) + "\n", encoding="utf-8")
        out = subprocess.run(
            [executable, str(ref_file), "-i", str(hyp_file), "-m", "bleu", "chrf", "-b", "-w", "4", "-tok", tokenize],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        cli_bleu, cli_chrf = json.loads(out)
        ours = corpus_bleu_chrf(hyps, refs, tokenize)
        assert round(ours["bleu"], 4) == pytest.approx(cli_bleu, abs=1e-9), name
        assert round(ours["chrf"], 4) == pytest.approx(cli_chrf, abs=1e-9), name
        assert 0 < ours["bleu"] < 100 and 0 < ours["chrf"] < 100


def test_pooled_bleu_sums_the_counts_of_each_direction():
    english = (ENGLISH_HYPS, ENGLISH_REFS, "13a")
    # the same tokenizer everywhere: pooling is the corpus BLEU of all segments together
    split = [(ENGLISH_HYPS[:2], ENGLISH_REFS[:2], "13a"), (ENGLISH_HYPS[2:], ENGLISH_REFS[2:], "13a")]
    assert pooled_bleu(split) == pytest.approx(sacrebleu.corpus_bleu(ENGLISH_HYPS, [ENGLISH_REFS]).score)
    # Chinese segments keep their own tokenizer: by hand from the two groups' counts
    en = sacrebleu.corpus_bleu(ENGLISH_HYPS, [ENGLISH_REFS])
    zh = sacrebleu.corpus_bleu(CHINESE_HYPS, [CHINESE_REFS], tokenize="zh")
    precisions = [(a + b) / (c + d) for a, b, c, d in zip(en.counts, zh.counts, en.totals, zh.totals)]
    hyp_len, ref_len = en.sys_len + zh.sys_len, en.ref_len + zh.ref_len
    brevity = 1.0 if hyp_len > ref_len else math.exp(1 - ref_len / hyp_len)
    by_hand = 100 * brevity * math.exp(sum(math.log(p) for p in precisions) / 4)
    assert pooled_bleu([english, (CHINESE_HYPS, CHINESE_REFS, "zh")]) == pytest.approx(by_hand)


def test_summary_per_direction_per_dataset_and_overall():
    queries = [Query(f"t{i}", "q", "cs-en", ref) for i, ref in enumerate(ENGLISH_REFS)]
    queries += [Query(f"z{i}", "q", "en-zh", ref) for i, ref in enumerate(CHINESE_REFS)]
    queries += [
        Query("s0", "q", "xsum", "The council said the road will reopen on Monday."),
        Query("s1", "q", "cnn_dm", "Police arrested two men after a robbery.\nThe shop was closed."),
        Query("b0", "q", "blog", "a post"),
    ]
    records = [record(f"t{i}", "cs-en", hyp) for i, hyp in enumerate(ENGLISH_HYPS)]
    records += [record(f"z{i}", "en-zh", hyp) for i, hyp in enumerate(CHINESE_HYPS)]
    records += [
        record("s0", "xsum", "The road will reopen on Monday, the council said."),
        record("s1", "cnn_dm", "Two men were arrested."),
        record("b0", "blog", "whatever"),
    ]
    scored = score_records(records, queries)
    assert scored[-1].ref is None and scored[-1].reference is None  # the blog has no reference metric
    assert "ref" not in scored[-1].to_json() and "reference" not in scored[-1].to_json()
    assert scored[0].reference == ENGLISH_REFS[0] and set(scored[0].ref) == {"bleu", "chrf"}
    assert list(scored[0].to_json())[-2:] == ["reference", "ref"]  # written after the record's own keys
    assert records[0].ref is None  # the input is not modified
    summary = summarize_references(scored)
    by = summary.by_category
    assert set(by) == {"cs-en", "en-zh", "xsum", "cnn_dm"}
    assert by["cs-en"]["bleu"] == pytest.approx(sacrebleu.corpus_bleu(ENGLISH_HYPS, [ENGLISH_REFS]).score)
    assert by["en-zh"]["bleu"] == pytest.approx(
        sacrebleu.corpus_bleu(CHINESE_HYPS, [CHINESE_REFS], tokenize="zh").score
    )
    assert by["en-zh"]["tokenize"] == "zh" and by["cs-en"]["tokenize"] == "13a" and by["cs-en"]["n"] == 5
    assert by["xsum"]["rouge1"] == pytest.approx(scored[-3].ref["rouge1"])
    overall = summary.overall
    assert overall["bleu"] == pytest.approx(
        pooled_bleu([(ENGLISH_HYPS, ENGLISH_REFS, "13a"), (CHINESE_HYPS, CHINESE_REFS, "zh")])
    )
    assert overall["chrf"] == pytest.approx(
        sacrebleu.corpus_chrf(ENGLISH_HYPS + CHINESE_HYPS, [ENGLISH_REFS + CHINESE_REFS]).score
    )
    assert overall["rougeL"] == pytest.approx((scored[-3].ref["rougeL"] + scored[-2].ref["rougeL"]) / 2)
    assert summary.n_scored == {"bleu": 8, "chrf": 8, "rouge1": 2, "rouge2": 2, "rougeL": 2}
    assert summarize_references([record("b0", "blog", "x")]) is None
    text = format_reference(summary)
    assert "BLEU" in text and "chrF" in text and "ROUGE-L" in text and "en-zh" in text


def test_trainer_metrics_are_named_per_metric_and_category_and_nan_when_missing():
    plan = ReferencePlan({"en-zh": "translation", "zh-en": "translation"})
    reference = ReferenceSummary(
        overall={"bleu": 10.0, "chrf": 20.0},
        n_scored={"bleu": 2, "chrf": 2},
        by_category={"en-zh": {"n": 1, "bleu": 5.0, "chrf": 15.0}},
    )
    metrics = trainer_metrics(reference, plan)
    assert metrics["eval_ref_bleu"] == 10.0 and metrics["eval_ref_chrf"] == 20.0
    assert metrics["eval_ref_bleu_en-zh"] == 5.0 and math.isnan(metrics["eval_ref_bleu_zh-en"])
    assert set(metrics) == {
        "eval_ref_bleu",
        "eval_ref_chrf",
        "eval_ref_bleu_en-zh",
        "eval_ref_chrf_en-zh",
        "eval_ref_bleu_zh-en",
        "eval_ref_chrf_zh-en",
    }
    failed = trainer_metrics(None, plan)
    assert set(failed) == set(metrics) and all(math.isnan(v) for v in failed.values())
    assert trainer_metrics(reference, ReferencePlan()) == {}
