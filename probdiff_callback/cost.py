"""What ProbDiff adds to a run's time, said once, after the first training steps."""

from __future__ import annotations

import time

from transformers import TrainerState, TrainingArguments

STEPS_BEFORE_REPORT = 3


def evaluation_interval(args: TrainingArguments, state: TrainerState) -> int | None:
    """Optimizer steps between the Trainer's evaluations (its saves when it does not evaluate), or None when
    they follow epochs or nothing."""
    if args.eval_strategy == "steps":
        return state.eval_steps or None
    if args.eval_strategy == "no" and args.save_strategy == "steps":
        return state.save_steps or None
    return None


class CostReport:
    def __init__(self) -> None:
        self.evaluation_seconds: float | None = None  # the first evaluation's
        self.training_started_at: float | None = None
        self.seconds_evaluating = 0.0  # evaluations since training started are not training time
        self.start_step = 0
        self.reported = False

    def training_started(self, step: int) -> None:
        self.training_started_at, self.start_step, self.seconds_evaluating = time.perf_counter(), step, 0.0

    def evaluated(self, seconds: float) -> None:
        if self.evaluation_seconds is None:
            self.evaluation_seconds = seconds
        if self.training_started_at is not None:
            self.seconds_evaluating += seconds

    def message(self, args: TrainingArguments, state: TrainerState, every: int) -> str | None:
        """The report, once, when a few steps have been trained and an evaluation has run; else None."""
        if self.reported or self.training_started_at is None or self.evaluation_seconds is None:
            return None
        done = state.global_step - self.start_step
        if done < min(STEPS_BEFORE_REPORT, state.max_steps - self.start_step):
            return None
        self.reported = True
        per_step = max(time.perf_counter() - self.training_started_at - self.seconds_evaluating, 0.0) / max(done, 1)
        text = f"ProbDiff: one evaluation takes {self.evaluation_seconds:.1f}s, a training step {per_step:.2f}s"
        interval = evaluation_interval(args, state)
        if interval is None or per_step == 0:
            return text
        share = self.evaluation_seconds / (per_step * interval * every)
        return f"{text}; evaluating every {interval * every} steps adds about {100 * share:.0f}% to the training time"
