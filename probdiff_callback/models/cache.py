"""Where built artefacts (the converted tokenizer, the unpacked `tiny` model) live, and how they are
built once: under a file lock (`filelock`), into a temporary directory, with a marker written last.

Several processes started by `accelerate launch` (or two runs at once) may ask for the same artefact.
The first builds it; the others wait on the lock and then find it complete. A directory counts as
complete only when its marker is there and every file the marker lists has the size it records, so a
build that died half-way (or wrote files that were later truncated) is built again, never used.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

COMPLETE_MARKER = "probdiff_complete.json"


def cache_dir() -> Path:
    """`$PROBDIFF_CACHE`, else `$XDG_CACHE_HOME/probdiff`, else `~/.cache/probdiff`."""
    if os.environ.get("PROBDIFF_CACHE"):
        root = Path(os.environ["PROBDIFF_CACHE"])
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "probdiff"
    root.mkdir(parents=True, exist_ok=True)
    return root


def is_complete(directory: Path) -> bool:
    """True when `directory` holds its marker and every file the marker lists, at the recorded size."""
    marker = directory / COMPLETE_MARKER
    try:
        sizes = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return bool(sizes) and all(
        (directory / name).is_file() and (directory / name).stat().st_size == size for name, size in sizes.items()
    )


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """`target`, built by `build(tmp_dir)` unless a complete copy is already there.

    `build` writes into an empty temporary directory beside `target`; the marker (every file's size)
    is written after it returns, and the directory is then renamed into place in one step.
    """
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.with_name(target.name + ".lock")):
        if is_complete(target):  # another process built it while we waited for the lock
            return target
        tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            build(tmp)
            sizes = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
            (tmp / COMPLETE_MARKER).write_text(json.dumps({"files": sizes}, indent=1))
            shutil.rmtree(target, ignore_errors=True)  # an incomplete copy left by an earlier crash
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
