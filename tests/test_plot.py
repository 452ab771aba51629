"""`probdiff plot` on run directories laid out as ProbDiffCallback writes them."""

from __future__ import annotations

import math
from pathlib import Path

from _runs import GOOD, MIXED, MIXED_HIGHER_D, POOR, write_run

from probdiff_callback.analysis.select import select_checkpoints
from probdiff_callback.cli import main
from probdiff_callback.runs.run_files import (
    history_path,
    read_history,
    read_run,
    write_jsonl,
)


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
