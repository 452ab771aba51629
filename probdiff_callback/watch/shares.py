"""The last evaluations on the cores training frees: helper processes that each evaluate a share of the queries.

Once training has queued its last step (the request says so) or ended, the cores it trained on are idle. An evaluator
given `helpers_after_training` (training's local evaluator on the CPU is) evaluates each request from then on in
shares of whole generation batches: its own, and one per helper process, each on as many threads as the evaluator.
Each query meets the batch partners it meets in one process, so the records are the same; a helper that fails or dies
leaves its share to the evaluator.

The helpers are a `ProcessPoolExecutor` (spawn: fresh interpreters, no copy of this one's threads or model) whose
initializer loads the base model. They are started while the evaluator waits for training's next step, so that their
start (an interpreter and the model) is not on the last evaluation's path, and only once an evaluation has taken long
enough to gain from them (`HELPER_WORTH_SECONDS`). Not on GPUs (the evaluator keeps its own devices), nor with vLLM.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import torch

from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.evaluator import Evaluation, evaluate, query_batches
from probdiff_callback.core.queries import Query
from probdiff_callback.core.records import Cost
from probdiff_callback.runs.queue import EvaluatorSpec
from probdiff_callback.runtime.parent import set_parent_death_signal
from probdiff_callback.watch.weights import Weights

# A helper starts an interpreter and loads the model before it helps: worth it only when an evaluation takes longer
# than this (the previous one's time tells)
HELPER_WORTH_SECONDS = 60.0


def helpers_worth(helpers_after_training: int, device: str, config: ProbDiffConfig, previous: float | None) -> int:
    """`helpers_after_training` on the CPU with the HF engine, unless the previous evaluation (`previous` seconds)
    was too short to gain from a helper's start; else none (also while `use_vllm=auto` is undecided: vLLM would
    leave them idle)."""
    if device != "cpu" or config.use_vllm is not False:
        return 0
    if previous is not None and previous < HELPER_WORTH_SECONDS:
        return 0
    return helpers_after_training


def split_batches(batches: list[list[Query]], parts: int) -> list[list[Query]]:
    """`parts` shares of whole batches, dealt in turn (the batches come longest prompts first: each share gets long
    and short ones)."""
    return [[query for batch in batches[i::parts] for query in batch] for i in range(parts)]


# ---- in a helper process ----
_helper: tuple[Weights, ProbDiffConfig] | None = None  # the base model and settings, once the initializer ran


def load_base_model(spec: EvaluatorSpec, config: ProbDiffConfig, threads: int, pids, evaluator: int) -> None:
    """A helper's initializer: its pid said first (the evaluator stops a helper by it), then the base model loaded
    as the evaluator loads it. It ends with the evaluator (pid `evaluator`), also when the evaluator was killed while
    this process was still importing, before it could ask to be; Ctrl-C is the evaluator's to act on."""
    pids.put(os.getpid())
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != evaluator:  # gone before the line above (kill -9 while this one imported): no signal will come
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch.set_num_threads(threads)
    global _helper
    _helper = (Weights.load(spec, "cpu"), config)


def evaluate_share(folder: str | None, queries: list[Query]) -> Evaluation:
    """A share of a request's queries evaluated on the request's weights (`folder`; None: the base model)."""
    assert _helper is not None, "load_base_model runs first"
    weights, config = _helper
    with weights.holding(None if folder is None else Path(folder)) as model:
        return evaluate(model, weights.tokenizer, queries, config, progress=False)


# ---- in the evaluator ----
class Helpers:
    """`count` helper processes, started at once: each loads the base model of `spec` and waits for shares."""

    def __init__(self, spec: EvaluatorSpec, config: ProbDiffConfig, count: int, threads: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.count, self.used, self._pids = count, False, context.SimpleQueue()
        self.pool = ProcessPoolExecutor(
            count,
            mp_context=context,
            initializer=load_base_model,
            initargs=(spec, config, threads, self._pids, os.getpid()),
        )
        for _ in range(count):  # the pool spawns a worker per task it cannot hand to an idle one: all of them now
            self.pool.submit(os.getpid)

    def submit(self, folder: Path | None, share: list[Query]) -> Future:
        """A share for a helper; its future fails at once when a helper died before (the share is then the
        evaluator's)."""
        self.used = True
        try:
            return self.pool.submit(evaluate_share, None if folder is None else str(folder), share)
        except BrokenProcessPool as broken:
            failed: Future = Future()
            failed.set_exception(broken)
            return failed

    def close(self) -> None:
        """Done with them: each is ended, idle, loading or evaluating (nothing it would still do is needed), and
        waited for."""
        while not self._pids.empty():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pids.get(), signal.SIGTERM)
        self.pool.shutdown(wait=True, cancel_futures=True)


def evaluate_in_shares(
    model, weights: Weights, queries: list[Query], config: ProbDiffConfig, folder: Path | None, helpers: Helpers,
    say: Callable[[str], None], step: int,
) -> Evaluation:  # fmt: skip
    """`queries` evaluated in shares of whole batches: the first here on `model`, the others by `helpers`; the records
    in the queries' order, each stage's cost the slowest share's (as ranks side by side). A share whose helper failed
    is evaluated here."""
    batches = query_batches(weights.tokenizer, queries, config)
    shares = split_batches(batches, min(helpers.count + 1, len(batches)))
    futures = [helpers.submit(folder, share) for share in shares[1:]]
    if futures:
        said = "1 helper process evaluates" if len(futures) == 1 else f"{len(futures)} helper processes evaluate"
        say(
            f"step {step}: training has freed its cores: {said} {len(queries) - len(shares[0])} of the {len(queries)} "
            f"queries beside this one, in whole batches of {config.batch_size}"
        )
    elif helpers.count:
        say(f"step {step}: the {len(queries)} queries make one batch: evaluated here, without the helpers")
    evaluations = [evaluate(model, weights.tokenizer, shares[0], config, progress=config.progress)]
    for future, share in zip(futures, shares[1:], strict=True):
        try:
            evaluations.append(future.result())
        except Exception as err:  # its evaluation raised, or the process died (BrokenProcessPool)
            last = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            say(f"a helper's share of {len(share)} queries failed ({last}): evaluating it here")
            evaluations.append(evaluate(model, weights.tokenizer, share, config))
    by_id = {r.id: r for evaluation in evaluations for r in evaluation.records}
    return Evaluation([by_id[query.id] for query in queries], Cost.merged([e.cost for e in evaluations]))
