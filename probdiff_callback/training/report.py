"""The end of a run: ProbDiff over training as a table, the cross-check, the best checkpoint, and where everything
is."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from probdiff_callback.analysis.crosscheck import LABELS
from probdiff_callback.analysis.report import fmt, format_p, format_table, format_win_tie_lose, pct
from probdiff_callback.runs.queue import Queue
from probdiff_callback.runs.run_files import HistoryRow
from probdiff_callback.training.recipe import Recipe


def probdiff_table(rows: list[HistoryRow], log_history: list[dict], references: list[str]) -> list[list[str]]:
    """One line per evaluated step: losses as last logged up to the step, confidence, mean d, caps, degenerate texts,
    vs base and the reference metrics."""

    def last(key: str, step: int) -> str:
        values = [e[key] for e in log_history if key in e and e.get("step", 0) <= step]
        return f"{values[-1]:.4f}" if values else "-"

    table = []
    for row in rows:
        s, step = row.summary, row.global_step
        assert s is not None  # the successful rows
        low, high = s.confidence_ci
        overall = {} if s.reference is None else s.reference.overall
        table.append([
            str(step), row.kind, last("loss", step) if step else "-", last("eval_loss", step),
            pct(s.confidence), f"[{pct(low)}, {pct(high)}]", fmt(s.d_mean, "+.4f"), str(s.n),
            # histories written before the cap was counted have no n_capped
            f"{s.n_capped}/{s.n_revision_capped}" if "n_capped" not in s.absent else "-",
            # and before degenerate texts were
            f"{s.n_degenerate}/{s.n_revision_degenerate}" if "n_degenerate" not in s.absent else "-",
            format_win_tie_lose(row.vs_base), format_p(row.vs_base),
            *[fmt(overall.get(name), ".2f", "-") for name in references],
        ])  # fmt: skip
    return table


def summarize_run(trainer, recipe: Recipe, run_dir: Path, final_dir: Path, wandb_sync: str | None, seconds: float):
    from probdiff_callback.analysis.crosscheck import crosscheck
    from probdiff_callback.analysis.plot import plot_run
    from probdiff_callback.analysis.select import format_selection, point_best, select, unpoint_best
    from probdiff_callback.core.reference_metrics import METRIC_LABELS
    from probdiff_callback.runs.run_files import read_run

    # Read once, ranked once: the table, the cross-check, the selection and the plot all show what was read here.
    run = read_run(run_dir, recipe.probdiff.output_subdir)
    rows = run.successful()
    overall = [r.summary.reference.overall for r in rows if r.summary is not None and r.summary.reference is not None]
    references = [name for name in METRIC_LABELS if any(name in values for values in overall)]
    print(
        f"\nProbDiff over training (delta {recipe.probdiff.delta:g}; loss: last logged training loss up to the step; "
        f"capped: answers/revisions that hit max_new_tokens={recipe.probdiff.max_new_tokens} without an end-of-turn "
        "token; degenerate: answers/revisions that loop or echo the refinement prompt, counted as confident where "
        "d >= delta; vs base: win/tie/lose against the base model on the same queries, with the Wilcoxon p)"
    )
    header = ["step", "kind", "loss", "eval loss", "confidence", "95% CI", "mean d", "n", "capped", "degenerate"]
    header += ["vs base", "p"]
    table = probdiff_table(rows, trainer.state.log_history, references)
    print(format_table([*header, *[METRIC_LABELS[name] for name in references]], table))
    if rows and not references:
        print("(no reference metric for these queries: blog and AlignBench answers have none)")
    if left := not_evaluated(run_dir, recipe.probdiff.output_subdir):
        print(left)
    try:
        rows = run.successful_or_raise("; was the run trained with ProbDiffCallback?")
        print(one_line(crosscheck(rows, run.records)) + f"; details: probdiff crosscheck {run_dir}")
    except FileNotFoundError as err:
        print(f"no cross-check: {err}")
    best_dir = selection = None
    try:
        selection = select(run, recipe.probdiff.alarm_gain_share)
        print("\n" + format_selection(selection))
        if selection.best_checkpoint is not None:
            best_dir = point_best(run_dir, selection.best_checkpoint.checkpoint)
        elif removed := unpoint_best(run_dir):  # an earlier start's link: it names no pick now
            print(f"removed {removed}: it named a checkpoint that is not the pick")
    except FileNotFoundError as err:
        print(f"no checkpoint selection: {err}")
    plot = None
    try:
        plot = plot_run(run, selection=selection)
    except FileNotFoundError as err:
        print(f"no plot: {err}")
    from probdiff_callback.callback.probdiff import ProbDiffCallback

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, ProbDiffCallback) and callback.cost_summary():
            print("\n" + callback.cost_summary())
    print(f"\ndone in {seconds / 60:.1f} min. Run directory {run_dir}:")
    print(f"  recipe as run        {run_dir / 'recipe.yaml'}")
    print(f"  ProbDiff history     {run.history_path}")
    if plot is not None:
        print(f"  plot                 {plot}")
    print(f"  final weights        {final_dir}")
    if selection is not None and selection.pick is not None and selection.pick.none_passes:
        held = (
            "the base model (load_best_model_at_end put the adapter back)"
            if final_is_base(trainer)
            else "the last step's"
        )
        print(f"  best checkpoint      none: no checkpoint passes the guard; the final weights are {held}")
    if best_dir is not None and selection is not None:
        print(f"  best checkpoint      {best_dir} -> {selection.best_checkpoint.checkpoint}")
        base = f"{recipe.model} --adapter {best_dir}" if recipe.lora.enabled else str(best_dir)
        print(f"  evaluate it          probdiff eval --model {base} --queries <held-out file> --out <dir>")
    print(f"  rank again           probdiff select {run_dir}")
    print(f"  cross-check          probdiff crosscheck {run_dir}")
    if wandb_sync:
        print(f"  W&B run (offline)    upload it with: {wandb_sync}")


def final_is_base(trainer) -> bool:
    """Whether the callback put the model back to the base model at the end (no checkpoint passed the guard)."""
    from probdiff_callback.callback.probdiff import ProbDiffCallback

    return any(
        isinstance(callback, ProbDiffCallback) and callback.best.restored_base
        for callback in trainer.callback_handler.callbacks
    )


def not_evaluated(run_dir: Path, subdir: str) -> str | None:
    """With async_eval: the queued steps the evaluator has not evaluated yet, and how to have them evaluated."""
    steps = [request.global_step for request in Queue(run_dir, subdir).pending()]
    if not steps:
        return None
    listed = f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"
    them = "them" if len(steps) > 1 else "it"
    return (
        f"({listed} not evaluated yet: `probdiff watch {run_dir}` evaluates {them}, then `probdiff select {run_dir}` "
        "ranks every step)"
    )


def one_line(report: Mapping) -> str:
    """The summary `train/sft.py` prints at the end of training."""
    parts = []
    for row in report["across_steps"]:
        if row["probdiff"] == "confidence":
            parts.append(
                f"{LABELS[row['measure']]} ρ {fmt(row['spearman'], '+.2f')} (p {fmt(row['spearman_p'], '.2g')})"
            )
    text = f"Cross-check over {report['n_steps']} steps, confidence vs " + (
        ", ".join(parts) if parts else "nothing (no reference metric or eval loss)"
    )
    for row in report["per_query"][:1]:
        text += f"; per query d vs {LABELS[row['metric']]}: median ρ {fmt(row['median_spearman'], '+.2f')}"
    return text
