"""One W&B run per training run across resumes: the stored run id, the W&B step recorded in each checkpoint, the
rewind (or resume) planned from it, and an interrupted, resumed tiny training run in offline W&B."""

from __future__ import annotations

import glob
import json
import os
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
from _distributed_eval import REPO, build_trainer, probdiff_config
from _faults import inject
from _launch import BLOG_RUN
from transformers import TrainerCallback
from transformers.integrations import WandbCallback

from probdiff_callback.callback.preemption import PreemptionCallback
from probdiff_callback.callback.probdiff import ProbDiffCallback
from probdiff_callback.core.queries import load_queries
from probdiff_callback.runs import run_files
from probdiff_callback.training.recipe import load_recipe, sft_config
from probdiff_callback.training.wandb_run import (
    RUN_ID_FILE,
    STEP_RECORD_FILE,
    StepRecord,
    WandbStepRecord,
    choose_run_id,
    plan_init,
    read_run_id,
    read_step_record,
    setup_wandb,
    start_run,
    start_wandb,
    step_recorder,
    sync_command,
    wandb_logged_in,
    write_step_record,
)

TRANSLATION_QUERIES = REPO / "data" / "samples" / "translation" / "heldout.jsonl"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def checkpoint(run: Path, step: int, record: StepRecord | None = None) -> Path:
    path = run / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if record is not None:
        write_step_record(path, record)
    return path


# ---- no training ----


def test_the_run_id_is_kept_in_the_run_directory_and_reused_only_on_resume(tmp_path):
    ids = iter(["first111", "second22"])
    run_id, reused = choose_run_id(tmp_path, resuming=False, make_id=lambda: next(ids))
    assert (run_id, reused) == ("first111", False) and read_run_id(tmp_path) == "first111"
    assert choose_run_id(tmp_path, resuming=True) == ("first111", True)
    run_id, reused = choose_run_id(tmp_path, resuming=False, make_id=lambda: next(ids))  # a fresh start: a new run
    assert (run_id, reused) == ("second22", False) and read_run_id(tmp_path) == "second22"
    (tmp_path / RUN_ID_FILE).write_text("not an id!\n")
    with pytest.raises(ValueError, match=f"{RUN_ID_FILE}: not a W&B run id"):
        choose_run_id(tmp_path, resuming=True)


def test_a_step_record_reads_back_and_a_bad_one_is_named(tmp_path):
    path = checkpoint(tmp_path, 6, StepRecord("abc123", 6, 17))
    assert read_step_record(path, 6) == StepRecord("abc123", 6, 17)
    assert json.loads((path / STEP_RECORD_FILE).read_text()) == {
        "run_id": "abc123",
        "global_step": 6,
        "last_wandb_step": 17,
    }
    assert read_step_record(checkpoint(tmp_path, 8), 8) is None
    with pytest.raises(ValueError, match=f"checkpoint-6/{STEP_RECORD_FILE}: .*checkpoint of step 4"):
        read_step_record(path, 4)  # a record copied from another checkpoint
    (path / STEP_RECORD_FILE).write_text('{"run_id": "abc123", "global_step": 6')
    with pytest.raises(ValueError, match=f"checkpoint-6/{STEP_RECORD_FILE}: not a W&B step record"):
        read_step_record(path, 6)


def test_plan_init_rewinds_to_the_recorded_step_resumes_or_starts():
    assert plan_init("r1", False, None, None)[:2] == ({"id": "r1"}, None)
    kwargs, point, message = plan_init("r1", True, 2, StepRecord("r1", 2, 9))
    assert kwargs == {"resume_from": "r1?_step=9"} and point == 9 and "rewound to _step 9" in message
    kwargs, point, message = plan_init("r1", True, 2, None)
    assert kwargs == {"id": "r1", "resume": "allow"} and point is None
    assert "without rewinding: checkpoint-2 has no wandb_step.json" in message
    kwargs, point, message = plan_init("r1", True, 2, StepRecord("other1", 2, 9))
    assert kwargs == {"id": "r1", "resume": "allow"} and point is None and "of W&B run other1" in message
    kwargs, _, message = plan_init("new1", False, 2, StepRecord("r1", 2, 9))
    assert kwargs == {"id": "new1"} and "stay separate" in message


def resumable_run(tmp_path: Path, record: StepRecord | None) -> Path:
    run = tmp_path / "run"
    checkpoint(run, 2, record)
    (run / RUN_ID_FILE).write_text("abc123\n")
    return run


def test_start_run_rewinds_to_the_step_recorded_in_the_checkpoint(tmp_path):
    run = resumable_run(tmp_path, StepRecord("abc123", 2, 7))
    calls = []
    started = start_run(run, run / "checkpoint-2", project="p", name="n", init=lambda **kw: calls.append(kw))
    assert calls == [{"project": "p", "name": "n", "resume_from": "abc123?_step=7"}]
    assert started.rewound_to == 7 and "rewound to _step 7" in started.message


def test_a_checkpoint_without_a_record_resumes_with_a_message(tmp_path):
    run = resumable_run(tmp_path, None)
    calls = []
    started = start_run(run, run / "checkpoint-2", project="p", name="n", init=lambda **kw: calls.append(kw))
    assert calls == [{"project": "p", "name": "n", "id": "abc123", "resume": "allow"}]
    assert started.rewound_to is None
    assert started.message == (
        "W&B run abc123 resumed without rewinding: checkpoint-2 has no wandb_step.json (saved without W&B, or by an "
        "older version), so rows logged after step 2 by the interrupted process stay in the run"
    )
    # offline, such a process counts its own segment's steps from 0: its checkpoints get no record
    assert step_recorder(started, offline=True) is None
    assert isinstance(step_recorder(started, offline=False), WandbStepRecord)


def test_a_refused_rewind_falls_back_to_resuming(tmp_path, capsys):
    run = resumable_run(tmp_path, StepRecord("abc123", 2, 7))
    calls = []

    def refusing_init(**kwargs):
        calls.append(kwargs)
        if "resume_from" in kwargs:
            raise RuntimeError("cannot rewind a run that is not in a terminal state")

    started = start_run(run, run / "checkpoint-2", project="p", name="n", init=refusing_init)
    assert [c.get("resume_from") for c in calls] == ["abc123?_step=7", None]
    assert calls[1] == {"project": "p", "name": "n", "id": "abc123", "resume": "allow"}
    assert started.rewound_to is None and "after step 2 appear twice" in started.message
    assert "refused to rewind" in capsys.readouterr().err
    # online, the resumed run's counter continues the run's own: its checkpoints are recorded
    assert isinstance(step_recorder(started, offline=False), WandbStepRecord)


def test_the_sync_command_names_the_runs_segments(tmp_path):
    for name in ("offline-run-20260102_000000-abc", "run-20260101_000000-abc", "offline-run-20260103_000000-xyz"):
        (tmp_path / name).mkdir()
    assert sync_command(tmp_path, "abc") == f"wandb sync --id abc {tmp_path}/offline-run-*-abc"
    assert [Path(p).name for p in glob.glob(shlex.split(sync_command(tmp_path, "abc"))[-1])] == [
        "offline-run-20260102_000000-abc"
    ]


def test_resuming_skips_the_evaluation_at_the_start(tmp_path):
    """The checkpoint's step was evaluated and logged before it was saved; `eval_on_start` would log its eval loss
    again at the same step."""
    recipe = load_recipe(["recipe=blog", "model=tiny"])
    assert sft_config(recipe, tmp_path).eval_on_start
    assert not sft_config(recipe, tmp_path, resuming=True).eval_on_start


# ---- wandb's step counter, offline ----


def save(recorder: WandbStepRecord, run: Path, step: int) -> StepRecord | None:
    (run / f"checkpoint-{step}").mkdir(parents=True, exist_ok=True)
    state = SimpleNamespace(is_world_process_zero=True, global_step=step)
    recorder.on_save(SimpleNamespace(output_dir=str(run)), state, None)
    if not (run / f"checkpoint-{step}" / STEP_RECORD_FILE).is_file():
        return None
    return read_step_record(run / f"checkpoint-{step}", step)


def test_the_recorded_step_is_the_last_row_logged_also_right_after_a_rewind(tmp_path, fresh_wandb):
    wandb = fresh_wandb
    run = tmp_path / "run"
    wandb.init(id="count001")
    assert save(WandbStepRecord(), run, 1) is None, "no row logged yet: nothing to rewind to"
    for i in range(3):
        wandb.log({"x": i})
    assert save(WandbStepRecord(), run, 2) == StepRecord("count001", 2, 2)  # rows 0, 1, 2
    wandb.log({"x": 3})
    wandb.finish()

    wandb.init(resume_from="count001?_step=2")
    recorder = WandbStepRecord(rewound_to=2)
    # offline, wandb's counter reads 0 until the first row after the rewind
    assert save(recorder, run, 3) == StepRecord("count001", 3, 2)
    wandb.log({"x": 4})
    assert save(recorder, run, 4) == StepRecord("count001", 4, 3), "the first row after the rewind is _step 3"
    wandb.finish()


# ---- an interrupted run, resumed ----


def history_of(run: Path) -> list[dict]:
    return [row.to_json() for row in run_files.read_history(run_files.history_path(run))]


class Interrupted(Exception):
    pass


class InterruptAt(TrainerCallback):
    """Stands for a killed process: raises once the evaluation of `step` has been logged (after the
    checkpoint before it was saved)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_evaluate(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise Interrupted(f"interrupted after the evaluation of step {self.step}")


class Process:
    """What one training process sent to W&B: each `wandb.log` call (one row each, as every caller commits) with
    the W&B `_step` it got, and the Trainer's step when each checkpoint was saved."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.saved_after_rows: dict[int, int] = {}  # global step -> rows logged before its checkpoint

    def spy(self, wandb) -> None:
        logged = wandb.log  # the run's own, which wandb.finish() puts back

        def log(data, *args, **kwargs):
            assert not args and not kwargs, "a row that is not committed on its own"
            logged(data)
            # read after the call: offline, right after a rewind, wandb counts from 0 until the first row
            self.rows.append({**data, "_step": wandb.run.step - 1})

        wandb.log = log

    def callback(self) -> TrainerCallback:
        process = self

        class SavedAfter(TrainerCallback):
            def on_save(self, args, state, control, **kwargs):
                process.saved_after_rows[state.global_step] = len(process.rows)

        return SavedAfter()


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["crash", "sigterm"])
def test_an_interrupted_and_resumed_run_is_one_wandb_run_with_each_step_once(
    fault, tmp_path, tiny_model_path, fresh_wandb, monkeypatch
):
    """crash: the process dies after step 3's evaluation is logged, checkpoint-2 the last one; sigterm: a preemption
    in step 3's evaluation abandons it, checkpoint-3 is saved, and the resumed run logs step 3's ProbDiff metrics."""
    wandb = fresh_wandb
    run = tmp_path / "run"
    recipe = load_recipe(["recipe=translation", "model=tiny"])
    queries = load_queries(TRANSLATION_QUERIES)
    inits: list[dict] = []
    real_init = wandb.init

    def init(**kwargs):
        inits.append(kwargs)
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", init)

    def train(process: Process, resume: Path | None, interrupt_at: int | None) -> list[type]:
        trainer = build_trainer(
            tiny_model_path,
            run,
            max_steps=4,
            eval_strategy="steps",
            eval_steps=1,
            save_steps=2,
            report_to="wandb",
            eval_on_start=resume is None,  # as train/sft.py sets it
        )
        preemption = PreemptionCallback(trainer)
        trainer.add_callback(preemption)
        config = probdiff_config(n_queries=4, wandb_table_rows=0)
        trainer.add_callback(ProbDiffCallback(trainer, queries, config, preemption=preemption))
        if interrupt_at is not None:  # after ProbDiff: its evaluation of the step is logged first
            trainer.add_callback(InterruptAt(interrupt_at))
        start_wandb(recipe, run, str(resume) if resume else None, trainer)
        trainer.add_callback(process.callback())
        process.spy(wandb)
        try:
            trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        finally:
            wandb.finish()
        return [type(c) for c in trainer.callback_handler.callbacks]

    first = Process()
    if fault == "crash":
        with pytest.raises(Interrupted):
            train(first, None, interrupt_at=3)
        last = 2
    else:
        with monkeypatch.context() as armed:
            inject("answers-done:4=TERM", armed.setattr)  # visit 1 is the baseline's
            train(first, None, interrupt_at=None)
        last = 3
        assert history_of(run)[-1]["abandoned"] and (run / "checkpoint-3").is_dir()
    run_id = read_run_id(run)
    assert inits[0]["id"] == run_id and "resume_from" not in inits[0]
    assert (run / f"checkpoint-{last}").is_dir() and not (run / "checkpoint-4").exists()
    assert [row["_step"] for row in first.rows] == list(range(len(first.rows))), "one row per call, from 0"
    recorded = read_step_record(run / f"checkpoint-{last}", last)
    assert recorded == StepRecord(run_id, last, first.saved_after_rows[last] - 1), "the last row before the save"
    if fault == "crash":
        assert len(first.rows) > first.saved_after_rows[2], "the interrupted process logged step 3 after it"
    else:
        after = first.rows[first.saved_after_rows[3] :]  # the Trainer's end-of-training summary, rewound away
        assert not [key for row in after for key in row if key.startswith("eval/")], "no evaluation after the save"

    resumed = Process()
    callbacks = train(resumed, run / f"checkpoint-{last}", interrupt_at=None)
    assert inits[1]["resume_from"] == f"{run_id}?_step={recorded.last_wandb_step}" and "id" not in inits[1]
    # the step record comes after the Trainer's W&B integration and after ProbDiff's evaluations
    assert callbacks.index(WandbCallback) < callbacks.index(ProbDiffCallback) < callbacks.index(WandbStepRecord)
    steps = [row["_step"] for row in resumed.rows]
    assert steps == list(range(recorded.last_wandb_step + 1, recorded.last_wandb_step + 1 + len(steps))), (
        "the resumed rows follow the recorded step"
    )
    assert read_step_record(run / "checkpoint-4", 4) == StepRecord(run_id, 4, steps[resumed.saved_after_rows[4] - 1])

    # what the run holds once the rewind applies: the first process's rows up to the record, then the resumed ones
    uploaded = first.rows[: recorded.last_wandb_step + 1] + resumed.rows

    def logged_at(key: str) -> list[int]:
        return [row["train/global_step"] for row in uploaded if key in row]

    assert logged_at("eval/probdiff_confidence") == [0, 1, 2, 3, 4]
    assert logged_at("eval/probdiff_d") == [0, 1, 2, 3, 4]  # the histograms
    assert logged_at("eval/loss") == [0, 1, 2, 3, 4], "the resumed process does not evaluate its start again"
    assert logged_at("train/loss") == [1, 2, 3, 4]
    # what W&B holds at each step is what the history holds: the resumed process's evaluation of step 3
    by_step = {row["train/global_step"]: row for row in uploaded if "eval/probdiff_confidence" in row}
    for row in history_of(run):
        assert "abandoned" not in row
        logged = by_step[row["global_step"]]
        assert logged["eval/probdiff_confidence"] == row["summary"]["confidence"]
        assert logged["eval/ref_chrf"] == pytest.approx(row["summary"]["reference"]["overall"]["chrf"])
        if row["kind"] != "baseline":
            assert [logged[f"eval/probdiff_vs_base_{k}"] for k in ("win", "tie", "lose")] == [
                row["vs_base"][k] for k in ("win", "tie", "lose")
            ]

    # offline: two segments of the one run, and the printed command uploads exactly them
    segments = sorted(glob.glob(shlex.split(sync_command(tmp_path / "wandb", run_id))[-1]))
    assert len(segments) == 2 and segments == sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*")))


def test_wandb_offline_when_not_logged_in(tmp_path, monkeypatch, sft_in_this_process):
    """setup_wandb sets W&B's environment for the run; here on a copy of it (a WANDB_DIR left behind would send
    later runs' W&B files here)."""
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_DIR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert not wandb_logged_in()
    recipe = load_recipe(["recipe=blog"])
    sync = setup_wandb(recipe, tmp_path / "run")
    assert os.environ["WANDB_MODE"] == "offline" and os.environ["WANDB_PROJECT"] == "probdiff-blog"
    assert sync == f"wandb sync {tmp_path / 'run' / 'wandb' / 'offline-run-*'}"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    assert wandb_logged_in()
    monkeypatch.delenv("WANDB_MODE")
    assert setup_wandb(load_recipe(["recipe=blog", "report_to=none"]), tmp_path / "run") is None
    assert "WANDB_MODE" not in os.environ


def test_wandb_run_config_holds_the_project_keys(tmp_path, monkeypatch):
    """The Trainer's integration logs the SFTConfig; the project's own keys go in at the start, as `recipe`."""
    import wandb

    calls = []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setenv("WANDB_MODE", "offline")
    added = []
    trainer = SimpleNamespace(args=SimpleNamespace(run_name="blog/run"), add_callback=added.append)
    sync = start_wandb(load_recipe(["recipe=blog", "model=tiny"]), tmp_path, None, trainer)
    assert [type(c).__name__ for c in added] == ["WandbStepRecord"]
    config = calls[0]["config"]["recipe"]
    assert config["model"] == "tiny" and config["lora"]["r"] == 64 and config["probdiff"]["n_queries"] == 12
    assert config["task"] == "blog" and "learning_rate" not in config
    assert calls[0]["name"] == "blog/run" and sync is not None and sync.startswith("wandb sync --id")


@pytest.mark.slow
def test_offline_wandb_run_no_url_warning_and_one_sync_line(blog_run):
    """conftest's `blog_run`, a few steps of model=tiny with W&B offline: trl's model card asked the offline run for
    its URL at each checkpoint, and W&B's own closing lines offered `wandb sync` for one segment beside the run's
    command."""
    output = blog_run.stdout + blog_run.stderr
    assert "URL not available" not in output
    [sync] = [line for line in output.splitlines() if "wandb sync" in line]
    run_id = (blog_run.run_dir / "wandb_run_id").read_text().strip()
    assert sync.endswith(f"upload it with: wandb sync --id {run_id} {BLOG_RUN}/wandb/offline-run-*-{run_id}")
    assert len(list((blog_run.run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))) == 1
