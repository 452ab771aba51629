"""`probdiff select` on run directories laid out as ProbDiffCallback writes them."""

from __future__ import annotations

import math
import os
import shutil

import pytest
from _runs import GOOD, MIXED, MIXED_HIGHER_D, POOR, write_run

from probdiff_callback.analysis.select import format_selection, ranked_rows, select_checkpoints
from probdiff_callback.cli import main
from probdiff_callback.core.records import Summary
from probdiff_callback.runs.run_files import (
    HistoryRow,
)


def summary(confidence: float) -> Summary:
    return Summary(n=8, delta=-0.05, confidence=confidence)


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
        HistoryRow(5, summary=summary(math.nan)),  # no valid query: NaN, never the best
        HistoryRow(10, summary=summary(0.5)),
        HistoryRow(20, summary=summary(0.5)),
        HistoryRow(30, summary=summary(0.75)),
        HistoryRow(40, summary=None, error="boom"),  # failed: not ranked
        HistoryRow(0, kind="baseline", summary=summary(0.9)),  # the baseline is not a candidate
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
    assert f"step 10 ({weights} is truncated or damaged (" in printed
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


def test_select_shows_win_tie_lose_against_the_base_model(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run, {0: POOR, 10: MIXED, 20: GOOD}, checkpoints=(10, 20))
    selection = select_checkpoints(run)
    by_step = {s.global_step: s for s in selection.ranked}
    # POOR is confident on query 4 only; GOOD on all 8: 7 won, 1 tied. MIXED on 0, 2, 4, 5, 7: 4 won, 4 tied.
    assert (by_step[20].vs_base.win, by_step[20].vs_base.tie, by_step[20].vs_base.lose) == (7, 1, 0)
    assert (by_step[10].vs_base.win, by_step[10].vs_base.tie, by_step[10].vs_base.lose) == (4, 4, 0)
    assert 0 < by_step[20].vs_base.wilcoxon_p < 1 and selection.baseline.vs_base is None
    assert main(["select", str(run)]) == 0
    printed = capsys.readouterr().out
    assert "vs base w/t/l" in printed and "p vs base" in printed
    line_20 = next(line for line in printed.splitlines() if line.split()[:2] == ["1", "20"])
    assert "7/1/0" in line_20


@pytest.mark.parametrize("command", ["select", "plot", "crosscheck"])
def test_an_evaluations_output_is_told_apart_from_a_training_run(command, tmp_path, capsys):
    out = tmp_path / "eval"
    out.mkdir()
    (out / "records.jsonl").write_text("")
    (out / "summary.json").write_text("{}")
    assert main([command, str(out)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{out} is an evaluation's output (records.jsonl, summary.json), not a training run" in err
    assert f"compare it with `probdiff compare {out} OTHER_OUT`" in err
