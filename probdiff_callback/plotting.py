"""`probdiff plot RUN_DIR`: ProbDiff over training in one PNG, for runs without W&B.

Top: confidence per evaluated step with its 95% Wilson interval (and one line per category
when there are several). Bottom: the distribution of d at each evaluated step as violins,
with the threshold delta.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from probdiff_callback import history
from probdiff_callback.io import read_jsonl


def _finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None, subdir: str = history.DEFAULT_SUBDIR) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = history.existing_run_dir(run_dir)
    directory = history.probdiff_dir(run_dir, subdir)
    all_rows = history.read_history(directory / history.HISTORY_FILE)
    rows = [r for r in all_rows if r.get("summary") is not None]
    failed_steps = [r["global_step"] for r in all_rows if r.get("summary") is None]
    if not rows:
        raise FileNotFoundError(f"{directory / history.HISTORY_FILE}: no successful evaluations to plot")
    out = Path(out) if out is not None else directory / "probdiff.png"
    steps = [r["global_step"] for r in rows]
    delta = rows[-1]["summary"]["delta"]

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8), sharex=True, constrained_layout=True)
    confidence = [100 * (r["summary"]["confidence"] if r["summary"]["confidence"] is not None else math.nan) for r in rows]
    low = [100 * (r["summary"]["confidence_ci"][0] if r["summary"]["confidence_ci"][0] is not None else math.nan) for r in rows]
    high = [100 * (r["summary"]["confidence_ci"][1] if r["summary"]["confidence_ci"][1] is not None else math.nan) for r in rows]
    top.fill_between(steps, low, high, color="tab:blue", alpha=0.2, label="95% Wilson interval")
    top.plot(steps, confidence, "o-", color="tab:blue", linewidth=2, label=f"confidence (d ≥ {delta:g})")
    categories = sorted({c for r in rows for c in r["summary"]["by_category"]})
    if len(categories) > 1:
        for category in categories:
            values = [100 * _category_confidence(r, category) for r in rows]
            top.plot(steps, values, ".--", linewidth=1, alpha=0.8, label=category)
    baseline = [r for r in rows if r.get("kind") == "baseline"]
    for row in baseline:
        top.annotate("baseline", (row["global_step"], 100 * (row["summary"]["confidence"] or 0)), textcoords="offset points", xytext=(4, 6), fontsize=8)
    for index, step in enumerate(failed_steps):
        top.axvline(step, color="tab:red", alpha=0.5, linestyle=":", label="failed evaluation" if index == 0 else None)
    top.set_ylabel("ProbDiff confidence (%)")
    top.set_ylim(-2, 102)
    top.grid(alpha=0.3)
    top.legend(fontsize=8, loc="best")
    top.set_title(f"ProbDiff over training: {run_dir.name}")

    distributions, positions, invalid = [], [], []
    for row in rows:
        path = directory / row["records"] if row.get("records") else None
        ds = _finite(r["d"] for r in read_jsonl(path)) if path is not None and path.is_file() else []
        if ds:
            distributions.append(ds)
            positions.append(row["global_step"])
        invalid.append(row["summary"]["n_invalid"])
    if distributions:
        spacing = min((b - a for a, b in zip(steps, steps[1:])), default=1) or 1
        violins = bottom.violinplot(distributions, positions=positions, widths=0.8 * spacing, showmedians=True, showextrema=False)
        for body in violins["bodies"]:
            body.set_alpha(0.5)
        for position, ds in zip(positions, distributions):
            bottom.scatter([position] * len(ds), ds, s=6, color="black", alpha=0.4, zorder=3)
    bottom.axhline(delta, color="tab:red", linestyle="--", linewidth=1, label=f"delta = {delta:g}")
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


def _category_confidence(row: dict, category: str) -> float:
    value = row["summary"]["by_category"].get(category, {}).get("confidence")
    return math.nan if value is None else value
