"""train/run_dir.py: the run directory's name, resuming and a directory that already holds checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

from train.recipe import RecipeError, load_recipe
from train.run_dir import default_run_name, resolve_run


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
