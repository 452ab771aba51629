"""Work shared across ranks (`callback/ranks.py`), one rank at a time in this process: accelerate's own split, the
gathering replaced by what each rank holds."""

from __future__ import annotations

import pytest

from probdiff_callback.callback import ranks
from probdiff_callback.core.evaluator import ABANDONED, EvaluationAbandoned
from probdiff_callback.core.records import Cost


class OneRankOf:
    """What `run_in_shares` needs of an accelerator, for one of `n` ranks (accelerate's own split)."""

    def __init__(self, rank: int, n: int) -> None:
        self.process_index, self.num_processes = rank, n

    def split_between_processes(self, inputs, apply_padding=False):
        from contextlib import contextmanager

        from accelerate import PartialState

        return contextmanager(PartialState.split_between_processes.__wrapped__)(self, inputs, apply_padding)


@pytest.mark.parametrize("n_items, n_ranks", [(5, 2), (7, 3), (2, 4), (4, 2), (1, 1)])
def test_equal_shares_make_equal_calls_and_are_gathered_in_order(monkeypatch, n_items, n_ranks):
    monkeypatch.setattr(ranks, "gather_object", lambda values: values)  # each rank's part; joined below
    items = [f"q{i}" for i in range(n_items)]
    shares, gathered = [], []

    def work(share):
        shares.append(list(share))
        return [s.upper() for s in share], Cost(scoring_seconds=1.5, answer_tokens=len(share))

    for rank in range(n_ranks):
        results, cost, error = ranks.run_in_shares(OneRankOf(rank, n_ranks), items, work)
        assert error is None
        # the padding's cost was spent and counts (on one rank, gather_object gives this rank's cost alone)
        assert cost == Cost(scoring_seconds=1.5, answer_tokens=len(shares[-1]))
        gathered += results
    assert len({len(share) for share in shares}) == 1  # the same number of calls on every rank (ZeRO-3)
    assert gathered == [item.upper() for item in items]


def test_the_ranks_costs_are_merged_as_stages_run_side_by_side(monkeypatch):
    costs = [
        Cost(answers_seconds=2.0, scoring_seconds=1.0, answer_tokens=30),
        Cost(answers_seconds=3.0, answer_tokens=20),
    ]
    monkeypatch.setattr(ranks, "gather_object", lambda values: costs if isinstance(values[0], Cost) else values * 2)
    results, cost, error = ranks.run_in_shares(OneRankOf(0, 2), ["a", "b"], lambda share: (share, costs[0]))
    assert error is None and cost == Cost(answers_seconds=3.0, scoring_seconds=1.0, answer_tokens=50)


def test_a_failure_on_one_rank_is_reported_with_its_traceback(monkeypatch):
    monkeypatch.setattr(ranks, "gather_object", lambda values: values)

    def fail(share):
        raise RuntimeError("out of memory")

    results, cost, error = ranks.run_in_shares(OneRankOf(1, 2), ["a", "b", "c"], fail)
    assert results == [] and cost == Cost() and error.startswith("rank 1: Traceback") and "out of memory" in error


def test_an_abandoned_share_is_said_as_abandoned_not_as_a_failure(monkeypatch):
    monkeypatch.setattr(ranks, "gather_object", lambda values: values)

    def asked_to_stop(share):
        raise EvaluationAbandoned("the run was asked to stop")

    results, cost, error = ranks.run_in_shares(OneRankOf(0, 2), ["a", "b"], asked_to_stop)
    assert results == [] and error == f"rank 0: {ABANDONED}: the run was asked to stop"


def test_one_process_broadcasts_its_own_value():
    value = {"rows": [1, 2]}
    assert ranks.broadcast(OneRankOf(0, 1), value) is value
