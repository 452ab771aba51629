"""Numbers in words and tables: one rule for missing and non-finite values, percentages and aligned columns; the
reports `probdiff eval`, `score` and `compare` print (a summary, a paired comparison) and the comparison with the
base model as a table cell."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from probdiff_callback.core.metric import is_finite
from probdiff_callback.core.records import Comparison, ReferenceSummary, Summary
from probdiff_callback.core.reference_metrics import METRIC_LABELS
from probdiff_callback.core.significance import queries_needed, resolution

RESOLUTION_CHANGE = 0.10  # the change the resolution line says how many queries it would take to see


def format_summary(summary: Summary) -> str:
    low, high = summary.confidence_ci
    lines = [
        f"queries            {summary.n}  (invalid {summary.n_invalid}, truncated {summary.n_truncated})",
        f"hit max_new_tokens answers {summary.n_capped}, revisions {summary.n_revision_capped}  (scored as cut)",
        *format_degenerate(summary),
        f"confidence         {pct(summary.confidence)}  at delta {summary.delta:g}   "
        f"95% CI [{pct(low)}, {pct(high)}] (Wilson)",
        *format_confidence_non_degenerate(summary),
        "sweep              " + "  ".join(f"{k}: {pct(v)}" for k, v in summary.confidence_sweep.items()),
        f"d mean / median    {summary.d_mean:.4f} / {summary.d_median:.4f}",
        f"log p answer/rev.  {summary.logp_response_mean:.4f} / {summary.logp_revised_mean:.4f}",
        f"length changed>50% {pct(summary.length_changed_share)}",
    ]
    if len(summary.by_category) > 1:
        lines.append("by category:")
        for name, cat in summary.by_category.items():
            lines.append(f"  {name:<20} n={cat.n:<4} confidence {pct(cat.confidence):>6}  d_mean {cat.d_mean:.4f}")
    if summary.reference is not None:
        lines.append(format_reference(summary.reference))
    if summary.n:
        lines.append(resolution_line(summary.n, summary.confidence, "two models or steps on these queries"))
    return "\n".join(lines)


def format_degenerate(summary: Summary) -> list[str]:
    """The degenerate answers and revisions, the revisions' by kind; nothing for a summary written before they were
    counted."""
    if "n_revision_degenerate" in summary.absent:
        return []
    kinds = ", ".join(f"{kind} {count}" for kind, count in summary.revision_degenerate_kinds.items())
    return [
        f"degenerate         answers {summary.n_degenerate}, revisions {summary.n_revision_degenerate} "
        f"({kinds})  (loops or echoes of the refinement prompt; scored as written)"
    ]


def format_confidence_non_degenerate(summary: Summary) -> list[str]:
    """The confidence with degenerate revisions counted as not confident, where any revision is degenerate."""
    if not summary.n_revision_degenerate:
        return []
    low, high = summary.confidence_non_degenerate_ci
    return [
        f"  w/o degenerate   {pct(summary.confidence_non_degenerate)}  95% CI [{pct(low)}, {pct(high)}]  "
        f"(the {summary.n_revision_degenerate} degenerate revisions counted as not confident)"
    ]


def degenerate_note(summary: Summary) -> str:
    """What the confidence means when revisions are degenerate: the note `probdiff eval` and `score` print."""
    n, n_degenerate = summary.n, summary.n_revision_degenerate
    kinds = ", ".join(f"{kind} {count}" for kind, count in summary.revision_degenerate_kinds.items() if count)
    note = (
        f"note: {n_degenerate} of {n} revisions are degenerate ({kinds}; see `revision_degenerate` in records.jsonl): "
        "the model looped or copied the refinement prompt's labels instead of rewriting. The paper's rule counts only "
        "empty texts as invalid, so these are scored as written, and a loop or an echo is likely under the model: "
        f"its d is large and it counts as confident. Counting them as not confident gives "
        f"{pct(summary.confidence_non_degenerate)} instead of {pct(summary.confidence)}."
    )
    if 2 * n_degenerate > n:
        note += (
            " With most revisions degenerate, the confidence measures how much the model prefers its own loops and "
            "echoes to its answers, not whether it can improve them: read it beside this count, or evaluate a larger "
            "model."
        )
    return note


def resolution_line(n: int, confidence: float | None, between: str = "two steps") -> str:
    """One line on how small a change in confidence `n` queries can show, from `confidence` (None or NaN: 50%, where
    a share varies most): `significance.resolution` and `queries_needed`, in words."""
    assumed = confidence is None or not is_finite(confidence)
    baseline = 0.5 if assumed else float(confidence)  # type: ignore[arg-type]
    seen = resolution(n, baseline)
    needed = queries_needed(baseline, RESOLUTION_CHANGE)
    start = f"ProbDiff resolution: with {n} quer{'y' if n == 1 else 'ies'} and a confidence of {pct(baseline)}" + (
        " (assumed: no baseline yet)" if assumed else ""
    )
    if seen.within_noise is None:
        what = (
            f"every change of confidence between {between} is within noise (a paired test over {n} "
            f"quer{'y' if n == 1 else 'ies'} calls none significant even half the time)"
        )
    else:
        parts = []
        if seen.smallest_rise is not None:
            parts.append(f"+{100 * seen.smallest_rise:.1f}")
        if seen.smallest_fall is not None:
            parts.append(f"-{100 * seen.smallest_fall:.1f}")
        what = f"a change of less than {'/'.join(parts)} points between {between} is within noise"
        if seen.smallest_rise is not None and seen.smallest_rise > 1 / n:
            what += f" ({pct(baseline)} cannot be told from {pct(baseline + seen.smallest_rise - 1 / n)})"
        elif seen.smallest_rise is None:
            what += f" (no rise from {pct(baseline)} could be significant)"
    points = f"{100 * RESOLUTION_CHANGE:.0f}"
    more = (
        f"a change of ±{points} points would need about {needed} queries"
        if needed is not None
        else f"±{points} points is out of reach"
    )
    return f"{start}, {what}; {more} (docs/callback.md#what-n-queries-can-see)"


def format_comparison(result: Comparison, name_a: str, name_b: str) -> str:
    """`probdiff compare`'s report: the counts, then each test with the question it answers."""
    n = result.n
    low, high = result.difference_ci

    def share(count: int) -> str:
        return f"{100 * count / n:.1f}%"

    return "\n".join(
        [
            f"A = {name_a}\nB = {name_b}\n{n} shared queries at delta {result.delta:g}",
            f"A wins {result.win} ({share(result.win)})  ties {result.tie} ({share(result.tie)})  "
            f"loses {result.lose} ({share(result.lose)})  "
            "(each model thresholded on its own d: a model is confident on a query when its d >= delta)",
            f"confidence on these queries: A {100 * result.confidence_a:.1f}%  "
            f"B {100 * result.confidence_b:.1f}%  "
            f"(win - lose)/n = {100 * result.difference:+.1f} points, 95% CI [{100 * low:+.1f}, {100 * high:+.1f}] "
            "(Bonett-Price adjusted Wald for paired proportions)",
            f"sign test p = {fmt(result.sign_p, '.3g')}: exact binomial test of {result.win} wins against "
            f"{result.lose} losses, ties left out; tests whether one model wins more queries than it loses",
            f"Wilcoxon signed-rank p = {fmt(result.wilcoxon_p, '.3g')} over {result.n_paired} pairs of valid d "
            f"(mean d: A {result.d_mean_a:.4f}  B {result.d_mean_b:.4f}); "
            "tests whether d is shifted between the models, not the win/lose split",
        ]
    )


def format_win_tie_lose(result: Comparison | None) -> str:
    """`win/tie/lose` as counts, or `-` without a comparison."""
    if result is None:
        return "-"
    return f"{result.win}/{result.tie}/{result.lose}"


def format_p(result: Comparison | None) -> str:
    return "-" if result is None else fmt(result.wilcoxon_p, ".3g")


def fmt(value: object, spec: str, missing: str = "n/a") -> str:
    """`value` formatted with `spec` (e.g. `.3g`, `+.2f`), or `missing` when it is not a finite number."""
    return format(value, spec) if is_finite(value) else missing


def pct(value: object, missing: str = "n/a") -> str:
    """A share in [0, 1] as a percentage with one decimal (`0.417` -> `41.7%`)."""
    return f"{100 * value:.1f}%" if is_finite(value) else missing  # type: ignore[operator]


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Right-aligned columns separated by two spaces."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    return "\n".join("  ".join(str(cell).rjust(width) for cell, width in zip(line, widths)) for line in [header, *rows])


def format_reference(reference: ReferenceSummary) -> str:
    """Lines for the terminal: overall, then each category."""
    names = [n for n in METRIC_LABELS if n in reference.overall]

    def cells(values: Mapping) -> str:
        return "  ".join(f"{METRIC_LABELS[n]} {fmt(values.get(n), '.2f')}" for n in names if n in values)

    lines = [f"reference metrics  {cells(reference.overall)}  (n {max(reference.n_scored.values(), default=0)})"]
    for category, entry in reference.by_category.items():
        lines.append(f"  {category:<20} n={entry['n']:<4} {cells(entry)}")
    return "\n".join(lines)
