"""What evaluating adds to a run's time: a forecast once the first evaluation during training has run, and the measured
total at the end, each with where the evaluations' time went (the evaluator's `Cost`: answers, revisions, scoring,
reference metrics, tokens generated). The forecast waits for an evaluation of the model in training: the base model's
evaluation, before the first step, runs once, and its answers can be far longer (or shorter) than those of the model
being trained."""

from __future__ import annotations

import time

from transformers import TrainerState, TrainingArguments

from probdiff_callback.core.records import Cost


def evaluation_interval(args: TrainingArguments, state: TrainerState) -> int | None:
    """Optimizer steps between the Trainer's evaluations (its saves when it does not evaluate), or None when
    they follow epochs or nothing."""
    if args.eval_strategy == "steps":
        return state.eval_steps or None
    if args.eval_strategy == "no" and args.save_strategy == "steps":
        return state.save_steps or None
    return None


def stage_words(cost: Cost) -> str:
    """Where an evaluation's time went, in words: each stage's seconds and the tokens generated."""
    stages = [
        f"answers {cost.answers_seconds:.1f}s",
        f"revisions {cost.revisions_seconds:.1f}s",
        f"scoring {cost.scoring_seconds:.1f}s",
    ]
    if cost.reference_seconds:
        stages.append(f"reference metrics {cost.reference_seconds:.1f}s")
    return f"{', '.join(stages)}; {cost.generated_tokens:,} tokens generated"


class CostReport:
    def __init__(self) -> None:
        self.before_training = 0.0  # the base model's evaluation (seconds), once before the first step
        self.during_training: list[float] = []  # each evaluation's seconds since training started
        self.costs: list[Cost | None] = []  # and where its time went (None: it failed)
        self.training_started_at: float | None = None
        self.start_step = 0
        self.reported = False

    def training_started(self, step: int) -> None:
        self.training_started_at, self.start_step, self.during_training, self.costs = time.perf_counter(), step, [], []

    def evaluated(self, seconds: float, cost: Cost | None = None, before_training: bool = False) -> None:
        """One evaluation's seconds and where they went; `before_training` for the base model's, which may run in the
        Trainer's evaluation at step 0 (`eval_on_start`), after training started: its time is then not training
        time."""
        if before_training or self.training_started_at is None:
            self.before_training += seconds
            if self.training_started_at is not None:
                self.training_started_at += seconds
        else:
            self.during_training.append(seconds)
            self.costs.append(cost)

    def _training_seconds(self) -> float:
        assert self.training_started_at is not None
        return max(time.perf_counter() - self.training_started_at - sum(self.during_training), 0.0)

    def message(self, args: TrainingArguments, state: TrainerState, every: int) -> str | None:
        """The forecast, once, at the first step after an evaluation during training; else None."""
        done = state.global_step - self.start_step
        if self.reported or self.training_started_at is None or not self.during_training or done < 1:
            return None
        self.reported = True
        per_step = self._training_seconds() / done
        text = f"ProbDiff: one evaluation takes {self.during_training[0]:.1f}s"
        if self.before_training:
            text += f" (the base model's took {self.before_training:.1f}s, once)"
        text += f", a training step {per_step:.2f}s"
        interval = evaluation_interval(args, state)
        if interval is not None and per_step > 0:
            share = self.during_training[0] / (per_step * interval * every)
            text += f"; evaluating every {interval * every} steps adds about {100 * share:.0f}% to the training time"
        if self.costs[0] is not None:
            text += f"; that evaluation: {stage_words(self.costs[0])}"
        return text

    def totals(self) -> str | None:
        """The measured cost of the whole run, for its end; None before training started."""
        if self.training_started_at is None:
            return None
        training, evaluating = self._training_seconds(), sum(self.during_training)
        text = (
            f"ProbDiff cost: {len(self.during_training)} evaluations during training took {evaluating / 60:.1f} min, "
            f"{100 * evaluating / max(training, 1e-9):.0f}% on top of {training / 60:.1f} min of training"
        )
        if self.before_training:
            text += f"; the base model's evaluation {self.before_training / 60:.1f} min before it"
        measured = [cost for cost in self.costs if cost is not None]
        if measured:
            text += f"; in the evaluations during training: {stage_words(sum(measured, Cost()))}"
        return text
