"""Whether a Trainer checkpoint is whole: every file there, none cut short, read from headers only.

The Trainer writes a checkpoint's files one after another (weights, optimizer, scheduler, RNG state) and
`trainer_state.json` last. It resumes from the newest `checkpoint-N` by name alone, and when `optimizer.pt` or
`scheduler.pt` is missing it trains on with a fresh optimizer without a word. So a kill in the middle of a save, a
disk that filled or a file deleted by hand would resume from a half-loaded state. These checks catch that without
loading any tensor: `safetensors.safe_open` checks that a file's header covers its data exactly, and `zipfile` reads a
`.pt`/`.pth` file's (torch's zip format) directory at its end, so a file cut short fails either. No torch import
(`safe_open` with the numpy framework): `probdiff select` uses them too.
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

from safetensors import SafetensorError, safe_open

TRAINER_STATE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME, written last
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")  # transformers' PREFIX_CHECKPOINT_DIR naming
WEIGHT_FILES = (
    "adapter_model.safetensors",
    "model.safetensors",
    "model.safetensors.index.json",
    "adapter_model.bin",
    "pytorch_model.bin",
)
OPTIMIZER_FILES = ("optimizer.pt", "scheduler.pt")


def checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's `checkpoint-N` folders, oldest first (by N, as the Trainer orders them)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if p.is_dir() and CHECKPOINT_NAME.match(p.name)]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(path: str | Path) -> int:
    return int(CHECKPOINT_NAME.match(Path(path).name).group(1))  # type: ignore[union-attr]


def is_cut_off(path: Path) -> bool:
    """The save stopped before its end: the Trainer writes `trainer_state.json` last."""
    return not (path / TRAINER_STATE).is_file()


def checkpoint_problem(path: str | Path, save_only_model: bool = False) -> str | None:
    """None for a checkpoint the Trainer can resume from; else what is wrong, naming the file."""
    path = Path(path)
    if is_cut_off(path):
        return f"{path / TRAINER_STATE} is missing: the save was cut off (the Trainer writes it last)"
    problem = json_problem(path / TRAINER_STATE) or weights_problem(path)
    if problem:
        return problem
    deepspeed = any(p.is_dir() for p in path.glob("global_step*"))  # DeepSpeed keeps the optimizer there
    if not save_only_model and not deepspeed:
        missing = [name for name in OPTIMIZER_FILES if not (path / name).is_file()]
        if missing:
            return f"{path / missing[0]} is missing"
    for pickled in sorted([*path.glob("*.pt"), *path.glob("*.pth")]):
        problem = zip_problem(pickled)
        if problem:
            return problem
    return None


def weights_problem(path: str | Path) -> str | None:
    """None if the checkpoint's weights (an adapter or the whole model, sharded or not) are there and whole."""
    path = Path(path)
    weights = next((path / name for name in WEIGHT_FILES if (path / name).is_file()), None)
    if weights is None:
        return f"{path}: no weights ({' or '.join(WEIGHT_FILES[:2])}) in it"
    if weights.name.startswith("adapter_") and not (path / "adapter_config.json").is_file():
        return f"{path / 'adapter_config.json'} is missing"
    if weights.name.endswith(".index.json"):
        problem = json_problem(weights)
        if problem:
            return problem
        shards = sorted(set(json.loads(weights.read_text(encoding="utf-8")).get("weight_map", {}).values()))
        for shard in shards:
            problem = (
                f"{path / shard} is missing" if not (path / shard).is_file() else safetensors_problem(path / shard)
            )
            if problem:
                return problem
        return None
    return safetensors_problem(weights) if weights.suffix == ".safetensors" else zip_problem(weights)


def safetensors_problem(path: Path) -> str | None:
    """None if safetensors opens the file: its header is whole JSON and its tensors cover the data to the last byte."""
    try:
        with safe_open(path, framework="numpy"):
            return None
    except (SafetensorError, OSError) as err:
        return f"{path} is truncated or damaged ({path.stat().st_size:,} bytes; safetensors: {err})"


def zip_problem(path: Path) -> str | None:
    try:
        with zipfile.ZipFile(path):
            return None
    except (zipfile.BadZipFile, OSError):
        return f"{path} is truncated or damaged ({path.stat().st_size:,} bytes, not a whole torch.save archive)"


def json_problem(path: Path) -> str | None:
    try:
        json.loads(path.read_text(encoding="utf-8"))
        return None
    except ValueError:
        return f"{path} is truncated or damaged (not valid JSON)"
