"""`probdiff crosscheck`: rank correlations across steps and per query, outside verdicts (pairwise and
revision vs answer) against hand-computed figures, and the comparison with the base model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from _records import make_record

from probdiff_callback.analysis.crosscheck import (
    across_steps,
    crosscheck,
    format_crosscheck,
    per_query,
    rank_correlation,
    step_measures,
)
from probdiff_callback.analysis.report import format_win_tie_lose
from probdiff_callback.analysis.verdicts import (
    check_verdicts,
    conflict_degree,
    format_conflict,
    format_pairwise,
    pairwise_agreement,
    read_verdicts,
)
from probdiff_callback.callback.metrics import vs_base_metrics
from probdiff_callback.cli import main
from probdiff_callback.core.metric import compare_to_base
from probdiff_callback.core.queries import DataFileError
from probdiff_callback.core.records import Record
from probdiff_callback.runs.run_files import history_path, read_run, step_records_path, write_jsonl
from probdiff_callback.training.report import one_line

DELTA = -0.05


def rec(id_: str, d: float | None, chrf: float | None = None, category: str = "zh-en") -> Record:
    scored = {} if chrf is None else {"reference": "y", "ref": {"bleu": chrf / 2, "chrf": chrf}}
    return make_record(id_, d, category=category, response="x", **scored)


def history_row(
    step: int,
    confidence: float,
    d_mean: float,
    *,
    bleu: float | None = None,
    chrf: float | None = None,
    eval_loss: float | None = None,
    kind: str = "evaluate",
) -> dict:
    summary = {
        "confidence": confidence,
        "d_mean": d_mean,
        "delta": DELTA,
        "n": 3,
        "by_category": {"zh-en": {"n": 3, "confidence": confidence, "d_mean": d_mean}},
    }
    if bleu is not None:
        summary["reference"] = {
            "overall": {"bleu": bleu, "chrf": chrf},
            "n_scored": {"bleu": 3, "chrf": 3},
            "by_category": {"zh-en": {"n": 3, "bleu": bleu, "chrf": chrf, "tokenize": "13a"}},
        }
    return {
        "global_step": step,
        "kind": kind,
        "summary": summary,
        "eval_loss": eval_loss,
        "records": f"step-{step}/records.jsonl",
    }


# ---- rank correlations, by hand ----


def test_rank_correlation_matches_hand_computed_values():
    perfect = rank_correlation([0.1, 0.3, 0.2, 0.4], [1, 3, 2, 5])
    assert perfect["n"] == 4 and perfect["spearman"] == pytest.approx(1.0) and perfect["kendall"] == pytest.approx(1.0)
    # exact p: of the 24 orderings of 4 values, 2 reach |rho| = 1 (scipy's t approximation would say 0)
    assert perfect["spearman_p"] == pytest.approx(2 / 24)
    # ranks 1,2,3,4 against 4,3,1,2: sum d^2 = 18, rho = 1 - 6*18/(4*15) = -0.8;
    # 1 concordant and 5 discordant pairs: tau = -4/6
    inverse = rank_correlation([0.1, 0.2, 0.3, 0.4], [4, 3, 1, 2])
    assert inverse["spearman"] == pytest.approx(-0.8) and inverse["kendall"] == pytest.approx(-4 / 6)
    assert 0 < inverse["spearman_p"] <= 1 and 0 < inverse["kendall_p"] <= 1
    missing = rank_correlation([0.1, None, 0.3, math.nan, 0.5], [1, 2, 3, 4, 5])
    assert missing["n"] == 3 and missing["spearman"] == pytest.approx(1.0)
    for xs, ys in (([1, 2], [1, 2]), ([1, 1, 1], [1, 2, 3])):
        few = rank_correlation(xs, ys)
        assert math.isnan(few["spearman"]) and math.isnan(few["kendall_p"])


def test_exact_spearman_p_counts_orderings_by_hand():
    # ranks 1..4 against 4,3,1,2 (rho = -0.8 = 1 - sum d^2 / 10): |rho| >= 0.8 for sum d^2 <= 2 (1 + 3 of the 24
    # orderings) or >= 18 (3 + 1): 8 of 24
    assert rank_correlation([0.1, 0.2, 0.3, 0.4], [4, 3, 1, 2])["spearman_p"] == pytest.approx(8 / 24)
    # ties as average ranks: 1,2,3 against 1.5,1.5,3 (rho = sqrt(3)/2); the 3 on rank 1 or 3 reaches |rho|, in
    # 4 of the 6 orderings
    tied = rank_correlation([1, 2, 3], [1, 1, 2])
    assert tied["spearman"] == pytest.approx(math.sqrt(3) / 2) and tied["spearman_p"] == pytest.approx(4 / 6)
    # ties on both sides make the orderings' rhos asymmetric (1 in 2 of 6 orderings, -0.5 in 4): |rho| >= 1 in
    # 2 of 6, where doubling the smaller tail would say 4 of 6
    both = rank_correlation([1, 1, 2], [5, 5, 7])
    assert both["spearman"] == pytest.approx(1.0) and both["spearman_p"] == pytest.approx(2 / 6)


def test_across_steps_pairs_confidence_and_mean_d_with_each_metric_and_the_loss():
    rows = [
        history_row(0, 0.1, 0.5, bleu=1.0, chrf=10.0, eval_loss=4.0, kind="baseline"),
        history_row(4, 0.2, 0.4, bleu=3.0, chrf=12.0, eval_loss=3.0),
        history_row(8, 0.3, 0.3, bleu=2.0, chrf=14.0, eval_loss=1.0),
        history_row(12, 0.4, 0.2, bleu=5.0, chrf=16.0, eval_loss=2.0),
        {"global_step": 16, "kind": "evaluate", "summary": None, "records": None},  # a failed evaluation is left out
    ]
    steps = step_measures(rows)
    assert [s["step"] for s in steps] == [0, 4, 8, 12]
    table = {(r["probdiff"], r["measure"]): r for r in across_steps(steps)}
    assert set(table) == {(p, m) for p in ("confidence", "d_mean") for m in ("bleu", "chrf", "eval_loss")}
    # confidence 0.1..0.4 against BLEU 1,3,2,5: ranks 1,2,3,4 vs 1,3,2,4: sum d^2 = 2, rho = 1 - 12/60 = 0.8
    assert table["confidence", "bleu"]["spearman"] == pytest.approx(0.8)
    assert table["confidence", "chrf"]["spearman"] == pytest.approx(1.0)
    assert (
        table["confidence", "eval_loss"]["spearman"] == pytest.approx(-0.8)
        and table["confidence", "eval_loss"]["agrees_if"] == "negative"
    )
    assert table["d_mean", "chrf"]["spearman"] == pytest.approx(-1.0) and table["d_mean", "chrf"][
        "kendall"
    ] == pytest.approx(-1.0)
    assert all(r["n"] == 4 for r in table.values())


def test_per_query_correlates_d_with_the_sentence_score_within_each_step():
    records = {
        0: [rec("a", 0.1, 10), rec("b", 0.2, 30), rec("c", 0.3, 20)],  # rho = 1 - 6*2/(3*8) = 0.5
        4: [rec("a", 0.1, 30), rec("b", 0.2, 20), rec("c", 0.3, 10)],  # rho = -1
        8: [
            rec("a", 0.1, 10),
            rec("b", 0.2, 20),
            rec("c", 0.3, 30),
            rec("d", None, 40),
        ],  # rho = 1 (invalid d left out)
    }
    result = {r["metric"]: r for r in per_query(records)}
    assert set(result) == {"bleu", "chrf"}
    chrf = result["chrf"]
    assert [s["spearman"] for s in chrf["by_step"]] == pytest.approx([0.5, -1.0, 1.0])
    assert [s["n"] for s in chrf["by_step"]] == [3, 3, 3]
    assert chrf["median_spearman"] == pytest.approx(0.5) and chrf["n_positive"] == 2 and chrf["n_steps"] == 3
    # three points: the exact p of rho = +-1 is 2/6, so nothing is significant
    assert chrf["n_significant_positive"] == 0 and chrf["n_significant_negative"] == 0
    assert per_query({0: [rec("a", 0.1)]}) == []  # no reference scores: no per-query rows


# ---- the comparison with the base model ----


def test_versus_base_is_metric_compare_against_the_baseline():
    base = [rec("a", -0.2), rec("b", 0.1), rec("c", -0.3), rec("d", 0.0)]
    step = [rec("a", 0.1), rec("b", -0.2), rec("c", 0.0), rec("d", 0.2)]
    result = compare_to_base(step, base, DELTA)
    assert (result.win, result.tie, result.lose) == (2, 1, 1)  # a, c won; b lost; d tied
    assert format_win_tie_lose(result) == "2/1/1"
    assert vs_base_metrics(result)["eval_probdiff_vs_base_win"] == 2.0
    assert compare_to_base(step, None, DELTA) is None and format_win_tie_lose(None) == "-"
    assert all(math.isnan(v) for v in vs_base_metrics(None).values())


# ---- outside verdicts, by hand ----

PAIRWISE_A = [
    rec("q1", 0.1),
    rec("q2", -0.2),
    rec("q3", 0.0),
    rec("q4", -0.3),
    rec("q5", 0.2),
    rec("q6", None),
    rec("q7", 0.1),
]
PAIRWISE_B = [
    rec("q1", -0.2),
    rec("q2", 0.1),
    rec("q3", 0.0),
    rec("q4", -0.4),
    rec("q5", -0.1),
    rec("q6", 0.0),
    rec("q7", 0.1),
]
PAIRWISE_VERDICTS = [("q1", "A"), ("q2", "a"), ("q3", "tie"), ("q4", "B"), ("q5", "Tie"), ("q6", "b"), ("q9", "A")]
REVISION_RECORDS = [
    rec("r1", 0.3),
    rec("r2", -0.2),
    rec("r3", 0.1),
    rec("r4", -0.1),
    rec("r5", 0.0),
    rec("r6", -0.05),
    rec("r7", None),
    rec("r8", 0.4),
]
REVISION_VERDICTS = [
    ("r1", "better"),
    ("r2", 1),
    ("r3", "worse"),
    ("r4", -1),
    ("r5", "Better"),
    ("r6", "same"),
    ("r7", "worse"),
    ("r10", 0),
]


def write_verdicts(path: Path, key: str, rows: list[tuple[str, object]]) -> Path:
    path.write_text("".join(json.dumps({"id": i, key: v}) + "\n" for i, v in rows), encoding="utf-8")
    return path


def test_pairwise_agreement_and_confusion_table_by_hand(tmp_path):
    verdicts = read_verdicts(write_verdicts(tmp_path / "pairwise.jsonl", "winner", PAIRWISE_VERDICTS))
    assert verdicts.kind == "pairwise" and verdicts.verdicts["q2"] == "A" and verdicts.verdicts["q5"] == "tie"
    result = pairwise_agreement(verdicts, PAIRWISE_A, PAIRWISE_B, DELTA)
    # ProbDiff: q1 A, q2 B, q3 tie, q4 tie, q5 A, q6 B (A's d invalid); judge: A, A, tie, B, tie, B
    assert result["n"] == 6 and result["n_agreed"] == 3 and result["agreement"] == pytest.approx(0.5)
    assert result["n_decisive"] == 3 and result["decisive_agreement"] == pytest.approx(2 / 3)  # q1, q2, q6
    assert result["confusion"] == {
        "A": {"A": 1, "tie": 1, "B": 0},
        "tie": {"A": 0, "tie": 1, "B": 1},
        "B": {"A": 1, "tie": 0, "B": 1},
    }
    assert result["judge"] == {"A": 2, "tie": 2, "B": 2}
    assert (result["compare"].win, result["compare"].tie, result["compare"].lose) == (2, 2, 2)
    assert (result["n_only_verdicts"], result["only_verdicts"]) == (1, ["q9"])
    assert (result["n_only_records"], result["only_records"]) == (1, ["q7"])
    text = format_pairwise(result, "step 20", "step 0 (base model)")
    assert (
        "agreement 50.0% (3 of 6)" in text
        and "A wins 2, ties 2, loses 2" in text
        and "1 verdict ids have no record (e.g. q9)" in text
    )


def test_conflict_degree_by_hand(tmp_path):
    verdicts = read_verdicts(write_verdicts(tmp_path / "revision.jsonl", "revision", REVISION_VERDICTS))
    assert verdicts.kind == "revision" and verdicts.verdicts == {
        "r1": 1,
        "r2": 1,
        "r3": -1,
        "r4": -1,
        "r5": 1,
        "r6": 0,
        "r7": -1,
        "r10": 0,
    }
    result = conflict_degree(verdicts, REVISION_RECORDS)
    # r2 (judged better, d < 0) and r3 (judged worse, d > 0) conflict; r5 has d = 0; r7 has no valid d
    assert result["n"] == 6 and result["n_conflicts"] == 2 and result["conflict_degree"] == pytest.approx(2 / 6)
    assert result["n_invalid_d"] == 1
    assert result["table"] == {
        "d > 0": {"better": 1, "same": 0, "worse": 1},
        "d = 0": {"better": 1, "same": 0, "worse": 0},
        "d < 0": {"better": 1, "same": 1, "worse": 1},
    }
    assert (result["n_only_verdicts"], result["n_only_records"]) == (1, 1)
    assert "conflict degree 33.3% (2 of 6" in format_conflict(result, "step 4")
    with pytest.raises(ValueError, match="not pairwise"):
        pairwise_agreement(verdicts, REVISION_RECORDS, REVISION_RECORDS, DELTA)


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"id": "a", "winner": "A"}', "not json"], ":2: not valid JSON"),
        (['{"winner": "A"}'], ':1: no "id"'),
        (['{"id": "a", "winner": "C"}'], ':1: "winner" must be "A", "B" or "tie"'),
        (['{"id": "a", "revision": "much better"}'], ':1: "revision" must be "better", "worse" or "same"'),
        (['{"id": "a", "revision": true}'], ':1: "revision" must be'),
        (
            ['{"id": "a", "winner": "A"}', '{"id": "b", "revision": "better"}'],
            ":2: a revision verdict, but line 1 made this a pairwise",
        ),
        (['{"id": "a", "winner": "A"}', '{"id": "a", "winner": "B"}'], ":2: id 'a' repeats line 1"),
        (['{"id": "a", "verdict": "A"}'], ':1: neither "winner"'),
        (['{"id": "a", "winner": "A", "revision": "better"}'], ':1: both "winner" and "revision"'),
    ],
)
def test_a_bad_verdict_row_is_an_error_with_its_line(tmp_path, lines, message):
    path = tmp_path / "verdicts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFileError) as err:
        read_verdicts(path)
    assert f"{path}{message}" in str(err.value)


# ---- the command on a run directory ----


def write_run(run: Path) -> None:
    rows = []
    steps = {
        0: ([0.1, -0.2, -0.3], [10, 20, 30], 4.0),
        4: ([0.2, 0.1, -0.2], [20, 10, 40], 3.0),
        8: ([0.3, 0.2, 0.1], [30, 25, 35], 2.5),
    }
    for step, (ds, chrfs, loss) in steps.items():
        records = [rec(f"q{i}", d, chrf) for i, (d, chrf) in enumerate(zip(ds, chrfs))]
        write_jsonl(step_records_path(run, step), records)
        confidence = sum(d >= DELTA for d in ds) / 3
        row = history_row(
            step,
            confidence,
            sum(ds) / 3,
            bleu=sum(chrfs) / 6,
            chrf=sum(chrfs) / 3,
            eval_loss=loss,
            kind="baseline" if step == 0 else "evaluate",
        )
        rows.append(row)
    write_jsonl(history_path(run), rows)


def test_crosscheck_command_prints_the_table_writes_json_and_plot_and_reads_verdicts(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run)
    verdicts = write_verdicts(tmp_path / "v.jsonl", "winner", [("q0", "A"), ("q1", "A"), ("q2", "tie")])
    assert main(["crosscheck", str(run), "--verdicts", str(verdicts)]) == 0
    out = capsys.readouterr().out
    assert "ProbDiff against independent measures over 3 evaluated steps (steps 0-8)" in out
    assert "Spearman ρ" in out and "Kendall τ" in out and "eval loss" in out and "chrF" in out and "BLEU" in out
    assert "Per query" in out and "Pairwise verdicts: A = step 8, B = step 0 (base model), 3 matched queries" in out
    report = json.loads((run / "probdiff" / "crosscheck.json").read_text())
    assert report["n_steps"] == 3 and report["verdicts"]["step"] == 8 and report["verdicts"]["against"] == 0
    # step 8 vs 0: q0 both confident (tie), q1 A only (A), q2 A only (A); judge A, A, tie: 1 of 3 agree
    assert report["verdicts"]["n_agreed"] == 1
    loss = next(r for r in report["across_steps"] if r["probdiff"] == "confidence" and r["measure"] == "eval_loss")
    assert (
        loss["spearman"] == pytest.approx(-1.0) and loss["n"] == 3
    )  # confidence 1/3, 2/3, 1 as the loss falls 4, 3, 2.5
    png = (run / "probdiff" / "crosscheck.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    read = read_run(run)
    rows, records = read.successful(), read.records
    assert [row.global_step for row in rows] == [0, 4, 8] and sorted(records) == [0, 4, 8]
    line = one_line(crosscheck(rows, records))
    assert line.startswith("Cross-check over 3 steps, confidence vs BLEU ρ") and "eval loss ρ -1.00" in line
    assert "per query d vs BLEU" in line
    with pytest.raises(ValueError, match="--step 5: no records"):
        check_verdicts(verdicts, rows, records, step=5)
    assert main(["crosscheck", str(tmp_path / "nothing")]) == 2
    assert f"{tmp_path / 'nothing'}: no such run directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["crosscheck", str(tmp_path / "empty")]) == 2
    assert f"{tmp_path / 'empty' / 'probdiff' / 'history.jsonl'}: no successful evaluations" in capsys.readouterr().err


def test_crosscheck_without_reference_metrics_says_so():
    rows = [
        history_row(0, 0.5, 0.1, eval_loss=3.0, kind="baseline"),
        history_row(4, 0.6, 0.2, eval_loss=2.9),
        history_row(8, 0.7, 0.3, eval_loss=2.8),
    ]
    report = crosscheck(rows, {})
    assert [r["measure"] for r in report["across_steps"]] == ["eval_loss", "eval_loss"]
    text = format_crosscheck(report)
    assert "no reference metric" in text and report["per_query"] == []
