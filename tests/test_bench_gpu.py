"""bench/gpu.py, the GPU benchmark kit, kept working on CPU: its `--shape tiny` run (with the vLLM path where vLLM
is found, as in CI), its floor arithmetic, and the `generate` path's sampler. Timings are printed by the kit, never
asserted here."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "bench" / "gpu.py"
sys.path.insert(0, str(KIT.parent))  # the kit's modules, bench/gpu_kit, as bench/gpu.py finds them

from gpu_kit.decoding_paths import generate_continuations  # noqa: E402
from gpu_kit.floor import Hardware, ModelCost, decode_floor, steps_per_row  # noqa: E402
from gpu_kit.vllm_path import LABEL as VLLM_LABEL  # noqa: E402
from gpu_kit.vllm_path import SCRATCH_PREFIX, vllm_unavailable  # noqa: E402
from gpu_kit.workload import build_model, model_config  # noqa: E402

from probdiff_callback.core.engines import vllm as vllm_engine  # noqa: E402

# A GPU machine may have only torch, transformers, peft and this package: the kit must run without these.
NOT_NEEDED = ("trl", "wandb", "deepspeed", "datasets", "omegaconf", "scipy", "matplotlib", "bitsandbytes")
PATH_LABELS = ("ours (sample_continuations)", "generate", "generate + static cache")
EXPECTED_ROWS = [
    "date",
    "device",
    "versions",
    "model",
    "workload",
    "memory bandwidth",
    "matmul throughput",
    "bytes per decode step",
    "model build",
    *[
        f"{path}: {stage}"
        for path in PATH_LABELS
        for stage in ("evaluation", "answer decoding", "revision decoding", "scoring", "share of training time")
    ],
    "generate + static cache + torch.compile: evaluation",
    "decode batch 1",
    "decode batch 2",
    "LoRA step (r 16, alpha 32, 7 projections), 32 tokens",
    "QLoRA step",
]
POSITIVE_SUFFIXES = ("_s", "_bytes", "_per_s", "ratio_to_floor", "_tokens")
VLLM_ROWS = [
    f"{VLLM_LABEL}: {stage}"
    for stage in (
        "engine start-up",
        "evaluation",
        "answer decoding",
        "revision decoding",
        "scoring",
        "share of training time",
    )
]


def vllm_expected() -> bool:
    """Whether the kit measures the vLLM path here: where vLLM is found ($PROBDIFF_VLLM_PYTHON), and always in CI,
    which installs it."""
    if os.environ.get("CI"):
        return True
    try:
        vllm_engine.vllm_python()
    except vllm_engine.EngineUnavailable:
        return False
    return True


def measured_labels() -> tuple[str, ...]:
    return (*PATH_LABELS, VLLM_LABEL) if vllm_expected() else PATH_LABELS


def command_lines() -> list[str]:
    """Every process's command line on this machine."""
    lines = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                lines.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue
    return lines


def load_kit():
    spec = importlib.util.spec_from_file_location("bench_gpu", KIT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def kit():
    return load_kit()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """(stdout, figures from --json) of one small `--shape tiny` run on CPU, with the optional packages hidden."""
    out = tmp_path_factory.mktemp("gpu_kit") / "figures.json"
    hide = "import sys, runpy\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in NOT_NEEDED)
    code = hide + f"runpy.run_path({str(KIT)!r}, run_name='__main__')"
    small = (
        "--shape tiny --device cpu --queries 2 --max-new-tokens 3 --batch-size 2 --decode-batch 1 2 --train-tokens 32"
    )
    arguments = [*small.split(), "--json", str(out)]
    result = subprocess.run(
        [sys.executable, "-c", code, *arguments], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout, json.loads(out.read_text())


def table_rows(stdout: str) -> dict[str, list[str]]:
    rows = {}
    for line in stdout.splitlines():
        if line.startswith("| ") and not line.startswith("| figure |"):
            cells = [cell.strip() for cell in line.strip("|").split(" | ")]
            rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.slow
def test_the_table_has_every_row(tiny_run):
    stdout, _ = tiny_run
    rows = table_rows(stdout)
    missing = [name for name in EXPECTED_ROWS if name not in rows]
    assert not missing, f"rows missing from the table: {missing}\n{stdout}"
    broken = {name: cells for name, cells in rows.items() if cells[0] in ("failed", "out of memory")}
    assert not broken, f"measurements that did not run: {broken}"
    assert rows["device"][0].startswith("CPU")
    for package in ("torch", "transformers", "peft", "probdiff"):
        assert package in rows["versions"][0]


@pytest.mark.slow
def test_cuda_only_measurements_say_why_they_were_skipped(tiny_run):
    rows = table_rows(tiny_run[0])
    for name in ("generate + static cache + torch.compile: evaluation", "QLoRA step"):
        value, reason = rows[name]
        assert value == "skipped" and "CUDA" in reason


@pytest.mark.slow
def test_the_output_says_rows_run_to_the_cap(tiny_run):
    stdout, figures = tiny_run
    assert "every row runs to max_new_tokens" in stdout
    assert any("every row runs to max_new_tokens" in note for note in figures["notes"])


@pytest.mark.slow
def test_json_holds_the_table_with_finite_positive_figures(tiny_run):
    stdout, figures = tiny_run
    names = [figure["name"] for figure in figures["figures"]]
    assert names == list(table_rows(stdout))
    checked = 0
    for figure in figures["figures"]:
        for key, value in figure["numbers"].items():
            assert math.isfinite(value), (figure["name"], key, value)
            if key.endswith(POSITIVE_SUFFIXES):
                assert value > 0, (figure["name"], key, value)
                checked += 1
    assert checked >= 40
    # the stage times of an evaluation add up to at most its wall time
    by_name = {figure["name"]: figure["numbers"] for figure in figures["figures"]}
    for path in measured_labels():
        stages = sum(
            by_name[f"{path}: {stage}"]["seconds_s"] for stage in ("answer decoding", "revision decoding", "scoring")
        )
        assert stages <= by_name[f"{path}: evaluation"]["seconds_s"]
        share = by_name[f"{path}: share of training time"]["share_at_32_tokens"]
        assert 0 < share < 1


@pytest.mark.slow
def test_the_vllm_path_runs_where_vllm_is_found(tiny_run):
    rows = table_rows(tiny_run[0])
    if not vllm_expected():
        value, reason = rows[f"{VLLM_LABEL}: evaluation"]
        assert value == "skipped" and "pip install" in reason and vllm_engine.PYTHON_VARIABLE in reason
        return
    missing = [name for name in VLLM_ROWS if name not in rows]
    assert not missing, f"vLLM rows missing from the table: {missing}\n{tiny_run[0]}"
    assert "LoRA on" in rows[f"{VLLM_LABEL}: engine start-up"][1]
    assert "tokens/s" in rows[f"{VLLM_LABEL}: answer decoding"][1]
    assert "the speed of ours" in rows[f"{VLLM_LABEL}: evaluation"][1]


@pytest.mark.slow
def test_no_vllm_server_outlives_the_run(tiny_run):
    left = [line for line in command_lines() if SCRATCH_PREFIX in line]
    assert not left, f"the kit's vLLM server is still running: {left}"


def test_a_missing_vllm_is_skipped_with_the_line_that_installs_it(monkeypatch, tmp_path):
    monkeypatch.setenv(vllm_engine.PYTHON_VARIABLE, str(tmp_path / "no-such-python"))
    on_cpu, on_gpu = vllm_unavailable(torch.device("cpu")), vllm_unavailable(torch.device("cuda"))
    assert vllm_engine.INSTALL_CPU in on_cpu and vllm_engine.INSTALL_GPU in on_gpu
    assert f"export {vllm_engine.PYTHON_VARIABLE}=" in on_cpu and "no-such-python" in on_cpu


def test_unknown_shape_lists_the_valid_ones(kit, capsys):
    with pytest.raises(SystemExit):
        kit.parse_args(["--shape", "qwen-72b"])
    assert "qwen-14b, qwen-7b, tiny" in capsys.readouterr().err


def test_qwen_14b_shape_and_bytes_per_step():
    config = model_config("qwen-14b")
    shape = (
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.intermediate_size,
        config.vocab_size,
        config.tie_word_embeddings,
    )
    assert shape == (40, 5120, 40, 40, 13696, 152064, False)
    cost = ModelCost.from_config(config, torch.bfloat16)
    layer = 4 * 5120 * 5120 + 3 * 5120 * 13696
    assert cost.weight_bytes_per_step == (40 * layer + 152064 * 5120) * 2
    assert cost.kv_bytes_per_token == 2 * 40 * 5120 * 2  # no grouped-query attention: 0.82 MB per token
    config_7b = model_config("qwen-7b")
    assert (config_7b.num_hidden_layers, config_7b.hidden_size, config_7b.intermediate_size, config_7b.vocab_size) == (
        32,
        4096,
        11008,
        151936,
    )


def test_decode_floor_counts_weights_per_step_and_kv_of_live_rows():
    cost = ModelCost(
        layers=1, attention_width=1, decoder_matmul_params=50, head_params=50, element_size=2, kv_bytes_per_token=10
    )
    hardware = Hardware(bandwidth=100.0, flops=1e12)
    # two rows, prompts of 3 and 5 tokens, live for 4 and 2 steps: 4 weight reads of 200 bytes; KV tokens
    # (3+4+5+6) + (5+6) = 29, 290 bytes
    floor = decode_floor(cost, hardware, [3, 5], [4, 2])
    assert floor.weights == pytest.approx(4 * 200 / 100)
    assert floor.kv_cache == pytest.approx(290 / 100)
    assert floor.prefill == pytest.approx(200 / 100)  # one weight read: far more than its FLOPs at 1 TFLOP/s
    assert steps_per_row([3, 8, 0], cap=8) == [4, 8, 1]


def test_generate_with_the_row_sampler_draws_what_our_loop_draws():
    """The `generate` path does the same work as ours: same seeds and steps give the same tokens."""
    from probdiff_callback.core.decoding import sample_continuations

    model = build_model(model_config("tiny"), torch.device("cpu"), torch.float32)
    arguments = dict(
        prompts=[[151644, 872, 198, 9707], [151644, 872, 198, 14990, 1879, 11]],
        seeds=[11, 12],
        temperatures=[0.7, 0.1],
        top_ps=[0.8, 0.9],
        max_new_tokens=3,
        stop_ids=[151643, 151644, 151645],
        pad_token_id=151643,
        n_valid_ids=151851,
    )
    ours = sample_continuations(model, **arguments)
    through_generate = generate_continuations(model, **arguments)
    assert through_generate == ours
    assert [len(row) for row in ours] == [3, 3]
