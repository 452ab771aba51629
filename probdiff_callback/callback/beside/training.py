"""The evaluation beside training, training's side: each step the loop would evaluate is queued for an evaluator
process, training never waits for it, and each result is logged where the loop's land when it arrives.

`ProbDiffCallback` decides when a step is evaluated, with the loop's schedule; with `async_eval` its way of evaluating
is `BesideTraining`:

- train begin: the queue taken over and the history read once (a resumed run drops what came after its step; the
  evaluator, the history's one writer, drops its rows), the spec (`spec.py`) and the selected queries written, the
  local evaluator started (`local.py`) unless another evaluator already holds the run's lock (`evaluator=external`:
  none, the user starts it);
- each scheduled step: a request with the Trainer's eval loss and each conversation's, after the step's weights: hard
  links to the checkpoint the Trainer saves at that step, else `Trainer.save_model` into the queue at that hook (on
  every rank: ZeRO-3 gathers there);
- between steps and after each save: the results that arrived, each once, in its done mark (the history is not read
  again), logged at their own steps (`late.py`) with W&B's histogram and table, the pick and the alarm; a dead local
  evaluator started again; rotation (`rotation.py`);
- the end: a wait for what is left, bounded by `end_wait_seconds`, with a progress line, before the Trainer loads the
  best model; a stop signal does not wait, and a resumed run's evaluator evaluates what is left.

Each step's stage (held, queued, done, logged) is one entry of `steps.QueuedSteps`, the same on every rank. Early
stopping and `save_strategy="best"` on a ProbDiff metric need the metric at the evaluation itself and are refused with
async_eval (`schedule.check_selection_setup`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path

from transformers import TrainerControl, TrainerState, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

from probdiff_callback.analysis.pick import GUARDED_KEY
from probdiff_callback.callback.beside.late import log_at_step
from probdiff_callback.callback.beside.local import LocalEvaluator
from probdiff_callback.callback.beside.rotation import rotate
from probdiff_callback.callback.beside.spec import evaluator_spec
from probdiff_callback.callback.beside.steps import QueuedSteps, Stage, describe_steps, several
from probdiff_callback.callback.best import TrainerBest
from probdiff_callback.callback.metrics import logged_steps
from probdiff_callback.callback.outputs import TrainerOutputs
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.evaluator import ABANDONED
from probdiff_callback.core.metric import is_finite
from probdiff_callback.core.queries import Query
from probdiff_callback.runs.checkpoints import weights_problem
from probdiff_callback.runs.queue import Queue, Request, describe_holder, evaluator_holder
from probdiff_callback.runs.run_files import (
    HistoryRow,
    history_path,
    probdiff_dir,
    read_eval_losses,
    read_history,
    read_records,
)

logger = logging.getLogger(__name__)

POLL_SECONDS = 2.0  # how often the end's wait looks for results
PROGRESS_SECONDS = 30.0  # and says what it waits for
IDLE_EXIT_SECONDS = 30.0  # at the end, the local evaluator's time to exit by itself once nothing is pending


class BesideTraining:
    """The evaluation beside training for one `ProbDiffCallback` (see the module's docstring). Every rank calls the
    same methods at the same hooks: weights are saved on every rank, and what the main process reads (results,
    decisions) it hands to the others through `outputs`."""

    def __init__(
        self, trainer, config: ProbDiffConfig, queries: Sequence[Query], outputs: TrainerOutputs, best: TrainerBest
    ) -> None:
        self.trainer, self.config, self.queries, self.outputs = trainer, config, list(queries), outputs
        self.best = best  # the Trainer's best-model record, decided again as results arrive
        self.run_dir = Path(trainer.args.output_dir)
        self.queue = Queue(self.run_dir, config.output_subdir)
        self.directory = probdiff_dir(self.run_dir, config.output_subdir)  # the evaluator writes it; training reads
        self.rows: dict[int, HistoryRow] = {}  # the history as training knows it (main process): kept, then arrived
        self.steps = QueuedSteps()
        self.evaluator: LocalEvaluator | None = None
        self.save_total_limit: int | None = None  # the user's, while rotation is done here
        self.queue_seconds = 0.0  # what queueing cost training: saving or linking the weights
        self.evaluator_seconds: list[float] = []  # each result's evaluation, in the evaluator
        self._deadline: float | None = None
        self._started_at = time.time()  # this training start's

    @property
    def evaluated(self) -> dict[int, dict[str, float]]:
        """The metrics of every step whose result is known, by step."""
        return self.steps.evaluated

    def known(self, step: int) -> bool:
        """The step is queued or evaluated: the schedule does not take it again."""
        return step in self.steps

    def history(self) -> list[HistoryRow]:
        """The history rows training knows so far (main process): those it took over, and each result as it arrived
        (the evaluator writes the file)."""
        return [self.rows[step] for step in sorted(self.rows)]

    # ---- train begin ----
    def begin(self, args: TrainingArguments, state: TrainerState) -> None:
        """Take the queue, the history and the Trainer's rotation over, write the spec, start the evaluator."""
        self.save_total_limit, args.save_total_limit = args.save_total_limit, None
        self._deadline, self._started_at = None, time.time()
        self.steps = self.outputs.broadcast(self._take_over(state) if self.outputs.is_main else None)
        if not self.outputs.is_main:
            return
        if self.config.evaluator == "external":
            logger.info(
                f"ProbDiff: evaluations are queued in {self.queue.folder}: start `probdiff watch {self.run_dir}` to "
                "evaluate them (another node, a SLURM job step; docs/async.md)"
            )
            return
        import torch

        self.evaluator = LocalEvaluator(self.queue, self.config, torch.get_num_threads())
        self.evaluator.start_unless_held()

    def _take_over(self, state: TrainerState) -> QueuedSteps:
        """The queue for a training start at `state.global_step` (main process): a fresh run empties it, a resumed one
        drops what came after its step; the history is read once, never written: the evaluator, its one writer, drops
        the rows of the steps after it when it reads the new spec. Returns the table of the steps kept."""
        step = state.global_step
        history = self.history_on_disk()
        kept = [row for row in history if step > 0 and row.global_step <= step]
        if dropped := len(history) - len(kept):
            logger.warning(
                f"ProbDiff: a new run in {self.run_dir}: the {dropped} rows of an earlier history go (the evaluator "
                "replaces them)"
                if step == 0
                else f"ProbDiff: resumed at step {step}; the {dropped} history rows of later steps go (they are "
                "trained and evaluated again; the evaluator drops them)"
            )
        self.queue.drop_after(step if step > 0 else -1)
        spec = evaluator_spec(self.trainer.model, self.config, self.run_dir, step, self.config.evaluator == "local")
        self.queue.write_spec(spec, self.queries)
        requeued = {r.global_step for r in self.queue.requests()}
        for row in kept:
            if row.abandoned and row.global_step not in requeued:
                self._requeue_abandoned(row, step)
        requests = {r.global_step: r for r in self.queue.requests()}
        rows = {row.global_step: row for row in kept if not row.abandoned}
        self.rows = dict(rows)
        logged = logged_steps(state.log_history)
        steps = QueuedSteps()
        for s in sorted(set(requests) | set(rows)):
            row, request = rows.get(s), requests.get(s)
            metrics = None if row is None else self.outputs.metrics(row.summary, row.vs_base)
            checkpoint = request.checkpoint if request is not None else row.checkpoint  # type: ignore[union-attr]
            stage = Stage.LOGGED if s in logged else Stage.QUEUED if request is not None else Stage.DONE
            steps.set(s, stage, checkpoint=checkpoint, metrics=metrics)
        baseline = next((row for row in rows.values() if row.kind == "baseline" and not row.failed), None)
        if baseline is not None and 0 in logged:
            self.outputs.say_resolution(baseline.confidence)
        if left := [r.global_step for r in self.queue.pending()]:
            them = "them" if several(left) else "it"
            logger.info(f"ProbDiff: {describe_steps(left)} queued before this start: the evaluator takes {them}")
        return steps

    def _requeue_abandoned(self, row: HistoryRow, resumed_step: int) -> None:
        """A row the loop left abandoned (a preemption stopped its evaluation): queued again where its weights are
        still at hand (the base model, or the checkpoint resumed from); else queued to be recorded failed, as in the
        loop (the evaluator writes the history)."""
        if row.base_model or row.global_step == resumed_step:
            losses = self.directory / row.eval_losses if row.eval_losses else None
            request = Request.for_row(row, read_eval_losses(losses) if losses and losses.is_file() else None)
            if not row.base_model:
                checkpoint = row.checkpoint or self.run_dir / f"{PREFIX_CHECKPOINT_DIR}-{row.global_step}"
                self.queue.link_checkpoint(row.global_step, checkpoint)
            logger.warning(f"ProbDiff: queueing step {row.global_step}, abandoned when the run was stopped")
            self.queue.submit(request)
            return
        why = (
            f"{ABANDONED} when the run stopped, and resuming from step {resumed_step} cannot run it: the weights of "
            "its step are gone"
        )
        logger.warning(f"ProbDiff: step {row.global_step}'s evaluation was {why}; it stays failed")
        request = Request.for_row(row, None)
        request.weights, request.failed = None, why
        self.queue.submit(request)

    # ---- a scheduled step ----
    def evaluate(
        self,
        row: HistoryRow,
        eval_losses: list[float] | None,
        control: TrainerControl | None,
        saved_now: bool = False,
    ) -> None:
        """Queue the step of `row` (every rank). The weights: none for the base model; the checkpoint's, linked now
        (`saved_now`: this is its on_save) or at the on_save to come; else `Trainer.save_model` now. Under
        `save_strategy="best"` the Trainer decides after the evaluation whether it saves: the request waits for that
        on_save, or the next step, to name the checkpoint or none."""
        started = time.perf_counter()
        # training's last step: the evaluator may take training's cores for it
        request = Request.for_row(row, eval_losses, last=0 < self.trainer.state.max_steps <= row.global_step)
        args = self.trainer.args
        best_decides = args.save_strategy == SaveStrategy.BEST and not saved_now
        if row.base_model:
            self._submit(request)
        elif saved_now:
            self._link_or_save(request)
            self._submit(request)
        elif row.checkpoint is not None and not best_decides and control is not None and control.should_save:
            self.steps.set(row.global_step, Stage.HELD, request=request, weights_ready=False)
        else:
            self._save_weights(row.global_step)
            if best_decides and row.kind == "evaluate":
                self.steps.set(row.global_step, Stage.HELD, request=request, weights_ready=True)
            else:
                self._submit(request)
        self.queue_seconds += time.perf_counter() - started

    def metrics_at_evaluation(self, step: int) -> dict[str, float]:
        """The metrics the Trainer gets at its evaluation of `step`: the step's, where they have arrived (an
        evaluation after training), else NaN under every key (never the best; the late result sets the best)."""
        known = self.steps[step].metrics if step in self.steps else None
        return dict(known or self.outputs.metrics(None, None))

    def evaluated_before(self, step: int, eval_loss: float, eval_losses: list[float] | None) -> None:
        """The Trainer evaluated a step queued earlier: the request took what there was (nothing to do)."""

    def _link_or_save(self, request: Request) -> None:
        """The step's weights in the queue: hard links to its checkpoint's files, or, where they are not whole weights
        (a checkpoint in another layout), the model saved there."""
        whole = False
        if self.outputs.is_main:
            folder = self.queue.link_checkpoint(request.global_step, request.checkpoint or "")
            whole = weights_problem(folder) is None
        if not self.outputs.broadcast(whole):
            self._save_weights(request.global_step)

    def _save_weights(self, step: int) -> None:
        """`Trainer.save_model` into the step's weights folder, on every rank (ZeRO-3 gathers the weights there); not
        pushed to the hub (`push_to_hub` is off for the call): these weights are the evaluator's."""
        folder = self.queue.weights_path(step)
        if self.outputs.is_main:
            self.queue.empty_weights(step)
        args = self.trainer.args
        push, args.push_to_hub = args.push_to_hub, False
        try:
            self.trainer.save_model(str(folder))
        finally:
            args.push_to_hub = push

    def _submit(self, request: Request) -> None:
        self.steps.set(request.global_step, Stage.QUEUED, checkpoint=request.checkpoint, request=None)
        if self.outputs.is_main:
            self.queue.submit(request)

    # ---- the Trainer saved a checkpoint ----
    def saved(self, args: TrainingArguments, state: TrainerState) -> None:
        """A request held for this step's save is queued with its checkpoint (every rank)."""
        step = state.global_step
        if step not in self.steps or self.steps[step].stage is not Stage.HELD:
            return
        started = time.perf_counter()
        held = self.steps[step]
        request = held.request
        request.checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        if not held.weights_ready:
            self._link_or_save(request)
        self._submit(request)
        self.queue_seconds += time.perf_counter() - started

    def after_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, stopping: bool) -> None:
        """Results logged, rotation; at training's last save (before the Trainer loads the best model; not on a stop
        signal's) the wait for what is left, and the last checkpoint's trainer state written again with the results
        that came after it."""
        self._poll(state)
        if self.outputs.is_main:
            rotate(args.output_dir, self.save_total_limit, state.best_model_checkpoint, self.steps.unlogged())
        if control.should_training_stop and not stopping:
            self.wait(state)
            checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            if self.outputs.is_main and os.path.isdir(checkpoint):
                state.save_to_json(os.path.join(checkpoint, TRAINER_STATE_NAME))

    def _flush_held(self, before_step: int | None = None) -> None:
        """Requests whose step's save is past (every rank): queued as they are, or said lost if their weights were
        to come from a checkpoint that was not saved."""
        for step in self.steps.at(Stage.HELD):
            if before_step is not None and step >= before_step:
                continue
            held = self.steps[step]
            if held.weights_ready:
                held.request.checkpoint = None
                self._submit(held.request)
                continue
            self.steps.set(step, Stage.LOST, request=None)
            if self.outputs.is_main:
                logger.error(
                    f"ProbDiff: step {step} was to be evaluated from its checkpoint, which the Trainer did not save; "
                    "it is not evaluated"
                )

    # ---- late results ----
    def between_steps(self, args: TrainingArguments, state: TrainerState) -> None:
        self._poll(state)

    def _poll(self, state: TrainerState) -> int:
        """Log the results that arrived since the last look (every rank, at the same hook); restart a dead local
        evaluator. Returns how many queued steps still await their result."""
        self._flush_held(before_step=state.global_step + 1)  # between steps: the last step's save is past
        arrived, left = [], 0
        if self.outputs.is_main:
            arrived = self._arrived()
            left = len(self.steps.awaited()) - len(arrived)
            if self.evaluator is not None and left:
                self.evaluator.check()
        arrived, left = self.outputs.broadcast((arrived, left))
        if arrived:  # the pick over every step logged so far and those that arrived now
            known = {row.global_step for row, _ in arrived} | set(self.steps.at(Stage.LOGGED))
            self.best.decide(
                [row for row in self.history() if row.global_step in known] if self.outputs.is_main else None
            )
        for row, seconds in arrived:
            self._apply(row, seconds)
        if arrived:
            self.best.apply()
        if arrived and self.outputs.is_main:
            rows = self.history()
            self.outputs.say_disagreements(rows, self.best.alarm_pick(rows))
        return left

    def _arrived(self) -> list[tuple[HistoryRow, float | None]]:
        """(the row the evaluator wrote, what it took: None for a result of an earlier training start) of each step
        that arrived since the last look (main process): each queued step's done mark, new ones only, holds its row;
        a step done before this start has its row from the history read then."""
        marks = {s: self.queue.done(s) for s in self.steps.at(Stage.QUEUED)}
        ready = [s for s in self.steps.awaited() if self.steps[s].stage is Stage.DONE or marks.get(s) is not None]
        history = None  # read only for marks an evaluator from before done marks held rows wrote
        arrived = []
        for step in ready:
            mark, seconds = marks.get(step), None
            if mark is None:
                row = self.rows[step]
            elif mark.row is not None:
                row = HistoryRow.from_json(mark.row)
            else:
                history = history if history is not None else {r.global_step: r for r in self.history_on_disk()}
                error = f"the evaluator marked step {step} done without its row, and the history has none for it"
                row = history.get(step) or HistoryRow(step, error=error)
            if mark is not None and mark.finished_at >= self._started_at:  # not a result logged again on resuming
                seconds = float(mark.seconds) if is_finite(mark.seconds) else float(row.seconds)
            self.rows[step] = row
            arrived.append((row, seconds))
        return arrived

    def history_on_disk(self) -> list[HistoryRow]:
        return read_history(history_path(self.run_dir, self.config.output_subdir))

    def _apply(self, row: HistoryRow, seconds: float | None) -> None:
        """A late result where the loop's land (every rank): the Trainer's log and its integrations at the result's
        step (with the guard's decision on it), W&B's histogram and table."""
        metrics = self.outputs.metrics(row.summary, row.vs_base)
        if GUARDED_KEY in metrics:
            metrics[GUARDED_KEY] = self.best.value_at(row.global_step)
        self.steps.set(row.global_step, Stage.LOGGED, metrics=metrics)
        log_at_step(self.trainer, row.global_step, row.epoch, metrics)
        error = row.error if row.failed else None
        if self.outputs.is_main:
            if seconds is not None:
                self.evaluator_seconds.append(seconds if math.isfinite(seconds) else 0.0)
            if row.kind == "baseline":
                self.outputs.say_resolution(row.confidence)
            if error is not None:
                logger.error(f"ProbDiff evaluation at step {row.global_step} failed (in the evaluator):\n{error}")
            elif row.records is not None:
                records = self.directory / row.records
                self.outputs.to_wandb(row.global_step, lambda: read_records(records))
        if error is not None and self.config.fail_on_error:
            raise RuntimeError(f"ProbDiff evaluation at step {row.global_step} failed (fail_on_error=True):\n{error}")

    # ---- the end ----
    def wait(self, state: TrainerState) -> None:
        """Every rank: log results until none is awaited, `end_wait_seconds` (from the first wait) are up, or nothing
        is left to evaluate them; a progress line on the main process."""
        self._flush_held()
        if self.outputs.is_main:
            self.queue.mark_ended("completed")
        limit = self.config.end_wait_seconds
        started = time.monotonic()
        if self._deadline is None:
            self._deadline = started + (math.inf if limit is None else limit)
        said_at = -math.inf
        while left := self._poll(state):
            stop = False
            if self.outputs.is_main:
                now = time.monotonic()
                stop = now >= self._deadline or (self.evaluator is not None and self.evaluator.gave_up)
                if not stop and now - said_at >= PROGRESS_SECONDS:
                    said_at = now
                    bound = "until they are done" if limit is None else f"up to {limit:g}s (end_wait_seconds)"
                    nobody = (
                        f"; no evaluator is running: start `probdiff watch {self.run_dir}`"
                        if evaluator_holder(self.queue) is None and not self._local_running()
                        else ""
                    )
                    logger.info(
                        f"ProbDiff: waiting for {left} evaluation{'s' if left > 1 else ''} "
                        f"({describe_steps(self.steps.awaited())}) before training ends: {now - started:.0f}s so far, "
                        f"{bound}{nobody}"
                    )
            if self.outputs.broadcast(stop):
                return
            time.sleep(POLL_SECONDS)

    def _local_running(self) -> bool:
        """The local evaluator's process is alive (it may not hold the lock yet: it is loading)."""
        return self.evaluator is not None and self.evaluator.running()

    def end(self, args: TrainingArguments, state: TrainerState, stopped: bool) -> None:
        """Training ends (every rank): without a stop, what is left is waited for (see `wait`); the evaluator is
        stopped, the user's `save_total_limit` applied and put back, and what is left unevaluated said."""
        if stopped:
            self._flush_held()
            if self.outputs.is_main:
                self.queue.mark_ended("stopped")
            self._poll(state)
        else:
            self.wait(state)
        args.save_total_limit = self.save_total_limit
        if not self.outputs.is_main:
            return
        awaited = self.steps.awaited()
        if self.evaluator is not None:
            self.evaluator.stop(grace=0.0 if stopped or awaited else IDLE_EXIT_SECONDS)
        rotate(args.output_dir, self.save_total_limit, state.best_model_checkpoint, self.steps.unlogged())
        if not awaited:
            return
        steps, them = describe_steps(awaited), "them" if several(awaited) else "it"
        holder = evaluator_holder(self.queue)
        if stopped:
            stay = "stay" if several(awaited) else "stays"
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
            "(saving or linking the weights)"
        )
        if awaited := self.steps.awaited():
            text += f"; {describe_steps(awaited)} not evaluated yet"
        return text
