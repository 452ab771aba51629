"""The evaluation beside training (`async_eval`): training queues each step the loop would evaluate for an evaluator
process, never waits for it, and logs its results when they arrive.

`ProbDiffCallback` decides when a step is evaluated, with the loop's schedule; with `async_eval` it hands the step to
`BesideTraining`, which owns the rest:

- the queue (`runs/queue.py`): the spec and the selected queries at train begin, then a request per step with the
  Trainer's eval loss and each conversation's, after the step's weights: hard links to the checkpoint the Trainer saves
  at that step, else `Trainer.save_model` into the queue at that hook (on every rank: ZeRO-3 gathers there);
- the local evaluator (`evaluator_process`: `probdiff watch RUN_DIR --started-by-training`): started at train begin
  unless another evaluator already holds the run's lock (`evaluator=external`: none, the user starts it), started again
  when it dies with work left (a few times, then the user is told the command), stopped at the end;
- late results: each done step's history row (the evaluator is the history's one writer) logged at its own step
  through the Trainer's `log` with its step set to it for the call (the log history, W&B's `train/global_step` step
  metric, every `report_to`), W&B's histogram and table, the best-model record as the Trainer would have set it,
  and the disagreement alarm;
- rotation: with `save_total_limit` the Trainer's own rotation is off (its limit is kept here and put back at the end)
  and the oldest checkpoints are deleted except the newest, the best and those whose step awaits its result;
- the end: a wait for what is left, bounded by `end_wait_seconds`, with a progress line, before the Trainer loads the
  best model; a preemption's stop does not wait, and a resumed run's evaluator evaluates what is left.

The metric the Trainer selects by does not exist yet when it evaluates: its metrics get NaN under every ProbDiff key
(`_determine_best_metric` raises on a missing key, and NaN is never best), and the late result sets `best_metric`,
`best_global_step` and `best_model_checkpoint`. Early stopping and `save_strategy="best"` on a ProbDiff metric need
the metric at the evaluation itself and are refused with async_eval (`schedule.check_selection_setup`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, sort_checkpoints

from probdiff_callback.analysis.report import resolution_line
from probdiff_callback.callback.alerts import DisagreementAlerts
from probdiff_callback.callback.eval_losses import ExampleLosses
from probdiff_callback.callback.evaluator_process import LocalEvaluator, describe_steps, several
from probdiff_callback.callback.ranks import broadcast, is_zero3
from probdiff_callback.callback.wandb_records import WandbRecords
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.evaluator import ABANDONED
from probdiff_callback.core.metric import is_finite
from probdiff_callback.core.queries import Query
from probdiff_callback.core.records import Comparison, Summary
from probdiff_callback.runs import queue as q
from probdiff_callback.runs.checkpoints import weights_problem
from probdiff_callback.runs.evaluator_lock import describe_holder, evaluator_holder
from probdiff_callback.runs.run_files import HistoryRow, RunFiles, read_eval_losses, read_history, read_records

logger = logging.getLogger(__name__)

POLL_SECONDS = 2.0  # how often the end's wait looks for results
PROGRESS_SECONDS = 30.0  # and says what it waits for
IDLE_EXIT_SECONDS = 30.0  # at the end, the local evaluator's time to exit by itself once nothing is pending
# What an evaluator needs of a checkpoint (the adapter or the whole model); `model*.safetensors` shards besides
CHECKPOINT_WEIGHT_FILES = (
    "adapter_model.safetensors",
    "adapter_model.bin",
    "adapter_config.json",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "config.json",
    "generation_config.json",
)


# ---- what training tells the evaluator ----
def base_model_of(model) -> Any:
    """The model whose weights every request starts from: a PEFT model's base, else the model itself."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) and hasattr(model, "peft_config") else model


def lora_rank_of(model) -> int | None:
    """The rank of the model's active LoRA adapter (vLLM sizes its LoRA slots by it); None without one."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or not configs:
        return None
    active = getattr(model, "active_adapter", None)
    config = configs.get(active) if isinstance(active, str) else None
    rank = getattr(config if config is not None else next(iter(configs.values())), "r", None)
    return rank if isinstance(rank, int) else None


def evaluator_spec(model, config: ProbDiffConfig, run_dir: Path, started_at_step: int, local: bool) -> q.EvaluatorSpec:
    """The spec of this training start: the base model's folder and dtype, the settings, the step it starts from."""
    base = base_model_of(model)
    return q.EvaluatorSpec(
        model=str(base.name_or_path),
        dtype=str(base.dtype).removeprefix("torch."),
        config=asdict(config),
        output_dir=str(run_dir),
        started_at_step=started_at_step,
        training_pid=os.getpid() if local else None,
        lora_rank=lora_rank_of(model),
    )


def checkpoint_weight_files(checkpoint: Path) -> list[str]:
    """The names of a checkpoint's weight and config files (an adapter, or the whole model and its shards)."""
    names = set(os.listdir(checkpoint)) if checkpoint.is_dir() else set()
    shards = {n for n in names if n.startswith("model") and n.endswith(".safetensors")}
    return sorted((names & set(CHECKPOINT_WEIGHT_FILES)) | shards)


def whole_weights_problem(accelerator) -> str | None:
    """Why the weights saved at a step would not be whole (the evaluator loads them): ZeRO-3 gathers them for a save
    only with `stage3_gather_16bit_weights_on_model_save`; else None."""
    if not is_zero3(accelerator):
        return None
    plugin = accelerator.state.deepspeed_plugin
    zero = (plugin.deepspeed_config or {}).get("zero_optimization", {})
    if plugin.zero3_save_16bit_model or zero.get("stage3_gather_16bit_weights_on_model_save") is True:
        return None
    return (
        "ProbDiff: async_eval under ZeRO-3 needs whole weights at every queued step: set "
        "zero_optimization.stage3_gather_16bit_weights_on_model_save: true (accelerate: zero3_save_16bit_model: true)"
    )


def finite_or_none(values: Iterable[float]) -> list[float | None]:
    return [float(v) if is_finite(v) else None for v in values]


def request_for(row: HistoryRow, eval_losses: list[float | None] | None) -> q.Request:
    """The request for the step of `row`: its weights in the step's queue folder (none for the base model)."""
    return q.Request(
        global_step=row.global_step,
        epoch=row.epoch,
        kind=row.kind,
        base_model=row.base_model,
        checkpoint=row.checkpoint,
        weights=None if row.base_model else q.WEIGHTS_DIR,
        eval_loss=row.eval_loss if is_finite(row.eval_loss) else None,
        eval_losses=eval_losses,
    )


def write_training_ended(queue: Path, how: str) -> None:
    """Tell the evaluator that training queues nothing more (`how`: completed or stopped)."""
    queue.mkdir(parents=True, exist_ok=True)
    (queue / q.ENDED_FILE).write_text(how + "\n", encoding="utf-8")


# ---- late results ----
@dataclass
class LateResult:
    """A step's evaluation as the evaluator wrote it: what every rank logs."""

    step: int
    epoch: float | None
    kind: str
    metrics: dict[str, float]
    error: str | None
    confidence: float
    records: str | None  # the step's records file, relative to the probdiff directory (W&B's histogram and table)
    seconds: float | None  # what the evaluator took, for an evaluation since this training start (else None)


@contextlib.contextmanager
def at_step(state: TrainerState, step: int, epoch: float | None) -> Iterator[None]:
    """The Trainer's state at `step` for a call that logs there (`trainer.log` stamps the state's step and epoch)."""
    saved = state.global_step, state.epoch
    state.global_step, state.epoch = step, epoch
    try:
        yield
    finally:
        state.global_step, state.epoch = saved


def move_into_step_order(log_history: list[dict], entry_index: int = -1) -> None:
    """The entry logged last put among the others by its step (after those of the same step)."""
    entry = log_history.pop(entry_index)
    position = next((i for i, e in enumerate(log_history) if e.get("step", 0) > entry["step"]), len(log_history))
    log_history.insert(position, entry)


def record_best_at(state: TrainerState, args: TrainingArguments, metrics: Mapping[str, float], step: int) -> bool:
    """`state.best_metric` and `best_global_step` after `metrics` of `step` arrived late, as the Trainer would have set
    them had they come in order: a strictly better value wins, an equal one only from an earlier step (the Trainer
    keeps the first of equals; so does `probdiff select`), NaN never. Returns whether the step is the best now."""
    name = args.metric_for_best_model
    if name is None:
        return False
    value = metrics.get(name if name.startswith("eval_") else f"eval_{name}")
    if not is_finite(value):
        return False
    better = operator.gt if args.greater_is_better else operator.lt
    best, best_step = state.best_metric, state.best_global_step
    tie_earlier = value == best and best_step is not None and step < best_step
    if best is not None and not better(value, best) and not tie_earlier:
        return False
    state.best_metric = value
    if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST):
        state.best_global_step = step
    return True


def logged_steps(log_history: Iterable[Mapping]) -> set[int]:
    """The steps whose ProbDiff metrics the Trainer's log holds."""
    return {e["step"] for e in log_history if "eval_probdiff_confidence" in e and "step" in e}


@dataclass
class Held:
    """A step queued at a hook whose request waits for the Trainer's save of that step (`weights_ready`: its weights
    are in the queue already; else they are linked from the checkpoint then)."""

    request: q.Request
    weights_ready: bool


class BesideTraining:
    """The queue, the local evaluator and the late results of one `ProbDiffCallback` with `async_eval`.

    Every rank calls the same methods at the same hooks (`queue`, `saved`, `poll`, `wait`, `end`): weights are saved
    on every rank, and what the main process reads (results, decisions) it hands to the others."""

    def __init__(
        self,
        trainer,
        config: ProbDiffConfig,
        queries: Sequence[Query],
        metrics_of: Callable[[Summary | None, Comparison | None], dict[str, float]],
    ) -> None:
        self.trainer, self.config, self.queries, self.metrics_of = trainer, config, list(queries), metrics_of
        self.run_dir = Path(trainer.args.output_dir)
        self.queue_path = q.queue_dir(self.run_dir, config.output_subdir)
        self.files = RunFiles(self.run_dir, config.output_subdir)
        self.evaluated: dict[int, dict[str, float]] = {}  # step -> its metrics, as they arrived (every rank)
        self.known: set[int] = set()  # steps queued or evaluated: the schedule does not queue them again
        self.awaiting: dict[int, str | None] = {}  # main: step -> its checkpoint, queued and not logged yet
        self.relog: set[int] = set()  # main: steps whose row is there without a request (written before this start)
        self.held: dict[int, Held] = {}
        self.evaluator: LocalEvaluator | None = None
        self.save_total_limit: int | None = None  # the user's, while this class rotates
        self.queue_seconds = 0.0  # what queueing cost training: weights, each conversation's eval loss
        self.evaluator_seconds: list[float] = []  # each result's evaluation, in the evaluator
        self._deadline: float | None = None
        self._started_at = time.time()  # this training start's
        self._resolution_said = False
        self._wandb = WandbRecords(config.wandb_table_rows)
        self._alerts = DisagreementAlerts()

    def _is_main(self) -> bool:
        return self.trainer.state.is_world_process_zero

    def _broadcast(self, value):
        return broadcast(self.trainer.accelerator, value)

    # ---- train begin ----
    def begin(self, args: TrainingArguments, state: TrainerState) -> None:
        """Take the queue and the Trainer's rotation over, write the spec, start the evaluator (main process)."""
        if problem := whole_weights_problem(self.trainer.accelerator):
            raise ValueError(problem)
        self.save_total_limit, args.save_total_limit = args.save_total_limit, None
        self._deadline, self._started_at = None, time.time()
        known, evaluated = self._take_over(args, state) if self._is_main() else (set(), {})
        self.known, self.evaluated = self._broadcast((known, evaluated))
        if not self._is_main():
            return
        if self.config.evaluator == "external":
            logger.info(
                f"ProbDiff: evaluations are queued in {self.queue_path}: start `probdiff watch {self.run_dir}` to "
                "evaluate them (another node, a SLURM job step; docs/async.md)"
            )
            return
        import torch

        self.evaluator = LocalEvaluator(self.run_dir, self.queue_path, self.config, torch.get_num_threads())
        self.evaluator.start_unless_held()

    def _take_over(self, args: TrainingArguments, state: TrainerState) -> tuple[set[int], dict[int, dict[str, float]]]:
        """The queue and history for a training start at `state.global_step` (main process): a fresh run empties
        both; a resumed one drops what came after its step (the history only while no evaluator holds it: a running
        one drops those rows itself when it reads the new spec). Returns (steps known, their metrics)."""
        step, queue = state.global_step, self.queue_path
        holder = evaluator_holder(queue)
        if holder is None:
            kept, dropped = self.files.continue_from(step)
            if dropped:
                logger.warning(
                    f"ProbDiff: a new run in {self.run_dir}: replacing the {dropped} rows of an earlier history"
                    if step == 0
                    else f"ProbDiff: resumed at step {step}; dropped {dropped} history rows of later steps (they are "
                    "trained and evaluated again)"
                )
        else:
            kept = [row for row in read_history(self.files.history_path) if step > 0 and row.global_step <= step]
        q.drop_after(queue, step if step > 0 else -1)
        (queue / q.ENDED_FILE).unlink(missing_ok=True)
        spec = evaluator_spec(self.trainer.model, self.config, self.run_dir, step, self.config.evaluator == "local")
        q.write_spec(queue, spec, self.queries)
        requests = {r.global_step: r for r in q.requests(queue)}
        logged = logged_steps(state.log_history)
        for row in kept:
            if row.abandoned and row.global_step not in requests:
                self._requeue_abandoned(row, step, holder is None)
        requests = {r.global_step: r for r in q.requests(queue)}
        rows = {row.global_step: row for row in kept if not row.abandoned}
        self.awaiting = {
            s: (requests[s].checkpoint if s in requests else rows[s].checkpoint)
            for s in (set(requests) | set(rows)) - logged
        }
        self.relog = {s for s in rows if s in self.awaiting and s not in requests}
        baseline = next((row for row in rows.values() if row.kind == "baseline" and not row.failed), None)
        if baseline is not None and 0 in logged:
            self._say_resolution(baseline.confidence)
        if left := [r.global_step for r in q.pending(queue)]:
            them = "them" if several(left) else "it"
            logger.info(f"ProbDiff: {describe_steps(left)} queued before this start: the evaluator takes {them}")
        metrics = {s: self.metrics_of(row.summary, row.vs_base) for s, row in rows.items()}
        return set(rows) | set(requests), metrics

    def _requeue_abandoned(self, row: HistoryRow, resumed_step: int, may_write: bool) -> None:
        """A row the loop left abandoned (a preemption stopped its evaluation): queued again where its weights are
        still at hand (the base model, or the checkpoint resumed from); else it stays failed, as in the loop."""
        if row.base_model or row.global_step == resumed_step:
            losses = self.files.directory / row.eval_losses if row.eval_losses else None
            request = request_for(
                row, finite_or_none(read_eval_losses(losses)) if losses and losses.is_file() else None
            )
            checkpoint = Path(row.checkpoint or self.run_dir / f"{PREFIX_CHECKPOINT_DIR}-{row.global_step}")
            if not row.base_model:
                q.link_files(
                    checkpoint, q.weights_dir(self.queue_path, row.global_step), checkpoint_weight_files(checkpoint)
                )
            logger.warning(f"ProbDiff: queueing step {row.global_step}, abandoned when the run was stopped")
            q.submit(self.queue_path, request)
            return
        why = (
            f"{ABANDONED} when the run stopped, and resuming from step {resumed_step} cannot run it: the weights of "
            "its step are gone"
        )
        logger.warning(f"ProbDiff: step {row.global_step}'s evaluation was {why}; it stays failed")
        if may_write:
            row.error, row.abandoned = why, False
            self.files.add(row, None)

    # ---- queueing ----
    def queue(
        self,
        row: HistoryRow,
        example_losses: ExampleLosses | None,
        args: TrainingArguments,
        control: TrainerControl | None,
        saved_now: bool = False,
    ) -> None:
        """Queue the step of `row` (every rank). The weights: none for the base model; the checkpoint's, linked now
        (`saved_now`: this is its on_save) or at the on_save to come; else `Trainer.save_model` now. Under
        `save_strategy="best"` the Trainer decides after the evaluation whether it saves: the request waits for that
        on_save, or the next step, to name the checkpoint or none."""
        started = time.perf_counter()
        losses = None if example_losses is None else finite_or_none(example_losses.losses)
        request = request_for(row, losses)
        request.last = 0 < self.trainer.state.max_steps <= row.global_step  # the evaluator may take training's cores
        self.known.add(row.global_step)
        best_decides = args.save_strategy == SaveStrategy.BEST and not saved_now
        if row.base_model:
            self._submit(request)
        elif saved_now:
            self._link_or_save(request)
            self._submit(request)
        elif row.checkpoint is not None and not best_decides and control is not None and control.should_save:
            self.held[row.global_step] = Held(request, weights_ready=False)
        else:
            self._save_weights(row.global_step)
            if best_decides and row.kind == "evaluate":
                self.held[row.global_step] = Held(request, weights_ready=True)
            else:
                self._submit(request)
        self.queue_seconds += time.perf_counter() - started + (example_losses.seconds if example_losses else 0.0)

    def saved(self, args: TrainingArguments, state: TrainerState) -> None:
        """The Trainer saved the checkpoint of this step (every rank): a request waiting for it is queued."""
        held = self.held.pop(state.global_step, None)
        if held is None:
            return
        started = time.perf_counter()
        held.request.checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if not held.weights_ready:
            self._link_or_save(held.request)
        self._submit(held.request)
        self.queue_seconds += time.perf_counter() - started

    def _flush_held(self, before_step: int | None = None) -> None:
        """Requests whose step's save is past (every rank): queued as they are, or said lost if their weights were
        to come from a checkpoint that was not saved."""
        for step in sorted(s for s in self.held if before_step is None or s < before_step):
            held = self.held.pop(step)
            if held.weights_ready:
                held.request.checkpoint = None
                self._submit(held.request)
            elif self._is_main():
                logger.error(
                    f"ProbDiff: step {step} was to be evaluated from its checkpoint, which the Trainer did not save; "
                    "it is not evaluated"
                )

    def _link_or_save(self, request: q.Request) -> None:
        """The step's weights in the queue: hard links to its checkpoint's files, or, where they are not whole weights
        (a checkpoint in another layout), the model saved there."""
        whole = False
        if self._is_main():
            checkpoint = Path(request.checkpoint or "")
            folder = q.weights_dir(self.queue_path, request.global_step)
            q.link_files(checkpoint, folder, checkpoint_weight_files(checkpoint))
            whole = weights_problem(folder) is None
        if not self._broadcast(whole):
            self._save_weights(request.global_step)

    def _save_weights(self, step: int) -> None:
        """`Trainer.save_model` into the step's weights folder, on every rank (ZeRO-3 gathers the weights there); not
        pushed to the hub (`push_to_hub` is off for the call): these weights are the evaluator's."""
        folder = q.step_dir(self.queue_path, step) / q.WEIGHTS_DIR
        if self._is_main():
            q.weights_dir(self.queue_path, step)
        args = self.trainer.args
        push, args.push_to_hub = args.push_to_hub, False
        try:
            self.trainer.save_model(str(folder))
        finally:
            args.push_to_hub = push

    def _submit(self, request: q.Request) -> None:
        if not self._is_main():
            return
        (self.queue_path / q.ENDED_FILE).unlink(missing_ok=True)  # training queues again: it has not ended
        q.submit(self.queue_path, request)
        self.awaiting[request.global_step] = request.checkpoint

    # ---- late results ----
    def poll(self, state: TrainerState) -> int:
        """Log the results that arrived since the last poll (every rank, at the same hook); restart a dead local
        evaluator. Returns how many queued steps still await their result."""
        self._flush_held(before_step=state.global_step + 1)  # between steps: the last step's save is past
        arrived, left = [], 0
        if self._is_main():
            arrived = self._arrived()
            left = len(self.awaiting)
            if self.evaluator is not None and left:
                self.evaluator.check(lambda: q.pending(self.queue_path))
        arrived, left = self._broadcast((arrived, left))
        for result in arrived:
            self._apply(result)
        if arrived and self._is_main():
            self._say_disagreements()
        return left

    def _arrived(self) -> list[LateResult]:
        """The queued steps the evaluator marked done, from its history rows (main process)."""
        ready = [s for s in sorted(self.awaiting) if s in self.relog or q.done(self.queue_path, s) is not None]
        if not ready:
            return []
        rows = {row.global_step: row for row in read_history(self.files.history_path)}
        arrived = []
        for step in ready:
            row = rows.get(step)
            del self.awaiting[step]
            self.relog.discard(step)
            if row is None:
                error = f"the evaluator marked step {step} done, but {self.files.history_path} has no row for it"
                row = HistoryRow(step, error=error)
            mark = q.done(self.queue_path, step)
            seconds = None
            if mark is not None and mark.finished_at >= self._started_at:  # not a result logged again on resuming
                seconds = float(mark.seconds) if is_finite(mark.seconds) else float(row.seconds)
            arrived.append(
                LateResult(
                    step=step,
                    epoch=row.epoch,
                    kind=row.kind,
                    metrics=self.metrics_of(row.summary, row.vs_base),
                    error=row.error if row.failed else None,
                    confidence=row.confidence,
                    records=row.records if not row.failed else None,
                    seconds=seconds,
                )
            )
        return arrived

    def _apply(self, result: LateResult) -> None:
        """A late result where the loop's land (every rank): the Trainer's log and its integrations at the result's
        step, the best-model record, W&B's histogram and table."""
        trainer = self.trainer
        self.evaluated[result.step] = result.metrics
        # The Trainer's own `log`: a subclass's additions (trl's training metrics gathered since its last log) stay
        # for the Trainer's next log, at its own step.
        with at_step(trainer.state, result.step, result.epoch):
            Trainer.log(trainer, dict(result.metrics))
        move_into_step_order(trainer.state.log_history)
        # the baseline is no checkpoint: `probdiff select` ranks the training steps only, and so does the record
        if result.kind != "baseline" and record_best_at(trainer.state, trainer.args, result.metrics, result.step):
            best = os.path.join(trainer.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.best_global_step}")
            if os.path.isdir(best):
                trainer.state.best_model_checkpoint = best
        if self._is_main():
            if result.seconds is not None:
                self.evaluator_seconds.append(result.seconds if math.isfinite(result.seconds) else 0.0)
            if result.kind == "baseline":
                self._say_resolution(result.confidence)
            if result.error is not None:
                logger.error(f"ProbDiff evaluation at step {result.step} failed (in the evaluator):\n{result.error}")
            elif result.records is not None and "wandb" in (trainer.args.report_to or []):
                try:
                    self._wandb.log(result.step, read_records(self.files.directory / result.records))
                except Exception:  # the scalars went through trainer.log; the extras are not worth the run
                    logger.exception(f"ProbDiff: logging the histogram and table of step {result.step} to W&B failed")
        if result.error is not None and self.config.fail_on_error:
            raise RuntimeError(
                f"ProbDiff evaluation at step {result.step} failed (fail_on_error=True):\n{result.error}"
            )

    def _say_resolution(self, confidence: float | None) -> None:
        if not self._resolution_said:
            self._resolution_said = True
            logger.info(resolution_line(len(self.queries), confidence if is_finite(confidence) else None))

    def _say_disagreements(self) -> None:
        rows = read_history(self.files.history_path)
        to_wandb = "wandb" in (self.trainer.args.report_to or [])
        self._alerts.announce(rows, str(self.run_dir), to_wandb, self.config.output_subdir)

    def placeholders(self, step: int) -> dict[str, float]:
        """The metrics the Trainer gets at its evaluation of `step`: the step's, where they have arrived (an
        evaluation after training), else NaN under every key (never the best; the late result sets the best)."""
        return dict(self.evaluated.get(step) or self.metrics_of(None, None))

    # ---- rotation ----
    def rotate(self, args: TrainingArguments, state: TrainerState) -> None:
        """`save_total_limit` as the Trainer applies it, but never deleting a checkpoint whose step awaits its result
        or is held for its save (main process)."""
        limit = self.save_total_limit
        if not self._is_main() or limit is None or limit <= 0:
            return
        checkpoints = sort_checkpoints(args.output_dir)
        if len(checkpoints) <= limit:
            return
        protected = {Path(checkpoints[-1]).name}
        if state.best_model_checkpoint is not None:
            protected.add(Path(state.best_model_checkpoint).name)
        protected |= {f"{PREFIX_CHECKPOINT_DIR}-{s}" for s in [*self.awaiting, *self.held]}
        remaining = len(checkpoints)
        for checkpoint in checkpoints:
            if remaining <= max(limit, len(protected)):
                break
            if Path(checkpoint).name in protected:
                continue
            logger.info(
                f"ProbDiff: deleting {checkpoint} (save_total_limit={limit}; kept: the newest, the best and those "
                "awaiting their evaluation)"
            )
            shutil.rmtree(checkpoint, ignore_errors=True)
            remaining -= 1

    # ---- the end ----
    def wait(self, state: TrainerState) -> None:
        """Every rank: log results until none is awaited, `end_wait_seconds` (from the first wait) are up, or nothing
        is left to evaluate them; a progress line on the main process."""
        self._flush_held()
        if self._is_main():
            write_training_ended(self.queue_path, "completed")
        limit = self.config.end_wait_seconds
        started = time.monotonic()
        if self._deadline is None:
            self._deadline = started + (math.inf if limit is None else limit)
        said_at = -math.inf
        while left := self.poll(state):
            stop = False
            if self._is_main():
                now = time.monotonic()
                stop = now >= self._deadline or (self.evaluator is not None and self.evaluator.gave_up)
                if not stop and now - said_at >= PROGRESS_SECONDS:
                    said_at = now
                    bound = "until they are done" if limit is None else f"up to {limit:g}s (end_wait_seconds)"
                    nobody = (
                        f"; no evaluator is running: start `probdiff watch {self.run_dir}`"
                        if evaluator_holder(self.queue_path) is None and not self._local_running()
                        else ""
                    )
                    logger.info(
                        f"ProbDiff: waiting for {left} evaluation{'s' if left > 1 else ''} "
                        f"({describe_steps(self.awaiting)}) before training ends: {now - started:.0f}s so far, {bound}"
                        f"{nobody}"
                    )
            if self._broadcast(stop):
                return
            time.sleep(POLL_SECONDS)

    def rewrite_trainer_state(self, checkpoint: str, state: TrainerState) -> None:
        """The last checkpoint's `trainer_state.json` again, now that the results that came after its save are in the
        state: its log history and `best_model_checkpoint` agree with the run's, as a checkpoint's do in the loop."""
        if self._is_main() and os.path.isdir(checkpoint):
            state.save_to_json(os.path.join(checkpoint, TRAINER_STATE_NAME))

    def _local_running(self) -> bool:
        """The local evaluator's process is alive (it may not hold the lock yet: it is loading)."""
        return self.evaluator is not None and self.evaluator.running()

    def end(self, args: TrainingArguments, state: TrainerState, stopped: bool) -> None:
        """Training ends (every rank): without a stop, what is left is waited for (see `wait`); the evaluator is
        stopped, the user's `save_total_limit` applied and put back, and what is left unevaluated said."""
        if stopped:
            self._flush_held()
            if self._is_main():
                write_training_ended(self.queue_path, "stopped")
            self.poll(state)
        else:
            self.wait(state)
        args.save_total_limit = self.save_total_limit
        if not self._is_main():
            return
        if self.evaluator is not None:
            self.evaluator.stop(grace=0.0 if stopped or self.awaiting else IDLE_EXIT_SECONDS)
        self.rotate(args, state)
        if not self.awaiting:
            return
        steps, many = describe_steps(self.awaiting), several(self.awaiting)
        them = "them" if many else "it"
        holder = evaluator_holder(self.queue_path)
        if stopped:
            stay = "stay" if many else "stays"
            logger.info(f"ProbDiff: {steps} {stay} queued: resuming the run evaluates {them} (or `probdiff watch "
                        f"{self.run_dir}`)")  # fmt: skip
        elif holder is not None:
            who = describe_holder(holder)
            logger.info(f"ProbDiff: {steps} not evaluated yet: the evaluator ({who}) goes on with {them}")
        else:
            logger.warning(f"ProbDiff: {steps} not evaluated yet: `probdiff watch {self.run_dir}` evaluates {them}")

    def summary(self) -> str | None:
        """What evaluating beside training cost, for the end of the run."""
        n = len(self.evaluator_seconds)
        text = (
            f"ProbDiff beside training: {n} evaluation{'s' if n != 1 else ''} took the evaluator "
            f"{sum(self.evaluator_seconds) / 60:.1f} min; queueing them took training {self.queue_seconds:.1f}s "
            "(weights, each conversation's eval loss)"
        )
        if self.awaiting:
            text += f"; {describe_steps(self.awaiting)} not evaluated yet"
        return text
