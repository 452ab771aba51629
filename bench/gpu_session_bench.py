"""bench/gpu.py for a device session with a time limit: the same sections, the same rows, written as each one ends.

    python bench/gpu_session_bench.py --md TABLE.md --json FIGURES.json --budget-s 270 [bench/gpu.py's options]

It measures what `python bench/gpu.py OPTIONS --json FIGURES.json > TABLE.md` measures, in the same order (the
device, the model, each decoding path, vLLM, the decode batches, the LoRA and QLoRA steps), with the kit's own
functions, and rewrites TABLE.md (the table and notes) and FIGURES.json (gpu.py's --json, plus `complete`,
`elapsed_s` and `skipped_for_time`) after each decoding path, each decode batch and each section: a session killed
by its time limit keeps what was measured. `--budget-s`: a path or batch that would not end within it, judged by
the time the last one took, is skipped with a row saying so, keeping `--reserve-s` for the LoRA step, and one that
runs past it is stopped (a `failed` row: TimeoutError); the session cuts queries (`--queries`) so that nothing needs
skipping.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import signal
import sys
import time
from pathlib import Path

import gpu  # noqa: E402
import torch  # noqa: E402
from gpu_kit import workload as work  # noqa: E402
from gpu_kit.device import guarded, hardware_section  # noqa: E402
from gpu_kit.evaluation import (  # noqa: E402
    decode_batch_section,
    evaluation_figures,
    floors_of,
    measure,
    warm_up,
)
from gpu_kit.floor import ModelCost  # noqa: E402
from gpu_kit.paths import PATHS, hf_paths  # noqa: E402
from gpu_kit.report import Figure, markdown_table, say  # noqa: E402
from gpu_kit.training import training_section  # noqa: E402
from gpu_kit.vllm_path import vllm_section  # noqa: E402

from probdiff_callback.models.tokenizer import load_qwen_tokenizer  # noqa: E402

SKIPPED = "skipped for time"


class Report:
    """The figures so far, written to the table and the JSON after each step of the run."""

    def __init__(self, md: Path, json_path: Path, args: argparse.Namespace, started: float) -> None:
        self.md, self.json, self.args, self.started = md, json_path, args, started
        self.figures: list[Figure] = []
        self.skipped: list[str] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def add(self, *figures: Figure, complete: bool = False) -> None:
        self.figures += figures
        notes = list(gpu.NOTES)
        if self.skipped:
            notes.append(f"Skipped for the session's time ({self.args.budget_s:.0f} s): {', '.join(self.skipped)}.")
        if not complete:
            notes.append(f"Incomplete: written after {self.elapsed():.0f} s; the run went on or was stopped.")
        table = markdown_table(self.figures) + "\n\n" + "\n".join(f"- {note}" for note in notes) + "\n"
        written = {
            "arguments": vars(self.args),
            "figures": [dataclasses.asdict(f) for f in self.figures],
            "notes": notes,
            "complete": complete,
            "elapsed_s": round(self.elapsed(), 1),
            "skipped_for_time": self.skipped,
        }
        for path, text in ((self.md, table), (self.json, json.dumps(written, indent=2, ensure_ascii=False) + "\n")):
            partial = path.with_name(path.name + ".partial")
            partial.write_text(text, encoding="utf-8")
            partial.replace(path)

    def left(self, reserve_s: float = 0.0) -> float:
        """Seconds of the budget left, less `reserve_s`."""
        return self.args.budget_s - self.elapsed() - reserve_s

    def fits(self, name: str, estimate_s: float, reserve_s: float) -> bool:
        """Whether `name` should start: it would end, by `estimate_s`, with `reserve_s` of the budget left."""
        if self.elapsed() + estimate_s + reserve_s <= self.args.budget_s:
            return True
        self.skipped.append(name)
        why = f"{self.elapsed():.0f} s of {self.args.budget_s:.0f} s gone; it would take about {estimate_s:.0f} s"
        self.add(Figure(name, SKIPPED, why + " (bench/gpu_session_bench.py --budget-s)"))
        say(f"{name}: {SKIPPED}")
        return False


@contextlib.contextmanager
def time_limit(seconds: float, name: str):
    """A TimeoutError inside the block after `seconds` (the kit's `guarded` turns it into a `failed` row), so that one
    slow measurement (a torch.compile, say) cannot take the budget of the rest."""
    if math.isinf(seconds):
        yield
        return

    def expired(signum, frame):
        raise TimeoutError(f"{name}: stopped after {seconds:.0f} s, the rest of the session's budget (--budget-s)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, max(1.0, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def evaluation_paths(report: Report, bench: work.Bench, model) -> dict:
    """evaluation_section's loop (bench/gpu_kit/evaluation.py), one path at a time, each written as it ends."""
    queries = work.cycled_queries(bench.workload.queries)
    config = work.probdiff_config(bench.recipe, bench.workload)
    paths, skipped = hf_paths(bench.args.paths, bench.device)
    runs: dict = {}
    last = 0.0
    for name, make_engine in paths.items():
        label = f"{PATHS[name]}: evaluation"
        if not report.fits(label, last, bench.args.reserve_s):
            continue
        say(f"evaluation through {PATHS[name]}: {len(queries)} queries, max_new_tokens {config.max_new_tokens}")
        engine = make_engine(model, bench.tokenizer, config.batch_size)

        def evaluation(engine=engine):
            warm_up(model, bench.tokenizer, queries, config, engine)
            return measure(bench, model, queries, config, engine)

        started, figures = time.perf_counter(), []
        with time_limit(report.left(bench.args.reserve_s), label):
            run = guarded(figures, label, bench.device, evaluation)
        last = time.perf_counter() - started
        if run is not None:
            runs[name] = run
            floors = floors_of(run, bench, queries, config)
            ours = runs.get("ours") if name != "ours" else None
            figures += evaluation_figures(PATHS[name], run, floors, config.max_new_tokens, ours)
        report.add(*figures)
    if skipped:
        report.add(*skipped)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False, allow_abbrev=False)
    parser.add_argument("--md", required=True, type=Path, help="the table, rewritten as it grows")
    parser.add_argument("--json", dest="json_path", required=True, type=Path, help="the figures, likewise")
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="seconds this run may take")
    parser.add_argument("--reserve-s", type=float, default=30.0, help="seconds kept for the LoRA step [30]")
    own, rest = parser.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        parser.print_help()
        return 0
    args = gpu.parse_args(rest)
    args.budget_s, args.reserve_s = own.budget_s, own.reserve_s
    if args.floor_only:
        raise SystemExit("error: --floor-only needs no session: run bench/gpu.py")
    report = Report(own.md, own.json_path, args, time.perf_counter())

    recipe = work.read_recipe()
    workload = gpu.resolve_workload(args, recipe)
    config = work.model_config(args.shape)
    dtype = getattr(torch, args.dtype or ("float32" if args.shape == "tiny" else "bfloat16"))
    cost = ModelCost.from_config(config, dtype)
    tokenizer = load_qwen_tokenizer()
    device = gpu.resolve_device(args.device)
    report.add(*gpu.header_figures(args, device, dtype, config, workload, recipe["probdiff"]["n_revisions"]))
    hardware, hardware_figures = hardware_section(device, dtype, cost)
    report.add(*hardware_figures)
    bench = work.Bench(args, recipe, workload, tokenizer, device, dtype, cost, hardware)
    model, build_figure = work.model_section(args, config, device, dtype)
    report.add(build_figure)

    runs = evaluation_paths(report, bench, model)
    vllm_run, vllm_rows = vllm_section(bench, model, runs.get("ours"))
    if vllm_run is not None:
        runs["vllm"] = vllm_run
    report.add(*vllm_rows)

    per_batch = runs["ours"].seconds / max(1, -(-workload.queries // workload.batch_size)) if "ours" in runs else 0.0
    for batch in workload.decode_batches:
        # one batch of `batch` rows: about one of the evaluation's batches, longer where the KV cache grows
        estimate = per_batch * max(1.0, batch / workload.batch_size) ** 0.5
        if report.fits(f"decode batch {batch}", estimate, args.reserve_s):
            one = dataclasses.replace(bench, workload=dataclasses.replace(workload, decode_batches=(batch,)))
            with time_limit(report.left(args.reserve_s), f"decode batch {batch}"):
                report.add(*decode_batch_section(one, model))
    if workload.train_tokens:
        with time_limit(report.left(), "the LoRA and QLoRA steps"):
            report.add(*training_section(bench, model, runs))
    report.add(complete=True)
    print(report.md.read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
