"""The evaluation in the training loop (the default): at each scheduled step training waits while every rank
evaluates its share of the queries (`trainer_evaluation`), and the outcome goes to the Trainer, W&B and the run's
files at once. A stop signal during an evaluation abandons it: the Trainer saves that step and stops, and the resumed
run evaluates the step (`complete_resumed_step`). `cost` measures what evaluating adds to the run's time.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from transformers import TrainerControl, TrainerState, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from probdiff_callback.analysis.pick import GUARDED_KEY
from probdiff_callback.callback.best import TrainerBest
from probdiff_callback.callback.cost import CostReport
from probdiff_callback.callback.metrics import logged_steps
from probdiff_callback.callback.outputs import TrainerOutputs
from probdiff_callback.callback.ranks import any_error
from probdiff_callback.callback.trainer_evaluation import EvaluationOutcome, evaluate_trainer_model, start_vllm
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.evaluator import ABANDONED
from probdiff_callback.core.metric import compare_to_base, is_finite
from probdiff_callback.core.queries import Query
from probdiff_callback.core.records import Record
from probdiff_callback.generation.choice import architectures_of, choose_engine, parameters_of
from probdiff_callback.generation.vllm import in_this_process
from probdiff_callback.runs.run_files import HistoryRow, RunFiles, read_records

logger = logging.getLogger(__name__)


@dataclass
class LoopState:
    """What the evaluations in the loop have done so far in this training start."""

    evaluated: dict[int, dict[str, float]] = field(default_factory=dict)  # global step -> its metrics
    baseline_records: list[Record] | None = None  # what every later step is compared with
    abandoned_step: int | None = None  # the step whose evaluation a stop signal abandoned
    last_outcome: EvaluationOutcome | None = None
    without_eval_loss: set[int] = field(default_factory=set)  # evaluated steps whose row awaits the Trainer's eval loss


class InLoop:
    """The evaluation in the loop for one `ProbDiffCallback`; every rank calls the same methods at the same hooks."""

    def __init__(
        self,
        trainer,
        tokenizer,
        config: ProbDiffConfig,
        queries: Sequence[Query],
        outputs: TrainerOutputs,
        best: TrainerBest,
        preemption,
    ) -> None:
        self.trainer, self.tokenizer, self.config, self.queries = trainer, tokenizer, config, list(queries)
        self.outputs, self.best, self.preemption = outputs, best, preemption
        self.state = LoopState()
        self.files = RunFiles(trainer.args.output_dir, config.output_subdir)  # written on the main process
        self.cost = CostReport()
        self.vllm = None  # VLLMGeneration (use_vllm), on each rank that holds one: started when training begins
        self.asked = config  # `use_vllm` as given (auto, true, false): the engine is decided at each training start

    @property
    def evaluated(self) -> dict[int, dict[str, float]]:
        return self.state.evaluated

    def known(self, step: int) -> bool:
        return step in self.state.evaluated

    def history(self) -> list[HistoryRow]:
        """The history rows so far (main process; this way writes them)."""
        return self.files.rows()

    # ---- train begin ----
    def begin(self, args: TrainingArguments, state: TrainerState) -> None:
        """vLLM started, the history taken over and the resumed step completed; the resolution line said unless the
        baseline is still to be evaluated (its evaluation says it)."""
        if self.vllm is None:
            self.config, self.vllm = self._engine()
        kept, baseline_records = self.outputs.broadcast(self._history_to_continue(state))
        self.state = LoopState(
            evaluated={row.global_step: self._metrics(row) for row in kept if not row.abandoned},
            baseline_records=baseline_records,
            without_eval_loss={row.global_step for row in kept if not row.abandoned and not is_finite(row.eval_loss)},
        )
        if self._complete_resumed_step(state, kept) and self.outputs.is_main:
            # the checkpoint resumed from holds its step's results now, as one saved after them does (when the run's
            # last step is that one, no later save would carry them)
            checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            if os.path.isfile(os.path.join(checkpoint, TRAINER_STATE_NAME)):
                state.save_to_json(os.path.join(checkpoint, TRAINER_STATE_NAME))
        if not (self.config.baseline and state.global_step == 0 and not self.known(0)):
            baseline = next((row for row in kept if row.kind == "baseline" and not row.failed), None)
            self.outputs.say_resolution(None if baseline is None else baseline.confidence)
        self.cost.training_started(state.global_step)

    def _metrics(self, row: HistoryRow) -> dict[str, float]:
        return self.outputs.metrics(row.summary, row.vs_base)

    def _history_to_continue(self, state: TrainerState) -> tuple[list[HistoryRow], list[Record] | None]:
        """(history rows up to the step training starts from, the baseline's records); main process only."""
        if not self.outputs.is_main:
            return [], None
        kept, dropped = self.files.continue_from(state.global_step)
        if dropped and state.global_step == 0:
            logger.warning(
                f"ProbDiff: a new run in {self.trainer.args.output_dir}: replacing the {dropped} rows of an earlier "
                "history"
            )
        elif dropped:
            logger.warning(
                f"ProbDiff: resumed at step {state.global_step}; dropped {dropped} history rows of later steps "
                "(they are trained and evaluated again)"
            )
        return kept, self.files.baseline_records()

    def _engine(self) -> tuple[ProbDiffConfig, object]:
        """The engine that writes this run's texts (generation/choice.py), said once, and the settings with its
        `use_vllm` decided. vLLM starts on every rank where it runs in the evaluating process (each rank writes its
        share's texts), else on the main process (None on the others). Where it fails to start, `use_vllm=true` stops
        training on every rank with the same message before the first step; `auto` evaluates with HF on every rank."""
        model = self.trainer.accelerator.unwrap_model(self.trainer.model_wrapped)
        choice = choose_engine(
            self.asked,
            parameters=parameters_of(model),
            architectures=architectures_of(model),
            queries=len(self.queries),
            in_training_loop=True,
            on_gpu=self.trainer.args.device.type == "cuda",
        )
        config, vllm, error = choice.applied(self.asked), None, None
        if choice.use_vllm and (self.outputs.is_main or in_this_process(config)):
            try:
                vllm = start_vllm(self.trainer, self.tokenizer, config)
            except Exception as err:  # noqa: BLE001 - every rank learns of it below
                error = f"{type(err).__name__}: {err}"
        if choice.use_vllm and (error := any_error(self.trainer.accelerator, error)) is not None:
            if self.asked.use_vllm is True:
                raise RuntimeError(f"ProbDiff: use_vllm=true: {error}")
            if vllm is not None:
                vllm.close()
            vllm, choice = None, choice.fallen_back(error)
        if self.outputs.is_main:
            logger.info(choice.line())
        return choice.applied(self.asked), vllm

    def _complete_resumed_step(self, state: TrainerState, kept: list[HistoryRow]) -> bool:
        """What the checkpoint resumed from lacks of its own step's ProbDiff evaluation, done now; whether anything
        of its step was logged.

        An evaluation a stop signal abandoned runs: the resumed step's (its weights are the checkpoint's) and a
        baseline of the base model; others stay failed, and the log says why. A row evaluated after its checkpoint
        was saved (by an earlier resume that was then killed) is logged again, since the Trainer's log and W&B go
        back to the checkpoint."""
        logged = False
        for row in kept:
            if not row.abandoned and row.global_step == state.global_step > 0:
                if row.global_step in logged_steps(state.log_history):
                    continue
                metrics = self.state.evaluated[row.global_step]
                self.trainer.log(dict(metrics))
                logged = True
                if self.outputs.is_main and row.records:
                    self.outputs.to_wandb(row.global_step, read_records(self.files.directory / row.records))
        for row in [row for row in kept if row.abandoned]:
            if row.global_step == state.global_step or row.base_model:
                logger.warning(f"ProbDiff: evaluating step {row.global_step}, abandoned when the run was stopped")
                # a stop signal now does not abandon the resumed step's evaluation again: the stop would save the
                # next step, and this step's weights would be gone with its evaluation (the base model's stay)
                self._run(dataclasses.replace(row, error=None, abandoned=False), abandonable=row.base_model)
                logged = logged or row.global_step == state.global_step > 0
                continue
            why = (
                f"{ABANDONED} when the run stopped, and resuming from step {state.global_step} cannot run it: the "
                "weights of its step are gone"
            )
            logger.warning(f"ProbDiff: step {row.global_step}'s evaluation was {why}; it stays failed")
            self.state.evaluated[row.global_step] = self.outputs.metrics(None, None)
            if self.outputs.is_main:
                self.files.add(dataclasses.replace(row, error=why, abandoned=False), None)
        return logged

    # ---- a scheduled step ----
    def evaluate(
        self,
        row: HistoryRow,
        eval_losses: list[float] | None,
        control: TrainerControl | None,
        saved_now: bool = False,
    ) -> None:
        """Evaluate the step of `row` now; an evaluation of a training step abandoned for a stop signal has the
        Trainer save this step and stop, on every rank."""
        self._run(row, eval_losses)
        if control is not None and row.kind != "baseline" and self.state.abandoned_step == row.global_step:
            control.should_save = True
            control.should_training_stop = True
            if self.preemption is not None:
                self.preemption.stopping = True

    def evaluated_before(self, step: int, eval_loss: float, eval_losses: list[float] | None) -> None:
        """The Trainer evaluated a step ProbDiff evaluated before it did (the end of training, a resumed run's row):
        its eval loss goes into the row, once."""
        if step not in self.state.without_eval_loss:
            eval_losses = None
        self.state.without_eval_loss.discard(step)
        if self.outputs.is_main:
            self.files.set_eval_loss(step, eval_loss, eval_losses)

    def metrics_at_evaluation(self, step: int) -> dict[str, float]:
        """The step's metrics for the Trainer's evaluation, after the alarm has seen them."""
        rows = self.files.rows()
        self.outputs.say_disagreements(rows, self.best.alarm_pick(rows))
        return dict(self.state.evaluated[step])

    def _run(
        self, row: HistoryRow, eval_losses: list[float] | None = None, abandonable: bool = True
    ) -> EvaluationOutcome:
        """Evaluate for `row` (its step, kind and checkpoint), then hand the outcome, with the step's eval loss of
        each conversation where the Trainer evaluated it, to the Trainer, W&B and the run's files. `abandonable`:
        a stop signal ends the evaluation at its next token (the row says the resumed run evaluates the step)."""
        outcome = self.evaluate_model(base_model=row.base_model, abandonable=abandonable)
        self.state.last_outcome = outcome
        if outcome.abandoned:
            return self._record_abandoned(row, outcome, eval_losses)
        if row.kind == "baseline":
            if outcome.error is None:
                self.state.baseline_records = outcome.records
            self.outputs.say_resolution(None if outcome.summary is None else outcome.summary.confidence)
        else:
            row.vs_base = compare_to_base(outcome.records, self.state.baseline_records, self.config.delta)
        outcome.metrics = self.outputs.metrics(outcome.summary, row.vs_base)
        if not is_finite(row.eval_loss):
            self.state.without_eval_loss.add(row.global_step)
        self.cost.evaluated(outcome.seconds, outcome.cost, before_training=row.kind == "baseline")
        if outcome.error is not None:
            logger.error(f"ProbDiff evaluation at step {row.global_step} failed; training goes on:\n{outcome.error}")
        if self.outputs.is_main:
            row.summary, row.error, row.seconds = outcome.summary, outcome.error, round(outcome.seconds, 3)
            row.cost = outcome.cost
            self.files.add(row, outcome.records if outcome.error is None else None, eval_losses)
        # the pick over every step so far, this one with the checkpoint the Trainer is about to save
        pending = row.global_step if row.checkpoint is not None else None
        self.best.decide(self.files.rows() if self.outputs.is_main else None, pending_step=pending)
        if GUARDED_KEY in outcome.metrics:
            outcome.metrics[GUARDED_KEY] = self.best.value_at(row.global_step)
        self.state.evaluated[row.global_step] = outcome.metrics
        # Trainer.evaluate logs its metrics before on_evaluate, so ours need their own log call (W&B,
        # TensorBoard and log_history then get them at this step).
        self.trainer.log(dict(outcome.metrics))
        if self.outputs.is_main:
            self.outputs.to_wandb(row.global_step, outcome.records)
        self.best.apply()
        if outcome.error is not None and self.config.fail_on_error:
            raise RuntimeError(
                f"ProbDiff evaluation at step {row.global_step} failed (fail_on_error=True):\n{outcome.error}"
            )
        return outcome

    def _record_abandoned(
        self, row: HistoryRow, outcome: EvaluationOutcome, eval_losses: list[float] | None
    ) -> EvaluationOutcome:
        """Not a failure: no metrics are logged, and the row says the resumed run evaluates the step; it keeps the
        step's eval loss, and each conversation's (the resumed run does not compute them again)."""
        outcome.metrics = self.outputs.metrics(None, None)
        self.state.evaluated[row.global_step] = outcome.metrics
        self.state.abandoned_step = row.global_step
        logger.warning(
            f"ProbDiff: the evaluation of step {row.global_step} was abandoned (the run was asked to stop); it runs "
            "when the run resumes"
        )
        if self.outputs.is_main:
            row.error = f"{ABANDONED}: the run was asked to stop; resuming evaluates this step"
            row.abandoned = True
            self.files.add(row, None, eval_losses)
        return outcome

    def evaluate_model(self, *, base_model: bool = False, abandonable: bool = True) -> EvaluationOutcome:
        """Evaluate the current weights on the queries, on all ranks; every rank returns the same records (in query
        order), summary, metrics and error. Called before training began (no engine decided yet), it decides the
        engine first, as a training start would."""
        if self.config is self.asked:  # `auto` still undecided: `_engine` always returns a decided copy
            self.config, self.vllm = self._engine()
        asked_to_stop = None if self.preemption is None or not abandonable else self.preemption.signalled
        outcome = evaluate_trainer_model(
            self.trainer,
            self.tokenizer,
            self.queries,
            self.config,
            self.outputs.reference_plan,
            base_model,
            asked_to_stop,
            vllm=self.vllm,
        )
        outcome.metrics = self.outputs.metrics(outcome.summary, None)
        return outcome

    # ---- between steps, saves, the end ----
    def between_steps(self, args: TrainingArguments, state: TrainerState) -> None:
        """Once, after the first evaluation during training: what evaluating adds to the run's time."""
        message = self.cost.message(args, state, self.config.every)
        if message and self.outputs.is_main:
            logger.info(message)

    def saved(self, args: TrainingArguments, state: TrainerState) -> None:
        """Nothing waits for a save in the loop."""

    def after_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, stopping: bool) -> None:
        """A checkpoint saved at a step evaluated earlier (not at this save): the step's row goes beside it."""
        checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if state.global_step in self.state.evaluated and self.outputs.is_main and os.path.isdir(checkpoint):
            self.files.link_checkpoint(state.global_step, checkpoint)

    def end(self, args: TrainingArguments, state: TrainerState, stopped: bool) -> None:
        """The alarm over the whole history; the vLLM server this run started stopped."""
        rows = self.files.rows()
        self.outputs.say_disagreements(rows, self.best.alarm_pick(rows))
        self.close_engine()

    def close_engine(self) -> None:
        """Stop the vLLM server this run started (none for a server you started, or without vLLM)."""
        vllm, self.vllm = self.vllm, None
        if vllm is not None:
            vllm.close()

    def summary(self) -> str | None:
        return self.cost.totals()
