"""The evaluation beside training against the loop's, as whole `train/sft.py` commands (issue 33's table).

The smollm2 summarization preset (40 steps of 4 documents, ProbDiff at step 0 and every 20 steps) on the paper's XSum
split (`data/prepare.py summarization --split-test 200`), N held-out documents per evaluation, one torch thread for
training and one for the evaluator:

  (a) ProbDiff off: no step evaluated (baseline, at_end off, `every` past the run; the eval loss stays, and selects)
  (b) in the loop: training waits for each evaluation
  (c) beside training: `probdiff.async_eval=true`, the evaluator on a thread of its own

(a) and (b) run at the same time (one core each), then (c) alone (its two processes on the two cores): every
process has one core to itself (`--sides c` runs (c) alone: a rerun of one part). For each: the whole command's wall
time, the time until the bar reaches the last step, the evaluator's busy time (the history's seconds per evaluation),
the 95% interval at the last step.

  (l) (c)'s last evaluation again, as its evaluator takes it once training has ended (training's core idle), in a
      copy of (c)'s run each: `probdiff watch --helpers-after-training 1` (a helper process evaluates a share on the
      freed core), then with 0 (the evaluator alone); each one's seconds, and its records against (c)'s own.

    python bench/bench_async.py [--n-queries 32] [--sides abcl] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _side_by_side import PAPER_DATA, ROOT, load_average, prepare_model

from probdiff_callback.runs.queue import Queue
from probdiff_callback.runs.run_files import read_history

OFF = ["probdiff.baseline=false", "probdiff.at_end=false", "probdiff.every=1000", "metric_for_best_model=eval_loss"]
# the smollm2 summarization preset evaluates beside training: (a) and (b) say the loop's way themselves
LOOP, BESIDE = "probdiff.async_eval=false", "probdiff.async_eval=true"
SIDES = {"a: ProbDiff off": [*OFF, LOOP], "b: in the loop": [LOOP], "c: beside training": [BESIDE]}


class Timed:
    """A command started now; its output read as it comes, the time the bar first shows `last_step` noted."""

    def __init__(self, command: list[str], log: Path, last_step: int, env: dict[str, str]) -> None:
        self.started = time.monotonic()
        self.last_step_at: float | None = None
        self.log = log
        self.bar = re.compile(rf"\|\s*{last_step}/{last_step} \[")
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        tail = ""
        with open(self.log, "wb") as log:
            for chunk in iter(lambda: self.process.stdout.read1(65536), b""):
                log.write(chunk)
                log.flush()  # the log shows where a run is while it runs
                tail = (tail + chunk.decode("utf-8", "replace"))[-400:]
                if self.last_step_at is None and self.bar.search(tail):
                    self.last_step_at = time.monotonic() - self.started

    def wait(self) -> float:
        code = self.process.wait()
        self.reader.join()
        if code != 0:
            sys.exit(f"failed ({code}): see {self.log}")
        return time.monotonic() - self.started


def figures(run_dir: Path, wall: float, last_step: float | None) -> dict:
    rows = [r for r in read_history(run_dir / "probdiff" / "history.jsonl") if not r.failed]
    last = max(rows, key=lambda r: r.global_step) if rows else None
    return {
        "wall_s": round(wall, 1),
        "last_step_s": None if last_step is None else round(last_step, 1),
        "evaluations": len(rows),
        "evaluator_busy_s": round(sum(r.seconds for r in rows), 1),
        "steps": [r.global_step for r in rows],
        "last_interval": None if last is None else [round(x, 3) for x in last.summary.confidence_ci],
        "last_confidence": None if last is None else round(last.summary.confidence, 3),
    }


def records_equal(one: Path, other: Path) -> dict[int, bool]:
    """Step -> whether the two runs' records of that step are the same bytes (the steps both evaluated)."""
    steps = {r.global_step: r.records for r in read_history(one / "probdiff" / "history.jsonl") if r.records}
    theirs = {r.global_step: r.records for r in read_history(other / "probdiff" / "history.jsonl") if r.records}
    return {
        step: (one / "probdiff" / path).read_bytes() == (other / "probdiff" / theirs[step]).read_bytes()
        for step, path in sorted(steps.items())
        if step in theirs
    }


def last_step_again(run_dir: Path, work: Path, helpers: int, env: dict[str, str]) -> dict:
    """(c)'s last step queued again in a copy of its run (its weights linked from its checkpoint) and evaluated by
    `probdiff watch` with `helpers` helper processes: the whole command's seconds, the evaluation's (its log line),
    and whether the records are (c)'s byte for byte."""
    copy = work / f"c-last-step-{helpers}-helpers"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(run_dir, copy)
    queue = Queue(copy)
    request = max(queue.requests(), key=lambda r: r.global_step)
    request.checkpoint = str(copy / Path(request.checkpoint).name)
    queue.link_checkpoint(request.global_step, request.checkpoint)
    queue.submit(request)  # pending again; it was training's last (`last`): the watch may use the freed core
    command = [sys.executable, "-m", "probdiff_callback.cli", "watch", str(copy), "--no-follow",
               "--helpers-after-training", str(helpers)]  # fmt: skip
    log = work / f"{copy.name}.log"
    started = time.monotonic()
    with open(log, "wb") as sink:
        subprocess.run(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, check=True)
    wall = time.monotonic() - started
    said = re.search(rf"step {request.global_step}: \d+ queries in ([\d.]+)s", log.read_text())
    records = f"probdiff/step-{request.global_step}/records.jsonl"
    return {
        "helpers": helpers,
        "wall_s": round(wall, 1),
        "evaluation_s": float(said.group(1)) if said else None,
        "records_equal_c": (copy / records).read_bytes() == (run_dir / records).read_bytes(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-queries", type=int, default=32, help="held-out documents per evaluation [32]")
    parser.add_argument("--max-steps", type=int, default=40, help="training steps [40, the preset's]")
    parser.add_argument("--work", type=Path, default=None, help="where the data and runs go [a temporary folder]")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    parser.add_argument(
        "--sides", default="abc", help="which to run: a and b side by side, then c, then l (needs c's run) [abc]"
    )
    options = parser.parse_args()

    work = options.work or Path(tempfile.mkdtemp(prefix="bench_async_"))
    data = work / "data"
    if not (data / "summarization" / "heldout.jsonl").is_file():
        prepare = [sys.executable, "data/prepare.py", "summarization", "--source", str(PAPER_DATA), "--split-test",
                   "200", "--out", str(data)]  # fmt: skip
        subprocess.run(prepare, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    prepare_model("smollm2")
    common = [
        sys.executable, "train/sft.py", "recipe=summarization", "model=smollm2", "threads=1",
        f"train_file={data / 'summarization/train.jsonl'}", f"heldout_file={data / 'summarization/heldout.jsonl'}",
        f"max_steps={options.max_steps}", f"probdiff.n_queries={options.n_queries}", "probdiff.evaluator_threads=1",
        "report_to=wandb",
    ]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

    def start(name: str) -> tuple[Timed, Path]:
        run_dir = work / name.split(":")[0]
        if run_dir.exists():  # an earlier run of this bench: the run starts afresh
            print(f"removing {run_dir} (an earlier run of this bench)", flush=True)
            shutil.rmtree(run_dir)
        command = [*common, f"output_dir={run_dir}", *SIDES[name]]
        print(f"{name}: {' '.join(command[1:])}", flush=True)
        return Timed(command, work / f"{run_dir.name}.log", options.max_steps, env), run_dir

    results, loads = {}, [load_average()]
    first = {name: start(name) for name in SIDES if name[0] in "ab" and name[0] in options.sides}  # one core each
    for name, (timed, run_dir) in first.items():
        results[name] = figures(run_dir, timed.wait(), timed.last_step_at)
    if "c" in options.sides:
        loads.append(load_average())
        name = list(SIDES)[2]
        timed, run_dir = start(name)
        results[name] = figures(run_dir, timed.wait(), timed.last_step_at)
    loads.append(load_average())
    last_step = []
    if "l" in options.sides:
        last_step = [last_step_again(work / "c", work, helpers, env) for helpers in (1, 0)]
        loads.append(load_average())

    print(f"\n{options.n_queries} documents per evaluation, {options.max_steps} steps; load (1 min) at the start, "
          f"between the parts, at the end: {', '.join(loads)}")  # fmt: skip
    print(f"{'':22} {'wall':>8} {'last step':>10} {'evaluator busy':>15} {'evaluations':>12}  95% interval, last step")
    for name, r in results.items():
        interval = "-" if r["last_interval"] is None else f"{r['last_confidence']:.1%} [{r['last_interval'][0]:.1%}, " \
                                                             f"{r['last_interval'][1]:.1%}]"  # fmt: skip
        print(f"{name:22} {r['wall_s']:7.0f}s {r['last_step_s'] or float('nan'):9.0f}s "
              f"{r['evaluator_busy_s']:14.0f}s {r['evaluations']:12d}  {interval}")  # fmt: skip
    ratios = {}
    if len(results) == len(SIDES):
        a, b, c = results.values()
        ratios = {
            "c last step / a last step": c["last_step_s"] / a["last_step_s"],
            "c whole / max(a whole, c evaluator busy)": c["wall_s"] / max(a["wall_s"], c["evaluator_busy_s"]),
            "c whole / b whole": c["wall_s"] / b["wall_s"],
        }
    for what, ratio in ratios.items():
        print(f"{what}: {ratio:.2f}")
    same = records_equal(work / "b", work / "c") if {"b", "c"} <= set(options.sides) else {}
    if same:
        steps = ", ".join(f"step {step} {'equal' if equal else 'DIFFER'}" for step, equal in same.items())
        print(f"records of (b) and (c), byte for byte: {steps}")
    for again in last_step:
        print(f"(l) c's last evaluation again, {again['helpers']} helper(s): {again['evaluation_s']}s (the command "
              f"{again['wall_s']:.0f}s), records {'equal to' if again['records_equal_c'] else 'NOT'} c's")  # fmt: skip
    if len(last_step) == 2 and all(again["evaluation_s"] for again in last_step):
        print(f"(l) without / with the helper: {last_step[1]['evaluation_s'] / last_step[0]['evaluation_s']:.2f}")
    if options.json:
        figures_json = {"results": results, "ratios": ratios, "records_equal": same, "last_step": last_step,
                        "loads": loads}  # fmt: skip
        options.json.write_text(json.dumps(figures_json, indent=1) + "\n")
    print(f"runs and logs: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
