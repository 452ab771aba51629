"""The reports `probdiff eval`, `score` and `compare` print: a summary and a paired comparison, in words."""

from __future__ import annotations

from probdiff_callback.formatting import fmt, pct
from probdiff_callback.reference_metrics import format_reference


def format_summary(summary: dict) -> str:
    low, high = summary["confidence_ci"]
    lines = [
        f"queries            {summary['n']}  (invalid {summary['n_invalid']}, truncated {summary['n_truncated']})",
        f"hit max_new_tokens answers {summary['n_capped']}, revisions {summary['n_revision_capped']}  (scored as cut)",
        f"confidence         {pct(summary['confidence'])}  at delta {summary['delta']:g}   "
        f"95% CI [{pct(low)}, {pct(high)}] (Wilson)",
        "sweep              " + "  ".join(f"{k}: {pct(v)}" for k, v in summary["confidence_sweep"].items()),
        f"d mean / median    {summary['d_mean']:.4f} / {summary['d_median']:.4f}",
        f"log p answer/rev.  {summary['logp_response_mean']:.4f} / {summary['logp_revised_mean']:.4f}",
        f"length changed>50% {pct(summary['length_changed_share'])}",
    ]
    if len(summary["by_category"]) > 1:
        lines.append("by category:")
        for name, cat in summary["by_category"].items():
            lines.append(
                f"  {name:<20} n={cat['n']:<4} confidence {pct(cat['confidence']):>6}  d_mean {cat['d_mean']:.4f}"
            )
    if summary.get("reference"):
        lines.append(format_reference(summary["reference"]))
    return "\n".join(lines)


def format_comparison(result: dict, name_a: str, name_b: str) -> str:
    """`probdiff compare`'s report: the counts, then each test with the question it answers."""
    n = result["n"]
    low, high = result["difference_ci"]
    share = {key: f"{100 * result[key] / n:.1f}%" for key in ("win", "tie", "lose")}
    return "\n".join(
        [
            f"A = {name_a}\nB = {name_b}\n{n} shared queries at delta {result['delta']:g}",
            f"A wins {result['win']} ({share['win']})  ties {result['tie']} ({share['tie']})  "
            f"loses {result['lose']} ({share['lose']})  "
            "(each model thresholded on its own d: a model is confident on a query when its d >= delta)",
            f"confidence on these queries: A {100 * result['confidence_a']:.1f}%  "
            f"B {100 * result['confidence_b']:.1f}%  "
            f"(win - lose)/n = {100 * result['difference']:+.1f} points, 95% CI [{100 * low:+.1f}, {100 * high:+.1f}] "
            "(Bonett-Price adjusted Wald for paired proportions)",
            f"sign test p = {fmt(result['sign_p'], '.3g')}: exact binomial test of {result['win']} wins against "
            f"{result['lose']} losses, ties left out; tests whether one model wins more queries than it loses",
            f"Wilcoxon signed-rank p = {fmt(result['wilcoxon_p'], '.3g')} over {result['n_paired']} pairs of valid d "
            f"(mean d: A {result['d_mean_a']:.4f}  B {result['d_mean_b']:.4f}); "
            "tests whether d is shifted between the models, not the win/lose split",
        ]
    )
