"""A training run's ProbDiff files under `OUTPUT_DIR/<subdir>/` (`probdiff/` by default): written and read here only.

- `history.jsonl`: one `HistoryRow` per evaluated step, oldest first: `global_step`, `epoch`, `kind` (baseline |
  evaluate | save | end), `base_model` (whether the adapters were disabled), `checkpoint` (the path the Trainer saves
  that step's weights to, or null), `records` (the step's records file, relative to this directory), `summary` (the
  core's `Summary`, null on failure; with `reference` where the queries have reference metrics), `error` (null or the
  message), `seconds`, `cost` (the evaluator's `Cost`: each stage's seconds and the tokens generated; rows written
  before it existed lack it), `vs_base` (the `Comparison` against the baseline, null for the baseline itself) and,
  where the Trainer computed it at that step, `eval_loss` and `eval_losses` (the step's per-conversation eval losses
  file, relative to this directory; rows written before it existed lack it).
- `step-<N>/records.jsonl`: the step's records (`Record`), one per query.
- `step-<N>/eval_losses.json`: `{"losses": [...]}`, the eval loss of each held-out conversation at that step, in the
  eval dataset's order (null where a conversation has no loss token), for the paired test of the disagreement alarm.
- `checkpoint-N/probdiff.json`: the step's row beside its weights, so it travels with the checkpoint.
- `selection.json`: what the run selects its best checkpoint by (`metric_for_best_model`, `greater_is_better`,
  `alarm_gain_share`), written when training starts, so that `probdiff select` picks as the Trainer does.

Writing: `RunFiles` keeps the rows in memory and writes the whole history from them (`write_atomic`: a temp file,
then `os.replace`), so `probdiff select` on a run still training never sees half a row. One process writes a run's
history: the training process in the loop (the callback's `RunFiles`, which never reads the file back), the evaluator
with `async_eval` (`probdiff watch`'s; training reads the file once when it starts and then gets each row in the
step's done mark, `runs/queue.py`). Reading: `read_run`, once, for `probdiff select`, `plot`,
`crosscheck` and the end of a training run.

The JSON form of the rows, and of the records, summaries, comparisons and costs in them, is `core/json_form.py`'s
(NaN as null and back, the keys in their order, older files' missing keys defaulted, unknown keys kept); this module
adds the files.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from probdiff_callback.core.config import DEFAULT_SUBDIR
from probdiff_callback.core.json_form import JsonRecord, json_field, jsonl_lines
from probdiff_callback.core.metric import is_finite
from probdiff_callback.core.queries import DataFileError, read_rows
from probdiff_callback.core.records import Comparison, Cost, Record, Summary, dumps

HISTORY_FILE = "history.jsonl"
RECORDS_FILE = "records.jsonl"
EVAL_LOSSES_FILE = "eval_losses.json"
CHECKPOINT_SUMMARY_FILE = "probdiff.json"
SELECTION_FILE = "selection.json"
# Why a step was evaluated: the base model before training, a Trainer evaluation, a save (no evaluations), the end
EvaluationKind = Literal["baseline", "evaluate", "save", "end"]


@dataclass
class HistoryRow(JsonRecord):
    """One evaluated step. Numbers are NaN where missing. Its JSON form (`to_json`, `from_json`) is `JsonRecord`'s,
    each key written, even where an older row lacked it (a row from before `vs_base` gains `"vs_base": null`), but
    `cost`, `eval_loss`, `eval_losses` and `abandoned`, which are left out while they hold their defaults."""

    remember_absent: ClassVar[bool] = False

    global_step: int
    epoch: float | None = None
    kind: EvaluationKind = "evaluate"
    base_model: bool = False
    checkpoint: str | None = None
    records: str | None = None
    summary: Summary | None = None
    error: str | None = None
    seconds: float = math.nan
    # what each stage of the evaluation cost; None in rows written before it was measured
    cost: Cost | None = json_field(None, omit_default=True)
    vs_base: Comparison | None = None
    eval_loss: float = json_field(math.nan, omit_default=True)  # written once the Trainer computed it
    # the per-conversation eval losses file, relative to the probdiff directory
    eval_losses: str | None = json_field(None, omit_default=True)
    # a preemption stopped the evaluation; resuming from this step's checkpoint runs it
    abandoned: bool = json_field(False, omit_default=True)
    extra: dict = field(default_factory=dict)  # keys this version does not know, kept as they were

    @property
    def failed(self) -> bool:
        return self.error is not None or self.summary is None

    @property
    def confidence(self) -> float:
        return math.nan if self.summary is None else self.summary.confidence


def as_row(row: HistoryRow | Mapping) -> HistoryRow:
    """A HistoryRow from a row or its JSON form (the pure functions of `agreement` take either)."""
    return row if isinstance(row, HistoryRow) else HistoryRow.from_json(row)


# ---- paths ----
def probdiff_dir(output_dir: str | os.PathLike, subdir: str = DEFAULT_SUBDIR) -> Path:
    return Path(output_dir) / subdir


def history_path(output_dir: str | os.PathLike, subdir: str = DEFAULT_SUBDIR) -> Path:
    return probdiff_dir(output_dir, subdir) / HISTORY_FILE


def step_records_path(output_dir: str | os.PathLike, step: int, subdir: str = DEFAULT_SUBDIR) -> Path:
    return probdiff_dir(output_dir, subdir) / f"step-{step}" / RECORDS_FILE


def step_eval_losses_path(output_dir: str | os.PathLike, step: int, subdir: str = DEFAULT_SUBDIR) -> Path:
    return probdiff_dir(output_dir, subdir) / f"step-{step}" / EVAL_LOSSES_FILE


def existing_run_dir(run_dir: str | os.PathLike) -> Path:
    """`run_dir` as a Path, or a FileNotFoundError saying that the folder itself is missing."""
    path = Path(run_dir)
    if not path.is_dir():
        raise FileNotFoundError(
            f"{path}: no such run directory (give the folder a training run wrote, e.g. runs/blog/tiny-<hash>)"
        )
    return path


# ---- reading ----
def read_history(path: str | os.PathLike) -> list[HistoryRow]:
    """The rows of a history file, oldest first; no file or an empty file is an empty history."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for number, line in enumerate(jsonl_lines(path.read_text(encoding="utf-8")), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataFileError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        if not isinstance(value, dict) or "global_step" not in value:
            raise DataFileError(f"{path}:{number}: not a history row (a JSON object with `global_step`)")
        try:
            rows.append(HistoryRow.from_json(value))
        except ValueError as err:  # its summary, comparison or cost lacks a key
            raise DataFileError(f"{path}:{number}: {err}") from None
    return sorted(rows, key=lambda row: row.global_step)


def read_records(path: str | os.PathLike) -> list[Record]:
    """The records of a records file (a step's, or `probdiff eval`'s); a row that is not a record raises with the
    file and line."""
    records = []
    for line, row in read_rows(path):
        try:
            records.append(Record.from_json(row))
        except ValueError as err:
            raise DataFileError(f"{path}:{line}: {err} (a records.jsonl row as `probdiff eval` writes it)") from None
    return records


def read_eval_losses(path: str | os.PathLike) -> list[float]:
    """A step's per-conversation eval losses (NaN for null); a file that does not hold them raises with its path."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataFileError(f"{path}: not valid JSON ({err.msg})") from None
    losses = value.get("losses") if isinstance(value, dict) else None
    if not isinstance(losses, list) or not all(v is None or is_finite(v) for v in losses):
        raise DataFileError(f'{path}: expected {{"losses": [numbers or null, ...]}}, one per eval conversation')
    return [math.nan if v is None else float(v) for v in losses]


def step_files(directory: Path, row: HistoryRow) -> tuple[list[Record] | None, list[float] | None]:
    """(records, per-conversation eval losses) of a row's step, each None where the row names no file or it is gone
    (a successful step only has records)."""
    records_path = directory / row.records if row.records and row.summary is not None else None
    losses_path = directory / row.eval_losses if row.eval_losses else None
    return (
        read_records(records_path) if records_path is not None and records_path.is_file() else None,
        read_eval_losses(losses_path) if losses_path is not None and losses_path.is_file() else None,
    )


@dataclass
class Run:
    """What a run directory holds, read once: every history row and the records of each step that has them."""

    run_dir: Path
    directory: Path  # run_dir / subdir
    rows: list[HistoryRow]  # oldest first, failed evaluations included
    records: dict[int, list[Record]]  # global step -> records, for the successful steps whose file is on disk
    eval_losses: dict[int, list[float]] = field(default_factory=dict)  # global step -> per-conversation eval losses
    selection: dict | None = None  # selection.json; None for a run written before it existed

    @property
    def history_path(self) -> Path:
        return self.directory / HISTORY_FILE

    def successful(self) -> list[HistoryRow]:
        return [row for row in self.rows if row.summary is not None]

    def failed_steps(self) -> list[int]:
        return [row.global_step for row in self.rows if row.failed and not row.abandoned]

    def abandoned_steps(self) -> list[int]:
        """Steps whose evaluation a preemption abandoned: resuming from their checkpoint evaluates them."""
        return [row.global_step for row in self.rows if row.abandoned]

    def successful_or_raise(self, why: str) -> list[HistoryRow]:
        """The successful rows, or a FileNotFoundError naming the history file and `why` none is there."""
        rows = self.successful()
        if not rows:
            raise FileNotFoundError(f"{self.history_path}: no successful evaluations{why}")
        return rows


def read_run(run_dir: str | os.PathLike, subdir: str = DEFAULT_SUBDIR) -> Run:
    """The run's history and step records; a FileNotFoundError if the run directory itself is missing, or if it is
    `probdiff eval`'s output rather than a training run's."""
    run_dir = existing_run_dir(run_dir)
    directory = probdiff_dir(run_dir, subdir)
    if not directory.is_dir() and (run_dir / RECORDS_FILE).is_file():
        raise FileNotFoundError(
            f"{run_dir} is an evaluation's output (records.jsonl, summary.json), not a training run: compare it with "
            f"`probdiff compare {run_dir} OTHER_OUT` (another evaluation's --out)"
        )
    rows = read_history(directory / HISTORY_FILE)
    records, eval_losses = {}, {}
    for row in rows:
        step_records, step_losses = step_files(directory, row)
        if step_records is not None:
            records[row.global_step] = step_records
        if step_losses is not None:
            eval_losses[row.global_step] = step_losses
    selection_path = directory / SELECTION_FILE
    selection = json.loads(selection_path.read_text(encoding="utf-8")) if selection_path.is_file() else None
    return Run(run_dir, directory, rows, records, eval_losses, selection)


# ---- writing (the callback, main process) ----
class RunFiles:
    """The writer of one training run's files: the rows in memory, the history rewritten whole from them."""

    def __init__(self, output_dir: str | os.PathLike, subdir: str = DEFAULT_SUBDIR) -> None:
        self.output_dir, self.subdir = output_dir, subdir
        self.directory = probdiff_dir(output_dir, subdir)
        self._rows: dict[int, HistoryRow] = {}

    @property
    def history_path(self) -> Path:
        return self.directory / HISTORY_FILE

    def rows(self) -> list[HistoryRow]:
        return [self._rows[step] for step in sorted(self._rows)]

    def row(self, step: int) -> HistoryRow | None:
        return self._rows.get(step)

    def continue_from(self, resumed_step: int, also_keep: Collection[int] = ()) -> tuple[list[HistoryRow], int]:
        """Take over the history for a training run that starts at `resumed_step`: the one time it is read.

        A fresh run (step 0) starts an empty history. A resumed run keeps the rows up to the checkpoint it resumed
        from and drops later ones: those steps belong to the interrupted run and are trained and evaluated again.
        The rows of the steps `also_keep` are kept whatever their step (an evaluator started again keeps what it
        evaluated for this training start). Returns (kept rows, number of dropped rows).
        """
        rows = read_history(self.history_path)
        for stale in self.directory.glob("**/.*.tmp*"):  # a process killed between writing and renaming
            stale.unlink()

        def kept_step(step: int) -> bool:
            return (resumed_step > 0 and step <= resumed_step) or step in also_keep

        kept = [row for row in rows if kept_step(row.global_step)]
        self._rows = {row.global_step: row for row in kept}
        # the file exists from the start, so a reader sees "no evaluations yet" rather than a missing history
        if len(kept) != len(rows) or not self.history_path.is_file():
            self._write_history()
        return kept, len(rows) - len(kept)

    def baseline_records(self) -> list[Record] | None:
        """The records of the baseline among the rows (a resumed run compares its steps against them)."""
        row = next((r for r in self.rows() if r.kind == "baseline" and r.records), None)
        path = None if row is None else self.directory / row.records  # type: ignore[operator]
        return read_records(path) if path is not None and path.is_file() else None

    def add(
        self, row: HistoryRow, records: Sequence[Record] | None, eval_losses: Sequence[float] | None = None
    ) -> HistoryRow:
        """Write the step's records (when it succeeded) and per-conversation eval losses (when given), then its row,
        replacing an earlier row of the same step; the row goes into its checkpoint too if that is already on disk
        (else `link_checkpoint` puts it there)."""
        row.records = None
        if records is not None:
            path = step_records_path(self.output_dir, row.global_step, self.subdir)
            write_jsonl(path, records)
            row.records = str(path.relative_to(self.directory))
        if eval_losses is not None:
            self._write_eval_losses(row, eval_losses)
        self._rows[row.global_step] = row
        self._write_history()
        if row.checkpoint is not None and os.path.isdir(row.checkpoint):
            self._write_checkpoint_summary(row.checkpoint, row)
        return row

    def set_eval_loss(self, step: int, eval_loss: float, eval_losses: Sequence[float] | None = None) -> None:
        """The eval loss (and per-conversation losses) of a step ProbDiff evaluated before the Trainer did (the end of
        training), set once: a later `trainer.evaluate()` may run on other weights (`load_best_model_at_end`) and must
        not overwrite it."""
        row = self._rows.get(step)
        if row is not None and not is_finite(row.eval_loss) and is_finite(eval_loss):
            row.eval_loss = eval_loss
            if eval_losses is not None:
                self._write_eval_losses(row, eval_losses)
            self._write_history()

    def step_files(self, step: int) -> tuple[list[Record] | None, list[float] | None]:
        """(records, per-conversation eval losses) of an evaluated step, read from the files this writer wrote."""
        row = self._rows.get(step)
        return (None, None) if row is None else step_files(self.directory, row)

    def _write_eval_losses(self, row: HistoryRow, eval_losses: Sequence[float]) -> None:
        path = step_eval_losses_path(self.output_dir, row.global_step, self.subdir)
        write_atomic(path, dumps({"losses": list(eval_losses)}) + "\n")  # one line: a number per conversation
        row.eval_losses = str(path.relative_to(self.directory))

    def link_checkpoint(self, step: int, checkpoint: str) -> None:
        """A checkpoint just saved at an evaluated step: the row goes beside it. The history changes only where the
        row did not name it yet (`save_strategy="best"` decides to save after the evaluation)."""
        row = self._rows.get(step)
        if row is None:
            return
        if row.checkpoint != checkpoint:
            row.checkpoint = checkpoint
            self._write_history()
        self._write_checkpoint_summary(checkpoint, row)

    def _write_history(self) -> None:
        write_jsonl(self.history_path, [row.to_json() for row in self.rows()])

    @staticmethod
    def _write_checkpoint_summary(checkpoint: str | os.PathLike, row: HistoryRow) -> None:
        write_json(Path(checkpoint) / CHECKPOINT_SUMMARY_FILE, row.to_json())


def write_selection(
    directory: str | os.PathLike, metric_for_best_model: str | None, greater_is_better: bool | None, gain_share: float
) -> None:
    """What the run selects its best checkpoint by (`SELECTION_FILE` in the run's ProbDiff folder), for `probdiff
    select`; written by the callback on the main process when training starts."""
    selection = {
        "metric_for_best_model": metric_for_best_model,
        "greater_is_better": greater_is_better,
        "alarm_gain_share": gain_share,
    }
    write_json(Path(directory) / SELECTION_FILE, selection)


# --- JSON (`records.dumps`: NaN as null), written atomically ----------------------------------------------
def write_atomic(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: str | os.PathLike, value) -> None:
    write_atomic(path, dumps(value, indent=2) + "\n")


def write_jsonl(path: str | os.PathLike, rows) -> None:
    write_atomic(path, "".join(dumps(row) + "\n" for row in rows))
