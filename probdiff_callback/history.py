"""`OUTPUT_DIR/probdiff/history.jsonl`: one row per evaluated step, rewritten atomically on each change.

A row: `global_step`, `epoch`, `kind` (baseline | evaluate | save | end), `base_model`
(whether the adapters were disabled), `checkpoint` (path or null), `records` (path of the
step's records, relative to the probdiff directory), `summary` (the core's summary, null on
failure; with `reference` where the queries have reference metrics), `error` (null or the
message), `seconds`, `vs_base` (`metric.compare` against the baseline row, null for the
baseline itself) and, once the Trainer has computed it at that step, `eval_loss`.

The file is small (one row per evaluation), so every change rewrites it whole through
`write_atomic`: a reader (`probdiff select` on a run still training) never sees half a row.
"""

from __future__ import annotations

import os
from pathlib import Path

from probdiff_callback.queries import read_jsonl, write_json, write_jsonl

DEFAULT_SUBDIR = "probdiff"
HISTORY_FILE = "history.jsonl"
RECORDS_FILE = "records.jsonl"
CHECKPOINT_SUMMARY_FILE = "probdiff.json"


def probdiff_dir(output_dir: str | os.PathLike, subdir: str = DEFAULT_SUBDIR) -> Path:
    return Path(output_dir) / subdir


def existing_run_dir(run_dir: str | os.PathLike) -> Path:
    """`run_dir` as a Path, or a FileNotFoundError saying that the folder itself is missing."""
    path = Path(run_dir)
    if not path.is_dir():
        raise FileNotFoundError(
            f"{path}: no such run directory (give the folder a training run wrote, e.g. runs/blog/tiny-<hash>)"
        )
    return path


def history_path(output_dir: str | os.PathLike, subdir: str = DEFAULT_SUBDIR) -> Path:
    return probdiff_dir(output_dir, subdir) / HISTORY_FILE


def step_records_path(output_dir: str | os.PathLike, step: int, subdir: str = DEFAULT_SUBDIR) -> Path:
    return probdiff_dir(output_dir, subdir) / f"step-{step}" / RECORDS_FILE


def read_history(path: str | os.PathLike) -> list[dict]:
    """The rows of a history file, oldest first; no file or an empty file is an empty history."""
    path = Path(path)
    if not path.is_file() or not path.read_text(encoding="utf-8").strip():
        return []
    return read_jsonl(path)


def write_history(path: str | os.PathLike, rows: list[dict]) -> None:
    write_jsonl(path, sorted(rows, key=lambda row: row["global_step"]))


def upsert_history_row(path: str | os.PathLike, row: dict) -> None:
    """Add `row`, replacing an existing row of the same step (a step has one row)."""
    rows = [r for r in read_history(path) if r["global_step"] != row["global_step"]]
    write_history(path, rows + [row])


def set_checkpoint(path: str | os.PathLike, step: int, checkpoint: str) -> dict | None:
    """Record that `checkpoint` holds the weights evaluated at `step`; the updated row, or None if
    the step was not evaluated."""
    rows = read_history(path)
    for row in rows:
        if row["global_step"] == step:
            row["checkpoint"] = checkpoint
            write_history(path, rows)
            return row
    return None


def update_row(path: str | os.PathLike, step: int, **fields) -> dict | None:
    """Set `fields` on the row of `step`; the updated row, or None if the step was not evaluated."""
    rows = read_history(path)
    for row in rows:
        if row["global_step"] == step:
            row.update(fields)
            write_history(path, rows)
            return row
    return None


def continue_history(path: str | os.PathLike, resumed_step: int) -> tuple[list[dict], int]:
    """Prepare the history for a training run that starts at `resumed_step`.

    A fresh run (step 0) starts an empty history. A resumed run keeps the rows up to the
    checkpoint it resumed from and drops later ones: those steps belong to the interrupted
    run and are trained and evaluated again. Returns (kept rows, number of dropped rows).
    """
    rows = read_history(path)
    kept = [r for r in rows if resumed_step > 0 and r["global_step"] <= resumed_step]
    if len(kept) != len(rows) or not Path(path).is_file():
        write_history(path, kept)
    return kept, len(rows) - len(kept)


def write_step_records(path: str | os.PathLike, records: list[dict]) -> None:
    write_jsonl(path, records)


def write_checkpoint_summary(checkpoint: str | os.PathLike, row: dict) -> None:
    """The evaluation of a checkpoint's weights, beside them (it travels with the checkpoint)."""
    write_json(Path(checkpoint) / CHECKPOINT_SUMMARY_FILE, row)
