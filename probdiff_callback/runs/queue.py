"""The evaluations queued beside training (`async_eval`): requests in the run directory, one evaluator taking them.

Training writes requests and never waits for them; the evaluator (`probdiff watch RUN_DIR`, started by training or by
you) takes them in step order, evaluates each with the loop's code, seeds and settings, writes the step's row and
records through `RunFiles` (it is the history's one writer while the queue is in use) and marks the request done.
Everything lives under `OUTPUT_DIR/<subdir>/queue/`:

- `evaluator.json`: `EvaluatorSpec`, written by training when it starts: what an evaluator needs to rebuild the
  loop's evaluation (the base model's folder, dtype, the ProbDiff settings, the held-out queries file, the step the
  run started from).
- `queries.jsonl`: the held-out queries the loop would evaluate (the selected subset, in its order).
- `step-<N>/weights/`: the weights to evaluate: hard links to the checkpoint's weight files made when it was saved
  (rotation may delete the checkpoint later; the links keep the files), or `Trainer.save_model`'s output where no
  checkpoint is saved at that step. No folder for the base model (`base_model`).
- `step-<N>/request.json`: `Request`, written last and atomically: its presence means the weights are complete.
- `step-<N>/done.json`: `Done`, written by the evaluator after the step's row: evaluated, or failed with the reason.
- `evaluator.lock`: held by the one evaluator of the run (`filelock`, `runs/evaluator_lock.py`); its text names the
  holder.
- `training-ended`: written by training when it stops queueing (its text: `completed`, or `stopped` for a preemption's
  stop); an evaluator that follows the run exits once it exists and nothing is pending. A training start removes it.

A request is pending while it has no `done.json`. Requests of steps past the step a resumed run starts from belong
to the interrupted run: `drop_after` removes them, as `RunFiles.continue_from` drops their rows.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from probdiff_callback.core.queries import Query, load_queries
from probdiff_callback.runs.run_files import EvaluationKind, probdiff_dir, write_json

QUEUE_DIR = "queue"
SPEC_FILE = "evaluator.json"
QUERIES_FILE = "queries.jsonl"
REQUEST_FILE = "request.json"
DONE_FILE = "done.json"
WEIGHTS_DIR = "weights"
LOCK_FILE = "evaluator.lock"
ENDED_FILE = "training-ended"


def queue_dir(output_dir: str | os.PathLike, subdir: str) -> Path:
    return probdiff_dir(output_dir, subdir) / QUEUE_DIR


def step_dir(queue: Path, step: int) -> Path:
    return queue / f"step-{step:08d}"  # zero-padded: the folders sort in step order


@dataclass(kw_only=True)
class EvaluatorSpec:
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
class Request:
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
    queued_at: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class Done:
    """The evaluator's mark on a request: the row is written (`evaluated` or `failed`, with `error`)."""

    global_step: int
    status: Literal["evaluated", "failed"]
    error: str | None = None
    seconds: float | None = None
    finished_at: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)


def _from_json(kind, value: Mapping[str, Any]):
    """A dataclass from its JSON form; keys this version does not know go to `extra`, kept as they were."""
    known = {name for name in kind.__dataclass_fields__ if name != "extra"}
    made = kind(**{k: v for k, v in value.items() if k in known})
    made.extra = {k: v for k, v in value.items() if k not in known}
    return made


def _to_json(value) -> dict[str, Any]:
    data = asdict(value)
    extra = data.pop("extra")
    return {**data, **extra}


def read_json_file(kind, path: Path):
    try:
        return _from_json(kind, json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(
            f"{path}: not a readable {kind.__name__} ({err}); remove the step's folder to drop it"
        ) from err


def query_row(query: Query) -> dict[str, Any]:
    """A query as `queries.jsonl` holds it: a row `load_queries` reads back as the same `Query`."""
    return {"id": query.id, "query": query.text, "category": query.category, "reference": query.reference}


# ---- training's side ----
def write_spec(queue: Path, spec: EvaluatorSpec, queries: Iterable[Query | Mapping[str, Any]]) -> None:
    """The spec and its queries (`Query`s, or rows as a query file holds them), the queries first."""
    from probdiff_callback.runs.run_files import write_jsonl

    queue.mkdir(parents=True, exist_ok=True)
    rows = [query_row(q) if isinstance(q, Query) else dict(q) for q in queries]
    write_jsonl(queue / spec.queries, rows)
    write_json(queue / SPEC_FILE, _to_json(spec))


def weights_dir(queue: Path, step: int) -> Path:
    """Where the step's weights go before its request is written (made empty)."""
    folder = step_dir(queue, step) / WEIGHTS_DIR
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


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


def submit(queue: Path, request: Request) -> Path:
    """Queue `request` (its weights already in place): the request file is written last, atomically."""
    path = step_dir(queue, request.global_step) / REQUEST_FILE
    (path.parent / DONE_FILE).unlink(missing_ok=True)  # a step queued again (a resumed run) is evaluated again
    write_json(path, _to_json(request))
    return path


def drop_after(queue: Path, step: int) -> list[int]:
    """A run resumed from `step`: the requests of later steps are the interrupted run's. Returns their steps."""
    dropped = []
    for folder in sorted(queue.glob("step-*")):
        later = int(folder.name.removeprefix("step-")) > step
        if later:
            shutil.rmtree(folder, ignore_errors=True)
            dropped.append(int(folder.name.removeprefix("step-")))
    return dropped


# ---- the evaluator's side (and training's, reading what is done) ----
def read_spec(queue: Path) -> EvaluatorSpec:
    return read_json_file(EvaluatorSpec, queue / SPEC_FILE)


def read_queries(queue: Path, spec: EvaluatorSpec) -> list[Query]:
    """The held-out queries of the spec, in the loop's order."""
    return load_queries(queue / spec.queries)


def training_ended(queue: Path) -> str | None:
    """How training ended (`completed` or `stopped`), or None while it has not."""
    try:
        return (queue / ENDED_FILE).read_text(encoding="utf-8").strip() or "completed"
    except FileNotFoundError:
        return None


def requests(queue: Path) -> list[Request]:
    """Every complete request, in step order."""
    return [
        read_json_file(Request, folder / REQUEST_FILE)
        for folder in sorted(queue.glob("step-*"))
        if (folder / REQUEST_FILE).is_file()
    ]


def done(queue: Path, step: int) -> Done | None:
    path = step_dir(queue, step) / DONE_FILE
    return read_json_file(Done, path) if path.is_file() else None


def pending(queue: Path) -> list[Request]:
    """The requests not done yet, in step order: what the evaluator takes next."""
    return [r for r in requests(queue) if not (step_dir(queue, r.global_step) / DONE_FILE).is_file()]


def mark_done(queue: Path, mark: Done, keep_weights: bool = False) -> None:
    """The request is finished (its row written before this): its weights are removed unless `keep_weights`."""
    write_json(step_dir(queue, mark.global_step) / DONE_FILE, _to_json(mark))
    if not keep_weights:
        shutil.rmtree(step_dir(queue, mark.global_step) / WEIGHTS_DIR, ignore_errors=True)
