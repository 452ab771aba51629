"""The queue between training and its evaluator: the one module that knows its files.

Training writes requests and never waits for them; the evaluator (`probdiff watch RUN_DIR`) takes them in step order,
writes the step's row and records through `RunFiles` and marks each request done, the row in the mark. One writer per
file: training writes the spec, the queries, the requests, the weights and the end; the evaluator writes the history
(with async_eval training never writes it, and reads none of it after it starts: each result reaches it once, in its
done mark), the step records and the done marks. Everything lives under `OUTPUT_DIR/<subdir>/queue/`:

- `evaluator.json`: `EvaluatorSpec`, written by training when it starts: what an evaluator needs to rebuild the
  loop's evaluation (the base model's folder, dtype, the ProbDiff settings, the step the run started from).
- `queries.jsonl`: the held-out queries the loop would evaluate (the selected subset, in its order).
- `step-<N>/weights/`: the weights to evaluate: hard links to the checkpoint's weight files made when it was saved
  (rotation may delete the checkpoint later; the links keep the files), or `Trainer.save_model`'s output where no
  checkpoint is saved at that step. No folder for the base model.
- `step-<N>/request.json`: `Request`, written last and atomically: its presence means the weights are complete.
- `step-<N>/done.json`: `Done`, written by the evaluator after the step's row: evaluated, or failed with the reason,
  and the row itself (what training logs).
- `training-ended`: written by training when it stops queueing (`completed`, or `stopped` for a preemption's stop);
  an evaluator that follows the run exits once it exists and nothing is pending. Queueing again removes it.
- `evaluator.lock` (one evaluator per run: `beside/lock.py`), `evaluator.log` (the local evaluator's output) and the
  vLLM engine's scratch folders.

A step is queued while it has a request and no done mark, then done (`evaluated` or `failed`). Requests of steps past
the step a resumed run starts from belong to the interrupted run: `drop_after` removes them, as
`RunFiles.continue_from` drops their rows.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from probdiff_callback.core.config import DEFAULT_SUBDIR
from probdiff_callback.core.json_form import JsonRecord
from probdiff_callback.core.metric import is_finite
from probdiff_callback.core.queries import Query, load_queries
from probdiff_callback.runs.run_files import EvaluationKind, HistoryRow, probdiff_dir, write_json, write_jsonl
from probdiff_callback.runtime import held_lock
from probdiff_callback.runtime.held_lock import LockHeld

QUEUE_DIR = "queue"
SPEC_FILE = "evaluator.json"
QUERIES_FILE = "queries.jsonl"
REQUEST_FILE = "request.json"
DONE_FILE = "done.json"
WEIGHTS_DIR = "weights"
ENDED_FILE = "training-ended"
LOCK_FILE = "evaluator.lock"
LOG_FILE = "evaluator.log"
# What an evaluator needs of a checkpoint (the adapter or the whole model); `model*.safetensors` shards besides
CHECKPOINT_WEIGHT_FILES = (
    "adapter_model.safetensors",
    "adapter_model.bin",
    "adapter_config.json",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "config.json",
    "generation_config.json",
)


M = TypeVar("M", bound=JsonRecord)
UNKNOWN_HOLDER = {"host": "?", "pid": "?", "started": "?", "command": "?"}


class NotQueued(FileNotFoundError):
    """The run has no evaluator spec: it was not trained with async_eval."""


@dataclass(kw_only=True)
class EvaluatorSpec(JsonRecord):
    """What the evaluator needs to evaluate as the loop does: written once per training start."""

    model: str  # the base model's folder (or a preset name `models` resolves): the weights every request starts from
    dtype: str | None  # the dtype the training loaded the model in (None: the model's own)
    trust_remote_code: bool = False
    config: dict[str, Any] = field(default_factory=dict)  # ProbDiffConfig's fields, as `dataclasses.asdict` gives
    queries: str = QUERIES_FILE  # relative to the queue folder
    output_dir: str = ""  # the run directory, as training named it
    started_at_step: int = 0  # the step this training start resumed from (0: a fresh run)
    lora_rank: int | None = None  # the adapters' LoRA rank (vLLM's LoRA slots); None: all weights are trained
    training_pid: int | None = None  # the training command that started the evaluator (None: started by you)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class Request(JsonRecord):
    """One step to evaluate: the row training would have written, less what the evaluation fills in."""

    global_step: int
    epoch: float | None
    kind: EvaluationKind
    base_model: bool = False
    checkpoint: str | None = None  # the checkpoint the Trainer saved at that step (it may be rotated away later)
    weights: str | None = WEIGHTS_DIR  # relative to the step's folder; None for the base model
    eval_loss: float | None = None  # the Trainer's eval loss at that step, where it computed one
    eval_losses: list[float | None] | None = None  # each held-out conversation's, for the alarm's paired test
    last: bool = False  # training's last step: training queues nothing after it, and its cores come free
    failed: str | None = None  # nothing to evaluate: the evaluator records the step as failed, for this reason
    queued_at: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_row(cls, row: HistoryRow, eval_losses: Sequence[float] | None, last: bool = False) -> Request:
        """The request for the step of `row` (training's side): its weights in the step's folder, none for the base
        model; the eval losses as JSON holds them (null for NaN)."""
        return cls(
            global_step=row.global_step,
            epoch=row.epoch,
            kind=row.kind,
            base_model=row.base_model,
            checkpoint=row.checkpoint,
            weights=None if row.base_model else WEIGHTS_DIR,
            eval_loss=row.eval_loss if is_finite(row.eval_loss) else None,
            eval_losses=None if eval_losses is None else [float(v) if is_finite(v) else None for v in eval_losses],
            last=last,
        )

    def row(self) -> HistoryRow:
        """The step's row as training would have begun it (the evaluator's side), for the evaluation to fill in."""
        loss = math.nan if self.eval_loss is None else float(self.eval_loss)
        return HistoryRow(self.global_step, self.epoch, self.kind, self.base_model, self.checkpoint, eval_loss=loss)

    def eval_losses_or_nan(self) -> list[float] | None:
        return None if self.eval_losses is None else [math.nan if v is None else v for v in self.eval_losses]


@dataclass(kw_only=True)
class Done(JsonRecord):
    """The evaluator's mark on a request: the row is written (`evaluated` or `failed`, with `error`)."""

    global_step: int
    status: Literal["evaluated", "failed"]
    error: str | None = None
    seconds: float | None = None
    finished_at: float = field(default_factory=time.time)
    row: dict[str, Any] | None = None  # the step's history row as written (None: a mark written before it was kept)
    extra: dict[str, Any] = field(default_factory=dict)


def read_message(kind: type[M], path: Path, remedy: str) -> M:
    """A queue file as its message; a ValueError naming the file, what is wrong and `remedy`."""
    try:
        return kind.from_file(path)
    except OSError as err:
        raise ValueError(f"{path}: not readable ({err.strerror}); {remedy}") from None
    except ValueError as err:
        raise ValueError(f"{err}; {remedy}") from None


def query_row(query: Query) -> dict[str, Any]:
    """A query as `queries.jsonl` holds it: a row `load_queries` reads back as the same `Query`."""
    return {"id": query.id, "query": query.text, "category": query.category, "reference": query.reference}


def link_files(source: Path, target: Path, names: Iterable[str]) -> list[str]:
    """Hard links in `target` to `source`'s files `names` (a copy where the file system refuses links): what a
    checkpoint's rotation then deletes stays readable here. Returns the names linked."""
    linked = []
    for name in names:
        if (source / name).is_file():
            try:
                os.link(source / name, target / name)
            except OSError:  # another file system, or links not allowed
                shutil.copy2(source / name, target / name)
            linked.append(name)
    return linked


def checkpoint_weight_files(checkpoint: Path) -> list[str]:
    """The names of a checkpoint's weight and config files (an adapter, or the whole model and its shards)."""
    names = set(os.listdir(checkpoint)) if checkpoint.is_dir() else set()
    shards = {n for n in names if n.startswith("model") and n.endswith(".safetensors")}
    return sorted((names & set(CHECKPOINT_WEIGHT_FILES)) | shards)


class Queue:
    """One run's queue folder, `OUTPUT_DIR/<subdir>/queue`."""

    def __init__(self, run_dir: str | os.PathLike, subdir: str = DEFAULT_SUBDIR) -> None:
        self.run_dir, self.subdir = Path(run_dir), subdir
        self.folder = probdiff_dir(run_dir, subdir) / QUEUE_DIR

    @classmethod
    def existing(cls, run_dir: str | os.PathLike, subdir: str = DEFAULT_SUBDIR) -> Queue:
        """The queue of a run trained with async_eval, or `NotQueued` saying why the run has none."""
        queue = cls(run_dir, subdir)
        if not queue.spec_path.is_file():
            raise NotQueued(
                f"{queue.spec_path}: not found: {run_dir} was not started with probdiff.async_eval=true (only such a "
                "run queues its evaluations for `probdiff watch`; its history is written by the training loop). "
                f"`probdiff eval --adapter {run_dir}/checkpoint-N` evaluates one checkpoint"
            )
        return queue

    def __repr__(self) -> str:
        return f"Queue({str(self.folder)!r})"

    @property
    def spec_path(self) -> Path:
        return self.folder / SPEC_FILE

    @property
    def lock_path(self) -> Path:
        return self.folder / LOCK_FILE

    @property
    def log_path(self) -> Path:
        return self.folder / LOG_FILE

    def _step_dir(self, step: int) -> Path:
        return self.folder / f"step-{step:08d}"  # zero-padded: the folders sort in step order

    # ---- training's side ----
    def write_spec(self, spec: EvaluatorSpec, queries: Iterable[Query | Mapping[str, Any]]) -> None:
        """The spec and its queries (`Query`s, or rows as a query file holds them), the queries first."""
        self.folder.mkdir(parents=True, exist_ok=True)
        rows = [query_row(q) if isinstance(q, Query) else dict(q) for q in queries]
        write_jsonl(self.folder / spec.queries, rows)
        write_json(self.spec_path, spec.to_json())

    def weights_path(self, step: int) -> Path:
        """Where the step's weights go before its request is written."""
        return self._step_dir(step) / WEIGHTS_DIR

    def empty_weights(self, step: int) -> Path:
        """The step's weights folder, made empty."""
        folder = self.weights_path(step)
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        return folder

    def link_checkpoint(self, step: int, checkpoint: str | os.PathLike) -> Path:
        """The step's weights folder holding hard links to the checkpoint's weight files; returns the folder."""
        folder, checkpoint = self.empty_weights(step), Path(checkpoint)
        link_files(checkpoint, folder, checkpoint_weight_files(checkpoint))
        return folder

    def submit(self, request: Request) -> None:
        """Queue `request` (its weights already in place): the request file is written last, atomically. Training
        queues again, so it has not ended; a step queued again (a resumed run) is evaluated again."""
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / ENDED_FILE).unlink(missing_ok=True)
        path = self._step_dir(request.global_step) / REQUEST_FILE
        (path.parent / DONE_FILE).unlink(missing_ok=True)
        write_json(path, request.to_json())

    def drop_after(self, step: int) -> list[int]:
        """A run (re)started from `step` (-1: a fresh run): the requests of later steps are the interrupted run's, and
        training has not ended. Returns the steps dropped."""
        (self.folder / ENDED_FILE).unlink(missing_ok=True)
        dropped = []
        for folder in sorted(self.folder.glob("step-*")):
            if int(folder.name.removeprefix("step-")) > step:
                shutil.rmtree(folder, ignore_errors=True)
                dropped.append(int(folder.name.removeprefix("step-")))
        return dropped

    def mark_ended(self, how: Literal["completed", "stopped"]) -> None:
        """Tell the evaluator that training queues nothing more."""
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / ENDED_FILE).write_text(how + "\n", encoding="utf-8")

    # ---- the evaluator's side (and training's, reading what is done) ----
    def read_spec(self) -> EvaluatorSpec:
        return read_message(EvaluatorSpec, self.spec_path, "remove the queue folder to start it afresh")

    def read_queries(self, spec: EvaluatorSpec) -> list[Query]:
        """The held-out queries of the spec, in the loop's order."""
        return load_queries(self.folder / spec.queries)

    def ended(self) -> str | None:
        """How training ended (`completed` or `stopped`), or None while it has not."""
        try:
            return (self.folder / ENDED_FILE).read_text(encoding="utf-8").strip() or "completed"
        except FileNotFoundError:
            return None

    def requests(self) -> list[Request]:
        """Every complete request, in step order."""
        return [
            self._read_request(folder / REQUEST_FILE)
            for folder in sorted(self.folder.glob("step-*"))
            if (folder / REQUEST_FILE).is_file()
        ]

    def pending(self) -> list[Request]:
        """The requests not done yet, in step order: what the evaluator takes next."""
        return [r for r in self.requests() if not (self._step_dir(r.global_step) / DONE_FILE).is_file()]

    def done(self, step: int) -> Done | None:
        """The step's done mark; None while it is queued (or was never queued)."""
        path = self._step_dir(step) / DONE_FILE
        return read_message(Done, path, "remove the step's folder to drop it") if path.is_file() else None

    def weights_of(self, request: Request) -> Path | None:
        """The request's weights folder; None for the base model (or a request with nothing to evaluate)."""
        if request.base_model or request.weights is None:
            return None
        return self._step_dir(request.global_step) / request.weights

    def is_current(self, request: Request) -> bool:
        """Whether `request` is still the step's: a training started again meanwhile drops it, and may queue the step
        anew (its new weights are evaluated next)."""
        path = self._step_dir(request.global_step) / REQUEST_FILE
        try:
            return self._read_request(path).queued_at == request.queued_at
        except ValueError:  # gone
            return False

    def mark_done(self, mark: Done, keep_weights: bool = False) -> None:
        """The request is finished (its row written before this): its weights are removed unless `keep_weights`."""
        write_json(self._step_dir(mark.global_step) / DONE_FILE, mark.to_json())
        if not keep_weights:
            shutil.rmtree(self._step_dir(mark.global_step) / WEIGHTS_DIR, ignore_errors=True)

    @staticmethod
    def _read_request(path: Path) -> Request:
        return read_message(Request, path, "remove the step's folder to drop it")


# ---- who evaluates the queue (the evaluator holds `evaluator.lock`: watch/lock.py) ----
def evaluator_holder(queue: Queue) -> dict | None:
    """Who holds the queue's evaluator lock ({host, pid, started, command}), or None when no live evaluator does (a
    missing lock file is not created)."""
    try:
        held_lock.raise_if_held(queue.lock_path)
    except LockHeld as busy:
        return busy.holder or dict(UNKNOWN_HOLDER)
    return None


def describe_holder(holder: dict) -> str:
    """`host H, pid P, started S (`command`)`: who holds the lock, as messages name it."""
    started = holder.get("started")
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {started} (`{holder.get('command')}`)"
