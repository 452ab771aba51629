"""The last evaluations in shares on the cores training frees (`beside/shares.py`); the records with a helper, and a
killed one, equal the loop's in tests/beside/test_watch.py."""

from __future__ import annotations

from probdiff_callback.beside.shares import HELPER_WORTH_SECONDS, helpers_worth, split_batches
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.queries import Query


def test_shares_are_whole_batches_dealt_in_turn():
    batches = [[Query(f"q{i}{j}", "x") for j in range(2)] for i in range(5)]
    shares = split_batches(batches, 2)
    assert [[query.id for query in share] for share in shares] == [
        ["q00", "q01", "q20", "q21", "q40", "q41"],
        ["q10", "q11", "q30", "q31"],
    ]
    assert split_batches(batches, 1) == [[query for batch in batches for query in batch]]


def test_helpers_only_on_the_cpu_with_the_hf_engine_after_a_long_enough_evaluation():
    config = ProbDiffConfig()
    assert helpers_worth(2, "cpu", config, None) == 2  # nothing measured yet: the last step takes them
    assert helpers_worth(2, "cpu", config, HELPER_WORTH_SECONDS) == 2
    assert helpers_worth(2, "cpu", config, HELPER_WORTH_SECONDS - 1) == 0  # a helper's start would not pay
    assert helpers_worth(2, "cuda", config, None) == 0  # the evaluator keeps its own devices
    assert helpers_worth(2, "cpu", ProbDiffConfig(use_vllm=True), None) == 0
