"""The HF engine (`core/decoding.py`'s `HFEngine`): HF `generate` on the model being evaluated, with the per-row
sampler. Its texts through a whole evaluation are in test_evaluator.py; the sampler itself in test_decoding.py."""

from __future__ import annotations

import itertools

import pytest

from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.decoding import HFEngine
from probdiff_callback.core.engine import GenerationRequest
from probdiff_callback.core.evaluator import EvaluationAbandoned, evaluate
from probdiff_callback.core.prompts import chat_prompt_ids
from probdiff_callback.core.queries import load_queries

SAMPLES = "data/samples/blog/heldout.jsonl"


@pytest.fixture(scope="module")
def requests(tiny_model) -> list[GenerationRequest]:
    """Three blog queries' chat prompts, each with its own seed."""
    tokenizer = tiny_model[1]
    queries = load_queries(SAMPLES)[:3]
    system = ProbDiffConfig().system_prompt
    return [
        GenerationRequest(chat_prompt_ids(tokenizer, system, q.text), 10 + i, 0.7, 1.0) for i, q in enumerate(queries)
    ]


def test_a_requests_text_depends_on_its_seed_not_on_its_batch(tiny_model, requests):
    model, tokenizer = tiny_model
    told: list[int] = []
    together = HFEngine(model, tokenizer, batch_size=3).generate(requests, 8, progress=told.append)
    alone = [HFEngine(model, tokenizer, batch_size=1).generate([request], 8)[0] for request in requests]
    assert together == alone and told == [3]  # progress is told of the whole batch
    assert all(0 <= text.n_tokens <= 8 and text.capped == (text.n_tokens == 8) for text in together)
    reseeded = HFEngine(model, tokenizer, 3).generate(
        [GenerationRequest(r.prompt_ids, 0, 0.7, 1.0) for r in requests], 8
    )
    assert [t.text for t in reseeded] != [t.text for t in together]


def test_asked_to_stop_it_ends_at_the_next_token_and_the_evaluation_is_abandoned(tiny_model, requests):
    model, tokenizer = tiny_model
    cut = HFEngine(model, tokenizer, 3).generate(requests, 64, should_stop=lambda: True)
    assert len(cut) == 3 and all(text.n_tokens <= 1 for text in cut)
    # asked while the answers are generated: the evaluator drops them and gives the evaluation up
    asks = itertools.count()
    with pytest.raises(EvaluationAbandoned, match="asked to stop"):
        evaluate(model, tokenizer, load_queries(SAMPLES)[:3], ProbDiffConfig(max_new_tokens=64), progress=False,
                 should_stop=lambda: next(asks) >= 4)  # fmt: skip
    assert next(asks) < 10  # a few tokens, not 64
