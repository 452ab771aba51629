import dataclasses
import math
import time

import pytest
from _records import make_record

from probdiff_callback.core import decoding as hf
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.decoding import HFEngine, sample_continuations
from probdiff_callback.core.engine import Generated, GenerationError
from probdiff_callback.core.evaluator import (
    Evaluation,
    build_record,
    evaluate,
    generate_answers,
    make_chains,
    measured_memory,
    query_batches,
    stage_clock,
    summarise,
)
from probdiff_callback.core.metric import summary_of
from probdiff_callback.core.prompts import (
    REWRITER,
    PreparedQuery,
    chat_prompt_ids,
    refinement_prompt_ids,
    refinement_request,
    truncate_middle,
)
from probdiff_callback.core.queries import Query, load_queries
from probdiff_callback.core.records import Cost
from probdiff_callback.core.reference_metrics import plan_references

SAMPLES = "data/samples/blog/heldout.jsonl"


@pytest.fixture(scope="module")
def queries():
    return load_queries(SAMPLES)[:8]


@pytest.fixture(scope="module")
def reference_evaluation(tiny_model, queries):
    """The 8 queries evaluated in one batch, with the ids `sample_continuations` generated at each call."""
    model, tokenizer = tiny_model
    generated = []

    def recording(*args, **kwargs):
        generated.append(sample_continuations(*args, **kwargs))
        return generated[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hf, "sample_continuations", recording)
        evaluation = evaluate(
            model, tokenizer, queries, ProbDiffConfig(max_new_tokens=24, batch_size=8), progress=False
        )
    return evaluation, generated


@pytest.fixture(scope="module")
def reference_records(reference_evaluation):
    return reference_evaluation[0].records


@pytest.mark.slow
def test_texts_do_not_depend_on_batch_size_or_composition(tiny_model, queries, reference_records):
    """Each query alone (batches of 1), and in batches of 3 of the queries in reverse order, as in one batch of 8: the
    same texts, the same d within float error (other padding), the records in the order of the queries given."""
    model, tokenizer = tiny_model
    alone = evaluate(model, tokenizer, queries, ProbDiffConfig(max_new_tokens=24, batch_size=1), progress=False)
    reordered = evaluate(
        model, tokenizer, queries[::-1], ProbDiffConfig(max_new_tokens=24, batch_size=3), progress=False
    ).records
    assert [r.id for r in reordered] == [q.id for q in queries[::-1]]
    for records in (alone.records, reordered[::-1]):
        assert [r.response for r in records] == [r.response for r in reference_records]
        assert [r.revisions for r in records] == [r.revisions for r in reference_records]
        for a, b in zip(records, reference_records):
            assert a.d == pytest.approx(b.d, abs=1e-4)


@pytest.mark.parametrize(
    ("batch_size", "n_samples", "sizes"), [(3, 1, [3, 3, 2]), (3, 2, [2, 1, 2, 1, 2]), (8, 1, [8])]
)
def test_query_batches_are_evaluates_batches_each_query_once_longest_prompts_first(
    tiny_model, queries, batch_size, n_samples, sizes
):
    """What `probdiff watch` deals out to its helpers: `evaluate`'s batches (`batch_size` chains, so fewer queries
    with several samples), each query in its first chain's batch, in the order of their prompts' lengths."""
    _, tokenizer = tiny_model
    config = ProbDiffConfig(batch_size=batch_size, n_samples=n_samples)
    batches = query_batches(tokenizer, queries, config)
    assert [len(batch) for batch in batches] == sizes
    dealt = [query for batch in batches for query in batch]
    assert sorted(query.id for query in dealt) == sorted(query.id for query in queries)
    lengths = [len(make_chains(tokenizer, [query], config)[0].prepared.prompt_ids) for query in dealt]
    assert lengths == sorted(lengths, reverse=True)


def test_records_hold_the_documented_fields(reference_records, queries):
    record = reference_records[0]
    assert set(record.to_json()) == {
        "id",
        "category",
        "query",
        "response",
        "revisions",
        "logp_response",
        "logp_revised",
        "d",
        "n_tokens_response",
        "n_tokens_revised",
        "confident",
        "truncated",
        "answer_temperature",
        "response_capped",
        "revision_capped",
        "revision_truncated",
        "response_degenerate",
        "revision_degenerate",
    }
    assert record.id == queries[0].id and record.category == "blog"
    assert len(record.revisions) == 1
    for r in reference_records:
        if r.n_tokens_response and r.n_tokens_revised:
            assert r.d == pytest.approx(r.logp_revised - r.logp_response)
            assert r.logp_response < 0
        assert r.confident == (not math.isnan(r.d) and r.d >= -0.05)


def test_the_evaluation_says_what_each_stage_cost(reference_evaluation):
    evaluation, generated = reference_evaluation
    cost = evaluation.cost
    assert cost.answers_seconds > 0 and cost.revisions_seconds > 0 and cost.scoring_seconds > 0
    assert cost.reference_seconds == 0  # summarise measures those
    # one batch: the answers, then the one revision round; the tokens are the ids generated before a stop id
    answers, revisions = generated
    assert cost.answer_tokens == sum(map(len, answers)) > 0
    assert cost.revision_tokens == sum(map(len, revisions)) > 0
    assert cost.generated_tokens == sum(len(ids) for call in generated for ids in call)
    assert cost.seconds == pytest.approx(cost.answers_seconds + cost.revisions_seconds + cost.scoring_seconds)


def test_stages_are_timed_on_the_host_clock_on_cpu(tiny_model):
    model, _ = tiny_model
    assert model.device.type == "cpu" and stage_clock(model) is time.perf_counter


def test_the_cost_holds_no_memory_on_a_cpu(reference_evaluation):
    cost = reference_evaluation[0].cost
    assert cost.peak_memory_bytes is cost.memory_before_bytes is cost.peak_memory_before_bytes is None
    assert not {"peak_memory_bytes", "memory_before_bytes", "peak_memory_before_bytes"} & set(cost.to_json())


def test_on_cuda_the_evaluation_reads_its_peak_and_the_one_before_and_resets_it(monkeypatch):
    """torch.cuda's allocator statistics, as the evaluator reads and resets them around an evaluation."""
    import torch

    stats = {"allocated": 5, "peak": 9, "resets": 0}

    def reset(device):
        stats["peak"], stats["resets"] = stats["allocated"], stats["resets"] + 1

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: stats["peak"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: stats["allocated"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    model = type("OnCuda", (), {"device": torch.device("cuda", 0)})()
    cost = Cost()
    with measured_memory(model, cost):
        assert stats["resets"] == 1 and stats["peak"] == 5  # its own window begins
        stats["peak"] = 12  # the evaluation's work
    assert (cost.peak_memory_before_bytes, cost.memory_before_bytes, cost.peak_memory_bytes) == (9, 5, 12)
    assert stats["resets"] == 2 and stats["peak"] == 5  # what comes next is measured on its own
    assert Cost.from_json(cost.to_json()) == cost


def test_summarise_scores_the_references_and_says_how_long_it_took():
    sentence = "The weather is very nice today."
    queries = [Query(f"q{i}", "Translate: Das Wetter ist heute sehr schön.", "de-en", sentence) for i in range(3)]
    records = [make_record(q.id, 0.1 * i, category="de-en", response=sentence) for i, q in enumerate(queries)]
    config = ProbDiffConfig()
    evaluation, summary = summarise(
        Evaluation(records, Cost(answers_seconds=1.0)), queries, config, plan_references(queries)
    )
    assert evaluation.cost.reference_seconds > 0 and evaluation.cost.answers_seconds == 1.0
    assert [r.ref["bleu"] for r in evaluation.records] == pytest.approx([100.0] * 3)
    assert summary.reference.overall["bleu"] == pytest.approx(100.0)
    assert summary.confidence == summary_of(records, config.delta, config.sweep).confidence
    blog = [Query("b", "Write a post", "blog", "a post")]
    plain, blog_summary = summarise(Evaluation(records[:1]), blog, config, plan_references(blog))
    assert plain.records == records[:1] and plain.cost.reference_seconds == 0 and blog_summary.reference is None


@pytest.mark.slow
def test_answers_cut_by_max_new_tokens_are_flagged_and_counted(tiny_model, queries):
    from probdiff_callback.core.metric import summary_of

    model, tokenizer = tiny_model
    cut = evaluate(model, tokenizer, queries[:4], ProbDiffConfig(max_new_tokens=1), progress=False).records
    # one new token leaves no room for the end-of-turn token: every non-empty text was cut
    assert all(r.response_capped or r.response == "" for r in cut) and any(r.response_capped for r in cut)
    assert all(r.revision_capped or r.revisions[-1] == "" for r in cut)
    summary = summary_of(cut, -0.05, [-0.05])
    assert summary.n_capped == sum(r.response_capped for r in cut) > 0
    assert summary.n_revision_capped == sum(r.revision_capped for r in cut)
    # with room, the answers end before the cap (the answers alone: the revisions and scores would tell nothing more)
    greedy = ProbDiffConfig(max_new_tokens=64, answer_temperature=0.0)
    roomy = make_chains(tokenizer, queries[:4], greedy)
    generate_answers(roomy, HFEngine(model, tokenizer, batch_size=greedy.batch_size), greedy)
    assert not all(c.answer_capped for c in roomy), "the tiny model ends most answers within 64 tokens"


class ScriptedEngine:
    """Writes each request's text from its seed, `batch_size` requests at a time. At its `failing_call`-th call it
    fails: with `finishing` (the indices of the requests it finished first) as an engine that finishes texts one by
    one does, or, without, as any error."""

    name = "scripted"

    def __init__(self, batch_size=None, failing_call=None, finishing=None) -> None:
        self.batch_size, self.failing_call, self.finishing, self.calls = batch_size, failing_call, finishing, 0

    def generate(self, requests, max_new_tokens, should_stop=None, progress=None):
        self.calls += 1
        texts = [Generated(f"text {request.seed % 997}", False, 2) for request in requests]
        if self.calls == self.failing_call:
            if self.finishing is None:
                raise RuntimeError("out of memory")
            raise GenerationError("the engine died", {i: texts[i] for i in self.finishing})
        return texts


def assert_same_records(kept, whole):
    """`kept` are `whole`'s records of the same queries: the same texts, the same scores (a batch of another
    composition pads otherwise: equal within float error)."""
    by_id = {record.id: record for record in whole}
    for record in kept:
        reference = by_id[record.id]
        assert (record.response, record.revisions) == (reference.response, reference.revisions)
        assert record.logp_response == pytest.approx(reference.logp_response, abs=1e-5)
        assert record.logp_revised == pytest.approx(reference.logp_revised, abs=1e-5)


def test_an_engine_that_fails_part_way_hands_on_the_queries_it_finished(tiny_model, queries):
    """Revisions fail after the engine finished three of six chains (3 queries × 2 samples): the one query whose
    both chains were finished is scored and handed on, then the engine's error goes up."""
    model, tokenizer = tiny_model
    config = ProbDiffConfig(max_new_tokens=8, n_samples=2)
    some = queries[:3]
    whole = evaluate(model, tokenizer, some, config, engine=ScriptedEngine(), progress=False).records
    handed = []
    with pytest.raises(GenerationError, match="the engine died"):
        engine = ScriptedEngine(failing_call=2, finishing=[0, 1, 2])
        evaluate(model, tokenizer, some, config, engine=engine, progress=False, on_finished=handed.append)
    [kept] = handed
    assert len(kept) == 1 and kept[0].responses is not None and len(kept[0].revisions_by_sample) == 2
    assert_same_records(kept, whole)


def test_an_evaluation_that_fails_hands_on_the_batches_it_finished(tiny_model, queries):
    model, tokenizer = tiny_model
    config = ProbDiffConfig(max_new_tokens=8)
    whole = evaluate(model, tokenizer, queries[:6], config, engine=ScriptedEngine(2), progress=False).records
    handed = []
    with pytest.raises(RuntimeError, match="out of memory"):  # the third batch's answers
        engine = ScriptedEngine(2, failing_call=5)
        evaluate(model, tokenizer, queries[:6], config, engine=engine, progress=False, on_finished=handed.append)
    assert [len(records) for records in handed] == [2, 2]
    assert_same_records([r for records in handed for r in records], whole)


def test_seed_changes_texts(tiny_model, queries, reference_records):
    model, tokenizer = tiny_model
    config = ProbDiffConfig(max_new_tokens=24, batch_size=8, seed=1)
    other = evaluate(model, tokenizer, queries, config, progress=False).records
    assert [r.response for r in other] != [r.response for r in reference_records]


@pytest.mark.slow
def test_several_samples_and_revisions(tiny_model, queries):
    model, tokenizer = tiny_model
    config = ProbDiffConfig(max_new_tokens=12, n_samples=3, n_revisions=2, batch_size=4)
    records = evaluate(model, tokenizer, queries[:2], config, progress=False).records
    for r in records:
        assert len(r.responses) == 3 and len(r.revisions_by_sample) == 3 and len(r.d_samples) == 3
        assert all(len(revs) == 2 for revs in r.revisions_by_sample)
        finite = [d for d in r.d_samples if not math.isnan(d)]
        assert r.d == pytest.approx(sum(finite) / len(finite))
        assert r.response == r.responses[0]
    single = evaluate(model, tokenizer, queries[:2], dataclasses.replace(config, n_samples=1), progress=False).records
    assert [r.response for r in single] == [r.responses[0] for r in records], "sample 0 does not depend on n_samples"


def test_per_category_answer_temperature(tiny_model):
    model, tokenizer = tiny_model
    # AlignBench's raw files name categories in Chinese, the recipes' keys are English: they must meet
    queries = [Query("a", "写一首关于秋天的诗", "文本写作"), Query("b", "写一首关于秋天的诗", "数学计算")]
    config = ProbDiffConfig(max_new_tokens=16, answer_temperature_by_category={"Mathematics": 0.0})
    records = evaluate(model, tokenizer, queries, config, progress=False).records
    assert [(r.category, r.answer_temperature) for r in records] == [("Writing", 0.7), ("Mathematics", 0.0)]
    # temperature 0 is greedy: the same text under any seed
    reseeded = evaluate(model, tokenizer, queries[1:], dataclasses.replace(config, seed=5), progress=False).records[0]
    assert reseeded.response == records[1].response
    assert config.answer_temperature_for("Writing") == 0.7 and config.answer_temperature_for(None) == 0.7


def test_middle_truncation_keeps_head_and_tail(qwen_tokenizer):
    text = "INSTRUCTION: summarise this. " + " ".join(f"word{i}" for i in range(400)) + " THE END"
    cut, truncated = truncate_middle(qwen_tokenizer, text, 60)
    assert truncated
    assert cut.startswith("INSTRUCTION: summarise") and cut.endswith("THE END")
    assert len(qwen_tokenizer(cut, add_special_tokens=False)["input_ids"]) <= 60
    assert truncate_middle(qwen_tokenizer, "short", 60) == ("short", False)


def test_long_queries_are_truncated_and_counted(tiny_model):
    model, tokenizer = tiny_model
    long_query = Query("long", "请总结下面的内容。" + "今天天气很好，我们去公园散步。" * 200)
    config = ProbDiffConfig(max_new_tokens=8, max_prompt_tokens=256)
    records = evaluate(model, tokenizer, [long_query, Query("short", "你好")], config, progress=False).records
    assert [r.truncated for r in records] == [True, False]
    assert records[0].query == long_query.text, "records keep the original query"
    # the cut query (256 tokens) plus the answer and the refinement prompt outgrow 256 again: cut, and said so
    assert [r.revision_truncated for r in records] == [True, False]


def test_refinement_requests_are_cut_to_the_prompt_budget(qwen_tokenizer):
    system = ProbDiffConfig().system_prompt
    instruction = "INSTRUCTION START " + " ".join(f"fact{i}" for i in range(600)) + " INSTRUCTION END"
    response = "RESPONSE START " + " ".join(f"claim{i}" for i in range(60)) + " RESPONSE END"
    whole = chat_prompt_ids(qwen_tokenizer, system, refinement_request(REWRITER, "short question", response))
    assert refinement_prompt_ids(qwen_tokenizer, system, REWRITER, "short question", response, 500) == (whole, False)
    ids, cut = refinement_prompt_ids(qwen_tokenizer, system, REWRITER, instruction, response, 500)
    text = qwen_tokenizer.decode(ids)
    assert cut and len(ids) <= 500
    # the instruction loses its middle; the response, which is what gets rewritten, stays whole
    assert "INSTRUCTION START" in text and "INSTRUCTION END" in text and "fact300" not in text
    assert response in text and text.endswith("#Rewritten Response#:\n<|im_end|>\n<|im_start|>assistant\n")
    long_response = response.replace("claim", "long claim number ") * 8
    ids, cut = refinement_prompt_ids(qwen_tokenizer, system, REWRITER, instruction, long_response, 500)
    text = qwen_tokenizer.decode(ids)
    assert cut and len(ids) <= 500 and "INSTRUCTION END" in text and "RESPONSE START" in text and "RESPONSE END" in text


def test_build_record_mean_over_valid_samples():
    prepared = PreparedQuery(Query("q", "text"), "text", False, [1, 2])
    record = build_record(
        prepared, ["a", ""], [["b"], ["c"]], [(-1.0, 3), (math.nan, 0)], [(-0.5, 3), (-2.0, 2)], -0.05
    )
    assert record.d == pytest.approx(0.5) and math.isnan(record.d_samples[1])


def test_refinement_request_fills_once():
    filled = refinement_request(REWRITER, "a {response} in the query", "the answer")
    assert (
        "#Given Prompt#:\na {response} in the query\n#Given Response#:\nthe answer\n#Rewritten Response#:\n" in filled
    )


def test_sampling_defaults_are_the_reference_codes_and_reach_the_sampler(tiny_model, queries):
    """top_p 1 for answers and revisions (the reference code); the submission paper's 0.8 / 0.9 by override."""
    config = ProbDiffConfig()
    assert (config.answer_temperature, config.answer_top_p) == (0.7, 1.0)
    assert (config.revision_temperature, config.revision_top_p) == (0.1, 1.0)
    submission = config.with_overrides(["answer_top_p=0.8", "revision_top_p=0.9"])
    assert (submission.answer_top_p, submission.revision_top_p) == (0.8, 0.9)
    # a nucleus of one token is greedy decoding: so each top_p reaches its stage's sampler
    model, tokenizer = tiny_model
    narrow = ProbDiffConfig(max_new_tokens=12, answer_top_p=1e-9, revision_top_p=1e-9)
    greedy = ProbDiffConfig(max_new_tokens=12, answer_temperature=0.0, revision_temperature=0.0)
    a, b = (evaluate(model, tokenizer, queries[:2], c, progress=False).records for c in (narrow, greedy))
    assert [(r.response, r.revisions) for r in a] == [(r.response, r.revisions) for r in b]
