"""What the side-by-side benchmarks (`bench_core.py`, `bench_eval_smollm2.py`) share: `probdiff eval` and a plain
pipeline doing the same work, each timed as a whole process (imports and model load included), run alternately
`pairs` times, since the machine's speed drifts; their ratio is then taken of the medians."""

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The paper's data (never committed: ../shared/data/probdiff-reference beside the checkout, or where
# PROBDIFF_REFERENCE_DATA says, e.g. for a git worktree elsewhere)
REFERENCE_DATA = Path(os.environ.get("PROBDIFF_REFERENCE_DATA", ROOT.parent / "shared" / "data" / "probdiff-reference"))


def timed(command: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> tuple[float, str]:
    """(wall seconds, stdout) of `command` run from `cwd` (this checkout) in `env` (this process's environment);
    exits with its stderr's tail if it fails."""
    started = time.time()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(command)}\n{result.stderr[-3000:]}")
    return time.time() - started, result.stdout


def probdiff_eval(model: str, queries: Path, limit: int, out: Path, max_new_tokens: int, batch_size: int) -> list[str]:
    """`probdiff eval` on the CPU in float32, its records and summary written to `out` (each run of the alternation
    replaces the last one's)."""
    return [
        "probdiff", "eval", "--model", model, "--device", "cpu", "--dtype", "float32", "--queries", str(queries),
        "--limit", str(limit), "--out", str(out), "--overwrite", f"max_new_tokens={max_new_tokens}",
        f"batch_size={batch_size}",
    ]  # fmt: skip


@dataclass
class Runs:
    """The seconds of each run of ours and of the plain side, in the order they ran."""

    ours: list[float]
    plain: list[float]

    def medians(self) -> tuple[float, float]:
        return statistics.median(self.ours), statistics.median(self.plain)

    def note(self) -> str:
        ours, plain = (", ".join(f"{t:.1f}" for t in runs) for runs in (self.ours, self.plain))
        return f"(medians of {len(self.ours)}; ours {ours} s, plain {plain} s)"


def alternately(pairs: int, ours: list[str], plain: list[str]) -> Runs:
    """`pairs` runs of each command, ours first in each pair."""
    runs = Runs([], [])
    for _ in range(pairs):
        runs.ours.append(timed(ours)[0])
        runs.plain.append(timed(plain)[0])
    return runs
