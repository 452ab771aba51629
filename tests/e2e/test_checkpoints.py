"""Broken checkpoints: every file the Trainer writes checked from its header, a broken checkpoint named with the
previous complete one offered (`resume=<it>`), never a silent fresh start or a half-loaded resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _launch import CHEAP, history_rows, run_sft
from transformers.trainer_utils import get_last_checkpoint, sort_checkpoints

from probdiff_callback.runs.checkpoints import checkpoint_problem, weights_problem

pytestmark = pytest.mark.slow  # every test here starts processes

ARGS = ["recipe=blog", *CHEAP, "output_dir=run"]  # 2 steps, a checkpoint at each


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_path) -> Path:
    """A real tiny run of train/sft.py with checkpoint-1 and checkpoint-2 (copied, never changed, by each test)."""
    cwd = tmp_path_factory.mktemp("trained")
    result = run_sft(ARGS, cwd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return cwd


@pytest.fixture
def run(trained, tmp_path) -> Path:
    shutil.copytree(trained / "run", tmp_path / "run", symlinks=True)
    return tmp_path / "run"


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


def test_a_truncated_adapter_stops_the_resume_and_the_offered_command_continues(run):
    cwd = run.parent
    truncate(run / "checkpoint-2/adapter_model.safetensors", 0.9)
    refused = run_sft([*ARGS, "resume=true"], cwd)
    assert refused.returncode == 2
    error = refused.stderr.strip().splitlines()[-1]
    assert error.startswith("error: cannot resume from run/checkpoint-2: run/checkpoint-2/adapter_model.safetensors is")
    assert "Continue from the previous complete checkpoint with resume=run/checkpoint-1" in error
    assert "Traceback" not in refused.stderr
    explicit = run_sft([*ARGS, "resume=run/checkpoint-2"], cwd)
    assert explicit.returncode == 2 and "resume=run/checkpoint-1" in explicit.stderr

    offered = run_sft([*ARGS, "resume=run/checkpoint-1"], cwd)
    assert offered.returncode == 0, offered.stdout[-3000:] + offered.stderr[-3000:]
    assert "set run/checkpoint-2 aside as incomplete-checkpoint-2" in offered.stdout
    assert checkpoint_problem(run / "checkpoint-2") is None  # saved again, whole
    assert (run / "incomplete-checkpoint-2/adapter_model.safetensors").is_file()  # kept, not deleted
    # neither the Trainer's rotation nor its lookup takes the folder set aside for a checkpoint
    assert [Path(p).name for p in sort_checkpoints(str(run))] == ["checkpoint-1", "checkpoint-2"]
    assert Path(get_last_checkpoint(str(run))).name == "checkpoint-2"
    assert [r["global_step"] for r in history_rows(run)] == [0, 1, 2]
    state = json.loads((run / "checkpoint-2/trainer_state.json").read_text())
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2]


def test_a_missing_optimizer_never_resumes_half_loaded(run):
    (run / "checkpoint-2/optimizer.pt").unlink()
    refused = run_sft([*ARGS, "resume=true"], run.parent)
    assert refused.returncode == 2
    assert "run/checkpoint-2/optimizer.pt is missing" in refused.stderr and "resume=run/checkpoint-1" in refused.stderr


def test_with_no_complete_checkpoint_resume_offers_a_fresh_start_and_does_not_take_it(run):
    for checkpoint in ("checkpoint-1", "checkpoint-2"):
        (run / checkpoint / "trainer_state.json").unlink()
    refused = run_sft([*ARGS, "resume=true"], run.parent)
    assert refused.returncode == 2
    assert "has no complete checkpoint" in refused.stderr and "overwrite=true" in refused.stderr
    assert [r["global_step"] for r in history_rows(run)] == [0, 1, 2], "nothing was started over"
