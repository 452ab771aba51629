"""Two machines from one empty cache: the tokenizer and the `tiny` model are made once, outside any distributed or
DeepSpeed context, and both ranks train on the complete copy. With ZeRO-3 the run is the one the loop's tests compare
(`_launch.SETTINGS`) and its records are those of the same run on one machine."""

from __future__ import annotations

import shutil

import pytest
from _launch import SETTINGS, assert_same_records, start_machines

from probdiff_callback.models.cache import is_complete

CHEAP = [
    "recipe=blog",
    "model=tiny",
    "report_to=none",
    "max_steps=1",
    "eval_steps=1",
    "save_steps=1",
    "probdiff.n_queries=2",
    "probdiff.max_new_tokens=4",
    "max_eval_samples=2",
    "per_device_train_batch_size=1",
    "per_device_eval_batch_size=1",
    "output_dir=run",
]
LAUNCHERS = {
    "ddp": ("--multi_gpu",),  # on CPU, --multi_gpu is what makes accelerate start 2 DDP processes (gloo)
    "zero3": ("--use_deepspeed", "--zero_stage", "3", "--zero3_init_flag", "false"),
}

pytestmark = [
    pytest.mark.slow,  # every test here starts processes
    pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher"),
]


@pytest.mark.parametrize("mode", sorted(LAUNCHERS))
def test_two_machines_from_one_empty_cache(mode, tmp_path, request):
    """Two machines (one training process each, `_launch.start_machines`) share one empty PROBDIFF_CACHE, as nodes
    sharing it on a network file system do: one builds each model file, the other waits and uses it. ZeRO-3's run
    (its weights sharded across the machines, gathered for each evaluation) evaluates every step as plain DDP on one
    machine does: the same texts, the scores within float noise."""
    if mode == "zero3":
        pytest.importorskip("deepspeed", reason="ZeRO-3 runs need the deepspeed extra: pip install -e '.[deepspeed]'")
    cache = tmp_path / "cache"
    shared = {"PROBDIFF_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    args = [*SETTINGS, "output_dir=run"] if mode == "zero3" else CHEAP
    machines = start_machines(args, tmp_path, launcher_args=LAUNCHERS[mode], env_of={0: shared, 1: shared})
    statuses = machines.wait(600)
    output = machines.output(0) + machines.output(1)
    assert statuses == [0, 0], f"{mode}:\n{machines.output(0)[-3000:]}\n{machines.output(1)[-6000:]}"
    assert output.count("Unpacking the `tiny` model") == 1  # one machine unpacked, the other waited
    assert output.count("Converting the Qwen v1 vocabulary") == 1
    model_dirs = [p for p in (cache / "models").iterdir() if p.is_dir()]  # no temporary copies left behind
    assert len(model_dirs) == 1 and is_complete(model_dirs[0])
    assert (tmp_path / "run" / "checkpoint-1" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "run" / "probdiff" / "history.jsonl").is_file()
    if mode == "zero3":
        assert_same_records(tmp_path / "run", request.getfixturevalue("uninterrupted")(2)[0])
