"""`probdiff crosscheck RUN_DIR`: how far ProbDiff followed independent measures over a training run.

Across the evaluated steps (the baseline included): the rank correlations, Spearman's rho and
Kendall's tau with their p-values and n, of ProbDiff's confidence and of its mean d with each
reference metric of the answers (BLEU, chrF, ROUGE; overall and per category) and with the eval
loss. A higher metric and a lower loss mean a better model, so agreement shows as a positive
correlation with a metric and a negative one with the loss.

Per query: at each step, Spearman's rho between the queries' d and their answers' sentence-level
reference score, then over the steps its median and how many steps have rho > 0 and p < 0.05 each
way. Within a step the queries are independent draws; pooling the steps would count each query
several times and mix the steps' shifts into the correlation, so the steps are kept apart.

Pure functions over the history rows and step records; the CLI prints `format_crosscheck`, writes
the report as JSON and a scatter plot (one point per step).
"""

from __future__ import annotations

import math
import os
import statistics
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

from probdiff_callback import history
from probdiff_callback.io import read_jsonl
from probdiff_callback.reference_metrics import METRIC_LABELS
from probdiff_callback.formatting import fmt, is_finite

PROBDIFF_MEASURES = {"confidence": "confidence", "d_mean": "mean d"}
LOSS = "eval_loss"
LABELS = {**METRIC_LABELS, LOSS: "eval loss", **PROBDIFF_MEASURES}
SIGNIFICANCE = 0.05
EXACT_SPEARMAN_MAX_N = 9  # up to 9! = 362,880 orderings


def exact_spearman_p(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Two-sided p of Spearman's rho over every ordering of `ys` against `xs` (ties kept as average
    ranks). scipy's p comes from a t approximation that is far off for a handful of steps (it gives
    p = 0 for rho = 1 on 3 points, where the exact p is 1/3)."""
    import itertools

    import numpy as np
    from scipy.stats import rankdata

    rx, ry = rankdata(xs), rankdata(ys)
    rx = (rx - rx.mean()) / np.linalg.norm(rx - rx.mean())
    orderings = np.array(list(itertools.permutations(ry)))
    centered = orderings - orderings.mean(axis=1, keepdims=True)
    rhos = centered @ rx / np.linalg.norm(centered, axis=1)
    observed = abs(float((ry - ry.mean()) @ rx / np.linalg.norm(ry - ry.mean())))
    return float(np.mean(np.abs(rhos) >= observed - 1e-12))


def rank_correlation(xs: Sequence[float | None], ys: Sequence[float | None]) -> dict:
    """Spearman and Kendall (scipy) over the pairs where both values are finite; NaN with fewer
    than 3 pairs or a constant side. Spearman's p is exact (every ordering) up to 9 pairs, scipy's
    t approximation beyond; Kendall's is scipy's (exact for small samples without ties)."""
    from scipy.stats import kendalltau, spearmanr

    pairs = [(float(x), float(y)) for x, y in zip(xs, ys) if is_finite(x) and is_finite(y)]
    result = {"n": len(pairs), "spearman": math.nan, "spearman_p": math.nan, "kendall": math.nan, "kendall_p": math.nan}
    if len(pairs) < 3 or len({x for x, _ in pairs}) < 2 or len({y for _, y in pairs}) < 2:
        return result
    x, y = [p[0] for p in pairs], [p[1] for p in pairs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rho = spearmanr(x, y)
        tau = kendalltau(x, y)
    spearman_p = exact_spearman_p(x, y) if len(pairs) <= EXACT_SPEARMAN_MAX_N else float(rho.pvalue)
    result.update(
        spearman=float(rho.statistic), spearman_p=spearman_p, kendall=float(tau.statistic), kendall_p=float(tau.pvalue)
    )
    return result


# --- the steps ---------------------------------------------------------------------------------
def step_measures(rows: Sequence[dict]) -> list[dict]:
    """One entry per successfully evaluated step: ProbDiff's measures, the overall reference metrics,
    per-category confidence and metrics, and the eval loss."""
    steps = []
    for row in sorted(rows, key=lambda r: r["global_step"]):
        summary = row.get("summary")
        if summary is None:
            continue
        reference = summary.get("reference") or {}
        steps.append(
            {
                "step": row["global_step"],
                "kind": row.get("kind"),
                "confidence": summary["confidence"],
                "d_mean": summary["d_mean"],
                LOSS: row.get(LOSS),
                "metrics": dict(reference.get("overall", {})),
                "by_category": {
                    category: {
                        "confidence": summary["by_category"].get(category, {}).get("confidence"),
                        **{k: v for k, v in entry.items() if k in METRIC_LABELS},
                    }
                    for category, entry in reference.get("by_category", {}).items()
                },
            }
        )
    return steps


def across_steps(steps: Sequence[Mapping]) -> list[dict]:
    """Each ProbDiff measure against each reference metric and the eval loss, over the steps."""
    metrics = [name for name in METRIC_LABELS if any(name in s["metrics"] for s in steps)]
    rows = []
    for ours in PROBDIFF_MEASURES:
        for measure in metrics + [LOSS]:
            values = [s["metrics"].get(measure) if measure != LOSS else s[LOSS] for s in steps]
            if not any(is_finite(v) for v in values):
                continue
            rows.append(
                {
                    "probdiff": ours,
                    "measure": measure,
                    "agrees_if": "negative" if measure == LOSS else "positive",
                    **rank_correlation([s[ours] for s in steps], values),
                }
            )
    return rows


def across_steps_by_category(steps: Sequence[Mapping]) -> list[dict]:
    """Each category's confidence against its own reference metrics, over the steps."""
    categories = sorted({c for s in steps for c in s["by_category"]})
    rows = []
    for category in categories:
        entries = [s["by_category"].get(category, {}) for s in steps]
        for measure in [m for m in METRIC_LABELS if any(m in e for e in entries)]:
            rows.append(
                {
                    "category": category,
                    "probdiff": "confidence",
                    "measure": measure,
                    "agrees_if": "positive",
                    **rank_correlation([e.get("confidence") for e in entries], [e.get(measure) for e in entries]),
                }
            )
    return rows


# --- the queries -------------------------------------------------------------------------------
def per_query(records_by_step: Mapping[int, Sequence[dict]]) -> list[dict]:
    """For each sentence-level metric in the records: Spearman of d with it within each step, and a summary."""
    metrics = [
        m for m in METRIC_LABELS if any(m in (r.get("ref") or {}) for rs in records_by_step.values() for r in rs)
    ]
    out = []
    for metric in metrics:
        by_step = []
        for step, records in sorted(records_by_step.items()):
            scored = [r for r in records if (r.get("ref") or {}).get(metric) is not None]
            if not scored:
                continue
            correlation = rank_correlation([r.get("d") for r in scored], [r["ref"][metric] for r in scored])
            by_step.append(
                {
                    "step": step,
                    "n": correlation["n"],
                    "spearman": correlation["spearman"],
                    "p": correlation["spearman_p"],
                }
            )
        rhos = [s["spearman"] for s in by_step if math.isfinite(s["spearman"])]
        out.append(
            {
                "metric": metric,
                "n_steps": len(by_step),
                "n_steps_with_rho": len(rhos),
                "median_spearman": statistics.median(rhos) if rhos else math.nan,
                "n_positive": sum(r > 0 for r in rhos),
                "n_significant_positive": sum(
                    s["spearman"] > 0 and s["p"] < SIGNIFICANCE for s in by_step if math.isfinite(s["spearman"])
                ),
                "n_significant_negative": sum(
                    s["spearman"] < 0 and s["p"] < SIGNIFICANCE for s in by_step if math.isfinite(s["spearman"])
                ),
                "by_step": by_step,
            }
        )
    return out


# --- the run -----------------------------------------------------------------------------------
def load_run(
    run_dir: str | os.PathLike, subdir: str = history.DEFAULT_SUBDIR
) -> tuple[list[dict], dict[int, list[dict]]]:
    """(successful history rows, records per step) of a run directory."""
    directory = history.probdiff_dir(run_dir, subdir)
    rows = [r for r in history.read_history(directory / history.HISTORY_FILE) if r.get("summary") is not None]
    if not rows:
        raise FileNotFoundError(
            f"{directory / history.HISTORY_FILE}: no successful evaluations; was the run trained with ProbDiffCallback?"
        )
    records = {}
    for row in rows:
        path = directory / row["records"] if row.get("records") else None
        if path is not None and path.is_file():
            records[row["global_step"]] = read_jsonl(path)
    return rows, records


def crosscheck(rows: Sequence[dict], records_by_step: Mapping[int, Sequence[dict]]) -> dict:
    """The whole report, JSON-ready."""
    steps = step_measures(rows)
    return {
        "steps": steps,
        "n_steps": len(steps),
        "across_steps": across_steps(steps),
        "across_steps_by_category": across_steps_by_category(steps),
        "per_query": per_query(records_by_step),
        "has_reference_metrics": any(s["metrics"] for s in steps),
    }


# --- output ------------------------------------------------------------------------------------
def format_crosscheck(report: Mapping) -> str:
    steps = report["steps"]
    span = f"steps {steps[0]['step']}-{steps[-1]['step']}" if steps else "no steps"
    lines = [f"ProbDiff against independent measures over {report['n_steps']} evaluated steps ({span})"]
    if not report["has_reference_metrics"]:
        lines.append("(these queries have no reference metric: only the eval loss is compared)")
    lines.append(
        f"  {'ProbDiff':<11} {'measure':<9} {'agrees if':<9} {'n':>3}  "
        f"{'Spearman ρ':>10} {'p':>7}  {'Kendall τ':>9} {'p':>7}"
    )
    for row in report["across_steps"]:
        agrees_if = "ρ > 0" if row["agrees_if"] == "positive" else "ρ < 0"
        lines.append(
            f"  {LABELS[row['probdiff']]:<11} {LABELS[row['measure']]:<9} {agrees_if:<9} {row['n']:>3}  "
            f"{fmt(row['spearman'], '+.2f'):>10} {fmt(row['spearman_p'], '.2g'):>7}  "
            f"{fmt(row['kendall'], '+.2f'):>9} {fmt(row['kendall_p'], '.2g'):>7}"
        )
    if not report["across_steps"]:
        lines.append("  (no reference metric or eval loss in the history)")
    if report["per_query"]:
        lines.append("Per query: Spearman ρ of d with the answer's sentence score, within each step")
        lines.append(
            f"  {'metric':<9} {'steps':>5}  {'median ρ':>8}  {'ρ > 0':>6}  {'p<0.05, ρ>0':>11}  {'p<0.05, ρ<0':>11}"
        )
        for row in report["per_query"]:
            k = row["n_steps_with_rho"]
            lines.append(
                f"  {LABELS[row['metric']]:<9} {row['n_steps']:>5}  {fmt(row['median_spearman'], '+.2f'):>8}  "
                f"{row['n_positive']:>2}/{k:<3}  {row['n_significant_positive']:>7}/{k:<3}  "
                f"{row['n_significant_negative']:>7}/{k:<3}"
            )
    return "\n".join(lines)


def one_line(report: Mapping) -> str:
    """The summary `train/sft.py` prints at the end of training."""
    parts = []
    for row in report["across_steps"]:
        if row["probdiff"] == "confidence":
            parts.append(f"{LABELS[row['measure']]} ρ {fmt(row['spearman'], '+.2f')} (p {fmt(row['spearman_p'], '.2g')})")
    text = f"Cross-check over {report['n_steps']} steps, confidence vs " + (
        ", ".join(parts) if parts else "nothing (no reference metric or eval loss)"
    )
    for row in report["per_query"][:1]:
        text += f"; per query d vs {LABELS[row['metric']]}: median ρ {fmt(row['median_spearman'], '+.2f')}"
    return text


def plot_crosscheck(report: Mapping, out: str | os.PathLike) -> Path:
    """Scatter plots, one point per step: each ProbDiff measure (rows) against each independent measure (columns)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = report["steps"]
    measures = list(dict.fromkeys(row["measure"] for row in report["across_steps"]))
    out = Path(out)
    columns = max(len(measures), 1)
    figure, axes = plt.subplots(
        len(PROBDIFF_MEASURES), columns, figsize=(4 * columns, 7), squeeze=False, constrained_layout=True
    )
    correlations = {(r["probdiff"], r["measure"]): r for r in report["across_steps"]}
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
            points = [(x, y, step) for x, y, step in points if is_finite(x) and is_finite(y)]
            scale = 100 if ours == "confidence" else 1
            scatter = axis.scatter(
                [x for x, _, _ in points],
                [scale * y for _, y, _ in points],
                c=[s for _, _, s in points],
                cmap="viridis",
                s=40,
                zorder=3,
            )
            for x, y, step in points:
                axis.annotate(str(step), (x, scale * y), textcoords="offset points", xytext=(4, 4), fontsize=7)
            row = correlations.get((ours, measure))
            if row is not None:
                axis.set_title(
                    f"ρ {fmt(row['spearman'], '+.2f')} (p {fmt(row['spearman_p'], '.2g')}), τ {fmt(row['kendall'], '+.2f')}, n {row['n']}",
                    fontsize=9,
                )
            axis.set_xlabel(LABELS[measure] + (" (lower is better)" if measure == LOSS else ""))
            axis.set_ylabel("ProbDiff confidence (%)" if ours == "confidence" else "mean d")
            axis.grid(alpha=0.3)
            if i == 0 and j == columns - 1 and points:
                figure.colorbar(scatter, ax=axis, label="global step")
    figure.suptitle("ProbDiff against independent measures, one point per evaluated step")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


# --- outside verdicts --------------------------------------------------------------------------
def check_verdicts(
    path: str | os.PathLike,
    rows: Sequence[dict],
    records_by_step: Mapping[int, Sequence[dict]],
    step: int | None = None,
    against: int | None = None,
) -> tuple[dict, str]:
    """(result, text) of a verdict file against the run's records: pairwise verdicts compare `step` (A, by
    default the last evaluated step) with `against` (B, by default the baseline); revision-vs-answer
    verdicts judge the records of `step`."""
    from probdiff_callback.verdicts import (
        PAIRWISE,
        conflict_degree,
        format_conflict,
        format_pairwise,
        pairwise_agreement,
        read_verdicts,
    )

    verdicts = read_verdicts(path)
    evaluated = sorted(records_by_step)
    if not evaluated:
        raise FileNotFoundError("no step records to set the verdicts beside")
    chosen = evaluated[-1] if step is None else step
    if chosen not in records_by_step:
        raise ValueError(
            f"--step {chosen}: no records of that step; evaluated steps with records: {', '.join(map(str, evaluated))}"
        )
    delta = next(r["summary"]["delta"] for r in rows if r["global_step"] == chosen)
    if verdicts.kind != PAIRWISE:
        result = conflict_degree(verdicts, records_by_step[chosen])
        return {"file": str(path), "step": chosen, **result}, format_conflict(result, f"step {chosen}")
    baseline = next((r["global_step"] for r in rows if r.get("kind") == "baseline"), None)
    other = baseline if against is None else against
    if other is None:
        raise ValueError("pairwise verdicts need two steps: this run has no baseline row, so give --against STEP")
    if other not in records_by_step:
        steps = ", ".join(map(str, evaluated))
        raise ValueError(f"--against {other}: no records of that step; evaluated steps with records: {steps}")
    result = pairwise_agreement(verdicts, records_by_step[chosen], records_by_step[other], delta)
    label_b = f"step {other}" + (" (base model)" if other == baseline else "")
    return {"file": str(path), "step": chosen, "against": other, **result}, format_pairwise(
        result, f"step {chosen}", label_b
    )
