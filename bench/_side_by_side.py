"""What the side-by-side benchmarks share (`bench_eval.py`, `bench_checkouts.py`, `bench_vllm.py`,
`bench_throughput.py`): commands run as whole processes from the checkout (imports and model load included) or calls
timed in one process, each side once per pair, `pairs` times in alternating order, since the machine's speed drifts;
the sides are compared by the ratio of their medians."""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[1]
# The paper's data, where present (never committed): ../shared/data/probdiff-reference beside the checkout, or where
# PROBDIFF_REFERENCE_DATA says (a git worktree elsewhere)
PAPER_DATA = Path(os.environ.get("PROBDIFF_REFERENCE_DATA", ROOT.parent / "shared" / "data" / "probdiff-reference"))
MT_BENCH = PAPER_DATA / "mtbench" / "question.jsonl"
SUMMARIZATION_SAMPLES = ROOT / "data" / "samples" / "summarization" / "heldout.jsonl"
T = TypeVar("T")


@dataclass(frozen=True)
class Done:
    seconds: float  # wall time
    cpu_seconds: float  # of the whole process tree (a vLLM server's included)
    stdout: str
    stderr: str

    @property
    def last_line(self) -> str:
        """What a measuring process prints last on stdout: its figure."""
        return self.stdout.strip().splitlines()[-1]


def run(command: list[str], env: Mapping[str, str] | None = None, cwd: Path = ROOT) -> Done:
    """`command` run to its end; exits with the end of its output if it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.time()
    result = subprocess.run(command, cwd=cwd, env=None if env is None else dict(env), capture_output=True, text=True)
    seconds, after = time.time() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(command)}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return Done(seconds, cpu, result.stdout, result.stderr)


def checkout_env(checkout: Path, env: Mapping[str, str]) -> dict[str, str]:
    """`env` with another checkout's source first on PYTHONPATH; exits unless `probdiff_callback` then comes from it
    (not from the installed copy)."""
    theirs = {**env, "PYTHONPATH": str(checkout)}
    code = [sys.executable, "-c", "import probdiff_callback; print(probdiff_callback.__file__)"]
    found = run(code, env=theirs, cwd=checkout).last_line
    if not found.startswith(str(checkout)):
        sys.exit(f"probdiff_callback comes from {found}, not from {checkout}")
    return theirs


def prepare_model(model: str) -> None:
    """The preset built (or found) in the cache once, outside the timings."""
    run(
        [
            sys.executable,
            "-c",
            f"from probdiff_callback.models import resolve_model_path; resolve_model_path({model!r})",
        ]
    )


def alternately(pairs: int, sides: Mapping[str, Callable[[int], T]]) -> dict[str, list[T]]:
    """Each side called with the pair's number, `pairs` times; the order turns around at every pair, so that no side
    always runs first."""
    results: dict[str, list[T]] = {name: [] for name in sides}
    for pair in range(pairs):
        for name in list(sides) if pair % 2 == 0 else reversed(list(sides)):
            results[name].append(sides[name](pair))
    return results


def medians(seconds: Mapping[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in seconds.items()}


def runs_note(seconds: Mapping[str, list[float]]) -> str:
    """Every run's seconds, for the reader to see the spread behind the medians."""
    sides = "; ".join(f"{name} " + ", ".join(f"{t:.1f}" for t in values) for name, values in seconds.items())
    return f"(medians of {len(next(iter(seconds.values())))}; {sides} s)"


def load_average() -> str:
    return f"{os.getloadavg()[0]:.2f}"


def read_run(out: Path) -> tuple[list[dict], dict]:
    """The records and the summary `probdiff eval --out out` wrote."""
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    return records, json.loads((out / "summary.json").read_text())
