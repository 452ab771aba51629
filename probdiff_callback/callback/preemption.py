"""Preemption: on SIGTERM or SIGUSR1, a checkpoint at the next step boundary and a clean stop.

A cluster preempts a job with SIGTERM and kills it a grace period later; SLURM's `--signal=USR1@<seconds>` warns
ahead of the time limit. The Trainer has no answer of its own, so a run loses everything since its last checkpoint.
Here the signal only sets a flag. The training step in progress finishes; at its end every rank agrees (one
all-reduce of a flag per step, so no rank stops a step before the others) and the Trainer saves a checkpoint and
leaves its loop. A ProbDiff evaluation in progress is abandoned at its next generated token and its step is
evaluated when the run resumes (`ProbDiffCallback(preemption=...)`), so the resumed history equals an
uninterrupted one. The time from the signal to the exit is one training step, a checkpoint save and the rest of
one forward pass.

A launcher that dies (a machine lost, `kill -9` of its `accelerate launch`) sends its training processes SIGTERM
(`term_when_launcher_dies`): they save and stop the same way, but every rank learns which machine lost its launcher
(`lost_machines`), and the training command exits non-zero, since the run did not finish.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from probdiff_callback.runtime.parent import parent_command, set_parent_death_signal
from probdiff_callback.runtime.threads import LAUNCHER_PID_ENV

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# what a rank brings to the agreement at each step's end
NO_SIGNAL, STOP_SIGNAL, LAUNCHER_LOST = 0, 1, 2


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
        self.lost_machines: list[int] = []  # the machine ranks (GROUP_RANK) whose launcher died, agreed on every rank
        self.launcher: int | None = None  # the pid of the launcher that started this process (None: none did)
        self._agreed_signal = 0  # a signal some rank received, once the ranks agreed to stop
        self._previous: dict[int, object] = {}

    @property
    def signal_name(self) -> str:
        """The signal this process received, else the one another rank received (agreed at the step's end)."""
        signum = self.received or self._agreed_signal
        return "a signal" if not signum else signal.Signals(signum).name

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
        if self.signals and term_when_launcher_dies(self.signals[0]):
            self.launcher = os.getppid()

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

    def launcher_lost(self) -> bool:
        """This process's launcher died (the kernel re-parents its children, and its death signal is this SIGTERM)."""
        return self.launcher is not None and os.getppid() != self.launcher

    def _agreed(self) -> bool:
        """Whether any rank received a signal, and which machines lost their launcher: the same on every rank."""
        accelerator = self.trainer.accelerator
        reason = NO_SIGNAL if self.received is None else LAUNCHER_LOST if self.launcher_lost() else STOP_SIGNAL
        machine = int(os.environ.get("GROUP_RANK", "0"))  # torchrun's node rank, `accelerate launch --machine_rank`
        if accelerator.num_processes == 1:
            reasons = [(reason, machine, self.received or 0)]
        else:
            import torch

            mine = torch.tensor([[reason, machine, self.received or 0]], device=accelerator.device)
            reasons = [tuple(row) for row in accelerator.gather(mine).tolist()]
        self.lost_machines = sorted({machine for reason, machine, _ in reasons if reason == LAUNCHER_LOST})
        self._agreed_signal = next((signum for _, _, signum in reasons if signum), 0)
        return any(reason != NO_SIGNAL for reason, _, _ in reasons)


def term_when_launcher_dies(signum: int) -> bool:
    """Have the kernel send `signum` to this process when its launcher dies (Linux), if a launcher started it.

    `accelerate launch` of one process forwards no signal: killing it would leave the training process running on
    alone, and a torchrun agent killed with -9 leaves its workers so. With this they stop as on a preemption. Not
    for a process a shell started: `nohup python train/sft.py &` must outlive its shell.
    """
    ours = os.environ.get(LAUNCHER_PID_ENV) == str(os.getppid())  # train/sft.py as the launcher (training/launch.py)
    launcher = parent_command()
    if not ours and not any(name in launcher for name in ("accelerate", "torchrun", "torch.distributed.run")):
        return False
    return set_parent_death_signal(signum)
