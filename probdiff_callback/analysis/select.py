"""`probdiff select RUN_DIR`: rank the evaluated checkpoints of a training run by ProbDiff confidence and name the
best one.

The table ranks by confidence: the higher first, on a tie the earlier step (the Trainer replaces its best only on a
strictly greater value), NaN last. The best checkpoint is the run's pick (`pick.decide`, the one decision the
Trainer's best-model record takes too): by the metric the run selected by (`RUN_DIR/probdiff/selection.json`, which
the callback writes), `probdiff_guarded` for a run written before it was, or `--by`. So `RUN_DIR/best`, this table,
the plot's marker, the callback's disagreement check and `trainer.state.best_model_checkpoint` name the same
checkpoint. Works on what `run_files.read_run` read, also while the run is still training.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from probdiff_callback.analysis.crosscheck import step_measures
from probdiff_callback.analysis.disagreement import Disagreement, disagreements_of, format_disagreements
from probdiff_callback.analysis.materiality import check_gain_share
from probdiff_callback.analysis.pick import CONFIDENCE, GUARDED, Pick, decide, is_guarded
from probdiff_callback.analysis.report import fmt, format_p, format_win_tie_lose, pct
from probdiff_callback.core.config import DEFAULT_ALARM_GAIN_SHARE
from probdiff_callback.core.metric import compare, is_finite
from probdiff_callback.core.records import Comparison
from probdiff_callback.runs.checkpoints import weights_problem
from probdiff_callback.runs.run_files import DEFAULT_SUBDIR, HistoryRow, Run, probdiff_dir, read_run, step_files


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
    rank: int | None = None  # 1 = the highest confidence; None for the baseline
    guard: str | None = None  # with probdiff_guarded: "" where the checkpoint passed, else why it failed
    p_vs_best: float = math.nan  # Wilcoxon signed-rank on d against the best step, same query ids
    win: int = 0  # queries confident here and not at the best step
    lose: int = 0
    vs_base: Comparison | None = None  # against the baseline (win/tie/lose, Wilcoxon p); None for the baseline


@dataclass
class Selection:
    ranked: list[RankedStep]  # evaluated training steps, best first
    baseline: RankedStep | None
    best_checkpoint: RankedStep | None  # the best-ranked step with a checkpoint on disk
    failed_steps: list[int]
    abandoned_steps: list[int]
    skipped: list[tuple[int, str]]  # steps ranked above the best checkpoint whose checkpoint is gone or broken, why
    delta: float
    run_dir: Path
    disagreements: list[Disagreement]  # where an independent measure moves against ProbDiff (disagreement.py)
    alarm_gain_share: float = DEFAULT_ALARM_GAIN_SHARE  # what they were judged by (materiality.py)
    pick: Pick | None = None  # the decision behind `best_checkpoint`

    @property
    def baseline_beats_all(self) -> bool:
        """The baseline's confidence is above the best step's (a tie does not beat it, as for the Trainer)."""
        if self.baseline is None or not self.ranked:
            return False
        return rank_key(self.baseline.confidence, 0)[0] < rank_key(self.ranked[0].confidence, 0)[0]


def rank_key(confidence: float, step: int) -> tuple[float, int]:
    """Higher confidence first, then the earlier step; NaN ranks last."""
    return (-confidence if math.isfinite(confidence) else math.inf, step)


def ranked_rows(rows: Sequence[HistoryRow]) -> list[HistoryRow]:
    """The successfully evaluated training steps (not the baseline), best first."""
    steps = [row for row in rows if not row.failed and row.kind != "baseline"]
    return sorted(steps, key=lambda row: rank_key(row.confidence, row.global_step))


def resolve_checkpoint(run_dir: Path, checkpoint: str | None) -> str | None:
    """The checkpoint directory if it exists with whole weights (not yet saved, deleted by rotation or a fault, or
    its weights missing or cut short: None); the history holds the path as the Trainer wrote it, which may be
    relative to another cwd."""
    return None if checkpoint is None else unusable_checkpoint(run_dir, checkpoint)[0]


def unusable_checkpoint(run_dir: Path, checkpoint: str) -> tuple[str | None, str | None]:
    """(the usable checkpoint directory, None) or (None, why not)."""
    for candidate in (Path(checkpoint), run_dir / Path(checkpoint).name):
        if candidate.is_dir():
            problem = weights_problem(candidate)
            return (str(candidate), None) if problem is None else (None, problem)
    return None, f"{Path(checkpoint).name} removed (checkpoint rotation, or a fault)"


def run_pick(
    rows: Sequence[HistoryRow],
    run_dir: str | os.PathLike,
    values,
    metric: str = GUARDED,
    gain_share: float = DEFAULT_ALARM_GAIN_SHARE,
    on_disk_only: bool = True,
) -> Pick:
    """The run's pick by `metric` (probdiff_guarded, or an unguarded ranking by confidence), among the checkpoints on
    disk (`on_disk_only`) or among every evaluated step; `values(step)`: the step's records and per-conversation eval
    losses."""
    return decide(
        rows,
        values,
        metric if is_guarded(metric) else CONFIDENCE,
        lambda row: row.confidence,
        gain_share=gain_share,
        usable=lambda row: not on_disk_only or resolve_checkpoint(Path(run_dir), row.checkpoint) is not None,
    )


def confidence_pick(ranked: Sequence[HistoryRow], run_dir: str | os.PathLike) -> int | None:
    """The highest confidence among the checkpoints on disk, else the highest-ranked step (`ranked_rows`)."""
    with_checkpoint = (row for row in ranked if resolve_checkpoint(Path(run_dir), row.checkpoint) is not None)
    pick = next(with_checkpoint, ranked[0] if ranked else None)
    return None if pick is None else pick.global_step


BY_CONFIDENCE = object()  # `disagreements`' pick where none is given: the highest confidence (`confidence_pick`)


def disagreements(
    rows: Sequence[HistoryRow],
    run_dir: str | os.PathLike,
    subdir: str = DEFAULT_SUBDIR,
    gain_share: float = DEFAULT_ALARM_GAIN_SHARE,
    picked: int | None | object = BY_CONFIDENCE,
) -> list[Disagreement]:
    """Where an independent measure moves against ProbDiff, from the rows (the callback's, in memory), each change
    graded with the per-query values in the files the rows name and judged by its size (`gain_share`); `picked`: the
    run's pick (`pick.decide`: the Trainer's best; None: no checkpoint is picked)."""
    directory = probdiff_dir(run_dir, subdir)
    by_step = {row.global_step: row for row in rows}
    pick = confidence_pick(ranked_rows(rows), run_dir) if picked is BY_CONFIDENCE else picked
    return disagreements_of(step_measures(rows), pick, lambda step: step_files(directory, by_step[step]), gain_share)  # type: ignore[arg-type]


def _ranked_step(row: HistoryRow, run_dir: Path) -> RankedStep:
    summary = row.summary
    assert summary is not None
    return RankedStep(
        global_step=row.global_step,
        kind=row.kind,
        base_model=row.base_model,
        checkpoint=resolve_checkpoint(run_dir, row.checkpoint),
        confidence=summary.confidence,
        confidence_ci=(summary.confidence_ci[0], summary.confidence_ci[1]),
        d_mean=summary.d_mean,
        n=summary.n,
        vs_base=row.vs_base,
    )


def select(run: Run, alarm_gain_share: float | None = None, metric: str | None = None) -> Selection:
    """The ranking of a run read by `run_files.read_run` and its pick by `metric` (default: what the run selected by,
    else probdiff_guarded); the p-values compare each step's records with the highest-ranked step's; the guard and
    the disagreements judged by `alarm_gain_share` (default: the run's probdiff.alarm_gain_share, else 0.25)."""
    recorded = run.selection or {}
    if metric is None:
        metric = GUARDED if is_guarded(recorded.get("metric_for_best_model")) or not recorded else CONFIDENCE
    if alarm_gain_share is None:
        alarm_gain_share = float(recorded.get("alarm_gain_share", DEFAULT_ALARM_GAIN_SHARE))
    check_gain_share(alarm_gain_share)
    if not run.rows:
        raise FileNotFoundError(f"{run.history_path}: no evaluations yet; was the run trained with ProbDiffCallback?")
    ranked = ranked_rows(run.rows)
    steps = [_ranked_step(row, run.run_dir) for row in ranked]
    baseline_row = next((row for row in run.rows if row.kind == "baseline" and not row.failed), None)
    baseline = None if baseline_row is None else _ranked_step(baseline_row, run.run_dir)
    delta = next(
        (row.summary.delta for row in reversed(run.rows) if row.summary is not None and not row.failed), math.nan
    )
    for rank, step in enumerate(steps, start=1):
        step.rank = rank
    if steps:
        best_records = run.records.get(steps[0].global_step)
        for step in steps[1:] + ([baseline] if baseline is not None else []):
            mine = run.records.get(step.global_step)
            if best_records is None or mine is None:
                continue
            result = compare(mine, best_records, delta)
            step.p_vs_best, step.win, step.lose = result.wilcoxon_p, result.win, result.lose
    values = lambda step: (run.records.get(step), run.eval_losses.get(step))  # noqa: E731
    pick = run_pick(run.rows, run.run_dir, values, metric, alarm_gain_share)
    alarm_step = pick.step  # where no checkpoint is on disk (yet), the alarm holds the measures against the step ranked
    if alarm_step is None and not pick.none_passes:  # first all the same
        alarm_step = run_pick(run.rows, run.run_dir, values, metric, alarm_gain_share, on_disk_only=False).step
    if pick.guard is not None:
        for step in steps:
            step.guard = pick.guard.why_failed(step.global_step)
    best_checkpoint = next((s for s in steps if s.global_step == pick.step), None)
    eligible = [row for row in ranked if is_finite(pick.values.get(row.global_step, math.nan))]
    above_best = (
        eligible if best_checkpoint is None else eligible[: eligible.index(ranked[steps.index(best_checkpoint)])]
    )
    skipped = [
        (row.global_step, unusable_checkpoint(run.run_dir, row.checkpoint)[1] or "")
        for row in above_best
        if row.checkpoint is not None
    ]
    return Selection(
        ranked=steps,
        baseline=baseline,
        best_checkpoint=best_checkpoint,
        failed_steps=run.failed_steps(),
        abandoned_steps=run.abandoned_steps(),
        skipped=skipped,
        delta=delta,
        run_dir=run.run_dir,
        disagreements=disagreements_of(step_measures(run.rows), alarm_step, values, alarm_gain_share),
        alarm_gain_share=alarm_gain_share,
        pick=pick,
    )


def select_checkpoints(
    run_dir: str | os.PathLike,
    subdir: str = DEFAULT_SUBDIR,
    alarm_gain_share: float | None = None,
    metric: str | None = None,
) -> Selection:
    return select(read_run(run_dir, subdir), alarm_gain_share, metric)


def format_selection(selection: Selection) -> str:
    header = (
        f"{'rank':>4}  {'step':>6}  {'confidence':>10}  {'95% CI':>15}  {'d mean':>8}  {'n':>4}  {'p vs best':>9}  "
        f"{'win/lose':>8}  {'vs base w/t/l':>13}  {'p vs base':>9}  checkpoint"
    )
    lines = [
        f"ProbDiff confidence at delta {selection.delta:g} (ties: the earlier step, as the Trainer's best model); "
        "p: Wilcoxon signed-rank on d, same queries; win/tie/lose: queries confident here and not there / both or "
        "neither / there and not here",
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
            f"{format_win_tie_lose(step.vs_base):>13}  {format_p(step.vs_base):>9}  "
            f"{step.checkpoint or '-'}" + (f"  FAILS THE GUARD: {step.guard}" if step.guard else "")
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
    if selection.abandoned_steps:
        lines.append(
            "evaluations abandoned when the run was stopped (resuming from their checkpoint evaluates them): steps "
            + ", ".join(map(str, selection.abandoned_steps))
        )
    if selection.baseline_beats_all:
        lines.append(
            f"The baseline (step {selection.baseline.global_step}, before fine-tuning) beats every evaluated "
            "checkpoint: fine-tuning has not improved ProbDiff confidence on these queries."
        )
    pick = selection.pick
    if pick is not None and pick.line():
        lines.append(pick.line().replace("; failed: ", ".\nFailed: "))
    if pick is not None and pick.none_passes:
        lines.append(
            "No checkpoint passes the guard: no best checkpoint, RUN_DIR/best is not made (the base model is better on "
            "the measures above; `--by probdiff_confidence` ranks without the guard)."
        )
    elif selection.best_checkpoint is None:
        lines.append("No evaluated step has a checkpoint on disk yet.")
    else:
        best = selection.best_checkpoint
        by = "" if pick is None else f", by {pick.metric}"
        lines.append(
            f"Best checkpoint: step {best.global_step}, {best.checkpoint} "
            f"(confidence {pct(best.confidence)}, d mean {best.d_mean:.4f}{by})"
        )
        if selection.skipped:
            lines.append(
                "skipped for best, ranked higher: "
                + "; ".join(f"step {step} ({why})" for step, why in selection.skipped)
            )
        elif selection.ranked and selection.ranked[0] is not best and not selection.ranked[0].guard:
            lines.append(f"(step {selection.ranked[0].global_step} ranks higher but its checkpoint was not saved)")
    if selection.disagreements:
        lines.append(format_disagreements(selection.disagreements, selection.run_dir, selection.alarm_gain_share))
    if pick is not None and pick.guard is not None and pick.step is not None:
        if why := pick.guard.passed_all_the_same(pick.step):  # the alarm above may name the guarded pick
            lines.append(why[0].upper() + why[1:] + ".")
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


def unpoint_best(run_dir: str | os.PathLike) -> Path | None:
    """`RUN_DIR/best` removed (a link or a copy made earlier), where the run now has no pick; the path, or None when
    there was none."""
    target = Path(run_dir) / "best"
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.is_dir():
        shutil.rmtree(target)
    else:
        return None
    return target
