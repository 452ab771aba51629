"""The engine a query's texts are generated with, as the evaluator sees it (lm-evaluation-harness keeps its typed
request in its lowest layer the same way): one typed request (`GenerationRequest`: a chat prompt's token ids with its
own seed, temperature and top_p), what comes back (`Generated`), and the protocol every engine speaks (`Engine`). The
evaluator's default engine is `decoding.HFEngine` (HF `generate` on the model being evaluated, with our per-row
sampler); vLLM, the other, is `generation/`'s, with the processes and connections it needs. Nothing here imports
torch.

Scoring never goes through an engine: both texts of a query are scored by the model itself, in fp32, from the weights
being trained or evaluated (`scoring.py`), whichever engine wrote them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class GenerationRequest:
    """One text to sample: a chat prompt and its own sampling. The seed is derived from (run seed, query id, sample,
    stage), so a query's text does not depend on the batch it is generated in."""

    prompt_ids: Sequence[int]
    seed: int
    temperature: float
    top_p: float


@dataclass(frozen=True)
class Generated:
    text: str  # special tokens stripped, whitespace trimmed
    capped: bool  # ended at max_new_tokens without a stop id, so it is scored cut short
    n_tokens: int  # the tokens generated before the stop id: the text's ids (re-encoding the text need not give them)


class GenerationError(RuntimeError):
    """An engine that failed part-way through `generate`. `finished` holds the texts it had completed, by the index
    of their request, so that a caller can keep what was done (`probdiff eval` scores and writes those queries)."""

    def __init__(self, message: str, finished: Mapping[int, Generated] | None = None) -> None:
        super().__init__(message)
        self.finished = dict(finished or {})


class Engine(Protocol):
    """Generates texts for requests; the evaluator hands it `batch_size` requests at a time (None: all at once,
    for engines that schedule their own batches)."""

    name: str
    batch_size: int | None

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        max_new_tokens: int,
        should_stop: Callable[[], bool] | None = None,
        progress: Callable[[int], object] | None = None,
    ) -> list[Generated]:
        """The texts of `requests`, in their order; `progress(n)` is told as texts finish. Once `should_stop()` is
        true the engine may end early with fewer or shorter texts: the caller abandons the batch. An engine that
        finishes texts one by one raises `GenerationError` with those it finished when it fails part-way."""
        ...


def cut_at_stop(ids: Sequence[int], stop_ids: Sequence[int] | set[int]) -> list[int]:
    """The ids before the first stop id (engines may return the stop id itself)."""
    stops = set(stop_ids)
    return list(next((ids[:i] for i, token in enumerate(ids) if token in stops), ids))
