"""The training side of the evaluation beside training (`async_eval`): `ProbDiffCallback` queues the loop's steps with
their eval losses and weights, starts (and restarts) the local evaluator, logs the late results at their own steps
(the Trainer's log, W&B, the best checkpoint), guards rotation and waits at the end; a preemption stops without
waiting and a resumed run evaluates what is left.

The schedule test hands the queue to the real evaluator (`probdiff watch`) and finds the loop's records. The tests of
late results, of the best checkpoint and of a resumed run need outcomes they choose (which step is the best, where the
evaluator dies): there the evaluator is a stand-in, `tests/_fake_evaluator.py` (the queue's contract, made-up
records), as the local evaluator's command (`fake_evaluator`) or as a user's `probdiff watch` beside an
`evaluator=external` run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _distributed_eval import build_trainer, held_out_queries, probdiff_config
from peft import get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import EarlyStoppingCallback, TrainerCallback, TrainingArguments

import probdiff_callback.callback.beside.local as local
from probdiff_callback.analysis.select import point_best, select
from probdiff_callback.callback.preemption import PreemptionCallback
from probdiff_callback.callback.probdiff import ProbDiffCallback
from probdiff_callback.callback.schedule import check_selection_setup
from probdiff_callback.cli import main
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.runs import queue as q
from probdiff_callback.runs import run_files
from probdiff_callback.runs.checkpoints import checkpoints, weights_problem
from probdiff_callback.runs.queue import Queue

FAKE = Path(__file__).parents[1] / "_fake_evaluator.py"
LOG = "probdiff_callback"
CONFIDENCES = {0: 0.25, 1: 0.5, 2: 1.0, 3: 0.5, 4: 0.75}  # what the FAKE evaluator finds at each step: 2 is the best


def fake_command(run_dir: Path, subdir: str, helpers: int = 0) -> list[str]:
    return [sys.executable, str(FAKE), str(run_dir), "--started-by-training", "--subdir", subdir]


@pytest.fixture
def fake_evaluator(monkeypatch):
    """The local evaluator is the FAKE one; `fake_evaluator(**env)` sets its FAKE_* behaviour."""
    monkeypatch.setattr(local, "evaluator_command", fake_command)

    def configure(**env: str) -> None:
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    return configure


def run_fake_evaluator(run_dir: Path, **env: str) -> subprocess.CompletedProcess:
    """The FAKE evaluator started as a user starts `probdiff watch RUN_DIR`: it evaluates what is pending and exits."""
    return subprocess.run(
        [sys.executable, str(FAKE), str(run_dir)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def history_of(run_dir: Path) -> list[run_files.HistoryRow]:
    return run_files.read_history(run_files.history_path(run_dir))


def probdiff_logs(trainer) -> list[tuple[int, float]]:
    return [
        (e["step"], e["eval_probdiff_confidence"]) for e in trainer.state.log_history if "eval_probdiff_confidence" in e
    ]


# ---- no training ----
def args_for(metric: str = "probdiff_confidence", save_strategy: str = "steps") -> TrainingArguments:
    return TrainingArguments(
        output_dir="unused", metric_for_best_model=metric, save_strategy=save_strategy, eval_strategy="steps",
        use_cpu=True, report_to="none",
    )  # fmt: skip


def test_what_decides_at_the_evaluation_cannot_select_by_a_metric_that_comes_later():
    config = ProbDiffConfig(async_eval=True)
    with pytest.raises(ValueError, match='save_strategy="best" needs the metric at the evaluation'):
        check_selection_setup(args_for(save_strategy="best"), config)
    with pytest.raises(ValueError, match="EarlyStoppingCallback on metric_for_best_model=probdiff_confidence"):
        check_selection_setup(args_for(), config, [EarlyStoppingCallback(early_stopping_patience=2)])
    check_selection_setup(args_for("eval_loss", "best"), config, [EarlyStoppingCallback()])  # the loss is in time
    check_selection_setup(args_for(save_strategy="best"), ProbDiffConfig())  # in the loop it is there


def test_zero3_must_gather_whole_weights_at_a_save_for_the_evaluator():
    from types import SimpleNamespace

    from probdiff_callback.callback.beside.spec import whole_weights_problem

    def accelerator(plugin):
        return SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin))

    def zero(stage: int, save_16bit: bool = False, gather: bool | None = None):
        config = {"zero_optimization": {} if gather is None else {"stage3_gather_16bit_weights_on_model_save": gather}}
        return SimpleNamespace(zero_stage=stage, zero3_save_16bit_model=save_16bit, deepspeed_config=config)

    assert whole_weights_problem(accelerator(None)) is None  # DDP, one process
    assert whole_weights_problem(accelerator(zero(2))) is None  # ZeRO-2 keeps whole weights on every rank
    assert whole_weights_problem(accelerator(zero(3, save_16bit=True))) is None  # accelerate's flag
    assert whole_weights_problem(accelerator(zero(3, gather=True))) is None  # a DeepSpeed config file's key
    problem = whole_weights_problem(accelerator(zero(3, gather=False)))
    assert problem and "stage3_gather_16bit_weights_on_model_save: true" in problem


@pytest.mark.slow  # builds the Trainer on the `tiny` model
def test_through_the_training_script_a_setup_problem_is_one_line_before_training(
    tmp_path, monkeypatch, capsys, sft_in_this_process
):
    """train/sft.py asks the callback before training (`ProbDiffCallback.setup_problem`: async_eval under ZeRO-3
    without whole weights at a save, a selection the metric cannot drive): one `error:` line and exit status 2, not
    the ValueError's traceback from every rank at the Trainer's train begin. (Two machines with ZeRO-3 said it so, by
    hand: 2026-11-29.)"""
    from _launch import sft_here

    from probdiff_callback.callback.probdiff import ProbDiffCallback

    monkeypatch.setattr(ProbDiffCallback, "setup_problem", lambda self, args: "ProbDiff: what the callback found")
    code, _, err = sft_here(["recipe=blog", "model=tiny", "report_to=none", "output_dir=run"], tmp_path, monkeypatch,
                            capsys)  # fmt: skip
    errors = [line for line in err.splitlines() if line.startswith("error:")]  # (stderr also has the loading bars)
    assert code == 2 and errors == ["error: ProbDiff: what the callback found"] and "Traceback" not in err, err
    assert not list((tmp_path / "run").glob("checkpoint-*")) and not (tmp_path / "run" / "probdiff").exists()


# ---- training on `tiny` ----
SCHEDULES = {
    # eval loss at every step, checkpoints at 2 and 4: weights linked there, saved into the queue at 1 and 3
    "evaluate": dict(eval_strategy="steps", eval_steps=1, save_steps=2, eval_on_start=True),
    # no evaluations: the saves at 2 and 4 are evaluated, the base model before the first step
    "save": dict(eval_strategy="no", save_steps=2),
}


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_requests_follow_the_loops_schedule_with_its_eval_losses_and_weights(
    schedule, tmp_path, tiny_model_path, caplog, monkeypatch
):
    """The steps, kinds, checkpoints and eval losses (the mean and each conversation's) of the requests equal the
    rows the loop writes for the same training; a checkpoint's weights are hard links to it, other steps' are saved
    whole into the queue; what the end leaves is said, and `probdiff watch` started later evaluates it into the
    loop's records and summaries."""
    settings = dict(max_steps=4, eval_rows=range(8, 11), **SCHEDULES[schedule])
    queries = held_out_queries()

    loop_run = tmp_path / "loop"
    trainer = build_trainer(tiny_model_path, loop_run, **settings)
    trainer.add_callback(ProbDiffCallback(trainer, queries, probdiff_config(n_queries=2, max_new_tokens=4)))
    trainer.train()
    expected = history_of(loop_run)

    run = tmp_path / "beside"
    trainer = build_trainer(tiny_model_path, run, **settings)
    config = probdiff_config(n_queries=2, max_new_tokens=4, async_eval=True, evaluator="external", end_wait_seconds=0)
    trainer.add_callback(ProbDiffCallback(trainer, queries, config))
    caplog.set_level(logging.INFO, logger=LOG)
    trainer.train()
    queue = Queue(run)
    requests = queue.pending()
    assert [(r.global_step, r.kind, r.base_model) for r in requests] == [
        (row.global_step, row.kind, row.base_model) for row in expected
    ]
    assert [r.last for r in requests] == [r.global_step == 4 for r in requests]  # max_steps: the evaluator's helpers
    for request, row in zip(requests, expected):
        assert (request.checkpoint and Path(request.checkpoint).name) == (row.checkpoint and Path(row.checkpoint).name)
        assert request.eval_loss == (pytest.approx(row.eval_loss, abs=1e-5) if math.isfinite(row.eval_loss) else None)
        losses = run_files.read_eval_losses(loop_run / "probdiff" / row.eval_losses) if row.eval_losses else None
        assert request.eval_losses == (None if losses is None else pytest.approx(losses, abs=1e-5))
        weights = queue.weights_path(request.global_step)
        if request.base_model:
            assert request.weights is None and not weights.exists()
            continue
        assert weights_problem(weights) is None
        adapter = weights / "adapter_model.safetensors"
        if request.checkpoint is not None:  # linked: the same file as the checkpoint's
            assert os.path.samefile(adapter, Path(request.checkpoint) / "adapter_model.safetensors")
    assert history_of(run) == []  # the evaluator writes the history; none ran
    spec = queue.read_spec()
    assert (spec.model, spec.dtype, spec.started_at_step, spec.training_pid) == (
        str(tiny_model_path),
        "float32",
        0,
        None,
    )
    assert spec.config == json.loads(json.dumps(spec.config)) and spec.config["n_queries"] == 2
    steps = ", ".join(str(row.global_step) for row in expected)
    assert f"steps {steps} not evaluated yet: `probdiff watch {run}` evaluates them" in caplog.text
    assert queue.ended() == "completed"

    # a user's `probdiff watch RUN_DIR` later (the real evaluator, at the loop's one thread): the loop's records
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main(["watch", str(run), "--no-follow"]) == 0
    assert queue.pending() == []
    rows = history_of(run)
    assert [(r.global_step, r.kind, r.checkpoint) for r in rows] == [
        (r.global_step, r.kind, r.checkpoint and str(run / Path(r.checkpoint).name)) for r in expected
    ]
    for row, loop in zip(rows, expected, strict=True):
        assert (row.summary, row.vs_base, row.failed) == (loop.summary, loop.vs_base, False)
        assert (run / "probdiff" / row.records).read_text() == (loop_run / "probdiff" / loop.records).read_text()


class Observer(TrainerCallback):
    """After ProbDiff's on_save: which checkpoints exist, and which queued steps await their result."""

    def __init__(self, queue: Queue) -> None:
        self.queue = queue
        self.at_saves: list[tuple[set[str], list[q.Request]]] = []

    def on_save(self, args, state, control, **kwargs):
        present = {c.name for c in checkpoints(args.output_dir)}
        self.at_saves.append((present, self.queue.pending()))


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_late_results_land_at_their_steps_and_select_the_best_checkpoint_everywhere(
    tmp_path, tiny_model_path, fake_evaluator, fresh_wandb, caplog
):
    """Confidences 25/50/100/50/75% at steps 0-4, each result a second late, the evaluator dying once at step 2:
    every result is in the Trainer's log at its step and in W&B at its `train/global_step`; step 2's checkpoint is the
    best for the Trainer (and the weights loaded at the end), for `probdiff select` and for RUN_DIR/best, while
    `save_total_limit=1` deleted no checkpoint that awaited its result."""
    wandb = fresh_wandb
    run = tmp_path / "run"
    confidences = CONFIDENCES
    fake_evaluator(FAKE_CONFIDENCES=json.dumps(confidences), FAKE_SECONDS="1", FAKE_DIE_AT="2",
                   FAKE_DIE_MARKER=str(tmp_path / "died"))  # fmt: skip
    trainer = build_trainer(tiny_model_path, run, max_steps=4, eval_strategy="steps", eval_steps=1, save_steps=1,
                            eval_on_start=True, save_total_limit=1, load_best_model_at_end=True,
                            metric_for_best_model="probdiff_confidence", report_to="wandb")  # fmt: skip
    trainer.add_callback(ProbDiffCallback(trainer, held_out_queries(), probdiff_config(n_queries=4, async_eval=True)))
    observer = Observer(Queue(run))
    trainer.add_callback(observer)
    rows: list[dict] = []

    class SpyOnWandb(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # after the W&B integration's init
            logged = wandb.log

            def log(data, *more, **options):
                logged(data, *more, **options)
                rows.append({**data, "_step": wandb.run.step - 1})

            wandb.log = log

    trainer.add_callback(SpyOnWandb())
    caplog.set_level(logging.INFO, logger=LOG)
    try:
        trainer.train()
    finally:
        wandb.finish()

    assert probdiff_logs(trainer) == sorted(confidences.items())
    steps = [e["step"] for e in trainer.state.log_history]
    assert steps == sorted(steps), "the late entries sit among the others by their step"
    at_step = {row["train/global_step"]: row for row in rows if "eval/probdiff_confidence" in row}
    assert {step: row["eval/probdiff_confidence"] for step, row in at_step.items()} == confidences
    assert sorted(row["train/global_step"] for row in rows if "eval/probdiff_d" in row) == list(confidences)
    eval_loss_rows = {row["train/global_step"]: row["_step"] for row in rows if "eval/loss" in row}
    assert all(at_step[step]["_step"] > eval_loss_rows[step] for step in confidences), "each logged after its step"

    best = str(run / "checkpoint-2")
    assert (trainer.state.best_model_checkpoint, trainer.state.best_metric) == (best, 1.0)
    state = json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())  # written again after the wait
    assert state["best_model_checkpoint"] == best
    assert sorted(e["step"] for e in state["log_history"] if "eval_probdiff_confidence" in e) == list(confidences)
    selection = select(run_files.read_run(run))
    assert Path(selection.best_checkpoint.checkpoint).resolve() == Path(best).resolve()
    assert point_best(run, selection.best_checkpoint.checkpoint).resolve() == Path(best).resolve()
    loaded = get_peft_model_state_dict(trainer.model)
    for step, same in ((2, True), (4, False)):
        saved = load_file(run / f"checkpoint-{step}" / "adapter_model.safetensors")
        assert all(loaded[k].equal(v) for k, v in saved.items()) is same, "load_best_model_at_end loaded step 2's"

    for present, pending in observer.at_saves:
        for request in pending:
            assert request.checkpoint is None or Path(request.checkpoint).name in present, (present, request)
    assert [c.name for c in checkpoints(run)] == ["checkpoint-2", "checkpoint-4"]  # the best and the newest
    assert trainer.args.save_total_limit == 1, "the user's limit put back"

    assert "starting it again (1 of 3)" in caplog.text
    history = history_of(run)
    assert [row.global_step for row in history] == list(confidences) and not any(row.failed for row in history)
    assert "ProbDiff resolution: with 4 queries and a confidence of 25.0%" in caplog.text


class SignalAt(TrainerCallback):
    """A preemption's SIGTERM, received while step `step` trains."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step - 1:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_a_stop_keeps_the_queue_and_the_resumed_run_evaluates_what_is_left_once(
    tmp_path, tiny_model_path, fake_evaluator
):
    """Stopped by SIGTERM at step 3 with nothing evaluated (no evaluator ran), the queue is kept; a user's evaluator
    then evaluates steps 0-3; the run resumes from checkpoint-2: step 3's row and request belong to the interrupted
    run and are dropped, steps 0-2 are logged from the history they have, steps 3 and 4 are queued and evaluated by
    the local evaluator. Each step is in the Trainer's log once, and the history ends as an uninterrupted run's."""
    run = tmp_path / "run"
    settings = dict(max_steps=4, eval_strategy="steps", eval_steps=1, save_steps=1, eval_on_start=True,
                    metric_for_best_model="probdiff_confidence")  # fmt: skip

    trainer = build_trainer(tiny_model_path, run, **settings)
    preemption = PreemptionCallback(trainer)
    trainer.add_callback(preemption)
    config = probdiff_config(n_queries=4, async_eval=True, evaluator="external")
    trainer.add_callback(ProbDiffCallback(trainer, held_out_queries(), config, preemption=preemption))
    trainer.add_callback(SignalAt(3))
    trainer.train()
    queue = Queue(run)
    assert preemption.stopping and preemption.checkpoint == str(run / "checkpoint-3")
    assert [r.global_step for r in queue.pending()] == [0, 1, 2, 3]
    assert queue.ended() == "stopped"
    # the interrupted run's step 3 got 0%: the resumed run's step 3 is another model
    evaluated = run_fake_evaluator(run, FAKE_CONFIDENCES=json.dumps({**CONFIDENCES, 3: 0.0}))
    assert evaluated.returncode == 0, evaluated.stderr
    assert [row.global_step for row in history_of(run)] == [0, 1, 2, 3]

    fake_evaluator(FAKE_CONFIDENCES=json.dumps(CONFIDENCES))
    trainer = build_trainer(tiny_model_path, run, **{**settings, "eval_on_start": False})
    config = probdiff_config(n_queries=4, async_eval=True)
    trainer.add_callback(ProbDiffCallback(trainer, held_out_queries(), config))
    trainer.train(resume_from_checkpoint=str(run / "checkpoint-2"))
    assert probdiff_logs(trainer) == sorted(CONFIDENCES.items())
    assert [(row.global_step, row.confidence) for row in history_of(run)] == sorted(CONFIDENCES.items())
    assert [(r.global_step, queue.done(r.global_step).status) for r in queue.requests()] == [
        (step, "evaluated") for step in CONFIDENCES
    ]
    assert trainer.state.best_model_checkpoint == str(run / "checkpoint-2")


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_beside_training_a_checkpoint_that_fails_the_guard_is_never_the_best(tmp_path, tiny_model_path, fake_evaluator):
    """probdiff_guarded with results arriving late: step 1 has the highest confidence and half the base model's ROUGE-L
    right answers gone, step 2 gives up all of step 3's gain; the Trainer's best (and the weights loaded at the end),
    `probdiff select` and the log name step 3."""
    run = tmp_path / "run"
    fake_evaluator(
        FAKE_CONFIDENCES=json.dumps({0: 0.5, 1: 1.0, 2: 0.875, 3: 0.625, 4: 0.5625}),
        FAKE_ROUGE_L=json.dumps({0: 0.5, 1: 0.0, 2: 0.5, 3: 1.0, 4: 1.0}),
        FAKE_SECONDS="1",
    )
    trainer = build_trainer(tiny_model_path, run, max_steps=4, eval_strategy="steps", eval_steps=1, save_steps=1,
                            eval_on_start=True, load_best_model_at_end=True, learning_rate=0.0,
                            metric_for_best_model="probdiff_guarded")  # fmt: skip
    config = probdiff_config(n_queries=16, async_eval=True)
    trainer.add_callback(ProbDiffCallback(trainer, held_out_queries(), config))
    trainer.train()

    assert (trainer.state.best_model_checkpoint, trainer.state.best_metric) == (str(run / "checkpoint-3"), 0.625)
    guarded = {e["step"]: e["eval_probdiff_guarded"] for e in trainer.state.log_history if "eval_probdiff_guarded" in e}
    assert math.isnan(guarded[0]) and math.isnan(guarded[1]) and (guarded[3], guarded[4]) == (0.625, 0.5625)
    selection = select(run_files.read_run(run))
    assert selection.pick.metric == "probdiff_guarded" and selection.best_checkpoint.global_step == 3
    assert selection.pick.failed_steps() == [1, 2]
