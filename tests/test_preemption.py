"""callback/preemption.py in this process: what a rank brings to the step's agreement, and the machines that lost
their launcher. (Real signals and processes: e2e/test_launcher_signals.py, e2e/test_machines.py.)"""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

from transformers import TrainerControl

from probdiff_callback.callback.preemption import PreemptionCallback


def one_process_callback() -> PreemptionCallback:
    trainer = SimpleNamespace(accelerator=SimpleNamespace(num_processes=1), is_world_process_zero=lambda: True)
    return PreemptionCallback(trainer)


def step_end(preemption: PreemptionCallback) -> TrainerControl:
    control = TrainerControl()
    preemption.on_step_end(None, None, control)
    return control


def test_a_signal_from_the_scheduler_is_a_stop_and_a_dead_launcher_a_lost_machine(monkeypatch):
    monkeypatch.setenv("GROUP_RANK", "3")  # torchrun's machine rank
    preemption = one_process_callback()
    assert not step_end(preemption).should_training_stop
    preemption.received = signal.SIGTERM
    preemption.launcher = os.getppid()  # the launcher that started this process is alive: a scheduler's signal
    control = step_end(preemption)
    assert control.should_save and control.should_training_stop and preemption.lost_machines == []

    lost = one_process_callback()
    lost.received, lost.launcher = signal.SIGTERM, os.getppid() + 1_000_000  # re-parented: its launcher died
    assert lost.launcher_lost()
    assert step_end(lost).should_training_stop and lost.lost_machines == [3]


def test_without_a_launcher_no_machine_is_lost():
    preemption = one_process_callback()  # started from a shell (`python train/sft.py`): no launcher to lose
    preemption.received = signal.SIGTERM
    assert not preemption.launcher_lost()
    assert step_end(preemption).should_training_stop and preemption.lost_machines == []
