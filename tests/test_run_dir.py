"""training/run_dir.py: the run directory's name, resuming and a directory that already holds checkpoints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from probdiff_callback.training import sft
from probdiff_callback.training.recipe import RecipeError, load_recipe
from probdiff_callback.training.run_dir import default_run_name, resolve_run


def test_run_name_is_stable_and_ignores_run_level_keys():
    a = load_recipe(["recipe=blog", "model=tiny"])
    b = load_recipe(["recipe=blog", "model=tiny", "report_to=none", "resume=true"])
    c = load_recipe(["recipe=blog", "model=tiny", "learning_rate=1e-3"])
    assert default_run_name(a) == default_run_name(b) != default_run_name(c)
    assert default_run_name(a).startswith("tiny-")


def write_whole_checkpoint(path: Path) -> None:
    """The files of a LoRA checkpoint, small but whole (`probdiff_callback.runs.checkpoints` checks their headers)."""
    import numpy as np
    import torch
    from safetensors.numpy import save_file

    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text("{}")
    (path / "adapter_config.json").write_text("{}")
    save_file({"lora_A": np.zeros((2, 2), dtype=np.float32)}, str(path / "adapter_model.safetensors"))
    for name in ("optimizer.pt", "scheduler.pt"):
        torch.save({}, path / name)


def test_resolve_run_resume_and_existing_checkpoints(tmp_path):
    run = tmp_path / "run"
    recipe = load_recipe(["recipe=blog", "model=tiny", f"output_dir={run}"])
    assert resolve_run(recipe) == (run, None)
    for step in (4, 12, 8):
        write_whole_checkpoint(run / f"checkpoint-{step}")
    with pytest.raises(RecipeError, match="already has checkpoints .checkpoint-12.*resume=true"):
        resolve_run(recipe)
    assert resolve_run(load_recipe(["recipe=blog", "model=tiny", f"output_dir={run}", "resume=true"])) == (
        run,
        str(run / "checkpoint-12"),
    )
    other = load_recipe(["recipe=blog", "model=tiny", f"resume={run / 'checkpoint-4'}"])
    assert resolve_run(other) == (run, str(run / "checkpoint-4"))  # the checkpoint's own run goes on
    with pytest.raises(RecipeError, match="not a training checkpoint"):
        resolve_run(load_recipe(["recipe=blog", f"resume={tmp_path}"]))
    assert resolve_run(load_recipe(["recipe=blog", "model=tiny", f"output_dir={run}", "overwrite=true"])) == (run, None)


def test_resume_of_a_missing_checkpoint_lists_the_runs_checkpoints(tmp_path, capsys, sft_in_this_process):
    run = tmp_path / "run"
    for step in (10, 20):
        (run / f"checkpoint-{step}").mkdir(parents=True)
    recipe = load_recipe(["recipe=blog", f"resume={run}/checkpoint-30", f"output_dir={run}"])
    with pytest.raises(RecipeError) as raised:
        resolve_run(recipe)
    assert str(raised.value) == (
        f"resume={run}/checkpoint-30: no such directory. {run} has checkpoint-10, checkpoint-20: give one of them "
        f"(e.g. resume={run}/checkpoint-20), or resume=true for the latest complete one"
    )
    args = ["recipe=blog", "model=tiny", f"resume={run}/checkpoint-30", f"output_dir={run}", "report_to=none"]
    assert sft.main(args) == 2
    assert error_lines(capsys.readouterr().err) == [f"error: {raised.value}"]
    # a folder that is there but is no checkpoint; a run of another recipe's directory gets no resume=true
    with pytest.raises(RecipeError, match=rf"resume={re.escape(str(run))}: not a training checkpoint \(a checkpoint-N"):
        resolve_run(load_recipe(["recipe=blog", f"resume={run}"]))
    with pytest.raises(RecipeError, match=rf"give one of them \(e.g. resume={re.escape(str(run))}/checkpoint-20\)$"):
        resolve_run(load_recipe(["recipe=blog", f"resume={run}/checkpoint-5"]))


def test_resume_of_a_missing_checkpoint_in_a_run_without_checkpoints(tmp_path):
    recipe = load_recipe(["recipe=blog", f"resume={tmp_path}/gone/checkpoint-3", f"output_dir={tmp_path}/run"])
    with pytest.raises(RecipeError) as raised:
        resolve_run(recipe)
    assert str(raised.value) == (
        f"resume={tmp_path}/gone/checkpoint-3: no such directory; {tmp_path}/run, this recipe's run directory, has no "
        "checkpoint yet. Leave resume out to start the run, or give resume=RUN_DIR/checkpoint-N of another run"
    )


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]
