"""analysis/plot.py: `probdiff plot` on run directories laid out as ProbDiffCallback writes them, and `probdiff
crosscheck`'s figure as rendered: wide enough, its title whole, its step labels apart and inside their panels, checked
on the text's bounding boxes from matplotlib's renderer."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import matplotlib
import pytest
from _runs import GOOD, MIXED, MIXED_HIGHER_D, POOR, write_run

from probdiff_callback.analysis.plot import CROSSCHECK_TITLE, crosscheck_figure, plot_crosscheck
from probdiff_callback.analysis.select import select_checkpoints
from probdiff_callback.cli import main
from probdiff_callback.core.records import ReferenceSummary
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


def test_plot_marks_the_best_checkpoint_shows_eval_loss_and_reference_metrics_and_labels_the_violin_bar(
    tmp_path, monkeypatch
):
    import matplotlib.figure

    run = tmp_path / "run"
    write_run(run, {0: POOR, 10: MIXED, 20: GOOD, 30: MIXED_HIGHER_D}, checkpoints=(10, 20, 30))
    set_measures(run, {0: (4.0, 1.0), 10: (3.5, 2.0), 20: (3.0, 4.0), 30: (3.2, 3.0)})
    captured = {}
    real_savefig = matplotlib.figure.Figure.savefig

    def capture(self, *args, **kwargs):
        captured["figure"] = self
        return real_savefig(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", capture)
    out = tmp_path / "elsewhere.png"
    assert main(["plot", str(run), "--out", str(out)]) == 0 and out.is_file()  # `--out`: not RUN_DIR/probdiff/
    figure = captured["figure"]
    for axis in figure.axes[:3]:  # the panels over the steps: only steps 0-30 are labelled
        assert [tick.get_text() for tick in axis.get_xticklabels()] == ["0", "10", "20", "30"]
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
                row.summary.reference = ReferenceSummary(
                    overall=overall, n_scored={"bleu": 8, "chrf": 8}, by_category={}
                )
    write_jsonl(history_path(run), [row.to_json() for row in rows])


def captured_figure(monkeypatch, run: Path):
    import matplotlib.figure

    from probdiff_callback.analysis.plot import plot_run

    captured = {}

    def capture(self, *args, **kwargs):  # laid out and drawn, not rasterised: the tests read its artists only
        captured["figure"] = self
        self.draw_without_rendering()

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


# ---- the crosscheck figure's layout ----
DPI = 110  # plot_crosscheck's


# The offline default's run (docs/offline-default.md): the confidence saturates at 100% and the eval loss barely moves.
OFFLINE_DEFAULT = [
    (0, 0.417, -0.168, 6.2577),
    (4, 0.833, 2.630, 6.2517),
    (8, 1.0, 3.018, 6.2411),
    (12, 0.917, 1.830, 6.2500),
    (16, 1.0, 2.875, 6.2427),
    (20, 1.0, 2.733, 6.2417),
]
# A longer run that has saturated: 25 evaluations, most at 100% with nearly the same loss and mean d.
SATURATED = [(4 * i, min(1.0, 0.5 + 0.25 * i), 2.5 + 0.01 * (i % 2), 6.24 + 0.0002 * (i % 3)) for i in range(25)]


def report(points: list[tuple[int, float, float, float]], measures: tuple[str, ...] = ("eval_loss",)) -> dict:
    """A cross-check report over (step, confidence, mean d, eval loss); reference metrics follow the loss down."""
    steps = [
        {
            "step": step,
            "confidence": confidence,
            "d_mean": d_mean,
            "eval_loss": loss,
            "metrics": {name: 100 * (7 - loss) for name in measures if name != "eval_loss"},
        }
        for step, confidence, d_mean, loss in points
    ]
    across = [
        {"probdiff": ours, "measure": measure, "spearman": 0.5, "spearman_p": 0.2, "kendall": 0.4, "n": len(steps)}
        for ours in ("confidence", "d_mean")
        for measure in measures
    ]
    return {"steps": steps, "across_steps": across}


def panel_labels(figure, n_panels: int) -> list[list]:
    """The step labels of each panel (the colour bar's axis comes after the panels)."""
    return [[t for t in axis.texts if t.get_text().isdigit()] for axis in figure.axes[:n_panels]]


def suptitle(figure):
    """The figure's title as drawn: `suptitle` adds it to the figure's texts."""
    return next(text for text in figure.texts if text.get_text() == figure.get_suptitle())


@pytest.mark.parametrize(
    ("points", "measures", "min_labelled"),
    [
        (OFFLINE_DEFAULT, ("eval_loss",), 6),  # room for every label
        (SATURATED, ("eval_loss",), 3),  # one per cluster of points at least
        (OFFLINE_DEFAULT, ("bleu", "chrf", "eval_loss"), 6),
    ],
)
def test_the_title_is_whole_and_labels_neither_overlap_nor_leave_their_panel(points, measures, min_labelled):
    figure = crosscheck_figure(report(points, measures))
    renderer = figure.canvas.get_renderer()
    whole = figure.bbox
    assert whole.width >= 900, "wide enough to read at the saved resolution"  # pixels at the figure's dpi
    assert figure.get_suptitle() == CROSSCHECK_TITLE
    box = suptitle(figure).get_window_extent(renderer)
    assert whole.x0 <= box.x0 and box.x1 <= whole.x1 and box.y1 <= whole.y1, "the title is cut"
    texts = [t for axis in figure.axes for t in (axis.title, axis.xaxis.label, axis.yaxis.label) if t.get_text()]
    for text in texts:
        box = text.get_window_extent(renderer)
        assert whole.x0 <= box.x0 and box.x1 <= whole.x1 and whole.y0 <= box.y0 and box.y1 <= whole.y1, text
    n_panels = 2 * len(measures)
    for axis, labels in zip(figure.axes, panel_labels(figure, n_panels)):
        assert len(labels) >= min_labelled
        assert len({t.get_text() for t in labels}) == len(labels), "a step labelled twice"
        boxes = [t.get_window_extent(renderer) for t in labels]
        inside = axis.get_window_extent(renderer)
        assert all(inside.x0 <= b.x0 and b.x1 <= inside.x1 and inside.y0 <= b.y0 and b.y1 <= inside.y1 for b in boxes)
        assert not any(a.overlaps(b) for a, b in itertools.combinations(boxes, 2)), "two step labels overlap"
    matplotlib.pyplot.close(figure)


def test_the_panels_titles_do_not_overlap_the_figure_title():
    figure = crosscheck_figure(report(OFFLINE_DEFAULT))
    renderer = figure.canvas.get_renderer()
    title = suptitle(figure).get_window_extent(renderer)
    for axis in figure.axes:
        if axis.get_title():
            assert not title.overlaps(axis.title.get_window_extent(renderer))
    matplotlib.pyplot.close(figure)


def test_the_saved_png_has_the_figures_width(tmp_path):
    from PIL import Image

    out = plot_crosscheck(report(OFFLINE_DEFAULT), tmp_path / "crosscheck.png")
    with Image.open(out) as image:
        assert image.width >= 900
