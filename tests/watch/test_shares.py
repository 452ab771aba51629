"""The last evaluations in shares on the cores training frees (`beside/shares.py`); the records with a helper, and a
killed one, equal the loop's in tests/watch/test_watch.py."""

from __future__ import annotations

import pytest

from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.queries import Query
from probdiff_callback.watch.shares import HELPER_WORTH_SECONDS, helpers_worth, split_batches


def test_shares_are_whole_batches_dealt_in_turn():
    batches = [[Query(f"q{i}{j}", "x") for j in range(2)] for i in range(5)]
    shares = split_batches(batches, 2)
    assert [[query.id for query in share] for share in shares] == [
        ["q00", "q01", "q20", "q21", "q40", "q41"],
        ["q10", "q11", "q30", "q31"],
    ]
    assert split_batches(batches, 1) == [[query for batch in batches for query in batch]]


def test_helpers_only_on_the_cpu_with_the_hf_engine_after_a_long_enough_evaluation():
    config = ProbDiffConfig(use_vllm=False)  # as the evaluator holds it once the engine is decided
    assert helpers_worth(2, "cpu", config, None) == 2  # nothing measured yet: the last step takes them
    assert helpers_worth(2, "cpu", config, HELPER_WORTH_SECONDS) == 2
    assert helpers_worth(2, "cpu", config, HELPER_WORTH_SECONDS - 1) == 0  # a helper's start would not pay
    assert helpers_worth(2, "cuda", config, None) == 0  # the evaluator keeps its own devices
    assert helpers_worth(2, "cpu", ProbDiffConfig(use_vllm=True), None) == 0
    assert helpers_worth(2, "cpu", ProbDiffConfig(use_vllm="auto"), None) == 0  # decided when the model is loaded


@pytest.mark.slow  # starts a process
def test_a_helper_whose_evaluator_died_while_it_started_ends_before_loading_anything():
    """kill -9 of the evaluator while a helper still imports (seconds, before it can ask the kernel for a signal on
    its parent's death) left the helper running for good, with its model loaded. Its initializer now sees that its
    parent is not the evaluator it was started by, and ends at once: with a spec that cannot load (no such model) it
    exits 0, which it could not if it had tried to load."""
    import multiprocessing
    import os

    from probdiff_callback.runs.queue import EvaluatorSpec
    from probdiff_callback.watch.shares import load_base_model

    context = multiprocessing.get_context("spawn")
    pids = context.SimpleQueue()
    spec = EvaluatorSpec(model="/no/such/model", dtype=None)
    not_its_parent = os.getpid() + 1_000_000  # as if the evaluator had been replaced by init
    helper = context.Process(target=load_base_model, args=(spec, ProbDiffConfig(), 1, pids, not_its_parent))
    helper.start()
    helper.join(timeout=120)
    # (with its evaluator alive the same initializer loads the model: test_watch.py's helper cases)
    assert helper.exitcode == 0 and pids.get() == helper.pid
