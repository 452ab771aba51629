"""probdiff_callback/core/pairs.py: texts generated elsewhere scored into records (`probdiff score`)."""

import math

import pytest

from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.pairs import score_pairs
from probdiff_callback.core.queries import Query


def test_empty_texts_give_nan_and_count_as_not_confident(tiny_model):
    model, tokenizer = tiny_model
    config = ProbDiffConfig()
    pairs = [
        (Query("e1", "hi"), "", "something"),
        (Query("e2", "hi"), "something", ""),
        (Query("ok", "hi"), "a b", "a b"),
    ]
    scored = score_pairs(model, tokenizer, pairs, config, progress=False)
    records = scored.records
    assert scored.cost.scoring_seconds > 0 and scored.cost.generated_tokens == 0
    assert math.isnan(records[0].d) and math.isnan(records[1].d)
    assert records[0].confident is False and records[1].confident is False
    assert records[2].d == pytest.approx(0.0, abs=1e-6) and records[2].confident is True
