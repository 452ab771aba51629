"""Broken checkpoints: every file the Trainer writes checked from its header, a broken checkpoint named with the
previous complete one offered (`resume=<it>`), never a silent fresh start or a half-loaded resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _launch import BLOG_RUN, CHEAP, history_rows, refused_here, run_sft
from transformers.trainer_utils import get_last_checkpoint, sort_checkpoints

from probdiff_callback.runs.checkpoints import checkpoint_problem, weights_problem

pytestmark = pytest.mark.slow  # every test here reads a real training run (and some start train/sft.py)

ARGS = ["recipe=blog", *CHEAP, f"output_dir={BLOG_RUN}"]  # conftest's `blog_run`: 2 steps, a checkpoint at each
RUN = BLOG_RUN  # as the messages name it


@pytest.fixture
def run(blog_run, tmp_path) -> Path:
    """A copy of conftest's `blog_run` (a real tiny run of train/sft.py with checkpoint-1 and checkpoint-2) for this
    test to damage, in `tmp_path` at the run's own relative place."""
    return blog_run.copy_to(tmp_path)


def cwd_of(run: Path) -> Path:
    return run.parents[2]  # runs/blog/test


def truncate(path: Path, keep: float = 0.5) -> None:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


@pytest.mark.parametrize(
    ("name", "damage", "expected"),
    [
        ("trainer_state.json", "delete", "trainer_state.json is missing: the save was cut off"),
        ("trainer_state.json", "truncate", "trainer_state.json is truncated or damaged (not valid JSON)"),
        ("optimizer.pt", "delete", "optimizer.pt is missing"),
        ("optimizer.pt", "truncate", "optimizer.pt is truncated or damaged"),
        ("scheduler.pt", "delete", "scheduler.pt is missing"),
        ("adapter_model.safetensors", "delete", "no weights (adapter_model.safetensors or model.safetensors)"),
        ("adapter_model.safetensors", "truncate", "adapter_model.safetensors is truncated or damaged ("),
        ("adapter_config.json", "delete", "adapter_config.json is missing"),
        ("rng_state.pth", "truncate", "rng_state.pth is truncated or damaged"),
    ],
)
def test_a_damaged_file_is_named(run, name, damage, expected):
    checkpoint = run / "checkpoint-2"
    assert checkpoint_problem(checkpoint) is None and checkpoint_problem(run / "checkpoint-1") is None
    target = checkpoint / name
    target.unlink() if damage == "delete" else truncate(target)
    problem = checkpoint_problem(checkpoint)
    assert problem is not None and expected in problem
    assert str(checkpoint) in problem
    if name == "optimizer.pt" and damage == "delete":
        assert checkpoint_problem(checkpoint, save_only_model=True) is None  # such runs save no optimizer
    if name.startswith("adapter"):
        assert weights_problem(checkpoint) is not None


def test_a_truncated_adapter_stops_the_resume_and_the_offered_command_continues(
    run, monkeypatch, capsys, sft_in_this_process
):
    """A run with checkpoints is not started afresh; a truncated adapter stops its resume, and the command offered
    (with max_steps raised: the run goes on past its end) continues from the checkpoint before it."""
    cwd = cwd_of(run)
    again = refused_here(ARGS, cwd, monkeypatch, capsys)  # a fresh start on it: refused before it trains
    assert "already has checkpoints" in again and "resume=true" in again
    truncate(run / "checkpoint-2/adapter_model.safetensors", 0.9)
    # refused before anything trains, by train/sft.py's `main` here (one `error:` line, exit 2)
    error = refused_here([*ARGS, "resume=true"], cwd, monkeypatch, capsys)
    assert error.startswith(
        f"error: cannot resume from {RUN}/checkpoint-2: {RUN}/checkpoint-2/adapter_model.safetensors is"
    )
    assert f"Continue from the previous complete checkpoint with resume={RUN}/checkpoint-1" in error
    explicit = refused_here([*ARGS, f"resume={RUN}/checkpoint-2"], cwd, monkeypatch, capsys)
    assert f"resume={RUN}/checkpoint-1" in explicit

    longer = [*(a for a in ARGS if not a.startswith("max_steps")), "max_steps=3"]
    offered = run_sft([*longer, f"resume={RUN}/checkpoint-1"], cwd)
    assert offered.returncode == 0, offered.stdout[-3000:] + offered.stderr[-3000:]
    assert f"set {RUN}/checkpoint-2 aside as incomplete-checkpoint-2" in offered.stdout
    assert checkpoint_problem(run / "checkpoint-2") is None and checkpoint_problem(run / "checkpoint-3") is None
    assert (run / "incomplete-checkpoint-2/adapter_model.safetensors").is_file()  # kept, not deleted
    # neither the Trainer's rotation nor its lookup takes the folder set aside for a checkpoint
    assert [Path(p).name for p in sort_checkpoints(str(run))] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert Path(get_last_checkpoint(str(run))).name == "checkpoint-3"
    assert [r["global_step"] for r in history_rows(run)] == [0, 1, 2, 3]  # 0 and 1 kept, 2 again, 3 added
    state = json.loads((run / "checkpoint-3/trainer_state.json").read_text())
    assert state["global_step"] == 3 and [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2, 3]
    # every step's eval loss logged once: the resumed process does not evaluate step 1 again at its start
    assert [e["step"] for e in state["log_history"] if "eval_loss" in e] == [0, 1, 2, 3]
    assert (run / "checkpoint-3/tokenizer_config.json").is_file()  # a checkpoint of the resumed run serves alone too


def test_a_missing_optimizer_never_resumes_half_loaded(run, monkeypatch, capsys, sft_in_this_process):
    (run / "checkpoint-2/optimizer.pt").unlink()
    error = refused_here([*ARGS, "resume=true"], cwd_of(run), monkeypatch, capsys)
    assert f"cannot resume from {RUN}/checkpoint-2: {RUN}/checkpoint-2/optimizer.pt is missing" in error
    assert f"resume={RUN}/checkpoint-1" in error


def test_with_no_complete_checkpoint_resume_offers_a_fresh_start_and_does_not_take_it(
    run, monkeypatch, capsys, sft_in_this_process
):
    for checkpoint in ("checkpoint-1", "checkpoint-2"):
        (run / checkpoint / "trainer_state.json").unlink()
    error = refused_here([*ARGS, "resume=true"], cwd_of(run), monkeypatch, capsys)
    assert "has no complete checkpoint" in error and "overwrite=true" in error
    assert [r["global_step"] for r in history_rows(run)] == [0, 1, 2], "nothing was started over"
