"""The evaluator a training run with `async_eval` starts beside itself on its node (`evaluator="local"`):
`probdiff watch RUN_DIR --started-by-training`, on the GPUs `evaluator_gpus` names (none: the CPU) with
`evaluator_threads`, outside the training's ranks and its process group; started again when it dies with work left,
a few times; stopped at the end. One evaluator per run: a live one holds the queue's lock, and training uses an
evaluator you started instead of starting its own."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from probdiff_callback.callback.beside.steps import describe_steps, several
from probdiff_callback.core.config import DEFAULT_SUBDIR, ProbDiffConfig
from probdiff_callback.runs.queue import Queue, describe_holder, evaluator_holder

logger = logging.getLogger(__name__)

MAX_RESTARTS = 3  # the local evaluator is started again this often after dying with work left
STOP_SECONDS = 10.0  # a terminated evaluator's time to leave before it is killed
# Set by `accelerate launch`, torchrun and train/sft.py's launcher for the training processes: the evaluator is none
LAUNCHER_VARIABLES = frozenset(
    "RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE ROLE_RANK ROLE_NAME ROLE_WORLD_SIZE "
    "MASTER_ADDR MASTER_PORT PROBDIFF_LAUNCHER_PID".split()
)
LAUNCHER_PREFIXES = ("ACCELERATE_", "TORCHELASTIC_", "PET_")


def evaluator_command(run_dir: Path, subdir: str, helpers: int = 0) -> list[str]:
    """`probdiff watch RUN_DIR --started-by-training` with this interpreter (the training's environment), with
    `helpers` helper processes once training has freed its cores."""
    command = [sys.executable, "-m", "probdiff_callback.cli", "watch", str(run_dir), "--started-by-training"]
    if subdir != DEFAULT_SUBDIR:
        command += ["--subdir", subdir]
    return [*command, "--helpers-after-training", str(helpers)] if helpers else command


def helpers_after_training(gpus: str | None, training_threads: int, local_processes: int, threads: int) -> int:
    """On the CPU, the helper processes of `threads` threads each that fit on the threads this node's training
    processes free when they end; none on GPUs (the evaluator keeps its own)."""
    return 0 if gpus else training_threads * local_processes // threads


def evaluator_environment(environ: Mapping[str, str], gpus: str | None, threads: int) -> dict[str, str]:
    """The training's environment less what makes a process one of the training's ranks, with the evaluator's devices
    (`gpus` as CUDA_VISIBLE_DEVICES takes them; none: the CPU) and CPU threads."""
    env = {k: v for k, v in environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith(LAUNCHER_PREFIXES)}
    env["CUDA_VISIBLE_DEVICES"] = gpus or ""
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def last_line(path: Path) -> str:
    """The last non-empty line of a log, "" when there is none."""
    try:
        lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    except FileNotFoundError:
        return ""
    return lines[-1].strip() if lines else ""


class LocalEvaluator:
    """The evaluator this training command starts on its node: `evaluator_command` in a session of its own (a Ctrl-C
    or a signal to the training's process group is training's to pass on), with `evaluator_environment`, its output
    appended to the queue's `evaluator.log`. The command sets its own parent-death signal; training stops it at its
    end, and at the exit of the process whatever the exit."""

    def __init__(self, queue: Queue, config: ProbDiffConfig, threads: int) -> None:
        self.run_dir, self.queue = queue.run_dir, queue
        self.gpus = config.evaluator_gpus
        self.threads = config.evaluator_threads or threads
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        self.helpers = helpers_after_training(self.gpus, threads, local_processes, self.threads)
        self.command = evaluator_command(self.run_dir, config.output_subdir, self.helpers)
        self.env = evaluator_environment(os.environ, self.gpus, self.threads)
        self.process: subprocess.Popen | None = None
        self.started_at = 0.0
        self.failures = 0
        self.gave_up = False

    @property
    def log_path(self) -> Path:
        return self.queue.log_path

    def start(self) -> None:
        self.queue.folder.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started_at = time.time()
        atexit.register(self.stop)
        where = f"GPU {self.gpus}" if self.gpus else f"the CPU, {self.threads} thread{'s' if self.threads > 1 else ''}"
        if self.helpers:
            where += f" (and {self.helpers} helper{'s' if self.helpers > 1 else ''} on training's cores once it ends)"
        logger.info(
            f"ProbDiff: evaluating beside training: `probdiff watch {self.run_dir}` runs as pid {self.process.pid} on "
            f"{where}; its log: {self.log_path}"
        )

    def start_unless_held(self) -> None:
        """At train begin: an evaluator already running for this run (one you started) is used as it is."""
        holder = evaluator_holder(self.queue)
        if holder is None:
            self.start()
        else:
            who = describe_holder(holder)
            logger.info(f"ProbDiff: an evaluator already runs for {self.run_dir} ({who}); it evaluates the queue")

    def check(self) -> None:
        """Start the evaluator again when it has exited with requests pending and no other evaluator took them. An exit
        that left work it had seen counts as a failure; after `MAX_RESTARTS` the user is told the command to run."""
        if self.gave_up:
            return
        code = None
        if self.process is not None:
            code = self.process.poll()
            if code is None:
                return
            pid, self.process = self.process.pid, None
            atexit.unregister(self.stop)
        left = self.queue.pending()
        if not left or evaluator_holder(self.queue) is not None:
            return
        steps = describe_steps(r.global_step for r in left)
        awaits = "await" if several(left) else "awaits"
        if code is not None and (code != 0 or any(r.queued_at <= self.started_at for r in left)):
            self.failures += 1
            last = last_line(self.log_path)
            said = f"exited with status {code} while {steps} {awaits} evaluation (its last line: {last or '-'})"
            if self.failures > MAX_RESTARTS:
                self.gave_up = True
                logger.error(
                    f"ProbDiff: the evaluator (pid {pid}) {said}; it died {self.failures} times, so training goes on "
                    f"without it: run `probdiff watch {self.run_dir}` to evaluate the queue (log: {self.log_path})"
                )
                return
            logger.warning(f"ProbDiff: the evaluator (pid {pid}) {said}; starting it again ({self.failures} of "
                           f"{MAX_RESTARTS})")  # fmt: skip
        elif code is None:
            logger.info(f"ProbDiff: no evaluator holds {self.run_dir}'s queue any more; starting one for {steps}")
        self.start()

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace: float = 0.0) -> None:
        """Let the evaluator exit by itself for `grace` seconds (nothing pending and training ended), then SIGTERM (it
        leaves the step in progress pending) and, `STOP_SECONDS` later, SIGKILL."""
        process, self.process = self.process, None
        atexit.unregister(self.stop)
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
            return
        process.terminate()
        try:
            process.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
