"""`probdiff.async_eval=true` at the command users start (`python train/sft.py`, one process or two): a stop signal
keeps the queue, `resume=true` and an evaluator evaluate what is left, each step once, and the end's table, the
history and RUN_DIR/best hold every step.

The evaluator is the FAKE one (tests/_fake_evaluator.py), started beside the command as a user starts `probdiff watch
RUN_DIR` with `evaluator=external` (another node, a SLURM job step), until the real one exists on this branch.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from _launch import CHEAP, sft_command, sft_env

from probdiff_callback.analysis.select import select
from probdiff_callback.runs import queue as q
from probdiff_callback.runs.run_files import read_run

pytestmark = pytest.mark.slow  # every test here starts processes

FAKE = Path(__file__).resolve().parents[1] / "_fake_evaluator.py"
STEPS = 4
CONFIDENCES = {0: 0.25, 1: 0.5, 2: 1.0, 3: 0.5, 4: 0.75}  # the FAKE evaluator's: step 2 is the best
ARGS = [
    "recipe=blog",
    *[a for a in CHEAP if not a.startswith(("max_steps", "probdiff.n_queries"))],
    f"max_steps={STEPS}",
    "probdiff.n_queries=4",
    "probdiff.async_eval=true",
    "probdiff.evaluator=external",
    "output_dir=run",
]


def start_evaluator(cwd: Path, name: str) -> subprocess.Popen:
    """The FAKE evaluator as a user starts `probdiff watch run` beside the command: two seconds per step."""
    env = sft_env(FAKE_CONFIDENCES=json.dumps(CONFIDENCES), FAKE_SECONDS="2")
    with (cwd / f"{name}.txt").open("w") as out:
        return subprocess.Popen([sys.executable, str(FAKE), "run"], cwd=cwd, env=env, stdout=out, stderr=out)


def evaluated_steps(cwd: Path, name: str) -> list[int]:
    lines = (cwd / f"{name}.txt").read_text().splitlines()
    return [int(line.split()[1].rstrip(":")) for line in lines if line.startswith("step ") and "evaluated" in line]


@pytest.mark.parametrize("processes", [1, 2], ids=["1 process", "2 processes"])
def test_a_stop_then_resume_evaluates_every_step_once_beside_training(processes, tmp_path):
    first = start_evaluator(tmp_path, "evaluator-1")
    command = [*sft_command(processes=processes), *ARGS]
    with (tmp_path / "stopped.txt").open("w") as out:
        training = subprocess.Popen(command, cwd=tmp_path, env=sft_env(), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
    deadline = time.time() + 600
    while not (tmp_path / "run/checkpoint-2/trainer_state.json").is_file():
        assert training.poll() is None, (tmp_path / "stopped.txt").read_text()[-3000:]
        assert time.time() < deadline, "no checkpoint-2 within 10 minutes"
        time.sleep(0.2)
    training.send_signal(signal.SIGTERM)
    assert training.wait(300) == 0, (tmp_path / "stopped.txt").read_text()[-3000:]
    stopped = (tmp_path / "stopped.txt").read_text()
    assert "stopped by SIGTERM: saved run/checkpoint-" in stopped, stopped[-3000:]
    queue = q.queue_dir(tmp_path / "run", "probdiff")
    assert (queue / "training-ended").read_text() == "stopped\n"
    assert first.wait(300) == 0, "the evaluator finishes what the stopped run queued, then exits"
    saved = max(r.global_step for r in q.requests(queue))
    assert saved < STEPS and q.pending(queue) == []

    # resumed; its evaluator starts once this start has queued (the stopped start's `training-ended` is gone), as
    # the SLURM script in docs/async.md starts it
    resumed = subprocess.Popen([*command, "resume=true"], cwd=tmp_path, env=sft_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    while (queue / "training-ended").exists():
        assert resumed.poll() is None, resumed.communicate()
        time.sleep(0.2)
    second = start_evaluator(tmp_path, "evaluator-2")
    stdout, stderr = resumed.communicate(timeout=600)
    finished = subprocess.CompletedProcess(resumed.args, resumed.returncode, stdout, stderr)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert second.wait(300) == 0

    # each step evaluated once, by the evaluator of the run that queued it
    evaluated = evaluated_steps(tmp_path, "evaluator-1") + evaluated_steps(tmp_path, "evaluator-2")
    assert Counter(evaluated) == Counter(range(STEPS + 1)), evaluated
    summary = finished.stdout[finished.stdout.index("ProbDiff over training") :].split("\n\n")[0].splitlines()
    steps = [int(row.split()[0]) for row in summary[2:] if row.split()[0].isdigit()]
    assert steps == list(range(STEPS + 1)), "\n".join(summary)
    run = read_run(tmp_path / "run")
    assert [(row.global_step, row.confidence) for row in run.rows] == sorted(CONFIDENCES.items())
    best = select(run).best_checkpoint
    assert Path(best.checkpoint).name == "checkpoint-2"
    assert (tmp_path / "run/best").resolve() == (tmp_path / "run/checkpoint-2").resolve()
    assert "not evaluated yet" not in finished.stdout
