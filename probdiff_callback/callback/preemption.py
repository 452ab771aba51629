"""Preemption: on SIGTERM or SIGUSR1, a checkpoint at the next step boundary and a clean stop.

A cluster preempts a job with SIGTERM and kills it a grace period later; SLURM's `--signal=USR1@<seconds>` warns
ahead of the time limit. The Trainer has no answer of its own, so a run loses everything since its last checkpoint.
Here the signal only sets a flag. The training step in progress finishes; at its end every rank agrees (one
all-reduce of a flag per step, so no rank stops a step before the others) and the Trainer saves a checkpoint and
leaves its loop. A ProbDiff evaluation in progress is abandoned at its next generated token and its step is
evaluated when the run resumes (`ProbDiffCallback(preemption=...)`), so the resumed history equals an
uninterrupted one. The time from the signal to the exit is one training step, a checkpoint save and the rest of
one forward pass.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Sequence

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from probdiff_callback.runtime.parent import parent_command, set_parent_death_signal

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionCallback(TrainerCallback):
    """A [`~transformers.TrainerCallback`] that turns SIGTERM and SIGUSR1 into a checkpoint and the end of
    training at the next step boundary.

    Usage:

    ```python
    preemption = PreemptionCallback(trainer)
    trainer.add_callback(preemption)  # first: its handlers are in place for the baseline evaluation
    trainer.add_callback(ProbDiffCallback(trainer, queries, preemption=preemption))
    trainer.train(resume_from_checkpoint=...)
    if preemption.stopping:
        print(f"stopped by {preemption.signal_name}: resume from {preemption.checkpoint}")
    ```

    Args:
        trainer (`Trainer`): the trainer to stop (its accelerator agrees on the flag across ranks).
        signals (`Sequence[signal.Signals]`, *optional*): the signals that ask for the stop.

    The handlers are installed when training begins and the previous ones put back when it ends.
    """

    def __init__(self, trainer, signals: Sequence[signal.Signals] = SIGNALS) -> None:
        self.trainer = trainer
        self.signals = tuple(signals)
        self.received: int | None = None  # the signal this process received
        # every rank agreed to save and stop: at a step boundary, or on an evaluation abandoned on every rank
        self.stopping = False
        self.checkpoint: str | None = None  # the checkpoint saved for the stop
        self._previous: dict[int, object] = {}

    @property
    def signal_name(self) -> str:
        return "a signal" if self.received is None else signal.Signals(self.received).name

    def signalled(self) -> bool:
        """This process was asked to stop (ranks may differ until the next step boundary)."""
        return self.received is not None or self.stopping

    def _handle(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signum
            if self.trainer.is_world_process_zero():
                sys.stderr.write(
                    f"received {signal.Signals(signum).name}: saving a checkpoint at the end of this step, then "
                    "stopping\n"
                )

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        if self.signals:
            term_when_launcher_dies(self.signals[0])

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if not self.stopping and self._agreed():
            self.stopping = True
            control.should_save = True
            control.should_training_stop = True

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self.stopping:
            self.checkpoint = f"{args.output_dir}/checkpoint-{state.global_step}"

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _agreed(self) -> bool:
        """Whether any rank received a signal: the same answer on every rank."""
        accelerator = self.trainer.accelerator
        if accelerator.num_processes == 1:
            return self.received is not None
        import torch

        flag = torch.tensor([int(self.received is not None)], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item())


def term_when_launcher_dies(signum: int) -> bool:
    """Have the kernel send `signum` to this process when its launcher dies (Linux), if a launcher started it.

    `accelerate launch` of one process forwards no signal: killing it would leave the training process running on
    alone, and a torchrun agent killed with -9 leaves its workers so. With this they stop as on a preemption. Not
    for a process a shell started: `nohup python train/sft.py &` must outlive its shell.
    """
    launcher = parent_command()
    if not any(name in launcher for name in ("accelerate", "torchrun", "torch.distributed.run")):
        return False
    return set_parent_death_signal(signum)
