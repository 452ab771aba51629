"""`accelerate launch` with 2 processes from an empty cache: the tokenizer and the `tiny` model are made once,
outside any distributed or DeepSpeed context, and both ranks train on the complete copy."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from _launch import run_sft

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
    "ddp": ["--multi_gpu"],  # on CPU, --multi_gpu is what makes accelerate start 2 DDP processes (gloo)
    "zero3": ["--use_deepspeed", "--zero_stage", "3", "--zero3_init_flag", "false"],
}

pytestmark = [
    pytest.mark.slow,  # every test here starts processes
    pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher"),
]


@pytest.mark.parametrize("mode", sorted(LAUNCHERS))
def test_two_processes_from_an_empty_cache(mode, tmp_path):
    if mode == "zero3":
        pytest.importorskip("deepspeed", reason="ZeRO-3 runs need the deepspeed extra: pip install -e '.[deepspeed]'")
    cache = tmp_path / "cache"
    extra = ("--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", *LAUNCHERS[mode])
    try:
        done = run_sft(
            CHEAP,
            tmp_path,
            "accelerate",
            processes=2,
            launcher_args=extra,
            PROBDIFF_CACHE=str(cache),
            OMP_NUM_THREADS="1",
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{mode}: the cold 2-process run did not finish in 600 s\n{str(err.stderr)[-4000:]}")
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{mode} launch failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert output.count("Unpacking the `tiny` model") == 1  # one rank unpacked, the other waited
    model_dirs = [p for p in (cache / "models").iterdir() if p.is_dir()]  # no temporary copies left behind
    assert len(model_dirs) == 1 and is_complete(model_dirs[0])
    assert (tmp_path / "run" / "checkpoint-1" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "run" / "probdiff" / "history.jsonl").is_file()
