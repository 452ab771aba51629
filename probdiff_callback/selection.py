"""`probdiff select RUN_DIR`: rank the evaluated checkpoints of a training run by ProbDiff confidence.

Reads `RUN_DIR/probdiff/history.jsonl` and the step records written by ProbDiffCallback,
so it also works while the run is still training (the history is rewritten atomically).
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from probdiff_callback import history, versus_base
from probdiff_callback.agreement import step_measures
from probdiff_callback.disagreement import Disagreement, find_disagreements, format_disagreements
from probdiff_callback.formatting import fmt, pct
from probdiff_callback.metric import compare
from probdiff_callback.queries import read_jsonl


@dataclass
class RankedStep:
    global_step: int
    kind: str
    base_model: bool
    checkpoint: str | None  # an existing checkpoint directory, or None
    confidence: float
    confidence_ci: tuple[float, float]
    d_mean: float
    n: int
    rank: int | None = None  # 1 = best; None for the baseline
    p_vs_best: float = math.nan  # Wilcoxon signed-rank on d against the best step, same query ids
    win: int = 0  # queries confident here and not at the best step
    lose: int = 0
    vs_base: dict | None = None  # metric.compare against the baseline (win/tie/lose, Wilcoxon p); None for the baseline


@dataclass
class Selection:
    ranked: list[RankedStep]  # evaluated training steps, best first
    baseline: RankedStep | None
    best_checkpoint: RankedStep | None  # the best-ranked step with a checkpoint on disk
    failed_steps: list[int]
    delta: float
    run_dir: Path
    disagreements: list[Disagreement]  # where an independent measure moves against ProbDiff (disagreement.py)

    @property
    def baseline_beats_all(self) -> bool:
        if self.baseline is None or not self.ranked:
            return False
        return _sort_key(self.baseline) < _sort_key(self.ranked[0])


def _number(value) -> float:
    return math.nan if value is None else float(value)


def _sort_key(step: RankedStep) -> tuple[float, float]:
    """Higher confidence first, ties by higher mean d; NaN ranks last."""
    confidence = step.confidence if math.isfinite(step.confidence) else -math.inf
    d_mean = step.d_mean if math.isfinite(step.d_mean) else -math.inf
    return (-confidence, -d_mean)


def resolve_checkpoint(run_dir: Path, checkpoint: str | None) -> str | None:
    """The checkpoint directory if it still exists (rotation may have deleted it); the
    history holds the path as the Trainer wrote it, which may be relative to another cwd."""
    if checkpoint is None:
        return None
    for candidate in (Path(checkpoint), run_dir / Path(checkpoint).name):
        if candidate.is_dir():
            return str(candidate)
    return None


def _step_records(probdiff_dir: Path, row: dict) -> list[dict] | None:
    if row.get("records") is None:
        return None
    path = probdiff_dir / row["records"]
    return read_jsonl(path) if path.is_file() else None


def select_checkpoints(run_dir: str | os.PathLike, subdir: str = history.DEFAULT_SUBDIR) -> Selection:
    run_dir = history.existing_run_dir(run_dir)
    directory = history.probdiff_dir(run_dir, subdir)
    rows = history.read_history(directory / history.HISTORY_FILE)
    if not rows:
        raise FileNotFoundError(
            f"{directory / history.HISTORY_FILE}: no evaluations yet; was the run trained with ProbDiffCallback?"
        )
    failed = [row["global_step"] for row in rows if row.get("error") is not None or row.get("summary") is None]
    steps, baseline, records = [], None, {}
    delta = math.nan
    for row in rows:
        if row["global_step"] in failed:
            continue
        summary = row["summary"]
        delta = summary["delta"]
        step = RankedStep(
            global_step=row["global_step"],
            kind=row.get("kind", "evaluate"),
            base_model=bool(row.get("base_model")),
            checkpoint=resolve_checkpoint(run_dir, row.get("checkpoint")),
            confidence=_number(summary["confidence"]),
            confidence_ci=(_number(summary["confidence_ci"][0]), _number(summary["confidence_ci"][1])),
            d_mean=_number(summary["d_mean"]),
            n=summary["n"],
        )
        records[step.global_step] = _step_records(directory, row)
        if step.kind == "baseline":
            baseline = step
        else:
            steps.append(step)
    steps.sort(key=lambda s: (_sort_key(s), s.global_step))
    for rank, step in enumerate(steps, start=1):
        step.rank = rank
    if steps:
        best_records = records[steps[0].global_step]
        for step in steps[1:] + ([baseline] if baseline is not None else []):
            mine = records[step.global_step]
            if best_records is None or mine is None:
                continue
            result = compare(mine, best_records, delta)
            step.p_vs_best, step.win, step.lose = result["wilcoxon_p"], result["win"], result["lose"]
    base_records = records[baseline.global_step] if baseline is not None else None
    for step in steps:
        step.vs_base = versus_base.compare_to_base(records[step.global_step] or [], base_records, delta)
    best_checkpoint = next((s for s in steps if s.checkpoint is not None), None)
    pick = best_checkpoint or (steps[0] if steps else None)
    disagreements = find_disagreements(step_measures(rows), pick.global_step if pick is not None else None)
    return Selection(
        ranked=steps,
        baseline=baseline,
        best_checkpoint=best_checkpoint,
        failed_steps=failed,
        delta=delta,
        run_dir=run_dir,
        disagreements=disagreements,
    )


def format_selection(selection: Selection) -> str:
    header = (
        f"{'rank':>4}  {'step':>6}  {'confidence':>10}  {'95% CI':>15}  {'d mean':>8}  {'n':>4}  {'p vs best':>9}  "
        f"{'win/lose':>8}  {'vs base w/t/l':>13}  {'p vs base':>9}  checkpoint"
    )
    lines = [
        f"ProbDiff confidence at delta {selection.delta:g} (ties by mean d); p: Wilcoxon signed-rank on d, "
        "same queries; win/tie/lose: queries confident here and not there / both or neither / there and not here",
        header,
    ]

    def line(step: RankedStep, rank: str) -> str:
        low, high = step.confidence_ci
        p = "-" if step.rank == 1 else fmt(step.p_vs_best, ".3g")
        win_lose = "-" if step.rank == 1 else f"{step.win}/{step.lose}"
        return (
            f"{rank:>4}  {step.global_step:>6}  {pct(step.confidence):>10}  "
            f"{'[' + pct(low) + ', ' + pct(high) + ']':>15}  "
            f"{step.d_mean:>8.4f}  {step.n:>4}  {p:>9}  {win_lose:>8}  "
            f"{versus_base.format_win_tie_lose(step.vs_base):>13}  {versus_base.format_p(step.vs_base):>9}  "
            f"{step.checkpoint or '-'}"
        )

    for step in selection.ranked:
        lines.append(line(step, str(step.rank)))
    if selection.baseline is not None:
        label = "base model" if selection.baseline.base_model else "before training"
        lines.append(line(selection.baseline, "base") + f"  ({label})")
    if selection.failed_steps:
        lines.append(
            "failed evaluations (see `error` in the history): steps " + ", ".join(map(str, selection.failed_steps))
        )
    if selection.baseline_beats_all:
        lines.append(
            f"The baseline (step {selection.baseline.global_step}, before fine-tuning) beats every evaluated "
            "checkpoint: fine-tuning has not improved ProbDiff confidence on these queries."
        )
    if selection.best_checkpoint is None:
        lines.append("No evaluated step has a checkpoint on disk yet.")
    else:
        best = selection.best_checkpoint
        lines.append(
            f"Best checkpoint: step {best.global_step}, {best.checkpoint} "
            f"(confidence {pct(best.confidence)}, d mean {best.d_mean:.4f})"
        )
        if selection.ranked and selection.ranked[0] is not best:
            lines.append(
                f"(step {selection.ranked[0].global_step} ranks higher but its checkpoint was not saved or was deleted)"
            )
    if selection.disagreements:
        lines.append(format_disagreements(selection.disagreements, selection.run_dir))
    return "\n".join(lines)


def point_best(run_dir: str | os.PathLike, checkpoint: str, copy: bool = False) -> Path:
    """Make `RUN_DIR/best` a symlink to `checkpoint` (relative, so the run directory can move),
    or a copy of it; replaces an earlier `best`."""
    target = Path(run_dir) / "best"
    staging = Path(run_dir) / f".best.tmp{os.getpid()}"
    if copy:
        shutil.copytree(checkpoint, staging, symlinks=True)
    else:
        os.symlink(
            os.path.relpath(Path(checkpoint).resolve(), Path(run_dir).resolve()), staging, target_is_directory=True
        )
    if target.is_symlink() and copy:
        target.unlink()  # rename cannot put a directory over a symlink
    elif target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
    os.replace(staging, target)  # a symlink over a symlink is swapped atomically
    return target
