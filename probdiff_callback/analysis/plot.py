"""`probdiff plot RUN_DIR`: ProbDiff over training in one PNG, for runs without W&B.

Top left: confidence per evaluated step with its 95% Wilson interval (and one line per category
when there are several). Top right: the independent measures at the same steps: the reference
metrics of the answers (BLEU/chrF, ROUGE) where the queries have them, and the eval loss (on an
axis of its own beside them, or alone). Bottom: the distribution of d at each evaluated step as
violins (the bar inside each is the median), with the threshold delta. A vertical line marks the
best checkpoint on every panel.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

from probdiff_callback.analysis.crosscheck import LABELS, LOSS, PROBDIFF_MEASURES
from probdiff_callback.analysis.report import fmt
from probdiff_callback.analysis.select import Selection, select
from probdiff_callback.core.metric import finite_values, is_finite
from probdiff_callback.core.reference_metrics import METRIC_LABELS
from probdiff_callback.runs.run_files import HistoryRow, Run


def plot_run(run: Run, out: str | os.PathLike | None = None, selection: Selection | None = None) -> Path:
    """The PNG of a run read by `run_files.read_run` (default: `RUN_DIR/probdiff/probdiff.png`); the best step
    marked is `selection`'s (`selection.select`), ranked here when not given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = run.successful_or_raise(" to plot")
    failed_steps = [r.global_step for r in run.rows if r.summary is None]
    out = Path(out) if out is not None else run.directory / "probdiff.png"
    steps = [r.global_step for r in rows]
    summaries = [r.summary for r in rows if r.summary is not None]
    delta = summaries[-1].delta

    figure = plt.figure(figsize=(14, 8), constrained_layout=True)
    grid = figure.add_gridspec(2, 2)
    top = figure.add_subplot(grid[0, 0])
    side = figure.add_subplot(grid[0, 1], sharex=top)
    bottom = figure.add_subplot(grid[1, :], sharex=top)
    confidence = [100 * s.confidence for s in summaries]
    low = [100 * s.confidence_ci[0] for s in summaries]
    high = [100 * s.confidence_ci[1] for s in summaries]
    top.fill_between(steps, low, high, color="tab:blue", alpha=0.2, label="95% Wilson interval")
    top.plot(steps, confidence, "o-", color="tab:blue", linewidth=2, label=f"confidence (d ≥ {delta:g})")
    categories = sorted({c for s in summaries for c in s.by_category})
    if len(categories) > 1:
        for category in categories:
            values = [
                100 * (s.by_category[category].confidence if category in s.by_category else math.nan) for s in summaries
            ]
            top.plot(steps, values, ".--", linewidth=1, alpha=0.8, label=category)
    for row in [r for r in rows if r.kind == "baseline"]:
        top.annotate(
            "baseline",
            (row.global_step, 100 * row.confidence if is_finite(row.confidence) else 0),
            textcoords="offset points",
            xytext=(4, 6),
            fontsize=8,
        )
    for index, step in enumerate(failed_steps):
        top.axvline(step, color="tab:red", alpha=0.5, linestyle=":", label="failed evaluation" if index == 0 else None)
    top.set_ylabel("ProbDiff confidence (%)")
    top.set_ylim(-2, 102)
    top.grid(alpha=0.3)
    best = _best_step(selection if selection is not None else select(run))
    _mark_best(top, best, label=True)
    top.legend(fontsize=8, loc="best")
    top.set_title(f"ProbDiff over training: {run.run_dir.name}")
    _plot_independent_measures(side, rows)
    _mark_best(side, best, label=False)

    distributions, positions, invalid = [], [], []
    for row, summary in zip(rows, summaries):
        ds = list(finite_values(r.d for r in run.records.get(row.global_step, [])))
        if ds:
            distributions.append(ds)
            positions.append(row.global_step)
        invalid.append(summary.n_invalid)
    if distributions:
        spacing = min((b - a for a, b in zip(steps, steps[1:])), default=1) or 1
        violins = bottom.violinplot(
            distributions, positions=positions, widths=0.8 * spacing, showmedians=True, showextrema=False
        )
        for body in violins["bodies"]:
            body.set_alpha(0.5)
        violins["cmedians"].set_label("bar: median d of the step")
        violins["bodies"][0].set_label("violin: distribution of d over the queries")
        for index, (position, ds) in enumerate(zip(positions, distributions)):
            label = "dot: one query" if index == 0 else None
            bottom.scatter([position] * len(ds), ds, s=6, color="black", alpha=0.4, zorder=3, label=label)
    bottom.axhline(delta, color="tab:red", linestyle="--", linewidth=1, label=f"delta = {delta:g}")
    _mark_best(bottom, best, label=False)
    _steps_axis(bottom, steps)
    bottom.set_xlabel("global step")
    bottom.set_ylabel("d = log p(revision) − log p(answer)")
    if any(invalid):
        bottom.set_title(f"invalid (NaN) d left out: {sum(invalid)} over all steps", fontsize=9)
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=8, loc="best")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def _steps_axis(axis, steps: list[int]) -> None:
    """The shared step axis: ticks at evaluated steps only (at most about ten), and limits that just hold the
    violins, so that no step before the first or after the last is labelled."""
    if not steps:
        return
    spacing = min((b - a for a, b in zip(steps, steps[1:])), default=1) or 1
    axis.set_xlim(steps[0] - 0.5 * spacing, steps[-1] + 0.5 * spacing)
    every = math.ceil(len(steps) / 10)
    ticks = steps[::every] if steps[-1] in steps[::every] else [*steps[::every], steps[-1]]
    axis.set_xticks(ticks)


def _best_step(selection: Selection) -> tuple[int, str] | None:
    """(step, label) of the best checkpoint as `probdiff select` ranks them, or of the best-ranked step
    when none of the ranked steps has a checkpoint on disk."""
    if selection.best_checkpoint is not None:
        return selection.best_checkpoint.global_step, f"best checkpoint (step {selection.best_checkpoint.global_step})"
    if selection.ranked:
        return selection.ranked[0].global_step, f"best step {selection.ranked[0].global_step} (no checkpoint on disk)"
    return None


def _mark_best(axis, best: tuple[int, str] | None, label: bool) -> None:
    if best is not None:
        axis.axvline(best[0], color="tab:green", linewidth=2, alpha=0.6, label=best[1] if label else None)


def reference_series(rows: list[HistoryRow]) -> dict[str, tuple[list[int], list[float]]]:
    """Overall reference metrics per step: {metric: (steps, values)}, in display order."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    overall = {
        r.global_step: {} if r.summary is None or r.summary.reference is None else r.summary.reference.overall
        for r in rows
    }
    for name in METRIC_LABELS:
        points = [(step, values.get(name)) for step, values in overall.items()]
        points = [(step, value) for step, value in points if is_finite(value)]
        if points:
            series[name] = ([step for step, _ in points], [value for _, value in points])
    return series


def _plot_independent_measures(axis, rows: list[HistoryRow]) -> None:
    """Reference metrics (left axis) and the eval loss (right axis) at the evaluated steps; the eval loss alone takes
    the left axis, so that a task without reference metrics shows no empty one."""
    series = reference_series(rows)
    for name, (steps, values) in series.items():
        axis.plot(steps, values, "o-", linewidth=1.5, label=METRIC_LABELS[name])
    losses = [(r.global_step, r.eval_loss) for r in rows if is_finite(r.eval_loss)]
    loss_axis = axis.twinx() if series and losses else axis
    if losses:
        loss_steps, loss_values = [s for s, _ in losses], [v for _, v in losses]
        loss_axis.plot(loss_steps, loss_values, "s--", color="tab:gray", linewidth=1.5, label="eval loss")
        loss_axis.set_ylabel("eval loss (held-out references)")
    if series:
        axis.set_ylabel("reference metric of the answers (0-100)")
        axis.set_title("independent measures: reference metrics and eval loss", fontsize=10)
    elif losses:
        axis.set_title("independent measure: eval loss (no reference metric for these queries)", fontsize=10)
    else:
        axis.text(
            0.5, 0.5, "no reference metric or eval loss in the history", ha="center", va="center",
            transform=axis.transAxes,
        )  # fmt: skip
        axis.set_yticks([])
        axis.set_title("independent measures", fontsize=10)
    handles, labels = axis.get_legend_handles_labels()
    if loss_axis is not axis:
        more_handles, more_labels = loss_axis.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    axis.grid(alpha=0.3)
    if handles:
        axis.legend(handles, labels, fontsize=8, loc="best")


CROSSCHECK_TITLE = "ProbDiff against independent measures, one point per evaluated step"
CROSSCHECK_PANEL_WIDTH = 4.5  # inches per independent measure
CROSSCHECK_MIN_WIDTH = 9.0  # inches: room for the title and the colour bar with a single measure
# Where a step's label may go around its point, in points, tried in this order; a label that fits nowhere is left out
# (the colour of the point still tells its step).
LABEL_OFFSETS = ((5, 5), (5, -12), (-12, 5), (-12, -12), (5, 14), (-12, 14), (5, -21), (-12, -21), (14, -4), (-21, -4))


def plot_crosscheck(report: Mapping, out: str | os.PathLike) -> Path:
    """Scatter plots, one point per step: each ProbDiff measure (rows) against each independent measure (columns)."""
    import matplotlib.pyplot as plt

    out = Path(out)
    figure = crosscheck_figure(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def crosscheck_figure(report: Mapping):
    """`plot_crosscheck`'s figure: at least `CROSSCHECK_MIN_WIDTH` wide, its step labels placed where they overlap
    neither each other nor the panel's edges (`place_labels`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import Normalize
    from matplotlib.ticker import MaxNLocator

    steps = report["steps"]
    measures = list(dict.fromkeys(row["measure"] for row in report["across_steps"]))
    columns = max(len(measures), 1)
    width = max(CROSSCHECK_PANEL_WIDTH * columns, CROSSCHECK_MIN_WIDTH)
    figure, axes = plt.subplots(
        len(PROBDIFF_MEASURES), columns, figsize=(width, 8), squeeze=False, layout="constrained"
    )
    # one colour scale for every panel, so that a colour is the same step everywhere
    norm = Normalize(min((s["step"] for s in steps), default=0), max((s["step"] for s in steps), default=1))
    correlations = {(r["probdiff"], r["measure"]): r for r in report["across_steps"]}
    labels: list[tuple] = []  # (axis, points) to label once the layout is fixed
    scatter = None
    for i, ours in enumerate(PROBDIFF_MEASURES):
        for j in range(columns):
            axis = axes[i][j]
            if not measures:
                axis.text(
                    0.5, 0.5, "no reference metric or eval loss", ha="center", va="center", transform=axis.transAxes
                )
                continue
            measure = measures[j]
            points = [(s["metrics"].get(measure) if measure != LOSS else s[LOSS], s[ours], s["step"]) for s in steps]
            scale = 100 if ours == "confidence" else 1
            points = [(x, scale * y, step) for x, y, step in points if is_finite(x) and is_finite(y)]
            scatter = axis.scatter(
                [x for x, _, _ in points],
                [y for _, y, _ in points],
                c=[s for _, _, s in points],
                cmap="viridis",
                norm=norm,
                s=40,
                zorder=3,
            )
            labels.append((axis, points))
            row = correlations.get((ours, measure))
            if row is not None:
                axis.set_title(
                    f"ρ {fmt(row['spearman'], '+.2f')} (p {fmt(row['spearman_p'], '.2g')}), "
                    f"τ {fmt(row['kendall'], '+.2f')}, n {row['n']}",
                    fontsize=9,
                )
            axis.set_xlabel(LABELS[measure] + (" (lower is better)" if measure == LOSS else ""))
            axis.set_ylabel("ProbDiff confidence (%)" if ours == "confidence" else "mean d")
            axis.margins(0.12)  # room around the outermost points for their labels
            axis.grid(alpha=0.3)
    if scatter is not None and steps:
        bar = figure.colorbar(scatter, ax=axes, label="global step", shrink=0.6)
        bar.ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    figure.suptitle(CROSSCHECK_TITLE)
    figure.draw_without_rendering()  # lays the figure out; then the layout is kept as it is while labels are placed
    figure.set_layout_engine("none")
    renderer = figure.canvas.get_renderer()
    for axis, points in labels:
        place_labels(axis, [(x, y, str(step)) for x, y, step in points], renderer)
    return figure


def place_labels(axis, points: list[tuple[float, float, str]], renderer) -> list:
    """Each point's label at the first of `LABEL_OFFSETS` where it stays inside the axis and overlaps no label placed
    before it; left out where none is free. Returns the labels placed."""
    inside = axis.get_window_extent(renderer)
    placed: list = []
    for x, y, text in points:
        for offset in LABEL_OFFSETS:
            label = axis.annotate(text, (x, y), textcoords="offset points", xytext=offset, fontsize=7)
            box = label.get_window_extent(renderer)
            fits = inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1
            if fits and not any(box.overlaps(other.get_window_extent(renderer)) for other in placed):
                placed.append(label)
                break
            label.remove()
    return placed
