"""Two machines from one empty cache, with ZeRO-3, in the loop: the tokenizer and the `tiny` model are made once,
outside any distributed or DeepSpeed context, and both ranks train on the complete copy; the run is the one the loop's
tests compare (`_launch.SETTINGS`), and its records are those of the same run in the loop on one machine. (Beside
training, ZeRO-3 on two nodes from one empty cache is e2e/test_slurm.py's requeue test; plain DDP builds the cache by
the same code before its process group exists: two DDP machines are e2e/test_machines.py's in the loop and
e2e/test_slurm.py's server-node test beside training.)"""

from __future__ import annotations

import shutil

import pytest
from _launch import SETTINGS, assert_same_records, start_machines

from probdiff_callback.models.cache import is_complete

ZERO3 = ("--use_deepspeed", "--zero_stage", "3", "--zero3_init_flag", "false")

pytestmark = [
    pytest.mark.slow,  # starts processes
    pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher"),
]


def test_zero3_on_two_machines_from_one_empty_cache_evaluates_as_one_machine(tmp_path, uninterrupted):
    """Two machines (one training process each, `_launch.start_machines`) share one empty PROBDIFF_CACHE, as nodes
    sharing it on a network file system do: one builds each model file, the other waits and uses it. The weights
    sharded across the machines and gathered for each evaluation, every step is evaluated as plain DDP on one machine
    evaluates it in the loop: the same texts, the scores within float noise."""
    pytest.importorskip("deepspeed", reason="ZeRO-3 runs need the deepspeed extra: pip install -e '.[deepspeed]'")
    cache = tmp_path / "cache"
    shared = {"PROBDIFF_CACHE": str(cache)}
    machines = start_machines([*SETTINGS, "output_dir=run"], tmp_path, launcher_args=ZERO3,
                              env_of={0: shared, 1: shared})  # fmt: skip
    statuses = machines.wait(600)
    output = machines.output(0) + machines.output(1)
    assert statuses == [0, 0], f"{machines.output(0)[-3000:]}\n{machines.output(1)[-6000:]}"
    assert output.count("Unpacking the `tiny` model") == 1  # one machine unpacked, the other waited
    assert output.count("Converting the Qwen v1 vocabulary") == 1
    model_dirs = [p for p in (cache / "models").iterdir() if p.is_dir()]  # no temporary copies left behind
    assert len(model_dirs) == 1 and is_complete(model_dirs[0])
    assert (tmp_path / "run" / "final" / "adapter_model.safetensors").is_file()
    assert_same_records(tmp_path / "run", uninterrupted(2)[0])
