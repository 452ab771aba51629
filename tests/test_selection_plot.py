"""`probdiff select` and `probdiff plot` on run directories laid out as ProbDiffCallback writes them."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from probdiff_callback.analysis.select import format_selection, ranked_rows, select_checkpoints
from probdiff_callback.cli import main
from probdiff_callback.core.metric import compare_to_base, summarize
from probdiff_callback.runs.run_files import (
    HistoryRow,
    history_path,
    read_history,
    read_records,
    read_run,
    step_records_path,
    write_jsonl,
)

DELTA = -0.05


def records_for(ds: list[float], categories: tuple[str, ...] = ("writing", "math")) -> list[dict]:
    return [
        {
            "id": f"q{i}",
            "category": categories[i % len(categories)],
            "d": d,
            "logp_response": -2.0,
            "logp_revised": -2.0 + d,
            "n_tokens_response": 10,
            "n_tokens_revised": 10,
            "truncated": False,
            "response": "a",
            "revisions": ["b"],
        }
        for i, d in enumerate(ds)
    ]


def write_run(
    run: Path, steps: dict[int, list[float] | None], *, checkpoints: tuple[int, ...] = (), baseline: bool = True
) -> None:
    """A run directory: history rows (step 0 the baseline), step records, checkpoint dirs, added to the rows
    already there. A step given None is a failed evaluation. `vs_base` is stored as the callback stores it."""
    rows = {row.global_step: row for row in read_history(history_path(run))}
    for step, ds in steps.items():
        kind = "baseline" if step == 0 and baseline else "evaluate"
        checkpoint = None
        if step in checkpoints:
            checkpoint = str(run / f"checkpoint-{step}")
            Path(checkpoint).mkdir(parents=True)
            (Path(checkpoint) / "adapter_config.json").write_text("{}")
            save_file(
                {"lora_A": np.zeros((4, 8), dtype=np.float32)}, str(Path(checkpoint) / "adapter_model.safetensors")
            )
        row = {
            "global_step": step,
            "epoch": step / 10,
            "kind": kind,
            "base_model": kind == "baseline",
            "checkpoint": checkpoint,
            "records": None,
            "summary": None,
            "error": "RuntimeError: boom" if ds is None else None,
            "seconds": 1.0,
        }
        if ds is not None:
            records = records_for(ds)
            write_jsonl(step_records_path(run, step), records)
            row["records"] = f"step-{step}/records.jsonl"
            row["summary"] = json.loads(json.dumps(summarize(records, DELTA, [0.0, -0.1])))
            base = rows.get(0)
            if kind != "baseline" and base is not None and base.records:
                base_records = read_records(run / "probdiff" / base.records)
                row["vs_base"] = json.loads(json.dumps(compare_to_base(records, base_records, DELTA)))
        rows[step] = HistoryRow.from_json(row)
    write_jsonl(history_path(run), [rows[step].to_json() for step in sorted(rows)])


GOOD = [0.2, 0.1, 0.3, 0.05, 0.4, 0.2, 0.1, -0.01]  # all confident
MIXED = [0.2, -0.3, 0.3, -0.2, 0.4, 0.2, -0.5, -0.01]  # 5 of 8
MIXED_HIGHER_D = [0.9, -0.3, 0.9, -0.2, 0.9, 0.9, -0.5, -0.01]  # 5 of 8, larger mean d
POOR = [-0.2, -0.3, -0.1, -0.2, 0.4, -0.6, -0.5, -0.4]  # 1 of 8


def test_select_ranks_by_confidence_then_the_earlier_step_and_tests_against_the_best(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run, {0: POOR, 10: MIXED, 20: GOOD, 30: MIXED_HIGHER_D, 40: None}, checkpoints=(10, 20, 30))
    selection = select_checkpoints(run)
    # 10 and 30 tie at 5 of 8: the earlier step first, as the Trainer keeps its first best (30's mean d is higher)
    assert [s.global_step for s in selection.ranked] == [20, 10, 30]
    assert selection.baseline.global_step == 0 and selection.baseline.rank is None
    assert selection.failed_steps == [40]
    assert selection.best_checkpoint.checkpoint == str(run / "checkpoint-20")
    assert not selection.baseline_beats_all
    best, second = selection.ranked[0], selection.ranked[1]
    assert math.isnan(best.p_vs_best)
    assert 0 < second.p_vs_best <= 1 and (second.win, second.lose) == (0, 3)
    low, high = second.confidence_ci
    assert low <= 5 / 8 <= high

    assert main(["select", str(run), "--link"]) == 0
    printed = capsys.readouterr().out
    assert "Best checkpoint: step 20" in printed and "base" in printed and "steps 40" in printed
    best_link = run / "best"
    assert best_link.is_symlink() and best_link.resolve() == (run / "checkpoint-20").resolve()
    assert not os.path.isabs(os.readlink(best_link))  # the run directory can move
    assert main(["select", str(run), "--copy"]) == 0  # replaces the link by a copy
    assert best_link.is_dir() and not best_link.is_symlink() and (best_link / "adapter_config.json").is_file()


def test_tied_confidences_pick_the_earliest_tied_step_with_a_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    # 10, 20 and 30 tie at 5 of 8; step 10's checkpoint is gone (rotated), and 30 has the highest mean d
    write_run(run, {0: POOR, 10: MIXED, 20: MIXED, 30: MIXED_HIGHER_D, 40: POOR}, checkpoints=(20, 30, 40))
    selection = select_checkpoints(run)
    assert [s.global_step for s in selection.ranked] == [10, 20, 30, 40]
    assert selection.best_checkpoint.global_step == 20
    assert selection.best_checkpoint.checkpoint == str(run / "checkpoint-20")
    assert not selection.baseline_beats_all
    text = format_selection(selection)
    assert "(ties: the earlier step, as the Trainer's best model)" in text and "ties by mean d" not in text
    assert "Best checkpoint: step 20" in text and "step 10 ranks higher but its checkpoint was not saved" in text
    assert main(["select", str(run), "--link"]) == 0
    assert (run / "best").resolve() == (run / "checkpoint-20").resolve()


def test_ranking_puts_a_nan_confidence_last_and_a_tied_baseline_does_not_beat_the_best(tmp_path):
    rows = [
        HistoryRow(5, summary={"confidence": math.nan}),  # no valid query: NaN, never the best
        HistoryRow(10, summary={"confidence": 0.5}),
        HistoryRow(20, summary={"confidence": 0.5}),
        HistoryRow(30, summary={"confidence": 0.75}),
        HistoryRow(40, summary=None, error="boom"),  # failed: not ranked
        HistoryRow(0, kind="baseline", summary={"confidence": 0.9}),  # the baseline is not a candidate
    ]
    assert [row.global_step for row in ranked_rows(rows)] == [30, 10, 20, 5]
    run = tmp_path / "run"
    write_run(run, {0: MIXED, 10: MIXED_HIGHER_D, 20: POOR}, checkpoints=(10, 20))
    selection = select_checkpoints(run)
    assert selection.baseline.confidence == selection.ranked[0].confidence and not selection.baseline_beats_all


def test_select_says_when_the_baseline_beats_every_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run, {0: GOOD, 10: MIXED, 20: POOR}, checkpoints=(10, 20))
    selection = select_checkpoints(run)
    assert selection.baseline_beats_all
    assert selection.best_checkpoint.global_step == 10
    assert main(["select", str(run)]) == 0
    printed = capsys.readouterr().out
    assert "beats every evaluated checkpoint" in printed
    assert "Best checkpoint: step 10" in printed


def test_select_names_the_best_step_with_a_checkpoint_still_on_disk(tmp_path, capsys):
    run = tmp_path / "run"
    # step 20 ranks first but its checkpoint was never saved (save_strategy="best" saves only improvements)
    write_run(run, {0: POOR, 10: MIXED, 20: GOOD}, checkpoints=(10,))
    selection = select_checkpoints(run)
    assert [s.global_step for s in selection.ranked] == [20, 10]
    assert selection.best_checkpoint.global_step == 10
    main(["select", str(run)])
    assert "step 20 ranks higher but its checkpoint was not saved" in capsys.readouterr().out


def test_select_and_best_skip_checkpoints_removed_or_broken_and_say_so(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run, {0: POOR, 10: MIXED, 20: GOOD, 30: MIXED_HIGHER_D}, checkpoints=(10, 20, 30))
    shutil.rmtree(run / "checkpoint-20")  # rotation, or a fault, removed the best-ranked step's checkpoint
    weights = run / "checkpoint-10/adapter_model.safetensors"  # the next one's weights were cut short
    weights.write_bytes(weights.read_bytes()[:-40])
    selection = select_checkpoints(run)
    assert [s.global_step for s in selection.ranked] == [20, 10, 30]
    assert selection.best_checkpoint.global_step == 30
    assert [step for step, _ in selection.skipped] == [20, 10]
    assert main(["select", str(run), "--link"]) == 0
    printed = capsys.readouterr().out
    assert "skipped for best, ranked higher: step 20 (checkpoint-20 removed (checkpoint rotation, or a fault)); " in (
        printed
    )
    assert f"step 10 ({weights} is truncated (" in printed
    assert "Best checkpoint: step 30" in printed
    assert (run / "best").resolve() == (run / "checkpoint-30").resolve()


def test_select_works_on_a_run_that_is_still_training(tmp_path):
    run = tmp_path / "run"
    write_run(run, {0: POOR})
    selection = select_checkpoints(run)
    assert selection.ranked == [] and selection.best_checkpoint is None
    write_run(run, {10: MIXED}, checkpoints=(10,))
    assert select_checkpoints(run).best_checkpoint.global_step == 10


def test_select_without_history_is_a_clear_error(tmp_path, capsys):
    assert main(["select", str(tmp_path)]) == 2
    assert f"{tmp_path / 'probdiff' / 'history.jsonl'}: no evaluations yet" in capsys.readouterr().err
    assert main(["select", str(tmp_path / "missing")]) == 2
    assert f"{tmp_path / 'missing'}: no such run directory" in capsys.readouterr().err


def test_plot_writes_one_png_with_confidence_and_distributions(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run, {0: POOR, 10: MIXED, 20: GOOD + [math.nan], 30: MIXED_HIGHER_D, 40: None}, checkpoints=(10,))
    assert main(["plot", str(run)]) == 0
    png = run / "probdiff" / "probdiff.png"
    assert f"wrote {png}" in capsys.readouterr().out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    out = tmp_path / "elsewhere.png"
    assert main(["plot", str(run), "--out", str(out)]) == 0 and out.is_file()


def test_select_shows_win_tie_lose_against_the_base_model(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run, {0: POOR, 10: MIXED, 20: GOOD}, checkpoints=(10, 20))
    selection = select_checkpoints(run)
    by_step = {s.global_step: s for s in selection.ranked}
    # POOR is confident on query 4 only; GOOD on all 8: 7 won, 1 tied. MIXED on 0, 2, 4, 5, 7: 4 won, 4 tied.
    assert (by_step[20].vs_base["win"], by_step[20].vs_base["tie"], by_step[20].vs_base["lose"]) == (7, 1, 0)
    assert (by_step[10].vs_base["win"], by_step[10].vs_base["tie"], by_step[10].vs_base["lose"]) == (4, 4, 0)
    assert 0 < by_step[20].vs_base["wilcoxon_p"] < 1 and selection.baseline.vs_base is None
    assert main(["select", str(run)]) == 0
    printed = capsys.readouterr().out
    assert "vs base w/t/l" in printed and "p vs base" in printed
    line_20 = next(line for line in printed.splitlines() if line.split()[:2] == ["1", "20"])
    assert "7/1/0" in line_20


def test_plot_marks_the_best_checkpoint_shows_eval_loss_and_reference_metrics_and_labels_the_violin_bar(
    tmp_path, monkeypatch
):
    import matplotlib.figure

    from probdiff_callback.analysis.plot import plot_run

    run = tmp_path / "run"
    write_run(run, {0: POOR, 10: MIXED, 20: GOOD, 30: MIXED_HIGHER_D}, checkpoints=(10, 20, 30))
    set_measures(run, {0: (4.0, 1.0), 10: (3.5, 2.0), 20: (3.0, 4.0), 30: (3.2, 3.0)})
    captured = {}
    real_savefig = matplotlib.figure.Figure.savefig

    def capture(self, *args, **kwargs):
        captured["figure"] = self
        return real_savefig(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", capture)
    plot_run(read_run(run))
    figure = captured["figure"]
    legends = [text.get_text() for axis in figure.axes if axis.get_legend() for text in axis.get_legend().get_texts()]
    for label in (
        "best checkpoint (step 20)",
        "bar: median d of the step",
        "violin: distribution of d over the queries",
        "eval loss",
        "BLEU",
        "chrF",
    ):
        assert label in legends, legends
    lines = {line.get_label(): line for axis in figure.axes for line in axis.get_lines()}
    assert list(lines["eval loss"].get_ydata()) == [4.0, 3.5, 3.0, 3.2]
    assert list(lines["BLEU"].get_xdata()) == [0, 10, 20, 30]
    assert list(lines["chrF"].get_ydata()) == [10.0, 20.0, 40.0, 30.0]
    best_lines = [line for axis in figure.axes for line in axis.get_lines() if list(line.get_xdata()) == [20, 20]]
    assert len(best_lines) == 3  # confidence, the independent measures and the violins


def set_measures(run: Path, measures: dict[int, tuple[float, float | None]]) -> None:
    """Give steps an eval loss and (unless None) BLEU and chrF, in the history as the callback writes it."""
    rows = read_history(history_path(run))
    for row in rows:
        if row.global_step in measures:
            row.eval_loss, bleu = measures[row.global_step]
            if bleu is not None:
                overall = {"bleu": bleu, "chrf": 10 * bleu}
                reference = {"overall": overall, "n_scored": {"bleu": 8, "chrf": 8}, "by_category": {}}
                row.summary = dict(row.summary, reference=reference)
    write_jsonl(history_path(run), [row.to_json() for row in rows])


def captured_figure(monkeypatch, run: Path):
    import matplotlib.figure

    from probdiff_callback.analysis.plot import plot_run

    captured = {}
    real_savefig = matplotlib.figure.Figure.savefig

    def capture(self, *args, **kwargs):
        captured["figure"] = self
        return real_savefig(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", capture)
    plot_run(read_run(run))
    return captured["figure"]


def test_plot_without_reference_metrics_draws_the_eval_loss_on_the_panel_itself(tmp_path, monkeypatch):
    run = tmp_path / "run"
    write_run(run, {0: POOR, 10: MIXED, 20: GOOD}, checkpoints=(10, 20))
    set_measures(run, {0: (4.0, None), 10: (3.5, None), 20: (3.0, None)})
    figure = captured_figure(monkeypatch, run)
    # three panels, no twin axis left empty: every axis draws something
    assert len(figure.axes) == 3 and all(axis.get_lines() for axis in figure.axes)
    side = figure.axes[1]
    assert [line.get_label() for line in side.get_lines() if not line.get_label().startswith("_")] == ["eval loss"]
    assert list(next(line for line in side.get_lines() if line.get_label() == "eval loss").get_ydata()) == [
        4.0,
        3.5,
        3.0,
    ]
    assert side.get_ylabel() == "eval loss (held-out references)"
    assert "no reference metric" in side.get_title()


def test_plot_marks_the_earliest_tied_step_as_select_does(tmp_path, monkeypatch):
    run = tmp_path / "run"
    write_run(run, {0: POOR, 10: MIXED, 20: MIXED_HIGHER_D}, checkpoints=(10, 20))
    figure = captured_figure(monkeypatch, run)
    legends = [text.get_text() for axis in figure.axes if axis.get_legend() for text in axis.get_legend().get_texts()]
    assert "best checkpoint (step 10)" in legends
    assert select_checkpoints(run).best_checkpoint.global_step == 10
