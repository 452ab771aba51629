"""`probdiff.async_eval=true` at the command users start (`python train/sft.py`), with the evaluator it starts beside
itself (`probdiff watch RUN_DIR --started-by-training`, the real one): a stop signal keeps the queue; `resume=true`
evaluates what is left while its evaluator is killed once mid-evaluation (kill -9) and started again; each step is
evaluated once, and the end's table, the history, RUN_DIR/best and the last checkpoint's trainer state hold every step
and the same best checkpoint. Two processes beside training, stopped and resumed, are e2e/test_slurm.py's two
machines (stopped by the time limit's SIGUSR1, requeued, continued).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from _launch import CHEAP, sft_command, sft_env

from probdiff_callback.analysis.select import select
from probdiff_callback.runs.queue import Queue, evaluator_holder
from probdiff_callback.runs.run_files import read_run

pytestmark = pytest.mark.slow  # every test here starts processes

STEPS = 4
ARGS = [
    "recipe=blog",
    *[a for a in CHEAP if not a.startswith(("max_steps", "probdiff.n_queries"))],
    f"max_steps={STEPS}",
    "probdiff.n_queries=4",
    "probdiff.async_eval=true",
    "output_dir=run",
]
# probdiff watch's lines for a step it finished and for one it started
FINISHED = re.compile(r"^probdiff watch: step (\d+): \d+ queries in ", re.MULTILINE)
STARTED = re.compile(r"^probdiff watch: step (\d+) \(", re.MULTILINE)


def test_a_stop_then_resume_with_the_evaluator_killed_evaluates_every_step_once(tmp_path):
    command = [*sft_command(), *ARGS]
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
    queue = Queue(tmp_path / "run")
    assert queue.ended() == "stopped"
    assert evaluator_holder(queue) is None, "the evaluator the command started ended with it"
    saved = max(r.global_step for r in queue.requests())
    assert saved < STEPS

    # resumed, its evaluator killed at its first answers (once: the one it starts again is not)
    env = sft_env(PROBDIFF_FAULT="answers-done=KILL", PROBDIFF_FAULT_ONCE=str(tmp_path / "killed"))
    finished = subprocess.run([*command, "resume=true"], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=900)  # fmt: skip
    output = finished.stdout + finished.stderr
    assert finished.returncode == 0, output[-3000:]
    assert (tmp_path / "killed").is_file(), "the fault acted"
    assert re.search(r"the evaluator \(pid \d+\) exited with status -9 .*; starting it again \(1 of 3\)", output)
    assert evaluator_holder(queue) is None and queue.pending() == []

    # each step evaluated to its end once; the killed step started twice
    log = queue.log_path.read_text()
    assert Counter(int(s) for s in FINISHED.findall(log)) == Counter(range(STEPS + 1)), log[-3000:]
    started = Counter(int(s) for s in STARTED.findall(log))
    assert sum(started.values()) >= STEPS + 2, "the killed step was started again"
    table = finished.stdout[finished.stdout.index("ProbDiff over training") :].split("\n\n")[0].splitlines()
    steps = [int(row.split()[0]) for row in table[2:] if row.split()[0].isdigit()]
    assert steps == list(range(STEPS + 1)), "\n".join(table)
    assert "not evaluated yet" not in output

    # one best checkpoint: probdiff select's, RUN_DIR/best, and the Trainer's in the last checkpoint's state
    run = read_run(tmp_path / "run")
    assert [row.global_step for row in run.rows] == list(range(STEPS + 1)) and not any(r.failed for r in run.rows)
    best = select(run).best_checkpoint.checkpoint
    assert (tmp_path / "run/best").resolve() == (tmp_path / "run" / Path(best).name).resolve()
    state = json.loads((tmp_path / f"run/checkpoint-{STEPS}/trainer_state.json").read_text())
    assert (tmp_path / state["best_model_checkpoint"]).resolve() == (tmp_path / "run/best").resolve()
    logged = sorted(e["step"] for e in state["log_history"] if "eval_probdiff_confidence" in e)
    assert logged == list(range(STEPS + 1)), "every step's late result is in the Trainer's log history"
