"""`probdiff watch RUN_DIR`: the evaluator of a run trained with `probdiff.async_eval=true`.

Training queues a request for every step the loop would evaluate (`queue.py`); this command takes them in step order
and evaluates each as the loop would have (`loop.py`), writing each step's row and records into the run's history.
What it needs on disk: the run directory and the base model's folder (the spec names it); the weights of each step
are in the queue.

One evaluator per run (`lock.py`). SIGTERM and SIGINT stop it at once, leaving the step in progress pending (it is
evaluated next time): exit status 0 for SIGTERM (a stop asked for), 130 for SIGINT (Ctrl-C). What can be refused (no
queue, another evaluator) is refused before the model and its libraries load.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from probdiff_callback.runs.queue import Queue
from probdiff_callback.runs.run_files import existing_run_dir
from probdiff_callback.runtime.parent import set_parent_death_signal
from probdiff_callback.runtime.stop_signals import Stopped, StopSignals
from probdiff_callback.watch.lock import hold_evaluator

POLL_SECONDS = 2.0


def say(message: str) -> None:
    print(f"probdiff watch: {message}", flush=True)


@dataclass
class Watch:
    run_dir: Path
    subdir: str = "probdiff"
    follow: bool = True  # wait for more requests until training has ended (`training-ended`); else stop when none
    started_by_training: bool = False
    poll_seconds: float = POLL_SECONDS
    helpers_after_training: int = 0  # helper processes once training has queued its last step (CPU, HF engine)
    own_process: bool = False  # the console script's: on the CPU, freed memory is kept for reuse (command_loading)


def run_watch(options: Watch) -> int:
    """Evaluate the run's pending requests, and follow it as `options` says; the exit status."""
    parent = os.getppid()
    if options.started_by_training:
        set_parent_death_signal(signal.SIGTERM)  # never outlive training
        if os.getppid() != parent:  # training died before the signal was set
            return 0
    queue = Queue.existing(existing_run_dir(options.run_dir), options.subdir)
    lock = hold_evaluator(queue)
    try:
        with StopSignals() as signals:
            try:
                if options.own_process:
                    reuse_freed_memory_on_cpu()
                from probdiff_callback.watch.loop import Evaluator  # the model's libraries: after the checks

                evaluator = Evaluator(queue, signals, say, follow=options.follow, poll_seconds=options.poll_seconds,
                                      helpers_after_training=options.helpers_after_training)  # fmt: skip
                evaluator.run()
            except Stopped as stop:
                say(f"{stop} received: stopped; the step in progress stays queued, `probdiff watch` evaluates it")
                return stop.exit_status
    finally:
        lock.release()
    return 0


def reuse_freed_memory_on_cpu() -> None:
    """Once the checks passed (torch is imported here): on the CPU, freed memory is kept for the next evaluation."""
    import torch

    from probdiff_callback.models.command_loading import reuse_freed_memory

    if not torch.cuda.is_available():
        reuse_freed_memory()
