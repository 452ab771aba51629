"""`probdiff crosscheck`'s figure as rendered: wide enough, its title whole, its step labels apart and inside their
panels, checked on the text's bounding boxes from matplotlib's renderer."""

from __future__ import annotations

import itertools

import matplotlib
import pytest

matplotlib.use("Agg")

from probdiff_callback.analysis.plot import CROSSCHECK_TITLE, crosscheck_figure, plot_crosscheck  # noqa: E402

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
    title = figure._suptitle
    assert title.get_text() == CROSSCHECK_TITLE
    box = title.get_window_extent(renderer)
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
    title = figure._suptitle.get_window_extent(renderer)
    for axis in figure.axes:
        if axis.get_title():
            assert not title.overlaps(axis.title.get_window_extent(renderer))
    matplotlib.pyplot.close(figure)


def test_the_saved_png_has_the_figures_width(tmp_path):
    from PIL import Image

    out = plot_crosscheck(report(OFFLINE_DEFAULT), tmp_path / "crosscheck.png")
    with Image.open(out) as image:
        assert image.width >= 900
