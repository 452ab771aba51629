"""Stop signals and setup errors at the command users start (`python train/sft.py ...`, the README's; with
`--num_processes 2 --multi_gpu` it launches its training processes), on `tiny` in real processes.

A stop signal to the command or to its process group, after the first checkpoint: the command waits for the
checkpoint, prints the continue line, exits 0 (Ctrl-C: 130, at once) and leaves no process behind. In a container
the command is PID 1: the runtime sends it SIGTERM and kills everything 30 s later, or as soon as it exits; the
checkpoint saved for the stop is whole (a resume from such a stop ending as the uninterrupted run: test_faults.py, one
process, and test_machines.py, two). A setup error prints one `error:` line and exits 2, without a traceback
(accelerate's and torchrun's included).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import psutil
import pytest
from _launch import CHEAP, ROOT, SETTINGS, one_error, run_sft, sft_command, sft_env, still_running

from probdiff_callback.cli import main as probdiff
from probdiff_callback.runs.checkpoints import checkpoint_problem, checkpoints

pytestmark = pytest.mark.slow  # every test here starts processes

GRACE_S = 30  # Kubernetes' default terminationGracePeriodSeconds: SIGTERM, then SIGKILL for all
LONG = ["recipe=blog", *[a for a in CHEAP if not a.startswith("max_steps")], "max_steps=50"]  # stopped long before


@dataclass
class Stopped:
    """How a command ended after a stop signal."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float  # from the signal to the command's exit
    left: list[str] = field(default_factory=list)  # its processes alive after it exited (before any hard kill)
    hard_killed: bool = False


@cache
def pid_namespaces() -> bool:
    """Whether this machine lets us start a process as PID 1 of a new PID namespace, as a container runtime does."""
    unshare = shutil.which("unshare")
    probe = [unshare, "--pid", "--fork", "--mount-proc", "true"] if unshare else None
    return probe is not None and subprocess.run(probe, capture_output=True).returncode == 0


def run_and_stop(
    command: list[str], cwd: Path, send: Callable[[psutil.Process], None], grace_s: float | None = None
) -> Stopped:
    """Start `command` in `cwd` (in a process group of its own, as a shell's job), send a signal with `send(target)`
    once checkpoint-1 is saved, and wait for the command to exit: up to `grace_s`, then SIGKILL for every process of
    the run, as a container runtime does (None: as long as it takes, up to 5 minutes)."""
    out, err = cwd / "stdout.txt", cwd / "stderr.txt"
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen(command, cwd=cwd, env=sft_env(), stdout=stdout, stderr=stderr,
                                   start_new_session=True)  # fmt: skip
    launched = psutil.Process(process.pid)
    seen: dict[int, psutil.Process] = {}
    deadline = time.time() + 300
    while not (cwd / "run/checkpoint-1/trainer_state.json").is_file():
        assert process.poll() is None, err.read_text()[-3000:]
        assert time.time() < deadline, "no checkpoint-1 within 5 minutes"
        seen |= {child.pid: child for child in launched.children(recursive=True)}
        time.sleep(0.1)
    seen |= {child.pid: child for child in launched.children(recursive=True)}
    signalled = time.time()
    send(launched)
    hard_killed = False
    try:
        process.wait(timeout=300 if grace_s is None else grace_s)
    except subprocess.TimeoutExpired:
        hard_killed = True
        kill([launched, *seen.values()])
        process.wait()
    seconds = time.time() - signalled
    left = still_running(seen.values())
    kill(seen.values())  # the runtime's kill of the rest (a test that failed must not leave them running)
    return Stopped(process.returncode, out.read_text(), err.read_text(), seconds, left, hard_killed)


def kill(processes: Iterable[psutil.Process]) -> None:
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def to_the_command(signum: int) -> Callable[[psutil.Process], None]:
    return lambda launched: launched.send_signal(signum)


def to_its_group(signum: int) -> Callable[[psutil.Process], None]:
    """A signal to the process group (`kill -TERM -PGID`, a terminal's Ctrl-C, SLURM's job step)."""
    return lambda launched: os.killpg(launched.pid, signum)


def to_pid_1(signum: int) -> Callable[[psutil.Process], None]:
    """`docker stop` / a pod's termination: the signal to the container's main process, PID 1 of its namespace."""
    return lambda unshare: unshare.children()[0].send_signal(signum)


def assert_clean_stop(stopped: Stopped, command_line: str, signame: str = "SIGTERM") -> Path:
    """Exit 0 after the checkpoint; the continue line (printed before the exit: no process was left to print it);
    no traceback; the checkpoint whole. Returns the checkpoint."""
    assert stopped.returncode == 0, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    assert not stopped.left and not stopped.hard_killed, stopped.left
    assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    lines = [line for line in stopped.stdout.splitlines() if line.startswith(f"stopped by {signame}: saved ")]
    assert len(lines) == 1, stopped.stdout[-3000:]  # (`accelerate launch` as PID 1 ignores SIGTERM: it has no handler)
    line = lines[0]
    saved = line.removeprefix(f"stopped by {signame}: saved ").split(". Continue with: ")[0]
    assert line.endswith(f". Continue with: {command_line} resume=true"), line
    assert Path(saved).parent.name == "run" and Path(saved).name not in ("checkpoint-0", "checkpoint-1"), line
    return Path(saved)


TWO = ["--num_processes", "2", "--multi_gpu"]


# (SIGUSR1 to the command, its launcher passing it on, and no process left: e2e/test_slurm.py's requeue test, where
# the SLURM script's trap sends it; SIGTERM to the command alone: the container test below)
@pytest.mark.parametrize(
    "options, target, signum",
    [
        pytest.param(TWO, to_its_group, signal.SIGTERM, id="2 processes: SIGTERM to the group"),
        pytest.param(TWO, to_its_group, signal.SIGINT, id="2 processes: Ctrl-C"),
    ],
)  # fmt: skip
def test_a_stop_signal_ends_the_command_cleanly(options, target, signum, tmp_path, tiny_model_path):
    args = [*LONG, "output_dir=run"]
    stopped = run_and_stop([*sft_command(), *options, *args], tmp_path, target(signum))
    command_line = " ".join(["python train/sft.py", *options, *args])
    print(f"{' '.join(options) or 'no options'}, {target.__name__} {signum.name}: exit {stopped.returncode} "
          f"{stopped.seconds:.1f} s after the signal")  # fmt: skip
    if signum != signal.SIGINT:
        saved = assert_clean_stop(stopped, command_line, signum.name)
        assert (tmp_path / saved / "trainer_state.json").is_file()
    else:  # Ctrl-C: at once, without a checkpoint; the line names the last one and the command
        assert stopped.returncode == 130 and not stopped.left, stopped.stdout[-3000:] + stopped.stderr[-3000:]
        assert "Traceback" not in stopped.stderr and "KeyboardInterrupt" not in stopped.stderr, stopped.stderr[-3000:]
        hints = [line for line in stopped.stdout.splitlines() if line.startswith("interrupted: ")]
        assert hints == [f"interrupted: the last checkpoint is run/checkpoint-1. Continue with: {command_line} "
                         "resume=true"], stopped.stdout[-3000:]  # fmt: skip
    assert all((c / "trainer_state.json").is_file() for c in checkpoints(tmp_path / "run")), "no checkpoint cut off"


def test_a_container_stop_saves_a_whole_checkpoint_in_time(tmp_path, tiny_model_path):
    """The command as a container's main process: SIGTERM to it, SIGKILL for everything when it exits or 30 s later.
    It exits 0 in time with the whole checkpoint of the step it was in. Two processes: the command is their launcher,
    which passes the signal on and must outlast them. (With one process the command is the training process itself,
    and SIGTERM to it then resume=true is test_faults.py's step 3; a SIGTERM to a launcher of two processes then
    resume=true ending as the uninterrupted run: e2e/test_machines.py's steps 3 and 4, on two machines.)"""
    processes = 2
    args = [*SETTINGS, "output_dir=run"]
    command = [*sft_command(processes=processes), *args]
    if pid_namespaces():  # PID 1 of its own namespace: when it exits, the kernel kills every process left in it
        stopped = run_and_stop(["unshare", "--pid", "--fork", "--mount-proc", *command], tmp_path,
                               to_pid_1(signal.SIGTERM), GRACE_S)  # fmt: skip
    else:
        stopped = run_and_stop(command, tmp_path, to_the_command(signal.SIGTERM), GRACE_S)
    print(f"{processes} process(es), PID 1: {pid_namespaces()}: exit {stopped.returncode} {stopped.seconds:.1f} s "
          "after SIGTERM")  # fmt: skip
    saved = assert_clean_stop(stopped, " ".join(["python train/sft.py", *command[2:]]))
    assert checkpoint_problem(tmp_path / saved) is None, "the checkpoint saved for the stop is whole"


def test_a_setup_error_through_the_readme_command_is_one_line(tmp_path, capsys):
    """`python train/sft.py recipe=blog model=tiny probdiff.delta=abc`: one line and exit 2, the same line as
    `probdiff eval ... delta=abc` says (one validator for both). Every setup error ends through train/sft.py's `main`
    as this one does: the others are met there, in the test's process (test_sft.py's configuration and data errors,
    test_run_lock.py's run in use, e2e/test_checkpoints.py's checkpoints it cannot resume from)."""
    training = one_error(run_sft(["recipe=blog", "model=tiny", "probdiff.delta=abc"], tmp_path))
    queries = str(ROOT / "data" / "samples" / "blog" / "heldout.jsonl")
    assert probdiff(["eval", "--queries", queries, "--out", str(tmp_path / "o"), "delta=abc"]) == 2
    evaluation = capsys.readouterr().err
    expected = "command line: wrong type for ProbDiff setting 'delta': got 'abc', expected float"
    assert training == f"error: {expected}"
    assert evaluation.strip().splitlines()[-1] == f"probdiff eval: error: {expected}"


def test_setup_errors_through_the_launcher(tmp_path, tiny_model_path):
    """With two training processes the error is said once, and neither torchrun nor accelerate add a word: by the
    command itself where its check before the imports sees it (training/precheck.py), else by the main training process
    (SFTConfig's own checks, after the imports)."""
    launched = run_sft(["recipe=blog", "model=tiny", "lerning_rate=1"], tmp_path, processes=2)
    assert "unknown key 'lerning_rate'" in one_error(launched)
    assert launched.stdout == ""
    launched = run_sft(["recipe=blog", "model=tiny", "report_to=none", "deepspeed=/nope.json"], tmp_path, processes=2)
    assert "SFTConfig rejects deepspeed='/nope.json' (command line)" in one_error(launched)
    # accelerate's own checks of its options
    bad_option = subprocess.run([*sft_command(), "--multi_gpu", "--num_processes", "1", "recipe=blog"], cwd=tmp_path,
                                env=sft_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert "at least 2 processes to use `--multi_gpu`" in one_error(bad_option)
