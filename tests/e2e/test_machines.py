"""Training across machines, as two machines on one host (`_launch.start_machines`: one launcher each, as `srun`
starts one per node, and one run directory): two machines from one empty model cache, what a lost machine does to the
other, a stop signal to one machine, a run directory that is not shared, and resumes that end as a run on one machine
does. (ZeRO-3 across machines from one empty cache: e2e/test_slurm.py's requeue test.)"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import psutil
import pytest
from _faults import FAULT_ENV
from _launch import SETTINGS, assert_same_run, history_rows, start_machines, table

from probdiff_callback.models.cache import is_complete
from probdiff_callback.runs.checkpoints import checkpoints

pytestmark = pytest.mark.slow  # every test here starts processes

NOT_FINISHED = 75  # training/run_dir.py's RUN_NOT_FINISHED: what a scheduler or a requeue script reads


def training_on(machines, machine: int, seconds: float = 300) -> None:
    """Wait until `machine`'s training process handles SIGTERM: its PreemptionCallback is in place (training began)."""
    launcher, deadline = psutil.Process(machines.launchers[machine].pid), time.time() + seconds
    while True:
        assert machines.launchers[machine].poll() is None, machines.output(machine)[-3000:]
        assert time.time() < deadline, f"machine {machine} did not begin training within {seconds:.0f} s"
        for process in launcher.children():
            try:
                caught = int(Path(f"/proc/{process.pid}/status").read_text().split("SigCgt:")[1].split()[0], 16)
            except (OSError, IndexError):
                continue
            if caught & (1 << (signal.SIGTERM - 1)):
                return
        time.sleep(0.1)


def one_line(output: str, start: str) -> str:
    lines = [line.strip() for line in output.splitlines() if start in line]
    assert len(lines) == 1, output[-3000:]
    assert "Traceback" not in output and "DistStoreError" not in output, output[-3000:]
    return lines[0][lines[0].index(start) :]


def test_a_lost_machine_a_lost_launcher_and_a_stop_then_a_resume_end_as_one_machines_run(tmp_path, uninterrupted):
    reference_run, reference_stdout = uninterrupted(2)  # one machine, two processes
    args = [*SETTINGS, "output_dir=run"]
    run, cache = tmp_path / "run", tmp_path / "cache"
    shared = {"PROBDIFF_CACHE": str(cache)}  # one model cache, empty at the first start, as on a network file system
    continue_with = re.escape(f"{' '.join(args)} resume=true (on each of the 2 machines, with its --machine_rank)")

    # 1. from the empty cache: one machine makes each model file, outside any process group, and the other waits and
    #    uses it. Machine 1's training process killed -9 in step 2's evaluation (its connections close, as when the
    #    machine is lost): machine 0 stops at its next collective with one line and exit status 75
    machines = start_machines(args, tmp_path, env_of={0: shared, 1: {**shared, FAULT_ENV: "answers-done:3"}})
    statuses = machines.wait()
    made = machines.output(0) + machines.output(1)
    assert made.count("Unpacking the `tiny` model") == 1 and made.count("Converting the Qwen v1 vocabulary") == 1
    model_dirs = [p for p in (cache / "models").iterdir() if p.is_dir()]  # no temporary copies left behind
    assert len(model_dirs) == 1 and is_complete(model_dirs[0])
    line = one_line(machines.output(0), "the run did not finish:")
    assert statuses[0] == NOT_FINISHED, machines.output(0)[-3000:]
    assert re.fullmatch(
        rf"the run did not finish: machine 1 is gone \(Connection closed by peer .*; exit status 75\)\. "
        rf"Continue from the last checkpoint with: python train/sft.py .*{continue_with}",
        line,
    ), line
    assert "was killed by SIGKILL" in machines.output(1)
    assert [c.name for c in checkpoints(run)] == ["checkpoint-1"]
    assert [r["global_step"] for r in history_rows(run)] == [0, 1]

    # 2. resumed on both; machine 1's launcher killed -9 (its training process gets SIGTERM): every rank saves the next
    #    step and stops, machine 0 with exit status 75, without waiting in torch's exit barrier
    machines = start_machines([*args, "resume=true"], tmp_path, env_of={0: shared, 1: shared})
    training_on(machines, 1)
    machines.launchers[1].kill()
    statuses = machines.wait()
    line = one_line(machines.output(0), "the run did not finish:")
    assert statuses[0] == NOT_FINISHED, machines.output(0)[-3000:]
    lost = r"the run did not finish: machine 1 lost its launcher \(accelerate launch\), so every rank saved "
    saved = re.fullmatch(
        rf"{lost}(run/checkpoint-\d) and stopped \(exit status 75\)\. Continue with: .*{continue_with}", line
    )
    assert saved and saved.group(1) == "run/checkpoint-2", line  # the step resumed into
    assert "exit barrier" not in machines.output(0)  # the failure skipped it: nothing to wait for

    # 3. resumed on both; SIGTERM to machine 1's launcher (a scheduler's stop on one node): both save the same step
    #    and exit 0, as a stopped run does
    machines = start_machines([*args, "resume=true"], tmp_path, env_of={0: shared, 1: shared})
    training_on(machines, 1)
    machines.launchers[1].terminate()
    assert machines.wait() == [0, 0], machines.output(0)[-3000:] + machines.output(1)[-3000:]
    line = one_line(machines.output(0), "stopped by SIGTERM: saved ")
    assert re.fullmatch(rf"stopped by SIGTERM: saved run/checkpoint-[23]\. Continue with: .*{continue_with}", line), (
        line
    )

    # 4. resumed to the end: the history, records, Trainer log and table of the run on one machine
    machines = start_machines([*args, "resume=true"], tmp_path, env_of={0: shared, 1: shared})
    assert machines.wait() == [0, 0], machines.output(0)[-3000:] + machines.output(1)[-3000:]
    assert_same_run(reference_run, run)
    assert table(machines.output(0)) == table(reference_stdout)


def test_a_run_directory_each_machine_has_on_its_own_disk_stops_before_training(tmp_path):
    """Each machine's `output_dir=run` in a working directory of its own, as on a disk of its own: one error on each,
    before anything is trained."""
    own = {machine: tmp_path / f"disk-{machine}" for machine in (0, 1)}
    for folder in own.values():
        folder.mkdir()
    machines = start_machines([*SETTINGS, "output_dir=run"], tmp_path, cwd_of=own)
    assert machines.wait() == [2, 2], machines.output(0)[-3000:] + machines.output(1)[-3000:]
    line = one_line(machines.output(0), "error: ")
    assert line.startswith("error: run is not shared between the machines: machine 1 cannot see the lock machine 0 "
                           "wrote there (run.lock).")  # fmt: skip
    assert not (own[0] / "run" / "checkpoint-1").exists() and not (own[1] / "run" / "checkpoint-1").exists()
