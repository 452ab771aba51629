"""Records built for tests that need only a few of a record's fields: the rest get plain values."""

from __future__ import annotations

import math

from probdiff_callback.core.metric import is_confident
from probdiff_callback.core.records import Record


def make_record(query_id: object = "q", d: float | None = 0.0, *, delta: float = -0.05, **fields) -> Record:
    """A Record with `d` (None: an invalid d, NaN) and the `fields` given; its other required fields plain (one-word
    texts, 10 tokens each, `logp_response` -1 and `logp_revised` -1 + d, `confident` from `delta`)."""
    d = math.nan if d is None else d
    values = {
        "id": str(query_id),
        "category": None,
        "query": f"query {query_id}",
        "response": "answer",
        "revisions": ["revision"],
        "logp_response": -1.0,
        "logp_revised": -1.0 + d,
        "d": d,
        "n_tokens_response": 10,
        "n_tokens_revised": 10,
        "confident": is_confident(d, delta),
        "truncated": False,
    }
    return Record(**{**values, **fields})
