"""The benchmark (`bench/gpu.py bench`): the device's bandwidth and matmul rate; one ProbDiff evaluation at the blog
recipe's settings through each decoding path, each stage as the evaluator timed it (`Evaluation.cost`) against its
floor, with the peak memory the evaluator read; one evaluation batch of each decode batch size. Its rows go into the
report (`--out`: OUT/summary.md and summary.json) as they come: a run stopped by its time limit keeps them."""

from __future__ import annotations

import dataclasses
import datetime
import gc
import resource
import sys
import traceback
from collections import namedtuple
from pathlib import Path

import torch

from probdiff_callback.core.decoding import HFEngine
from probdiff_callback.core.evaluator import evaluate
from probdiff_callback.core.prompts import prepare_queries
from probdiff_callback.models.tokenizer import load_qwen_tokenizer

from . import model as work
from . import report
from .floor import Hardware, ModelCost, decode_floor, scoring_floor, steps_per_row

PATHS = {"ours": "ours (sample_continuations)", "generate": "generate", "generate-static": "generate + static cache",
         "generate-compile": "generate + static cache + torch.compile"}  # fmt: skip
# generate's options of each path after ours (the library's HF engine): the cache, and whether generate may compile
# its forward (transformers compiles it by itself when the cache is static and the device a GPU)
OPTIONS = {"generate": {"cache_implementation": None, "disable_compile": True},
           "generate-static": {"cache_implementation": "static", "disable_compile": True},
           "generate-compile": {"cache_implementation": "static", "disable_compile": False}}  # fmt: skip
NOTES = [
    "Random weights never produce <|im_end|>, so every row runs to max_new_tokens: the worst case the floor assumes.",
    "Floors: decode steps read the weights and the live rows' KV cache once at the measured bandwidth; prefill and "
    "scoring need their FLOPs at the measured matmul rate. Ratios are measured / floor.",
    "Stage times and peak memory are the evaluator's own (Evaluation.cost); a revision stage's time includes building "
    "its prompts. On a CPU the memory is the process's peak RSS so far.",
]


def row(name: str, value: str, detail: str = "", **numbers: float) -> dict:
    return {"name": name, "value": value, "detail": detail, "numbers": numbers}


def seconds(value: float) -> str:
    return f"{value:.3g} s" if value < 100 else f"{value:.0f} s"


def say(message: str) -> None:
    print(f"[gpu.py {datetime.datetime.now():%H:%M:%S}] {message}", file=sys.stderr, flush=True)


def hardware_rows(device: torch.device, dtype: torch.dtype) -> tuple[Hardware, list[dict]]:
    """The memory bandwidth (a device-to-device copy, reads and writes counted) and a square matmul's rate, each the
    best of several runs after a warm-up."""
    on_gpu = device.type == "cuda"
    (n_bytes, copies), (n, products) = ((2 * 1024**3, 10), (8192, 20)) if on_gpu else ((2**28, 3), (1024, 3))

    def best(work_, amount: float, runs: int, repeats: int) -> float:
        work_()  # a warm-up
        times = []
        for _ in range(runs):
            started = work.clock(device)
            [work_() for _ in range(repeats)]
            times.append(work.clock(device) - started)
        return amount * repeats / min(times)

    source = torch.ones(n_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    bandwidth = best(lambda: target.copy_(source), 2 * n_bytes, 5, copies)
    source = target = None  # the copy's 4 GiB back before the matmuls
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    flops = best(lambda: a @ b, 2 * n**3, 3, products)
    return Hardware(bandwidth, flops), [
        row("memory bandwidth", f"{bandwidth / 1e9:.1f} GB/s", f"best of 5 runs of {copies} copies of "
            f"{n_bytes / 1024**3:.2f} GiB (read + write counted)", bandwidth_bytes_per_s=bandwidth),
        row("matmul throughput", f"{flops / 1e12:.2f} TFLOP/s", f"best of 3 runs of {products} {n}x{n} matmuls in "
            f"{str(dtype).removeprefix('torch.')}", flops_per_s=flops),
    ]  # fmt: skip


class Recording:
    """An engine as the evaluator sees it, each call's (prompt lengths, generated lengths) kept for the floor."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine, self.name, self.batch_size, self.calls = engine, engine.name, engine.batch_size, []

    def generate(self, requests, max_new_tokens, should_stop=None, progress=None):
        generated = self.engine.generate(requests, max_new_tokens, should_stop, progress)
        self.calls.append(([len(r.prompt_ids) for r in requests], [g.n_tokens for g in generated]))
        return generated


# One evaluation: its records and Cost, wall seconds, the floor of each stage (answer, revision, scoring), the engine's
# calls of each decoding stage, the peak memory
Measured = namedtuple("Measured", "records cost seconds floors stages memory")


class Bench:
    """One run: what its measurements share, and its rows so far, written into the report (`--out`) as they come."""

    def __init__(self, args, recipe: dict, load: work.Workload, device: torch.device, cost: ModelCost) -> None:
        self.args, self.recipe, self.load, self.device, self.cost, self.rows = args, recipe, load, device, cost, []
        self.tokenizer, self.hardware = load_qwen_tokenizer(), None

    def add(self, *rows: dict, complete: bool = False) -> None:
        self.rows += rows
        if self.args.out:
            arguments = {k: v for k, v in vars(self.args).items() if isinstance(v, str | int | list | type(None))}
            written = {"arguments": arguments, "figures": self.rows, "notes": NOTES, "complete": complete}
            report.update(Path(self.args.out), bench=written)

    def guarded(self, name: str, measurement):
        """The measurement's result, or None and a row saying why not: a batch that does not fit is a result too, and
        one failing path (a torch.compile error, say) should not cost the rest."""
        try:
            return measurement()
        except torch.OutOfMemoryError as err:
            value, detail = "out of memory", str(err).splitlines()[0]
        except Exception as err:  # in the table and on stderr; then the next measurement
            traceback.print_exc()
            value, detail = "failed", f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
        gc.collect()  # only here, outside the except clauses, are the failed call's frames and tensors gone
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.add(row(name, value, detail))

    def measure(self, model, name: str, n_queries: int, batch: int, warm_up: bool = True) -> Measured:
        """One evaluation of `n_queries` through path `name`, after a one-token warm-up (CUDA context, kernel choice
        and allocator growth stay out of the timings); the floor of each stage as its calls ran."""
        queries, config = work.cycled_queries(n_queries), work.probdiff_config(self.recipe, self.load, batch)
        engine = Recording(HFEngine(model, self.tokenizer, batch, generation_options=OPTIONS.get(name)))
        if warm_up:
            short = dataclasses.replace(config, max_new_tokens=1)
            evaluate(model, self.tokenizer, queries[:batch], short, engine=engine.engine, progress=False)
        started = work.clock(self.device)
        evaluation = evaluate(model, self.tokenizer, queries, config, engine=engine, progress=sys.stderr.isatty())
        took, cost, cap = work.clock(self.device) - started, evaluation.cost, config.max_new_tokens
        if cost.peak_memory_bytes is not None:
            memory = {"peak_memory_bytes": cost.peak_memory_bytes, "memory_before_bytes": cost.memory_before_bytes}
        else:
            memory = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        rounds = 1 + config.n_revisions  # for each batch the evaluator asks once for the answers, then each round
        stages = {"answer": engine.calls[::rounds], "revision": [c for i, c in enumerate(engine.calls) if i % rounds]}
        if sum(n for _, generated in stages["answer"] for n in generated) != cost.answer_tokens:
            raise RuntimeError("the engine's calls did not come in the order the stages are read in")
        floors = {stage: sum(sum(decode_floor(self.cost, self.hardware, p, steps_per_row(g, cap))) for p, g in calls)
                  for stage, calls in stages.items()}  # fmt: skip
        prepared = prepare_queries(self.tokenizer, queries, system_prompt=config.system_prompt,
                                   max_prompt_tokens=config.max_prompt_tokens)  # fmt: skip
        prompt = {p.query.id: len(p.prompt_ids) for p in prepared}
        texts = [[r.n_tokens_response, r.n_tokens_revised] for r in evaluation.records]
        floors["scoring"] = scoring_floor(self.cost, self.hardware, [prompt[r.id] for r in evaluation.records], texts)
        return Measured(evaluation.records, cost, took, floors, stages, memory)


def memory_words(memory: dict) -> str:
    if "peak_rss_bytes" in memory:
        return f"memory {report.gib(memory['peak_rss_bytes'])} (CPU: peak RSS of the process so far)"
    return f"peak {report.gib(memory['peak_memory_bytes'])}, {report.gib(memory['memory_before_bytes'])} held before"


def path_rows(label: str, run: Measured, cap: int, ours: Measured | None) -> list[dict]:
    """A path's rows: the evaluation (next to ours), its two decoding stages and scoring, each against its floor."""
    total, n = sum(run.floors.values()), len(run.records)
    words = (f"{n} queries; floor {seconds(total)}, {run.seconds / total:.2f}x the floor; other (prompts, tokenizing) "
             f"{seconds(run.seconds - run.cost.seconds)}; {memory_words(run.memory)}")  # fmt: skip
    numbers = {"seconds_s": run.seconds, "floor_s": total, "ratio_to_floor": run.seconds / total, **run.memory}
    if ours is not None:
        same = sum(a.response == b.response and a.revisions == b.revisions for a, b in zip(run.records, ours.records))
        words += f"; {ours.seconds / run.seconds:.2f}x the speed of ours; texts identical to ours for {same}/{n}"
        numbers["speed_vs_ours"] = ours.seconds / run.seconds
    rows = [row(f"{label}: evaluation", seconds(run.seconds), words, **numbers)]
    for stage, spent in (("answer", run.cost.answers_seconds), ("revision", run.cost.revisions_seconds)):
        calls, floor = run.stages[stage], run.floors[stage]
        lengths, steps = [n for _, g in calls for n in g], sum(max(steps_per_row(g, cap)) for _, g in calls)
        rows.append(row(f"{label}: {stage} decoding", seconds(spent), f"{len(calls)} batches, {steps} decode steps: "
                        f"{steps / spent:.1f} steps/s; {sum(lengths)} tokens ({lengths.count(cap)}/{len(lengths)} "
                        f"rows ran to the cap); floor {seconds(floor)}, {spent / floor:.2f}x the floor",
                        seconds_s=spent, decode_steps=steps, tokens=sum(lengths), floor_s=floor,
                        ratio_to_floor=spent / floor))  # fmt: skip
    spent, floor = run.cost.scoring_seconds, run.floors["scoring"]
    words = f"{2 * n} texts; compute floor {seconds(floor)}, {spent / floor:.2f}x the floor"
    return [*rows, row(f"{label}: scoring", seconds(spent), words, seconds_s=spent, floor_s=floor,
                       ratio_to_floor=spent / floor)]  # fmt: skip


def run(args) -> int:
    recipe = work.read_recipe()
    pd = recipe["probdiff"]  # the recipe's evaluation; the tiny shape's is small
    load = work.Workload(pd["n_queries"], pd["max_new_tokens"], pd["batch_size"], (16, 32, 64))
    chosen = {"queries": args.queries, "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size}
    load = (work.TINY_WORKLOAD if args.shape == "tiny" else load)._replace(**{k: v for k, v in chosen.items() if v})
    load = load._replace(decode_batches=load.decode_batches if args.decode_batch is None else tuple(args.decode_batch))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda asked for, but torch sees no CUDA device")
    dtype = torch.float32 if args.shape == "tiny" else torch.bfloat16
    config = work.model_config(args.shape)
    bench = Bench(args, recipe, load, device, ModelCost.from_config(config, dtype))
    cost, c = bench.cost, config
    bench.add(
        row("date", f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}"),
        row("device", work.device_name(device)),
        row("versions", work.versions()),
        row("model", f"--shape {args.shape}, {str(dtype).removeprefix('torch.')}", f"{c.num_hidden_layers} layers, "
            f"hidden {c.hidden_size}, {c.num_attention_heads} heads ({c.num_key_value_heads} kv), intermediate "
            f"{c.intermediate_size}, vocabulary {c.vocab_size}, untied head; "
            f"{(cost.decoder_matmul_params + 2 * cost.head_params) / 1e9:.2f} B parameters in matmuls and embeddings"),
        row("workload", f"{load.queries} queries x (answer + {recipe['probdiff']['n_revisions']} revision), "
            f"max_new_tokens {load.max_new_tokens}, batch {load.batch_size}",
            "the data/samples/blog/heldout.jsonl prompts cycled; settings of recipes/blog.yaml"),
    )  # fmt: skip
    bench.hardware, rows = hardware_rows(device, dtype)
    step = f"{cost.weight_bytes_per_step / 1e9:.2f} GB weights + {cost.kv_bytes_per_token / 1e6:.3f} MB per token"
    how = "decoder and LM head (the embedding lookup reads only the batch's rows); KV: 2 x layers x kv width x bytes"
    bench.add(*rows, row("bytes per decode step", step + " of context", how))
    started = work.clock(device)
    model = work.build_model(config, device, dtype)
    bench.add(row("model build", seconds(work.clock(device) - started), f"random weights made on {device.type}"))
    paths = [p for p in args.paths if p != "generate-compile" or device.type == "cuda"]
    if len(paths) < len(args.paths):
        bench.add(row(f"{PATHS['generate-compile']}: evaluation", "skipped", "CUDA only: transformers compiles "
                      "generate's forward itself on GPUs, not on a CPU"))  # fmt: skip
    runs = {}

    def through(name: str) -> None:
        say(f"evaluation through {PATHS[name]}: {load.queries} queries, max_new_tokens {load.max_new_tokens}")
        runs[name] = bench.guarded(f"{PATHS[name]}: evaluation",
                                   lambda: bench.measure(model, name, load.queries, load.batch_size))  # fmt: skip
        if runs[name] is not None:
            ours = runs.get("ours") if name != "ours" else None
            bench.add(*path_rows(PATHS[name], runs[name], load.max_new_tokens, ours))

    for name in (name for name in paths if name != "generate-compile"):
        through(name)
    for batch in load.decode_batches:
        say(f"decode batch {batch}: one evaluation batch through ours")
        one = bench.guarded(f"decode batch {batch}", lambda b=batch: bench.measure(model, "ours", b, b, False))
        if one is not None:
            bench.add(row(f"decode batch {batch}", f"{seconds(one.seconds / batch)} per query", f"one batch of {batch} "
                          f"queries through ours in {seconds(one.seconds)}; {memory_words(one.memory)}",
                          seconds_per_query_s=one.seconds / batch, seconds_s=one.seconds, **one.memory))  # fmt: skip
    if "generate-compile" in paths:  # last: its compiling is the slowest to start and the likeliest to fail
        through("generate-compile")
    bench.add(complete=True)
    print(report.markdown_table(bench.rows) + "\n\n" + "\n".join(f"- {note}" for note in NOTES))
    return 0
