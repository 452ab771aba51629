"""`probdiff watch RUN_DIR`: the evaluator of a run trained with `probdiff.async_eval=true`.

Training queues a request for every step the loop would evaluate (`runs/queue.py`); this process takes them in step
order and evaluates each as the loop would have: the same `ProbDiffConfig` (the spec's), the same queries in the same
order, the same reference plan, `core.evaluator.evaluate` and `summarise`, `compare_to_base` against the baseline's
records. It writes the step's row and records through `RunFiles` (while the queue is in use it is the history's one
writer) and then the request's done mark. What it needs on disk: the run directory and the base model's folder (the
spec names it); the weights of each step are in the queue.

The base model is loaded once. A request's weights are the base model (`base_model`: the adapters disabled), a PEFT
adapter (loaded onto the one base model, and swapped for the next step's), or whole weights (loaded for the request).
With `use_vllm=true` one vLLM engine is started for the base model and handed each request's weights.

Once training has queued its last step (the request says so) or ended, the cores it trained on are idle: an evaluator
given `helpers_after_training` (training's local evaluator on the CPU is) evaluates each request from then on in
shares of whole generation batches, its own and one per helper process, each process on as many threads as the
evaluator (unless the previous evaluation was too short to gain from a helper's start). Each query meets the batch
partners it meets in one process, so the records are the same; a helper that fails leaves its share to the evaluator.
The helpers are spawned while the evaluator waits for training's next step, so that their start (an interpreter and
the base model) is not on the last evaluation's path.

One evaluator per run (`runs/evaluator_lock.py`). SIGTERM and SIGINT stop it at once, leaving the step in progress
pending (it is evaluated next time): exit status 0 for SIGTERM (a stop asked for), 130 for SIGINT (Ctrl-C). A step's
row and done mark are written together: a signal that comes while they are written acts right after.
"""

from __future__ import annotations

import contextlib
import gc
import math
import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from probdiff_callback.analysis.report import pct
from probdiff_callback.core.config import ConfigError, ProbDiffConfig
from probdiff_callback.core.metric import compare_to_base
from probdiff_callback.core.reference_metrics import ReferencePlan, plan_references
from probdiff_callback.runs import queue as q
from probdiff_callback.runs.evaluator_lock import hold_evaluator
from probdiff_callback.runs.run_files import HistoryRow, RunFiles, existing_run_dir

if TYPE_CHECKING:
    from probdiff_callback.core.engines.vllm import VLLMGeneration
    from probdiff_callback.core.evaluator import Evaluation
    from probdiff_callback.core.queries import Query
    from probdiff_callback.core.records import Cost, Record, Summary

POLL_SECONDS = 2.0
STOP_HELPER_SECONDS = 10.0  # a helper process's time to leave when stopped
# A helper starts an interpreter and loads the model (10-20 s for `tiny` or `smollm2` on 2 busy cores): worth it only
# when an evaluation takes longer than this (the previous one's time tells)
HELPER_WORTH_SECONDS = 60.0
EXIT_ON_SIGNAL = {signal.SIGTERM: 0, signal.SIGINT: 130}  # a stop asked for; Ctrl-C as shells report it
ADAPTER_CONFIG = "adapter_config.json"
MODEL_CONFIG = "config.json"


class NotQueued(FileNotFoundError):
    """The run has no evaluator spec: it was not trained with async_eval."""


class Stopped(BaseException):  # noqa: N818 - not an error: a signal asked the watch to stop
    """SIGTERM or SIGINT: the watch ends where it is (a BaseException: no `except Exception` keeps it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def say(message: str) -> None:
    print(f"probdiff watch: {message}", flush=True)


# ---- signals ----
class StopSignals:
    """SIGTERM and SIGINT raise `Stopped` where the process is; inside `deferred()`, on leaving it."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._deferring = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        for signum in EXIT_ON_SIGNAL:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame) -> None:
        self.received = signum
        if not self._deferring:
            raise Stopped(signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        self.raise_if_received()

    def raise_if_received(self) -> None:
        if self.received is not None:
            raise Stopped(self.received)


# ---- the run ----
def queue_of(run_dir: Path, subdir: str) -> Path:
    """The run's queue folder, or `NotQueued` saying why there is none."""
    queue = q.queue_dir(existing_run_dir(run_dir), subdir)
    if not (queue / q.SPEC_FILE).is_file():
        raise NotQueued(
            f"{queue / q.SPEC_FILE}: not found: {run_dir} was not started with probdiff.async_eval=true (only such a "
            "run queues its evaluations for `probdiff watch`; its history is written by the training loop). "
            f"`probdiff eval --adapter {run_dir}/checkpoint-N` evaluates one checkpoint"
        )
    return queue


def config_of(spec: q.EvaluatorSpec, queue: Path) -> ProbDiffConfig:
    """The loop's settings, from the spec: a key this version does not know stops with the file's name."""
    try:
        return ProbDiffConfig.from_values(spec.config, f"{queue / q.SPEC_FILE}: config")
    except ConfigError as err:
        raise ConfigError(f"{err} (was the run trained with another version of probdiff?)") from None


@dataclass
class Session:
    """What one training start's spec gives: the loop's settings and queries, and the history taken over."""

    spec: q.EvaluatorSpec
    config: ProbDiffConfig
    queries: list[Query]
    plan: ReferencePlan
    files: RunFiles
    baseline_records: list[Record] | None = None


def start_session(run_dir: Path, subdir: str, queue: Path, spec: q.EvaluatorSpec) -> Session:
    """Read the spec's settings and queries and take the history over as training's `continue_from` would: the rows
    up to the step training started from, and those of the steps this training start's evaluator marked done (an
    evaluator started again keeps them; their requests are not pending any more)."""
    config = config_of(spec, queue)
    queries = q.read_queries(queue, spec)
    files = RunFiles(run_dir, subdir)
    done_steps = {r.global_step for r in q.requests(queue) if q.done(queue, r.global_step) is not None}
    _, dropped = files.continue_from(spec.started_at_step, also_keep=done_steps)
    if dropped:
        say(f"dropped {dropped} history rows of steps past {spec.started_at_step} (the run was started from there)")
    return Session(spec, config, queries, plan_references(queries), files, files.baseline_records())


# ---- weights ----
def weights_folder(queue: Path, request: q.Request) -> Path | None:
    """The request's weights folder; None for the base model."""
    if request.base_model or request.weights is None:
        return None
    return q.step_dir(queue, request.global_step) / request.weights


def weights_gone(folder: Path, step: int) -> str | None:
    """Why `folder` holds no weights to evaluate, or None when it holds an adapter or a model."""
    if not folder.is_dir():
        why = f"{folder}: no such folder"
    elif not (folder / ADAPTER_CONFIG).is_file() and not (folder / MODEL_CONFIG).is_file():
        why = f"{folder} holds neither {ADAPTER_CONFIG} nor {MODEL_CONFIG}"
    else:
        return None
    return f"the weights of step {step} are gone ({why})"


def model_key(spec: q.EvaluatorSpec) -> tuple:
    """What the base model is loaded from: a new training start that changes it loads it again."""
    return (spec.model, spec.dtype, spec.trust_remote_code)


class Weights:
    """The base model, loaded once, and the weights of each request put on it: none (the base model, with the
    adapters disabled once an adapter was loaded), a PEFT adapter (loaded onto the base model, the previous one
    deleted), or whole weights (loaded for the request, freed after)."""

    def __init__(self, base, tokenizer, *, key: tuple, device: str, dtype: str) -> None:
        self.base, self.tokenizer, self.key, self.device, self.dtype = base, tokenizer, key, device, dtype
        self.peft = None  # the PeftModel around `base`, once an adapter was loaded
        self.adapter: str | None = None  # the adapter on it now
        self.loaded = 0  # adapters loaded so far

    @classmethod
    def load(cls, spec: q.EvaluatorSpec, device: str) -> Weights:
        """The spec's base model (a folder or a preset), in its dtype, on `device`."""
        from probdiff_callback.models import load_model_and_tokenizer

        dtype = spec.dtype or "auto"
        extra = {"trust_remote_code": True} if spec.trust_remote_code else {}
        try:
            base, tokenizer = load_model_and_tokenizer(spec.model, dtype=dtype, device=device, **extra)
        except (FileNotFoundError, ValueError) as err:  # no such folder, not a model, not downloadable now
            raise FileNotFoundError(
                f"the base model {spec.model} ({q.SPEC_FILE}'s `model`): {err}. The evaluator loads the base model the "
                "run was trained from: run it where that folder is at the same path"
            ) from None
        return cls(base, tokenizer, key=model_key(spec), device=device, dtype=dtype)

    @contextlib.contextmanager
    def holding(self, folder: Path | None) -> Iterator[object]:
        if folder is None:
            with self.peft.disable_adapter() if self.peft is not None else contextlib.nullcontext():
                yield self.peft if self.peft is not None else self.base
        elif (folder / ADAPTER_CONFIG).is_file():
            yield self._with_adapter(folder)
        else:
            yield self._whole_weights(folder)  # freed when the evaluation lets it go

    def _with_adapter(self, folder: Path):
        from peft import PeftModel

        from probdiff_callback.models import peft_without_deprecated_alias_warning

        self.loaded += 1
        name = f"queued{self.loaded}"  # a name of its own: a step queued again comes with new weights
        with peft_without_deprecated_alias_warning():
            if self.peft is None:
                self.peft = PeftModel.from_pretrained(self.base, str(folder), adapter_name=name)
            else:
                self.peft.load_adapter(str(folder), adapter_name=name)
                self.peft.set_adapter(name)
        if self.adapter is not None and self.adapter != name:
            self.peft.delete_adapter(self.adapter)
        self.adapter = name
        self.peft.to(self.device)
        self.peft.eval()
        return self.peft

    def _whole_weights(self, folder: Path):
        from transformers import AutoModelForCausalLM

        from probdiff_callback.models import parse_dtype

        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=parse_dtype(self.dtype))
        return model.to(self.device).eval()


# ---- one request ----
@dataclass
class Outcome:
    records: list[Record] = field(default_factory=list)
    summary: Summary | None = None
    cost: Cost | None = None
    error: str | None = None
    seconds: float = 0.0


def evaluate_request(
    session: Session,
    weights: Weights,
    vllm: VLLMGeneration | None,
    folder: Path | None,
    request: q.Request,
    helpers: int = 0,
    ahead: list[Helper] | None = None,
) -> Outcome:
    """The loop's evaluation of the request's weights (`folder`; None: the base model), in shares with `helpers`
    processes (the HF engine only; those started `ahead` first); a failure is an outcome with its error (never
    raised)."""
    from probdiff_callback.core.evaluator import evaluate, summarise

    started = time.perf_counter()
    config = session.config
    try:
        with weights.holding(folder) as model, contextlib.ExitStack() as engine_scope:
            engine = None
            if vllm is not None:
                adapter = folder if folder is not None and (folder / ADAPTER_CONFIG).is_file() else None
                engine = engine_scope.enter_context(
                    vllm.holding(model, base_model=folder is None, adapter=adapter)  # type: ignore[arg-type]
                )
            if helpers and engine is None:
                evaluation = evaluate_in_shares(
                    session, weights, model, folder, request.global_step, helpers, ahead or []
                )
            else:
                evaluation = evaluate(
                    model, weights.tokenizer, session.queries, config, engine=engine, progress=config.progress
                )
        evaluation, summary = summarise(evaluation, session.queries, config, session.plan)
    except Exception:
        return Outcome(error=traceback.format_exc(), seconds=time.perf_counter() - started)
    return Outcome(evaluation.records, summary, evaluation.cost, None, time.perf_counter() - started)


# ---- shares on the cores training freed ----
def split_batches(batches: list[list[Query]], parts: int) -> list[list[Query]]:
    """`parts` shares of whole batches, dealt in turn (the batches come longest prompts first: each share gets long
    and short ones)."""
    return [[query for batch in batches[i::parts] for query in batch] for i in range(parts)]


def evaluate_share(spec: q.EvaluatorSpec, config: ProbDiffConfig, threads: int, connection) -> None:
    """A helper process (spawned): the base model loaded as the evaluator loads it, then one share received (the
    request's weights folder and its queries), evaluated, and (evaluation, None) or (None, the error) sent back. It
    ends with the evaluator, and without a word when the evaluator closes its pipe before sending a share."""
    from probdiff_callback.runtime.parent import set_parent_death_signal

    set_parent_death_signal(signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the evaluator's to act on: it stops its helpers
    try:
        import torch

        from probdiff_callback.core.evaluator import evaluate

        torch.set_num_threads(threads)
        weights = Weights.load(spec, "cpu")
        try:
            folder, queries = connection.recv()
        except EOFError:  # not needed after all
            return
        with weights.holding(None if folder is None else Path(folder)) as model:
            connection.send((evaluate(model, weights.tokenizer, queries, config, progress=False), None))
    except Exception:
        with contextlib.suppress(OSError):
            connection.send((None, traceback.format_exc()))
    finally:
        connection.close()


class Helper:
    """One helper process: spawned (it loads the base model at once), then given one share by `evaluate`; `result()`
    is its evaluation, or None when it failed (said). Started ahead while the evaluator waits, its start is off the
    path of the evaluation it helps with."""

    def __init__(self, session: Session, threads: int) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no copy of this one's threads or model
        self.share: list[Query] = []
        self.connection, theirs = context.Pipe()
        self.process = context.Process(
            target=evaluate_share, args=(session.spec, session.config, threads, theirs), daemon=True
        )
        self.process.start()
        theirs.close()  # the helper's end only: its exit without a result is an EOFError here

    def evaluate(self, folder: Path | None, share: list[Query]) -> None:
        self.share = share
        with contextlib.suppress(OSError):  # it died already: `result()` says so
            self.connection.send((None if folder is None else str(folder), share))

    def result(self) -> Evaluation | None:
        try:
            evaluation, error = self.connection.recv()
        except (EOFError, OSError):
            evaluation, error = None, None
        # let it exit on its own: a helper stopped while it exits leaves its semaphores to the resource tracker
        self.process.join(timeout=STOP_HELPER_SECONDS)
        if evaluation is None and error is None:
            error = f"it exited with status {self.process.exitcode} before sending its records"
        if error is not None:
            last = error.strip().splitlines()[-1] if error.strip() else "-"
            say(f"a helper's share of {len(self.share)} queries failed ({last}): evaluating it here")
        return evaluation

    def stop(self) -> None:
        self.connection.close()  # a helper still waiting for its share leaves on its own
        self.process.join(timeout=STOP_HELPER_SECONDS)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=STOP_HELPER_SECONDS)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def evaluate_in_shares(
    session: Session, weights: Weights, model, folder: Path | None, step: int, helpers: int, ahead: list[Helper]
) -> Evaluation:
    """`session.queries` evaluated in shares of whole batches: the first here on `model`, one per helper process
    (those started `ahead` first; the ones not needed are stopped); the records in the queries' order, each stage's
    cost the slowest share's (as ranks side by side)."""
    import torch

    from probdiff_callback.core.evaluator import Evaluation, evaluate, query_batches
    from probdiff_callback.core.records import Cost

    config = session.config
    batches = query_batches(weights.tokenizer, session.queries, config)
    shares = split_batches(batches, min(helpers + 1, len(batches)))
    threads = torch.get_num_threads()
    started = ahead[: len(shares) - 1]
    started += [Helper(session, threads) for _ in range(len(shares) - 1 - len(started))]
    for helper in ahead[len(started) :]:
        helper.stop()
    for helper, share in zip(started, shares[1:], strict=True):
        helper.evaluate(folder, share)
    if started:
        said = "1 helper process evaluates" if len(started) == 1 else f"{len(started)} helper processes evaluate"
        say(
            f"step {step}: training has freed its cores: {said} {len(session.queries) - len(shares[0])} of "
            f"the {len(session.queries)} queries beside this one, in whole batches of {config.batch_size}"
        )
    try:
        evaluations = [evaluate(model, weights.tokenizer, shares[0], config, progress=config.progress)]
        for helper in started:
            evaluations.append(helper.result() or evaluate(model, weights.tokenizer, helper.share, config))
    finally:
        for helper in started:
            helper.stop()
    by_id = {r.id: r for evaluation in evaluations for r in evaluation.records}
    records = [by_id[query.id] for query in session.queries]
    return Evaluation(records, Cost.merged([evaluation.cost for evaluation in evaluations]))


def record(session: Session, queue: Path, request: q.Request, outcome: Outcome) -> HistoryRow:
    """The step's row (as the loop writes it), its records and eval losses, then its done mark."""
    config = session.config
    row = HistoryRow(
        request.global_step,
        request.epoch,
        request.kind,
        request.base_model,
        request.checkpoint,
        eval_loss=math.nan if request.eval_loss is None else float(request.eval_loss),
    )
    if request.kind == "baseline":
        if outcome.error is None:
            session.baseline_records = outcome.records
    else:
        row.vs_base = compare_to_base(outcome.records, session.baseline_records, config.delta)
    row.summary, row.error, row.cost = outcome.summary, outcome.error, outcome.cost
    row.seconds = round(outcome.seconds, 3)
    losses = None if request.eval_losses is None else [math.nan if v is None else v for v in request.eval_losses]
    session.files.add(row, outcome.records if outcome.error is None else None, losses)
    if still_queued(queue, request):
        status = "evaluated" if outcome.error is None else "failed"
        mark = q.Done(global_step=request.global_step, status=status, error=outcome.error, seconds=row.seconds)
        q.mark_done(queue, mark)
    return row


def still_queued(queue: Path, request: q.Request) -> bool:
    """Whether `request` is still the step's: a training started again meanwhile drops it, and may queue the step anew
    (its new weights are evaluated next, and the row of the old ones is dropped when the new start is taken over)."""
    path = q.step_dir(queue, request.global_step) / q.REQUEST_FILE
    try:
        return q.read_json_file(q.Request, path).queued_at == request.queued_at
    except ValueError:  # gone
        return False


def progress_line(request: q.Request, outcome: Outcome) -> str:
    if outcome.error is not None:
        last = outcome.error.strip().splitlines()[-1]
        return f"step {request.global_step}: failed after {outcome.seconds:.1f}s: {last}"
    summary = outcome.summary
    return (
        f"step {request.global_step}: {len(outcome.records)} queries in {outcome.seconds:.1f}s, confidence "
        f"{pct(summary.confidence)} (95% CI {pct(summary.confidence_ci[0])}-{pct(summary.confidence_ci[1])})"
    )


def describe_weights(folder: Path | None) -> str:
    if folder is None:
        return "the base model"
    if (folder / ADAPTER_CONFIG).is_file():
        return "its adapter"
    return "its weights"


# ---- the loop ----
@dataclass
class Watch:
    run_dir: Path
    subdir: str = "probdiff"
    follow: bool = True  # wait for more requests until training has ended (`training-ended`); else stop when none
    started_by_training: bool = False
    poll_seconds: float = POLL_SECONDS
    helpers_after_training: int = 0  # helper processes once training has queued its last step (CPU, HF engine)


def run_watch(options: Watch) -> int:
    """Evaluate the run's pending requests, and follow it as `options` says; the exit status."""
    parent = os.getppid()
    if options.started_by_training:
        from probdiff_callback.runtime.parent import set_parent_death_signal

        set_parent_death_signal(signal.SIGTERM)  # never outlive training
        if os.getppid() != parent:  # training died before the signal was set
            return 0
    queue = queue_of(options.run_dir, options.subdir)
    lock = hold_evaluator(queue)
    try:
        with StopSignals() as signals:
            try:
                _loop(options, queue, signals)
            except Stopped as stop:
                say(f"{stop} received: stopped; the step in progress stays queued, `probdiff watch` evaluates it")
                return EXIT_ON_SIGNAL[stop.signum]
    finally:
        lock.release()
    return 0


def _threads(device: str) -> None:
    if device == "cpu":
        from probdiff_callback.runtime.threads import configure_threads

        threads, why = configure_threads()
        print(f"{threads} CPU thread{'s' if threads > 1 else ''} ({why})", file=sys.stderr, flush=True)


class Loaded:
    """The base model and (use_vllm) the vLLM engine: loaded when the first request needs them, kept for the next
    ones, loaded again only when a new training start's spec names another model or engine."""

    def __init__(self, queue: Path, device: str) -> None:
        self.queue, self.device = queue, device
        self.weights: Weights | None = None
        self.vllm: VLLMGeneration | None = None
        self._vllm_spec: q.EvaluatorSpec | None = None

    def for_session(self, session: Session) -> tuple[Weights, VLLMGeneration | None]:
        spec = session.spec
        if self.weights is None or self.weights.key != model_key(spec):
            self.close()
            self.weights = None
            gc.collect()
            started = time.perf_counter()
            self.weights = Weights.load(spec, self.device)
            say(f"{spec.model} loaded in {time.perf_counter() - started:.1f}s on {self.device}")
        if self._vllm_spec != spec:
            self.close()
        if session.config.use_vllm and self.vllm is None:
            self.vllm, self._vllm_spec = self._start_vllm(session, self.weights), spec
        return self.weights, self.vllm

    def _start_vllm(self, session: Session, weights: Weights) -> VLLMGeneration:
        from probdiff_callback.core.engines.vllm import VLLMGeneration

        started = time.perf_counter()
        vllm = VLLMGeneration.start(
            session.config,
            weights.base,
            weights.tokenizer,
            lora_rank=session.spec.lora_rank or 0,
            log_dir=self.queue,
            scratch_parent=self.queue,
        )
        say(f"vLLM ({session.config.vllm_mode}) ready in {time.perf_counter() - started:.1f}s")
        return vllm

    def close(self) -> None:
        """Stop the vLLM server this process started, if any."""
        vllm, self.vllm, self._vllm_spec = self.vllm, None, None
        if vllm is not None:
            vllm.close()


def _loop(options: Watch, queue: Path, signals: StopSignals) -> None:
    from probdiff_callback.models import default_device

    session = start_session(options.run_dir, options.subdir, queue, q.read_spec(queue))
    device = default_device()
    _threads(device)
    loaded = Loaded(queue, device)
    ahead: list[Helper] = []  # helper processes started while waiting, for the last step
    try:
        waiting = False
        previous: float | None = None  # the last evaluation's seconds
        while True:
            signals.raise_if_received()
            latest = q.read_spec(queue)
            if latest != session.spec:  # training was started again (resumed): its spec, its history
                say(f"the run was started again from step {latest.started_at_step}: taking its queue over")
                session = start_session(options.run_dir, options.subdir, queue, latest)
                ahead = stop_helpers(ahead)  # they hold the earlier start's settings
            ended = q.training_ended(queue)  # read before the requests: the last request comes before it
            pending = q.pending(queue)
            if pending:
                waiting = False
                helpers = helpers_for(options, device, session, pending[0], ended, previous)
                previous = _evaluate_next(session, loaded, queue, pending, signals, helpers, ahead if helpers else [])
                if helpers:  # used, or stopped as not needed
                    ahead = stop_helpers(ahead)
                continue
            if ended is not None:
                say(f"nothing pending, and training has ended ({ended}): done")
                return
            if not options.follow:
                say("nothing pending: done (--no-follow)")
                return
            ahead = ahead or start_helpers_ahead(options, device, session, previous)
            if not waiting:
                say(
                    f"nothing pending; waiting for training to queue more until it writes {q.ENDED_FILE} "
                    "(--no-follow stops when nothing is pending; SIGTERM or Ctrl-C stops now)"
                )
                waiting = True
            wait_for_training(options.poll_seconds)
    finally:
        stop_helpers(ahead)
        loaded.close()


def wait_for_training(seconds: float) -> None:
    time.sleep(seconds)


def start_helpers_ahead(options: Watch, device: str, session: Session, previous: float | None) -> list[Helper]:
    """While the evaluator waits for training's next step, the helpers the last step will have (`helpers_for`),
    started now: each loads the base model on the evaluator's idle cores instead of on the last evaluation's path
    (10-20 s for smollm2 here), then waits. None until an evaluation has shown they are worth it."""
    import torch

    count = 0 if previous is None else helpers_worth(options, device, session, previous)
    if not count:
        return []
    threads = torch.get_num_threads()
    helpers = [Helper(session, threads) for _ in range(count)]
    many = "1 helper process" if count == 1 else f"{count} helper processes"
    say(f"{many} for the last step started ahead: loading the base model while this one waits for training")
    return helpers


def stop_helpers(helpers: list[Helper]) -> list[Helper]:
    for helper in helpers:
        helper.stop()
    return []


def helpers_for(
    options: Watch, device: str, session: Session, request: q.Request, ended: str | None, previous: float | None
) -> int:
    """Helper processes for `request`: once training has queued its last step or ended (the cores it trained on are
    idle), those `helpers_worth` gives; else none."""
    if not (request.last or ended is not None):
        return 0
    return helpers_worth(options, device, session, previous)


def helpers_worth(options: Watch, device: str, session: Session, previous: float | None) -> int:
    """`helpers_after_training` on the CPU with the HF engine, unless the previous evaluation (`previous` seconds)
    was too short to gain from a helper's start; else none."""
    if device != "cpu" or session.config.use_vllm:
        return 0
    if previous is not None and previous < HELPER_WORTH_SECONDS:
        return 0
    return options.helpers_after_training


def _evaluate_next(
    session: Session,
    loaded: Loaded,
    queue: Path,
    pending: list[q.Request],
    signals,
    helpers: int = 0,
    ahead: list[Helper] | None = None,
) -> float | None:
    """Evaluate the first pending request and record it; its seconds (None when it failed: they tell nothing)."""
    request = pending[0]
    folder = weights_folder(queue, request)
    gone = None if folder is None else weights_gone(folder, request.global_step)
    later = f"; then steps {', '.join(str(r.global_step) for r in pending[1:])}" if len(pending) > 1 else ""
    say(
        f"step {request.global_step} ({request.kind}, {describe_weights(folder)}): evaluating "
        f"{len(session.queries)} queries{later}"
    )
    if gone is not None:
        outcome = Outcome(error=gone)
    else:
        weights, vllm = loaded.for_session(session)
        outcome = evaluate_request(session, weights, vllm, folder, request, helpers, ahead)
    with signals.deferred():
        record(session, queue, request, outcome)
    say(progress_line(request, outcome))
    return outcome.seconds if outcome.error is None else None
