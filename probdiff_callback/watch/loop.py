"""The loop of `probdiff watch`: the next pending request evaluated as the training loop would have, and recorded;
else a wait for training.

Each request is evaluated with the same `ProbDiffConfig` (the spec's), the same queries in the same order, the same
reference plan, `core.evaluator.evaluate` and `summarise`, and `compare_to_base` against the baseline's records. The
step's row and records go through `RunFiles` (the evaluator is the history's one writer), then the request's done mark
with the row in it (training reads the mark, not the history). The models are `weights.py`'s; the last evaluations, on
the cores training frees, `shares.py`'s. A step's row and done mark are written together: a stop signal that comes
while they are written acts right after.
"""

from __future__ import annotations

import contextlib
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from probdiff_callback.analysis.report import pct
from probdiff_callback.core.config import ConfigError, ProbDiffConfig
from probdiff_callback.core.evaluator import evaluate, summarise
from probdiff_callback.core.metric import compare_to_base
from probdiff_callback.core.queries import Query
from probdiff_callback.core.records import Cost, Record, Summary
from probdiff_callback.core.reference_metrics import ReferencePlan, plan_references
from probdiff_callback.generation.vllm import VLLMGeneration
from probdiff_callback.models import default_device
from probdiff_callback.runs.queue import ENDED_FILE, Done, EvaluatorSpec, Queue, Request
from probdiff_callback.runs.run_files import HistoryRow, RunFiles
from probdiff_callback.runtime.stop_signals import StopSignals
from probdiff_callback.runtime.threads import configure_threads
from probdiff_callback.watch.shares import Helpers, evaluate_in_shares, helpers_worth
from probdiff_callback.watch.weights import Loaded, Weights, adapter_in, describe_weights, weights_gone


# ---- one training start's spec ----
def config_of(spec: EvaluatorSpec, queue: Queue) -> ProbDiffConfig:
    """The loop's settings, from the spec: a key this version does not know stops with the file's name."""
    try:
        return ProbDiffConfig.from_values(spec.config, f"{queue.spec_path}: config")
    except ConfigError as err:
        raise ConfigError(f"{err} (was the run trained with another version of probdiff?)") from None


@dataclass
class Session:
    """What one training start's spec gives: the loop's settings and queries, and the history taken over."""

    spec: EvaluatorSpec
    config: ProbDiffConfig
    queries: list[Query]
    plan: ReferencePlan
    files: RunFiles
    baseline_records: list[Record] | None = None


def start_session(queue: Queue, spec: EvaluatorSpec, say: Callable[[str], None]) -> Session:
    """Read the spec's settings and queries and take the history over as training's `continue_from` would: the rows
    up to the step training started from, and those of the steps this training start's evaluator marked done (an
    evaluator started again keeps them; their requests are not pending any more)."""
    config = config_of(spec, queue)
    queries = queue.read_queries(spec)
    files = RunFiles(queue.run_dir, queue.subdir)
    done_steps = {r.global_step for r in queue.requests() if queue.done(r.global_step) is not None}
    _, dropped = files.continue_from(spec.started_at_step, also_keep=done_steps)
    if dropped:
        say(f"dropped {dropped} history rows of steps past {spec.started_at_step} (the run was started from there)")
    return Session(spec, config, queries, plan_references(queries), files, files.baseline_records())


# ---- one request ----
@dataclass
class Outcome:
    records: list[Record] = field(default_factory=list)
    summary: Summary | None = None
    cost: Cost | None = None
    error: str | None = None
    seconds: float = 0.0


def evaluate_request(
    session: Session, weights: Weights, vllm: VLLMGeneration | None, folder: Path | None, step: int,
    helpers: Helpers | None, say: Callable[[str], None],
) -> Outcome:  # fmt: skip
    """The loop's evaluation of the request's weights (`folder`; None: the base model), through `vllm` or in shares
    with `helpers` (the HF engine only); a failure is an outcome with its error (never raised)."""
    started = time.perf_counter()
    config = session.config
    try:
        with weights.holding(folder) as model, contextlib.ExitStack() as scope:
            if vllm is not None:
                engine = scope.enter_context(vllm.holding(model, base_model=folder is None, adapter=adapter_in(folder)))
                evaluation = evaluate(model, weights.tokenizer, session.queries, config, engine=engine,
                                      progress=config.progress)  # fmt: skip
            elif helpers is not None:
                evaluation = evaluate_in_shares(model, weights, session.queries, config, folder, helpers, say, step)
            else:
                evaluation = evaluate(model, weights.tokenizer, session.queries, config, progress=config.progress)
        evaluation, summary = summarise(evaluation, session.queries, config, session.plan)
    except Exception:
        return Outcome(error=traceback.format_exc(), seconds=time.perf_counter() - started)
    return Outcome(evaluation.records, summary, evaluation.cost, None, time.perf_counter() - started)


def record(session: Session, queue: Queue, request: Request, outcome: Outcome) -> HistoryRow:
    """The step's row (as the loop writes it), its records and eval losses, then its done mark."""
    row = request.row()
    if request.kind == "baseline":
        if outcome.error is None:
            session.baseline_records = outcome.records
    else:
        row.vs_base = compare_to_base(outcome.records, session.baseline_records, session.config.delta)
    row.summary, row.error, row.cost = outcome.summary, outcome.error, outcome.cost
    row.seconds = round(outcome.seconds, 3)
    session.files.add(row, outcome.records if outcome.error is None else None, request.eval_losses_or_nan())
    if queue.is_current(request):  # a training started again meanwhile drops it, and may queue the step anew
        status = "evaluated" if outcome.error is None else "failed"
        mark = Done(global_step=request.global_step, status=status, error=outcome.error, seconds=row.seconds)
        mark.row = row.to_json()
        queue.mark_done(mark)
    return row


def progress_line(request: Request, outcome: Outcome) -> str:
    if outcome.error is not None:
        last = outcome.error.strip().splitlines()[-1]
        return f"step {request.global_step}: failed after {outcome.seconds:.1f}s: {last}"
    summary = outcome.summary
    return (
        f"step {request.global_step}: {len(outcome.records)} queries in {outcome.seconds:.1f}s, confidence "
        f"{pct(summary.confidence)} (95% CI {pct(summary.confidence_ci[0])}-{pct(summary.confidence_ci[1])})"
    )


# ---- the loop ----
class Evaluator:
    """The loop of `probdiff watch`: the next pending request evaluated and recorded, else a wait for training."""

    def __init__(
        self,
        queue: Queue,
        signals: StopSignals,
        say: Callable[[str], None],
        *,
        follow: bool,
        poll_seconds: float,
        helpers_after_training: int,
    ) -> None:
        self.queue, self.signals, self.say = queue, signals, say
        self.follow, self.poll_seconds, self.helpers_after_training = follow, poll_seconds, helpers_after_training
        self.session = start_session(queue, queue.read_spec(), say)
        self.device = default_device()
        if self.device == "cpu":
            threads, why = configure_threads()
            print(f"{threads} CPU thread{'s' if threads > 1 else ''} ({why})", file=sys.stderr, flush=True)
        self.loaded = Loaded(queue, self.device, say)
        self.helpers = None  # `shares.Helpers` on the cores training frees, once worth it
        self.previous: float | None = None  # the last evaluation's seconds

    def run(self) -> None:
        try:
            waiting = False
            while True:
                self.signals.raise_if_received()
                latest = self.queue.read_spec()
                if latest != self.session.spec:  # training was started again (resumed): its spec, its history
                    self.say(f"the run was started again from step {latest.started_at_step}: taking its queue over")
                    self.session = start_session(self.queue, latest, self.say)
                    self._close_helpers("the run was started again")  # they hold the earlier start's settings
                ended = self.queue.ended()  # read before the requests: the last request comes before it
                pending = self.queue.pending()
                if pending:
                    waiting = False
                    freed = pending[0].last or ended is not None  # training's cores are idle
                    self._evaluate_next(pending, freed)
                    continue
                if ended is not None:
                    self.say(f"nothing pending, and training has ended ({ended}): done")
                    return
                if not self.follow:
                    self.say("nothing pending: done (--no-follow)")
                    return
                self._start_helpers_ahead()
                if not waiting:
                    self.say(
                        f"nothing pending; waiting for training to queue more until it writes {ENDED_FILE} "
                        "(--no-follow stops when nothing is pending; SIGTERM or Ctrl-C stops now)"
                    )
                    waiting = True
                wait_for_training(self.poll_seconds)
        finally:
            self._close_helpers("the evaluator stopped")
            self.loaded.close()

    def _helpers_worth(self) -> int:
        return helpers_worth(self.helpers_after_training, self.device, self.session.config, self.previous)

    def _helpers(self, count: int):
        """The helper processes, `count` of them (those started ahead, or started now)."""
        if self.helpers is None and count:
            self.helpers = Helpers(self.session.spec, self.session.config, count, torch.get_num_threads())
        return self.helpers

    def _start_helpers_ahead(self) -> None:
        """While the evaluator waits for training's next step, the helpers the last step will have, started now: each
        loads the base model on the evaluator's idle cores instead of on the last evaluation's path. None until an
        evaluation has shown they are worth it."""
        if self.helpers is not None or self.previous is None or not (count := self._helpers_worth()):
            return
        self._helpers(count)
        many = "1 helper process" if count == 1 else f"{count} helper processes"
        self.say(f"{many} for the last step started ahead: loading the base model while this one waits for training")

    def _close_helpers(self, why: str) -> None:
        helpers, self.helpers = self.helpers, None
        if helpers is None:
            return
        if not helpers.used:
            self.say(f"the helper processes started ahead were not used ({why}): stopped")
        helpers.close()

    def _evaluate_next(self, pending: list[Request], freed: bool) -> None:
        """Evaluate the first pending request and record it; with helpers where training's cores are `freed` and the
        engine, decided first, is HF."""
        request = pending[0]
        folder = self.queue.weights_of(request)
        gone = None if folder is None else weights_gone(folder, request.global_step)
        later = f"; then steps {', '.join(str(r.global_step) for r in pending[1:])}" if len(pending) > 1 else ""
        self.say(
            f"step {request.global_step} ({request.kind}, {describe_weights(folder)}): evaluating "
            f"{len(self.session.queries)} queries{later}"
        )
        if request.failed is not None:  # training had nothing to queue for it: recorded as it says
            outcome = Outcome(error=request.failed)
        elif gone is not None:
            outcome = Outcome(error=gone)
        else:
            # a missing model stops here; `auto` is decided on this process's device (generation/choice.py)
            weights, vllm, self.session.config = self.loaded.for_spec(
                self.session.spec, self.session.config, len(self.session.queries)
            )
            helpers = self._helpers_worth() if freed else 0
            shares = self._helpers(helpers) if helpers else None
            outcome = evaluate_request(self.session, weights, vllm, folder, request.global_step, shares, self.say)
        with self.signals.deferred():
            record(self.session, self.queue, request, outcome)
        self.say(progress_line(request, outcome))
        self.previous = outcome.seconds if outcome.error is None else None  # a failure's time tells nothing


def wait_for_training(seconds: float) -> None:
    time.sleep(seconds)
