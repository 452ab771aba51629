"""One W&B run per training run across resumes: the stored run id, the rewind point read from the local
run files, and an interrupted, resumed tiny training run read back from its offline W&B files."""

from __future__ import annotations

import glob
import json
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from _distributed_eval import REPO, build_trainer, probdiff_config
from transformers import TrainerCallback

from probdiff_callback import history
from probdiff_callback.callback import ProbDiffCallback
from probdiff_callback.metric import compare
from probdiff_callback.queries import load_queries, read_jsonl
from probdiff_callback.wandb_files import Segment, effective_history, last_step_at_or_before, read_segment
from probdiff_callback.wandb_run import (
    RUN_ID_FILE,
    choose_run_id,
    plan_init,
    read_run_id,
    rewind_point,
    segment_files,
    start_run,
    sync_command,
)

TRANSLATION_QUERIES = REPO / "data" / "samples" / "translation" / "heldout.jsonl"


def rows(steps_and_globals: list[tuple[int, int]]) -> list[dict]:
    return [{"_step": s, "train/global_step": g} for s, g in steps_and_globals]


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


def test_effective_history_applies_each_rewind_and_finds_the_rewind_point(tmp_path):
    # segment 1 logged global steps 0..3 (two rows at steps 0 and 3), then died; segment 2 resumed from
    # global step 1 (rewound to _step 2) and died at step 4; segment 3 resumes from global step 3.
    first = Segment(tmp_path / "a", "r", None, rows([(0, 0), (1, 0), (2, 1), (3, 2), (4, 3), (5, 3)]))
    second = Segment(tmp_path / "b", "r", 2, rows([(3, 2), (4, 3), (5, 4)]))
    assert [r["train/global_step"] for r in effective_history([first, second])] == [0, 0, 1, 2, 3, 4]
    assert [r["_step"] for r in effective_history([first, second])] == [0, 1, 2, 3, 4, 5]
    assert rewind_point([first, second], 3) == 4
    assert rewind_point([first], 1) == 2 and rewind_point([first], 0) == 1
    assert last_step_at_or_before(rows([(0, 5)]), 4) is None


def test_plan_init_rewinds_resumes_or_starts():
    segment = Segment(Path("x"), "r1", None, rows([(0, 0), (1, 2), (2, 4)]))
    assert plan_init("r1", False, [], None)[:2] == ({"id": "r1"}, None)
    kwargs, point, message = plan_init("r1", True, [segment], 2)
    assert kwargs == {"resume_from": "r1?_step=1"} and point == 1 and "rewound to _step 1" in message
    kwargs, point, message = plan_init("r1", True, [], 2)
    assert kwargs == {"id": "r1", "resume": "allow"} and point is None and "without rewinding" in message
    kwargs, _, message = plan_init("new1", False, [], 2)
    assert kwargs == {"id": "new1"} and "stay separate" in message


def test_a_refused_rewind_falls_back_to_resuming(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    (run / "checkpoint-2").mkdir(parents=True)
    (run / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2}')
    (run / RUN_ID_FILE).write_text("abc123\n")
    calls = []

    def refusing_init(**kwargs):
        calls.append(kwargs)
        if "resume_from" in kwargs:
            raise RuntimeError("cannot rewind a run that is not in a terminal state")

    monkeypatch.setattr("probdiff_callback.wandb_run.segment_files", lambda directory, run_id: [Path("seg")])
    monkeypatch.setattr(
        "probdiff_callback.wandb_run.read_segment",
        lambda path: Segment(Path(path), "abc123", None, rows([(0, 0), (7, 2)])),
    )
    started = start_run(
        run, run / "checkpoint-2", project="p", name="n", wandb_dir=tmp_path / "wandb", init=refusing_init
    )
    assert [c.get("resume_from") for c in calls] == ["abc123?_step=7", None]
    assert calls[1] == {"project": "p", "name": "n", "id": "abc123", "resume": "allow"}
    assert started.rewound_to is None and "appear twice" in started.message
    assert "refused to rewind" in capsys.readouterr().err


def test_segment_files_are_this_runs_in_start_order(tmp_path):
    for name in ("offline-run-20260102_000000-abc", "run-20260101_000000-abc", "offline-run-20260103_000000-xyz"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"run-{name.rsplit('-', 1)[1]}.wandb").write_bytes(b"")
    assert [p.parent.name for p in segment_files(tmp_path, "abc")] == [
        "run-20260101_000000-abc",
        "offline-run-20260102_000000-abc",
    ]
    assert sync_command(tmp_path, "abc") == f"wandb sync --id abc {tmp_path}/offline-run-*-abc"


# ---- an interrupted run, resumed ----


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


def finished_segments(wandb_dir: Path, run_id: str, count: int) -> list[Segment]:
    """The run's segments once wandb-core (its own process) has written their exit records."""
    deadline = time.monotonic() + 60
    while True:
        paths = segment_files(wandb_dir, run_id)
        try:
            segments = [read_segment(p) for p in paths]
        except ValueError:  # a file with no record yet
            segments = []
        if len(segments) == count and all("exit" in s.record_types for s in segments):
            return segments
        assert time.monotonic() < deadline, (
            f"run files not finished: {paths}, {[s.record_types[-5:] for s in segments]}"
        )
        time.sleep(0.5)


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_wandb(tmp_path, monkeypatch):
    """wandb offline in `tmp_path`; its process-wide settings are dropped afterwards, so a later test's
    WANDB_DIR is read again (wandb reads the environment once per setup)."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    wandb.teardown()
    yield wandb
    wandb.teardown()


def test_an_interrupted_and_resumed_run_is_one_wandb_run_with_each_step_once(tmp_path, tiny_model_path, fresh_wandb):
    wandb = fresh_wandb
    run = tmp_path / "run"
    wandb_dir = tmp_path / "wandb"
    queries = load_queries(TRANSLATION_QUERIES)
    settings = dict(max_steps=4, eval_strategy="steps", eval_steps=1, save_steps=2, report_to="wandb")

    def train(resume: Path | None, interrupt_at: int | None):
        trainer = build_trainer(tiny_model_path, run, **settings)
        trainer.add_callback(ProbDiffCallback(trainer, queries, probdiff_config(n_queries=8, wandb_table_rows=0)))
        if interrupt_at is not None:
            trainer.add_callback(
                InterruptAt(interrupt_at)
            )  # after ProbDiff: its evaluation of the step is logged first
        started = start_run(
            run,
            resume,
            project="probdiff-test",
            name="resume-test",
            wandb_dir=wandb_dir,
            init=lambda **kw: wandb.init(dir=str(tmp_path), **kw),
        )
        try:
            trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        finally:
            wandb.finish()
        return started

    with pytest.raises(Interrupted):
        train(None, interrupt_at=3)
    assert (run / "checkpoint-2").is_dir() and not (run / "checkpoint-4").exists()
    first_rows = history.read_history(history.history_path(run))
    assert [r["global_step"] for r in first_rows] == [0, 1, 2, 3]
    resumed = train(run / "checkpoint-2", interrupt_at=None)

    run_id = read_run_id(run)
    assert resumed.run_id == run_id and resumed.rewound_to is not None
    segments = finished_segments(wandb_dir, run_id, 2)
    assert {s.run_id for s in segments} == {run_id}, "one W&B run"
    assert segments[0].branch_step is None and segments[1].branch_step == resumed.rewound_to

    def probdiff_steps(logged: list[dict]) -> list[int]:
        return [row["train/global_step"] for row in logged if "eval/probdiff_confidence" in row]

    # without the rewind, step 3 (evaluated by the interrupted process) would be uploaded twice
    assert probdiff_steps(segments[0].rows + segments[1].rows) == [0, 1, 2, 3, 3, 4]
    uploaded = effective_history(segments)
    assert probdiff_steps(uploaded) == [0, 1, 2, 3, 4]
    assert [row["train/global_step"] for row in uploaded if "eval/loss" in row] == [1, 2, 3, 4]
    assert [row["_step"] for row in uploaded] == sorted({row["_step"] for row in uploaded}), (
        "W&B steps increase without repeats"
    )

    # what W&B holds at each step is what the history holds: the resumed process's evaluation of step 3
    by_step = {row["train/global_step"]: row for row in uploaded if "eval/probdiff_confidence" in row}
    rows_now = history.read_history(history.history_path(run))
    base_records = read_jsonl(run / "probdiff" / rows_now[0]["records"])
    for row in rows_now:
        logged = by_step[row["global_step"]]
        summary = row["summary"]
        assert logged["eval/probdiff_confidence"] == summary["confidence"]
        assert logged["eval/ref_bleu"] == pytest.approx(summary["reference"]["overall"]["bleu"])
        assert logged["eval/ref_chrf"] == pytest.approx(summary["reference"]["overall"]["chrf"])
        for category, scores in summary["reference"]["by_category"].items():
            assert logged[f"eval/ref_bleu_{category}"] == pytest.approx(scores["bleu"])
        if row["kind"] == "baseline":
            assert row["vs_base"] is None
            continue
        # the resumed process compared its steps with the baseline records it read back from the history
        expected = compare(read_jsonl(run / "probdiff" / row["records"]), base_records, probdiff_config().delta)
        assert row["vs_base"] == json.loads(json.dumps(expected))
        assert [logged[f"eval/probdiff_vs_base_{k}"] for k in ("win", "tie", "lose")] == [
            row["vs_base"][k] for k in ("win", "tie", "lose")
        ]
        logged_loss = next(
            r["eval/loss"] for r in uploaded if r.get("train/global_step") == row["global_step"] and "eval/loss" in r
        )
        assert row["eval_loss"] == pytest.approx(logged_loss)

    # the printed sync command names exactly these segments, and wandb's dry run would upload them as one run
    command = sync_command(wandb_dir, run_id)
    pattern = shlex.split(command)[-1]
    assert sorted(glob.glob(pattern)) == sorted(str(s.path.parent) for s in segments)
    executable = shutil.which("wandb")
    if executable is not None:
        dry = subprocess.run(
            [executable, "sync", "--dry-run", "--id", run_id, *sorted(glob.glob(pattern))],
            capture_output=True,
            text=True,
            timeout=120,
        )
        listed = [line for line in (dry.stdout + dry.stderr).splitlines() if line.strip().endswith(".wandb")]
        assert sorted(Path(line.split()[-1]).resolve() for line in listed) == sorted(s.path.resolve() for s in segments)
