"""training/launch.py in this process: which arguments are the launcher's, when the script launches, the exit status it
reports, the defaults that keep accelerate's warning block away, and the command in the continue line.
(The launcher with real processes and signals: e2e/test_launcher_signals.py.)"""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from probdiff_callback.training import launch


def test_launcher_options_come_before_the_key_value_arguments():
    assert launch.split_arguments(["recipe=blog", "model=tiny"]) == ([], ["recipe=blog", "model=tiny"])
    assert launch.split_arguments(["--config_file", "recipes/accelerate/zero3.yaml", "recipe=blog", "lora.r=8"]) == (
        ["--config_file", "recipes/accelerate/zero3.yaml"],
        ["recipe=blog", "lora.r=8"],
    )
    assert launch.split_arguments(["--num_processes=2", "--multi_gpu", "recipe=blog"]) == (
        ["--num_processes=2", "--multi_gpu"],
        ["recipe=blog"],
    )
    # an option after the key=value arguments is the training script's (the recipe says it is not key=value)
    late = ["recipe=blog", "--num_processes", "2"]
    assert launch.split_arguments(late) == ([], late)
    assert launch.split_arguments(["--help"]) == (["--help"], [])


def test_a_training_process_never_launches_again(monkeypatch):
    for name in ("PROBDIFF_LAUNCHER_PID", "LOCAL_RANK", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    assert launch.needs_launcher(["--num_processes", "2"])
    monkeypatch.setenv("LOCAL_RANK", "0")  # torchrun's worker
    assert not launch.needs_launcher(["--num_processes", "2"])


def test_without_options_it_launches_only_where_accelerate_launch_would_start_more(monkeypatch, tmp_path):
    import accelerate.commands.config
    import torch

    for name in ("PROBDIFF_LAUNCHER_PID", "LOCAL_RANK", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(accelerate.commands.config, "default_config_file", str(tmp_path / "none.yaml"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert not launch.needs_launcher([])  # one process: this one
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert launch.needs_launcher([])  # one per GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    (tmp_path / "none.yaml").write_text("distributed_type: DEEPSPEED\n")
    assert launch.needs_launcher([])  # the user's `accelerate config`


def test_exit_status(capsys):
    assert launch.exit_status(0, "the training process", []) == 0
    assert launch.exit_status(2, "the training process", []) == 2  # a setup error: the process said it
    assert launch.exit_status(-signal.SIGTERM, "the training process", [signal.SIGTERM]) == 143  # the one passed on
    assert capsys.readouterr().err == ""
    assert launch.exit_status(-signal.SIGKILL, "the training process of rank 1 (pid 7)", [signal.SIGTERM]) == 137
    assert capsys.readouterr().err == "error: the training process of rank 1 (pid 7) was killed by SIGKILL\n"


def test_the_rank_that_failed_by_itself_is_reported_before_those_torchrun_then_stopped():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = {0: ProcessFailure(0, 10, -signal.SIGTERM, "<N/A>"), 1: ProcessFailure(1, 11, 2, "<N/A>")}
    rank, failure = launch.first_failure(ChildFailedError("train/sft.py", failures))
    assert (rank, failure.exitcode) == (1, 2)
    only_killed = {0: ProcessFailure(0, 10, -signal.SIGKILL, "<N/A>")}
    assert launch.first_failure(ChildFailedError("train/sft.py", only_killed))[0] == 0


@pytest.mark.parametrize("gpus, expected", [(0, (1, False)), (1, (1, False)), (8, (8, True))])
def test_the_values_accelerate_would_warn_about_are_set(gpus, expected, monkeypatch, tmp_path):
    import accelerate.commands.config
    import torch

    monkeypatch.setattr(accelerate.commands.config, "default_config_file", str(tmp_path / "none.yaml"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    args = SimpleNamespace(config_file=None, cpu=False, num_processes=None, num_machines=None, mixed_precision=None,
                           dynamo_backend=None, multi_gpu=False, use_deepspeed=False, use_fsdp=False,
                           main_process_port=None, deepspeed_multinode_launcher=None)  # fmt: skip
    launch.set_unset_defaults(args)
    assert (args.num_processes, args.multi_gpu) == expected
    assert args.deepspeed_multinode_launcher == "standard"  # one command per machine, not pdsh from machine 0
    assert (args.num_machines, args.mixed_precision, args.dynamo_backend) == (1, "no", "no")
    assert args.main_process_port == 0  # accelerate picks a free port: a second job on the machine does not collide
    given = SimpleNamespace(**{**vars(args), "config_file": "recipes/accelerate/zero3.yaml", "num_processes": None})
    launch.set_unset_defaults(given)
    assert given.num_processes is None  # a config file says it


def test_the_continue_line_names_the_command_with_its_options(monkeypatch):
    from probdiff_callback.training.run_dir import resume_command

    monkeypatch.delenv(launch.LAUNCH_OPTIONS_ENV, raising=False)
    assert resume_command(["recipe=blog", "model=tiny", "resume=false"]) == (
        "python train/sft.py recipe=blog model=tiny resume=true"
    )
    monkeypatch.setenv(launch.LAUNCH_OPTIONS_ENV, "--config_file recipes/accelerate/zero3.yaml")
    assert resume_command(["recipe=blog"]) == (
        "python train/sft.py --config_file recipes/accelerate/zero3.yaml recipe=blog resume=true"
    )


def test_the_run_says_how_many_processes_train_and_the_flag_when_fewer_started_than_asked():
    plain = "/usr/bin/python train/sft.py recipe=blog model=tiny"
    assert launch.processes_line(1, plain) == "1 training process"
    asked = "/venv/bin/python /venv/bin/accelerate launch --num_processes 2 train/sft.py recipe=blog model=tiny"
    assert launch.processes_line(2, asked.replace("--num_processes 2", "--num_processes 2 --multi_gpu")) == (
        "2 training processes"
    )
    line = launch.processes_line(1, asked)
    assert line.startswith("1 training process; 2 were asked for (--num_processes 2), but accelerate started 1")
    assert "--num_processes 2 --multi_gpu" in line
    ours = "/venv/bin/python train/sft.py --num_processes=4 recipe=blog"  # the training script as the launcher
    assert "4 were asked for (--num_processes 4)" in launch.processes_line(1, ours)


# ---- across machines: torchrun's exit barrier ----
WAITS_IN_THE_BARRIER = """
import subprocess, sys, time
from probdiff_callback.training import launch
launch.watch_exit_barrier(float(sys.argv[1]))
env = {"GROUP_WORLD_SIZE": sys.argv[2], "PATH": ""}
subprocess.run([sys.executable, "-c", "import time; time.sleep(1.5)"], env=env)  # this machine's training process
time.sleep(4)  # torchrun's agent in its exit barrier, waiting for a machine that is gone (the watch: 0.5 s)
sys.exit(7)
"""


@pytest.mark.slow  # starts processes: a stand-in torchrun agent and its training process
@pytest.mark.parametrize("machines", [2, 1])
def test_a_launcher_waits_in_the_exit_barrier_only_as_long_as_asked(machines):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", WAITS_IN_THE_BARRIER, "0.5", str(machines)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    if machines == 1:  # one machine: nothing to wait for, and the watch leaves the agent alone
        assert done.returncode == 7 and done.stdout == "", done.stderr
        return
    assert done.returncode == 0, done.stderr  # only training processes that all succeeded reach the barrier
    # ended by the watch (0), not by the stand-in barrier's end (7)
    assert "another machine's launcher has still not (lost?)" in done.stdout and launch.EXIT_BARRIER_ENV in done.stdout


def test_the_exit_barrier_timeout_is_read_from_the_environment(monkeypatch, capsys):
    monkeypatch.delenv(launch.EXIT_BARRIER_ENV, raising=False)
    assert launch.exit_barrier_seconds() == launch.EXIT_BARRIER_SECONDS
    monkeypatch.setenv(launch.EXIT_BARRIER_ENV, "45")
    assert launch.exit_barrier_seconds() == 45.0
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv(launch.EXIT_BARRIER_ENV, bad)
        with pytest.raises(SystemExit) as stopped:
            launch.exit_barrier_seconds()
        assert stopped.value.code == 2
        assert capsys.readouterr().err == (
            f"error: PROBDIFF_EXIT_BARRIER_TIMEOUT={bad!r}: give the seconds to wait, e.g. 10\n"
        )


def test_torchruns_exit_barrier_race_leaves_no_traceback_and_its_other_errors_stay(caplog):
    """pytorch/pytorch#69520: a machine's agent fails its exit barrier on the connection the other machine closed when
    it left (seen here as a traceback after a clean stop on two machines, e2e/test_slurm.py)."""
    import logging

    agent = logging.getLogger("torch.distributed.elastic.agent.server.api")
    filters = list(agent.filters)
    try:
        launch.quiet_torchrun()
        with caplog.at_level(logging.INFO, logger=agent.name):
            try:
                raise ConnectionError("Failed to recv, got 0 bytes. Connection was likely closed.")
            except ConnectionError:
                agent.exception("Error waiting on exit barrier. Elapsed: %s seconds", 0.02)
            agent.error("Rendezvous failed")
    finally:
        agent.filters[:] = filters
    assert [record.getMessage() for record in caplog.records] == ["Rendezvous failed"]
