"""`probdiff select` and `probdiff plot` on run directories laid out as ProbDiffCallback writes them."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from probdiff_callback import history
from probdiff_callback.cli import main
from probdiff_callback.metric import summarize
from probdiff_callback.queries import write_jsonl
from probdiff_callback.selection import select_checkpoints

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
    """A run directory: history rows (step 0 the baseline), step records, checkpoint dirs.
    A step given None is a failed evaluation."""
    for step, ds in steps.items():
        kind = "baseline" if step == 0 and baseline else "evaluate"
        checkpoint = None
        if step in checkpoints:
            checkpoint = str(run / f"checkpoint-{step}")
            Path(checkpoint).mkdir(parents=True)
            (Path(checkpoint) / "adapter_config.json").write_text("{}")
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
            write_jsonl(history.step_records_path(run, step), records)
            row["records"] = f"step-{step}/records.jsonl"
            row["summary"] = json.loads(json.dumps(summarize(records, DELTA, [0.0, -0.1])))
        history.upsert_history_row(history.history_path(run), row)


GOOD = [0.2, 0.1, 0.3, 0.05, 0.4, 0.2, 0.1, -0.01]  # all confident
MIXED = [0.2, -0.3, 0.3, -0.2, 0.4, 0.2, -0.5, -0.01]  # 5 of 8
MIXED_HIGHER_D = [0.9, -0.3, 0.9, -0.2, 0.9, 0.9, -0.5, -0.01]  # 5 of 8, larger mean d
POOR = [-0.2, -0.3, -0.1, -0.2, 0.4, -0.6, -0.5, -0.4]  # 1 of 8


def test_select_ranks_by_confidence_then_mean_d_and_tests_against_the_best(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run, {0: POOR, 10: MIXED, 20: GOOD, 30: MIXED_HIGHER_D, 40: None}, checkpoints=(10, 20, 30))
    selection = select_checkpoints(run)
    assert [s.global_step for s in selection.ranked] == [20, 30, 10]
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


def test_select_works_on_a_run_that_is_still_training(tmp_path):
    run = tmp_path / "run"
    write_run(run, {0: POOR})
    selection = select_checkpoints(run)
    assert selection.ranked == [] and selection.best_checkpoint is None
    write_run(run, {10: MIXED}, checkpoints=(10,))
    assert select_checkpoints(run).best_checkpoint.global_step == 10


def test_select_without_history_is_a_clear_error(tmp_path, capsys):
    assert main(["select", str(tmp_path)]) == 2
    assert "no evaluations yet" in capsys.readouterr().err


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

    from probdiff_callback.plotting import plot_run

    run = tmp_path / "run"
    write_run(run, {0: POOR, 10: MIXED, 20: GOOD, 30: MIXED_HIGHER_D}, checkpoints=(10, 20, 30))
    path = history.history_path(run)
    for step, loss, bleu in ((0, 4.0, 1.0), (10, 3.5, 2.0), (20, 3.0, 4.0), (30, 3.2, 3.0)):
        row = next(r for r in history.read_history(path) if r["global_step"] == step)
        overall = {"bleu": bleu, "chrf": 10 * bleu}
        reference = {"overall": overall, "n_scored": {"bleu": 8, "chrf": 8}, "by_category": {}}
        summary = dict(row["summary"], reference=reference)
        history.update_row(path, step, eval_loss=loss, summary=summary)
    captured = {}
    real_savefig = matplotlib.figure.Figure.savefig

    def capture(self, *args, **kwargs):
        captured["figure"] = self
        return real_savefig(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", capture)
    plot_run(run)
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
