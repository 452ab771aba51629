"""Faults a training job meets, on `tiny` in real processes: kill -9 at named places (`PROBDIFF_FAULT`) and from
outside, preemption by SIGTERM and SIGUSR1 mid-evaluation and between steps, an evaluation that runs out of memory
among them. After each chain of faults, `resume=true` ends with the uninterrupted run's history, records, Trainer
log and final table. (Two ranks, each on a machine of its own, one lost: e2e/test_machines.py.)"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _launch import SETTINGS, STEPS, assert_same_run, history_rows, run_sft, sft_env, table

from probdiff_callback.analysis.select import select_checkpoints
from probdiff_callback.runs.checkpoints import checkpoints
from probdiff_callback.runs.run_files import RunFiles, read_history

pytestmark = pytest.mark.slow  # every test here starts processes

OOM_AT_STEP_1 = "answers-done:2=OOM"  # the baseline's answers are visit 1: step 1's evaluation runs out of memory


def assert_no_stray_files(run: Path) -> None:
    assert not list(run.glob("**/.*.tmp*")), "no half-written file left behind"
    assert all((p / "trainer_state.json").is_file() for p in checkpoints(run)), "every checkpoint-N complete"


@pytest.fixture(scope="module")
def uninterrupted_with_oom_at_step_1(tmp_path_factory, tiny_model_path):
    """The uninterrupted run, with the same out-of-memory evaluation at step 1 as the interrupted ones."""
    cwd = tmp_path_factory.mktemp("reference")
    result = run_sft([*SETTINGS, "output_dir=run"], cwd, PROBDIFF_FAULT=OOM_AT_STEP_1)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = history_rows(cwd / "run")
    # fail-soft: the failed evaluation is a row with NaN metrics, counted, and training went on to the end
    assert [r["global_step"] for r in rows] == [0, 1, 2, 3, 4] and rows[1]["summary"] is None
    assert "OutOfMemoryError" in rows[1]["error"]
    assert "failed evaluations (see `error` in the history): steps 1" in result.stdout
    return cwd / "run", result.stdout


def test_kill_9_and_preemption_at_named_places_then_resume(uninterrupted_with_oom_at_step_1, tmp_path):
    """One run through six faults, each followed by `resume=true`; it ends as the uninterrupted run."""
    args = [*SETTINGS, "output_dir=run"]
    run = tmp_path / "run"

    def start(fault: str, resume: bool = True) -> subprocess.CompletedProcess:
        return run_sft([*args, *(["resume=true"] if resume else [])], tmp_path, PROBDIFF_FAULT=fault)

    # 1. kill -9 in step 1's evaluation, revisions done: no checkpoint yet, so the resume starts over
    killed = start("revisions-done:2", resume=False)
    assert killed.returncode == -signal.SIGKILL
    assert [r["global_step"] for r in history_rows(run)] == [0]
    # 2. from scratch (said so): step 1 runs out of memory (fail-soft), kill -9 with step 3's records written and
    #    its history row not yet: the history ends at step 2, and step 3's records are not named by any row
    killed = start(f"{OOM_AT_STEP_1},records-written:3")
    assert "has no checkpoint yet; starting from step 0" in killed.stdout
    # the job killed with -9 left its lock file's text; the kernel dropped the lock, and this job takes it over
    assert f"run.lock: taking over the lock of host {socket.gethostname()}, pid " in killed.stdout
    assert killed.returncode == -signal.SIGKILL
    assert [r["global_step"] for r in history_rows(run)] == [0, 1, 2] and (run / "probdiff/step-3").is_dir()
    # 3. resumed from checkpoint-2: SIGTERM arrives in step 3's evaluation, which is abandoned; checkpoint-3 is saved
    #    with its row marked abandoned, and the process exits 0 with one line naming it and the command
    preempted = start("answers-done:1=TERM")
    assert preempted.returncode == 0, preempted.stdout[-3000:] + preempted.stderr[-3000:]
    assert "received SIGTERM: saving a checkpoint at the end of this step, then stopping" in preempted.stderr
    line = next(line for line in preempted.stdout.splitlines() if line.startswith("stopped by SIGTERM"))
    assert line == "stopped by SIGTERM: saved run/checkpoint-3. Continue with: python train/sft.py " + (
        " ".join(args) + " resume=true"
    )
    assert (run / "run.lock").read_text() == "", "a preemption's stop releases the run directory cleanly"
    assert select_checkpoints(run).abandoned_steps == [3]
    rows = history_rows(run)
    assert rows[-1]["global_step"] == 3 and rows[-1]["abandoned"] and rows[-1]["eval_loss"] is not None
    assert (run / "checkpoint-3/trainer_state.json").is_file() and not (run / "checkpoint-4").exists()
    # 4. resumed from checkpoint-3: step 3 is evaluated first; kill -9 with checkpoint-4's weights saved, its
    #    optimizer and trainer state not
    killed = start("checkpoint-weights-saved:1")
    assert killed.returncode == -signal.SIGKILL
    assert (run / "checkpoint-4/adapter_model.safetensors").is_file()
    assert not (run / "checkpoint-4/trainer_state.json").exists()
    # 5. resume=true sets the cut-off checkpoint-4 aside and continues from checkpoint-3; SIGTERM in step 4's
    #    evaluation, the last step's: checkpoint-4 of 4 is saved with its row abandoned
    preempted = start("answers-done:1=TERM")
    assert preempted.returncode == 0, preempted.stdout[-3000:] + preempted.stderr[-3000:]
    assert (
        "resume=true: skipping checkpoint-4 (its save was cut off: no checkpoint-4/trainer_state.json). "
        in (preempted.stdout)
        and "Continuing from run/checkpoint-3" in preempted.stdout
    )
    assert "set run/checkpoint-4 aside as incomplete-checkpoint-4" in preempted.stdout
    assert (run / "incomplete-checkpoint-4/adapter_model.safetensors").is_file()
    assert "stopped by SIGTERM: saved run/checkpoint-4. Continue with: " in preempted.stdout, preempted.stdout[-3000:]
    assert [(r["global_step"], bool(r.get("abandoned"))) for r in history_rows(run)][-1] == (4, True)
    # 6. resumed from checkpoint-4: step 4 is evaluated and the run ends there (transformers' loop, which checks
    #    max_steps only after a step, would train a step 5: another checkpoint, evaluation and history row)
    finished = start("")
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert [c.name for c in checkpoints(run)] == [f"checkpoint-{step}" for step in range(1, STEPS + 1)]

    assert_same_run(uninterrupted_with_oom_at_step_1[0], run)
    assert table(finished.stdout) == table(uninterrupted_with_oom_at_step_1[1])
    assert "failed evaluations (see `error` in the history): steps 1" in finished.stdout
    assert_no_stray_files(run)


def test_a_history_write_cut_off_leaves_the_previous_history(tmp_path):
    """kill -9 between writing the history's temporary file and renaming it: the history holds the rows before."""
    script = (
        "from probdiff_callback.runs.run_files import HistoryRow, RunFiles\n"
        f"files = RunFiles({str(tmp_path)!r})\n"
        "files.continue_from(0)\n"
        "files.add(HistoryRow(0, kind='baseline'), [{'id': 'a', 'd': 0.5}])\n"
        "files.add(HistoryRow(1), [{'id': 'a', 'd': 0.7}])\n"
    )
    killed = subprocess.run(
        [sys.executable, "-c", script], env=sft_env(PROBDIFF_FAULT="history-tmp-written:3"), capture_output=True
    )
    assert killed.returncode == -signal.SIGKILL
    assert [row.global_step for row in read_history(tmp_path / "probdiff/history.jsonl")] == [0]
    assert list((tmp_path / "probdiff").glob(".history.jsonl.tmp*")), "the cut-off write is the temporary file"
    kept, dropped = RunFiles(tmp_path).continue_from(0)
    assert (kept, dropped) == ([], 1) and not list((tmp_path / "probdiff").glob(".*.tmp*"))


def test_a_process_started_with_a_bad_fault_plan_stops_at_once():
    """Python would print an error in `sitecustomize` and run on, without the faults the test counts on."""
    started = subprocess.run(
        [sys.executable, "-c", "print('ran')"], env=sft_env(PROBDIFF_FAULT="answers:2"), capture_output=True, text=True
    )
    assert started.returncode == 2 and started.stdout == ""
    assert started.stderr.startswith("error: PROBDIFF_FAULT=answers:2: 'answers:2' is not <place>[:<n>][=<fault>]")
