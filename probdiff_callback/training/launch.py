"""The command users start, `python train/sft.py [accelerate launch options] recipe=NAME [key=value ...]`, and the
launcher it becomes when training takes more than its own process.

`accelerate launch` cannot be the process a terminal, a container runtime or SLURM signals. For one training process
it dies of SIGTERM at once (exit 143), and the training process saves and prints its continue line in the
background; a container runtime, seeing its main process gone, kills the save (and as the container's PID 1, without
a handler, it ignores SIGTERM: training goes on until the SIGKILL). For several, torchrun (inside it)
forwards SIGTERM, kills the training processes 30 s later whether they are done or not, and exits 1 with its
traceback. A setup error ends in accelerate's traceback and exit 1.

So the training script is the command. It trains in its own process where `accelerate launch` would start one plain
process: no launcher options, no `accelerate config` file, at most one GPU. Otherwise it runs `accelerate launch` in
this process (accelerate's parser, config files and launchers, torchrun for several processes) on itself, and stays
the process that is signalled:

- SIGTERM, SIGUSR1 and SIGINT go on to the training processes, once each: they are outside this process's group, so a
  signal to the group or a terminal's Ctrl-C reaches them only through here. They save and stop (Ctrl-C: they stop at
  once), and this process waits for them. torchrun is told to leave these signals alone.
- It exits with their status and without accelerate's or torchrun's traceback: 0 after a clean stop, 2 on a setup
  error (the training process says it in one `error:` line), 130 after Ctrl-C, 128+N when one was killed by signal N
  (said in one line unless the signal was the one passed on), 75 when a machine lost its launcher (preemption.py).
- Across machines, torchrun's agent waits after its training processes succeeded until every other machine's agent
  says the same (its exit barrier: 300 s, which torch 2.13 does not let anyone change). A lost machine never says it.
  This launcher waits `PROBDIFF_EXIT_BARRIER_TIMEOUT` seconds (EXIT_BARRIER_SECONDS) once its own training
  processes have exited, then exits with their status (0: only a success reaches the barrier) and a line.

Imports stay light here: the launcher process loads accelerate and torch, never the training stack.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
from argparse import Namespace
from typing import TYPE_CHECKING

from probdiff_callback.runtime.parent import set_parent_death_signal
from probdiff_callback.runtime.threads import LAUNCHER_PID_ENV

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

# The launcher's options, in the environment of the training processes it starts, for the continue line (and its pid,
# LAUNCHER_PID_ENV: how they know it; threads.py reads the user's OMP_NUM_THREADS from its environment)
LAUNCH_OPTIONS_ENV = "PROBDIFF_LAUNCH_OPTIONS"
ENTRY_ENV = "PROBDIFF_TRAIN_ENTRY"  # how the command was started, where it is not train/sft.py
PASSED_ON = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# torchrun (`--signals_to_handle`, read from PET_SIGNALS_TO_HANDLE) keeps its own handling only for these
TORCHRUN_SIGNALS = "SIGHUP,SIGQUIT"
USAGE = "python train/sft.py [accelerate launch options] recipe=NAME [key=value ...]"
# How long a launcher on several machines waits for the others once its training processes succeeded: well inside
# SLURM's default KillWait (30 s between its SIGTERM and SIGKILL), and far longer than agents that are alive need
EXIT_BARRIER_ENV = "PROBDIFF_EXIT_BARRIER_TIMEOUT"
EXIT_BARRIER_SECONDS = 10.0


def split_arguments(argv: list[str]) -> tuple[list[str], list[str]]:
    """(launcher options, the training script's `key=value` arguments). The options come first, as in
    `accelerate launch`; an option's value never has the form key=value."""
    if not argv or not argv[0].startswith("-"):
        return [], argv
    for index, arg in enumerate(argv):
        if not arg.startswith("-") and "=" in arg:
            return argv[:index], argv[index:]
    return argv, []


def asked_processes(launcher_command: str) -> int | None:
    """The `--num_processes N` (or `--num_processes=N`) of the command that launched this process, None without."""
    words = launcher_command.split()
    for index, word in enumerate(words):
        value = None
        if word == "--num_processes" and index + 1 < len(words):
            value = words[index + 1]
        elif word.startswith("--num_processes="):
            value = word.partition("=")[2]
        if value is not None:
            return int(value) if value.isdigit() else None
    return None


def processes_line(world_size: int, launcher_command: str) -> str:
    """How many processes train; where the launching command asked for more than started (accelerate runs one
    process on a CPU, or on fewer GPUs than asked, unless told how to run several), the flag that gives them."""
    line = f"{world_size} training process{'es' if world_size != 1 else ''}"
    asked = asked_processes(launcher_command)
    if asked is not None and asked > world_size:
        line += (
            f"; {asked} were asked for (--num_processes {asked}), but accelerate started {world_size}: add "
            f"--multi_gpu for several processes (DDP; on a CPU too, `--num_processes {asked} --multi_gpu`), or a "
            "--config_file of recipes/accelerate/ (zero3.yaml: ZeRO-3)"
        )
    return line


def under_a_launcher() -> bool:
    """This process is a training process: started by this launcher, `accelerate launch` or torchrun."""
    return any(name in os.environ for name in (LAUNCHER_PID_ENV, "LOCAL_RANK", "ACCELERATE_USE_CPU"))


def needs_launcher(options: list[str]) -> bool:
    """Whether `accelerate launch` has something to do: options, a default `accelerate config` file (the setup the
    user chose for `accelerate launch`), or several GPUs (one process each)."""
    if under_a_launcher():
        return False
    if options:
        return True
    import torch
    from accelerate.commands.config import default_config_file

    return os.path.isfile(default_config_file) or torch.cuda.device_count() > 1


def training_command() -> str:
    """The command that started this run (without its key=value arguments), for the lines that say how to go on."""
    options = os.environ.get(LAUNCH_OPTIONS_ENV, "")
    return f"{os.environ.get(ENTRY_ENV, 'python train/sft.py')} {options}".rstrip()


def follow_launcher() -> None:
    """In a training process this launcher started: get SIGTERM when the launcher dies (a clean stop, as on a
    preemption, instead of training on alone), and leave its process group, so that a signal to that group or a
    terminal's Ctrl-C reaches the training process once, through the launcher."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is None or sys.platform != "linux":
        return
    set_parent_death_signal(signal.SIGTERM)
    if str(os.getppid()) != launcher:
        import psutil

        if not psutil.pid_exists(int(launcher)):  # it died before the line above: nobody waits for this process
            print(f"error: the launcher (pid {launcher}) is gone; not training", file=sys.stderr)
            sys.exit(1)
        return  # a stale variable in the environment of a process that no launcher of ours started
    try:
        if os.getpgid(0) == os.getpgid(int(launcher)):  # torchrun's workers have sessions of their own already
            os.setpgid(0, 0)
    except ProcessLookupError:  # the launcher died just now: the death signal is on its way
        pass


def main(argv: list[str], script: str | None, module: str | None = None) -> int:
    """Launch `script` (a file), or `module` (as `python -m`), with `argv` (launcher options, then its arguments); the
    training processes' exit status."""
    options, script_args = split_arguments(argv)
    if options in (["-h"], ["--help"]):
        print(f"usage: {USAGE}\n\nOptions before the key=value arguments are `accelerate launch`'s (accelerate launch "
              "--help). Recipes and keys: docs/configuration.md")  # fmt: skip
        return 0
    received: list[int] = []
    for signum in PASSED_ON:  # first: a signal during the imports below must not end this process alone
        signal.signal(signum, lambda signum, frame: pass_on(signum, received))
    target = [script] if script is not None else ["--module", str(module)]
    return launch(options, target, script_args, received)


def pass_on(signum: int, received: list[int]) -> None:
    """Send the signal to the training processes (this process's children). Before there is any, nothing has started
    that could be saved: stop here as the training process would (Ctrl-C: one line and 130; SIGTERM: 143)."""
    import psutil

    received.append(signum)
    children = psutil.Process().children()
    if not children:
        if signum == signal.SIGINT:
            print("interrupted before training started", flush=True)
        os._exit(128 + signum)  # leaves no child: one that forks from now on sees its launcher gone and stops
    for child in children:
        try:
            child.send_signal(signum)
        except psutil.NoSuchProcess:
            pass


def launch(options: list[str], target: list[str], script_args: list[str], received: list[int]) -> int:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    parser = launch_command_parser()
    parser.usage = USAGE
    args = parser.parse_args([*options, *target, *script_args])
    set_unset_defaults(args)
    os.environ.update({
        LAUNCHER_PID_ENV: str(os.getpid()), LAUNCH_OPTIONS_ENV: shlex.join(options),
        "PET_SIGNALS_TO_HANDLE": TORCHRUN_SIGNALS,
    })  # fmt: skip
    quiet_torchrun()
    watch_exit_barrier(exit_barrier_seconds())
    try:
        launch_command(args)
    except ValueError as err:  # accelerate's checks of the options
        print(f"error: {shlex.join(options) or 'accelerate launch'}: {err}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as err:  # one process (accelerate's simple launcher)
        return exit_status(err.returncode, "the training process", received)
    except ChildFailedError as err:  # several (torchrun)
        rank, failure = first_failure(err)
        return exit_status(failure.exitcode, f"the training process of rank {rank} (pid {failure.pid})", received)
    except SignalException as err:  # SIGHUP or SIGQUIT: torchrun stopped the training processes
        return 128 + err.sigval
    return 0


def quiet_torchrun() -> None:
    """torchrun's log, less what would tell the user nothing the run does not say itself: its lines on a training
    process that failed ("failed (exitcode: 2) local_rank: 1 ...", "Sending process ... closing signal"), where the
    training process said why and `exit_status` names a process killed by a signal; and the traceback of its exit
    barrier's race (pytorch/pytorch#69520), where the machine whose agent holds the rendezvous store leaves the barrier
    and exits before another has read it: that one's barrier fails on the closed connection, after every training
    process of the run succeeded (an agent only enters the barrier then)."""
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(not_the_exit_barrier_race)


def not_the_exit_barrier_race(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Error waiting on exit barrier")


def exit_barrier_seconds() -> float:
    """`PROBDIFF_EXIT_BARRIER_TIMEOUT`, or EXIT_BARRIER_SECONDS; a value that is not a number stops here."""
    value = os.environ.get(EXIT_BARRIER_ENV, "")
    try:
        seconds = float(value) if value else EXIT_BARRIER_SECONDS
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        print(f"error: {EXIT_BARRIER_ENV}={value!r}: give the seconds to wait, e.g. {EXIT_BARRIER_SECONDS:g}",
              file=sys.stderr)  # fmt: skip
        sys.exit(2)
    return seconds


def watch_exit_barrier(seconds: float) -> None:
    """A thread that ends this launcher `seconds` after its training processes have all exited, if torchrun's agent
    still waits in its exit barrier then (it only enters it after they all succeeded: exit status 0). It ends at once
    on one machine (torchrun's GROUP_WORLD_SIZE, in the training processes' environment, is the number of machines)."""
    import threading
    import time

    import psutil

    def watch() -> None:
        me, started = psutil.Process(), False
        while True:
            time.sleep(0.5)
            if children := me.children():
                if not started and (count := machines(children[0])) is not None:
                    if count == 1:
                        return
                    started = True
                continue
            if not started:
                continue
            time.sleep(seconds)
            if not me.children():
                print(f"the training processes on this machine finished, and {seconds:g} s later another machine's "
                      "launcher has still not (lost?): not waiting for it in torch's exit barrier "
                      f"({EXIT_BARRIER_ENV})", flush=True)  # fmt: skip
                os._exit(0)

    threading.Thread(target=watch, name="exit-barrier-watch", daemon=True).start()


def machines(training_process) -> int | None:
    """The number of machines a training process was started on (1 without torchrun); None while it cannot tell yet
    (a process not yet past its exec)."""
    import psutil

    try:
        environment = training_process.environ()
    except psutil.Error:
        return None
    if "GROUP_WORLD_SIZE" in environment:
        return int(environment["GROUP_WORLD_SIZE"])
    return 1 if "ACCELERATE_USE_CPU" in environment or "LOCAL_RANK" in environment else None


def first_failure(err: ChildFailedError) -> tuple[int, ProcessFailure]:
    """The rank that failed by itself: one that exited with an error, before any that torchrun then killed."""
    failures = err.failures
    exited = [rank for rank in sorted(failures) if failures[rank].exitcode > 0]
    rank = exited[0] if exited else err.get_first_failure()[0]
    return rank, failures[rank]


def exit_status(returncode: int, who: str, received: list[int]) -> int:
    """The shell's exit status for a training process's return code; a death by a signal that was not passed on
    (the OOM killer's SIGKILL, a crash) is said in one line."""
    if returncode >= 0:
        return returncode
    signum = -returncode
    if signum not in received:
        print(f"error: {who} was killed by {signal.Signals(signum).name}", file=sys.stderr)
    return 128 + signum


def set_unset_defaults(args: Namespace) -> None:
    """Without a config file, `accelerate launch` opens with a block of warnings naming the values it defaulted
    (`--num_processes was set to a value of 0`, ...): set the same values. One process per GPU (DDP on several), as
    accelerate would; one process on a CPU."""
    from accelerate.commands.config import default_config_file

    if args.config_file is not None or (os.path.isfile(default_config_file) and not args.cpu):
        return
    if args.num_processes is None:
        import torch

        gpus = torch.cuda.device_count()
        args.num_processes = max(gpus, 1)
        if gpus > 1 and not (args.multi_gpu or args.use_deepspeed or args.use_fsdp or args.cpu):
            args.multi_gpu = True
    args.num_machines = 1 if args.num_machines is None else args.num_machines
    if args.num_machines == 1 and args.main_process_port is None:
        args.main_process_port = 0  # a free port: a second job on the machine would find 29500 taken and stop
    args.mixed_precision = args.mixed_precision or "no"
    args.dynamo_backend = args.dynamo_backend or "no"
    # across machines this command is started on each (one launcher per machine, torchrun's), not pdsh from machine 0
    args.deepspeed_multinode_launcher = args.deepspeed_multinode_launcher or "standard"
