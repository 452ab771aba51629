"""A stand-in evaluator for the training side's tests whose outcome a test chooses: `probdiff watch` on `tiny` gives
whatever confidences the model earns, so a test of "step 2 is the best everywhere" or of an evaluator that dies at a
given step cannot steer it. It speaks the queue's contract (`runs/queue.py`) and nothing more: it takes the run's
evaluator lock, reads the spec and the queries, takes the requests in step order, checks each request's weights as an
evaluator would load them (`weights_problem`), writes the step's row and made-up records through `RunFiles` (no
model: each step's confidence comes from `FAKE_CONFIDENCES`) and marks the request done; it exits once
`training-ended` is there and nothing is pending, or on SIGTERM (the step in progress stays pending). Started before
training, it waits for the spec. The tests with the real evaluator: tests/test_watch.py, tests/test_beside.py's
schedule test and tests/e2e/test_async_eval.py.

    python tests/_fake_evaluator.py RUN_DIR [--started-by-training] [--subdir probdiff]

Its behaviour for a test, from the environment:
- `FAKE_CONFIDENCES`: JSON {"step": confidence}; 0.5 where a step is not named. The step's records are one per query,
  that share of them confident (d 0.2, else -0.3).
- `FAKE_ROUGE_L`: JSON {"step": share}: that share of the step's queries (the first ones) get ROUGE-L 100 against their
  reference, the others 0, in their records and the step's summary (an independent measure for the guard); none where
  a step is not named.
- `FAKE_SECONDS`: seconds each evaluation takes (default 0).
- `FAKE_DIE_AT`: a step at which the evaluator exits with status 1 before writing anything, once per marker file
  (`FAKE_DIE_MARKER`, created at the first death), or every time without a marker.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from _records import make_record  # noqa: E402
from filelock import FileLock, Timeout  # noqa: E402

from probdiff_callback.core.config import ProbDiffConfig  # noqa: E402
from probdiff_callback.core.metric import compare_to_base, summary_of  # noqa: E402
from probdiff_callback.core.records import ReferenceSummary  # noqa: E402
from probdiff_callback.runs import queue as q
from probdiff_callback.runs.checkpoints import weights_problem  # noqa: E402
from probdiff_callback.runs.queue import Queue  # noqa: E402
from probdiff_callback.runs.run_files import RunFiles  # noqa: E402
from probdiff_callback.runtime.parent import set_parent_death_signal  # noqa: E402


def records_for(queries, confidence: float, delta: float, rouge_l: float | None = None):
    confident = round(confidence * len(queries))
    right = None if rouge_l is None else round(rouge_l * len(queries))
    return [
        make_record(
            query.id,
            0.2 if i < confident else -0.3,
            delta=delta,
            query=query.text,
            category=query.category,
            ref=None if right is None else {"rougeL": 100.0 if i < right else 0.0},
        )  # fmt: skip
        for i, query in enumerate(queries)
    ]


def reference_of(records) -> ReferenceSummary | None:
    scores = [r.ref["rougeL"] for r in records if r.ref]
    if not scores:
        return None
    return ReferenceSummary(
        overall={"rougeL": sum(scores) / len(scores)}, n_scored={"rougeL": len(scores)}, by_category={}
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--started-by-training", action="store_true")
    parser.add_argument("--subdir", default="probdiff")
    options = parser.parse_args()
    if options.started_by_training:
        set_parent_death_signal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    queue = Queue(options.run_dir, options.subdir)
    while not queue.spec_path.is_file():  # started before training wrote its spec
        time.sleep(0.2)
    lock = FileLock(queue.lock_path, timeout=0, thread_local=False, fallback_to_soft=False, preserve_lock_file=True)
    try:
        lock.acquire()
    except Timeout:
        print("another evaluator holds the queue", flush=True)
        return 2
    spec = queue.read_spec()
    config = ProbDiffConfig.from_values(spec.config, "spec")
    queries = queue.read_queries(spec)
    files = RunFiles(options.run_dir, options.subdir)
    files.continue_from(sys.maxsize)  # every row: training dropped the stale ones when it started
    confidences = {int(k): v for k, v in json.loads(os.environ.get("FAKE_CONFIDENCES", "{}")).items()}
    rouge_l = {int(k): v for k, v in json.loads(os.environ.get("FAKE_ROUGE_L", "{}")).items()}
    seconds = float(os.environ.get("FAKE_SECONDS", "0"))
    die_at = int(os.environ.get("FAKE_DIE_AT", "-1"))
    marker = Path(os.environ["FAKE_DIE_MARKER"]) if os.environ.get("FAKE_DIE_MARKER") else None
    print(
        f"fake evaluator pid {os.getpid()}: {len(queries)} queries, started at step {spec.started_at_step}", flush=True
    )
    while True:
        ended = queue.ended() is not None
        pending = queue.pending()
        if not pending:
            if ended:
                return 0
            time.sleep(0.2)
            continue
        request = pending[0]
        step = request.global_step
        if step == die_at and (marker is None or not marker.exists()):
            if marker is not None:
                marker.touch()
            print(f"dying at step {step}", flush=True)
            return 1
        time.sleep(seconds)
        started = time.time()
        folder = queue.weights_of(request)
        problem = None if folder is None else weights_problem(folder)
        row = request.row()
        records = None
        if request.failed is not None:
            row.error = request.failed
        elif problem is not None:
            row.error = f"the weights of step {step} are gone ({problem})"
        else:
            records = records_for(queries, confidences.get(step, 0.5), config.delta, rouge_l.get(step))
            row.summary = summary_of(records, config.delta, config.sweep)
            row.summary.reference = reference_of(records)
            row.vs_base = (
                None if request.base_model else compare_to_base(records, files.baseline_records(), config.delta)
            )
        row.seconds = seconds
        files.add(row, records, request.eval_losses_or_nan())
        status = "failed" if row.error is not None else "evaluated"
        mark = q.Done(global_step=step, status=status, error=row.error, seconds=time.time() - started + seconds)
        mark.row = row.to_json()  # the row reaches training in its done mark, as the real evaluator's does
        queue.mark_done(mark)
        print(f"step {step}: {status}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
