"""One ProbDiff evaluation, its stages timed (answer decoding, revision decoding, scoring) and each against its
floor, through every decoding path asked for; then one evaluation batch of each decode batch size."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from probdiff_callback.core import evaluator
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.decoding import sample_continuations
from probdiff_callback.core.queries import Query

from .decoding_paths import PATHS, decoding_paths
from .device import allocated_memory, clock, guarded, memory_detail, reset_peak_memory
from .floor import Hardware, ModelCost, decode_floor, scoring_floor, steps_per_row
from .report import Figure, plural, say, seconds
from .workload import Bench, cycled_queries, probdiff_config


@dataclass
class DecodeCall:
    prompt_lengths: list[int]
    generated_lengths: list[int]


@dataclass
class EvaluationRun:
    records: list[dict] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=lambda: {"answer": 0.0, "revision": 0.0, "scoring": 0.0})
    total_seconds: float = 0.0
    decode_calls: dict[str, list[DecodeCall]] = field(default_factory=lambda: {"answer": [], "revision": []})
    scored: list[tuple[int, list[str]]] = field(default_factory=list)  # (prompt length, its texts) as scored
    memory_detail: str = ""
    memory_numbers: dict[str, float] = field(default_factory=dict)


@contextlib.contextmanager
def patched(module, name: str, replacement) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


def next_stage(run: EvaluationRun, n_revisions: int) -> str:
    """The stage of the evaluator's next generation call: for each generation batch it asks once for the answers,
    then once per revision round."""
    calls_so_far = sum(len(calls) for calls in run.decode_calls.values())
    return "answer" if calls_so_far % (1 + n_revisions) == 0 else "revision"


def timed_by_stage(
    run: EvaluationRun, n_revisions: int, device: torch.device, generate: Callable, decode_call: Callable
) -> Callable:
    """`generate` (one of the evaluator's generation calls), its time added to the run's stage (`next_stage`) and
    `decode_call(args, result)`, the call's lengths for the floor, recorded under that stage."""

    def timed(*args, **kwargs):
        stage = next_stage(run, n_revisions)
        started = clock(device)
        result = generate(*args, **kwargs)
        run.seconds[stage] += clock(device) - started
        run.decode_calls[stage].append(decode_call(args, result))
        return result

    return timed


@contextlib.contextmanager
def timed_scoring(run: EvaluationRun, device: torch.device) -> Iterator[None]:
    """Time score_texts, which `evaluate` calls by its module-level name for each scoring batch whatever engine
    wrote the texts, and record what it scored, for the floor."""
    original_score_texts = evaluator.score_texts

    def timed_score_texts(model, tokenizer, prompts, texts, *args, **kwargs):
        started = clock(device)
        scores = original_score_texts(model, tokenizer, prompts, texts, *args, **kwargs)
        run.seconds["scoring"] += clock(device) - started
        run.scored.extend((len(p), list(t)) for p, t in zip(prompts, texts))
        return scores

    with patched(evaluator, "score_texts", timed_score_texts):
        yield


@contextlib.contextmanager
def instrumented(run: EvaluationRun, decode: Callable, n_revisions: int, device: torch.device) -> Iterator[None]:
    """Time the evaluator's stages by wrapping the functions `evaluate` calls by their module-level names: for
    each batch it calls generate_texts once for the answers, once per revision round, then score_texts.
    `decode` replaces sample_continuations, which generate_texts calls; it also records lengths for the floor."""
    last_call: list[DecodeCall] = []

    def recording_decode(model, prompts, *args, **kwargs):
        generated = decode(model, prompts, *args, **kwargs)
        last_call.append(DecodeCall([len(p) for p in prompts], [len(g) for g in generated]))
        return generated

    timed_generate_texts = timed_by_stage(
        run, n_revisions, device, evaluator.generate_texts, lambda args, texts: last_call.pop()
    )
    with (
        patched(evaluator, "sample_continuations", recording_decode),
        patched(evaluator, "generate_texts", timed_generate_texts),
        timed_scoring(run, device),
    ):
        yield


def timed_evaluation(
    model,
    tokenizer,
    queries: Sequence[Query],
    config: ProbDiffConfig,
    device: torch.device,
    instrumentation: Callable[[EvaluationRun], contextlib.AbstractContextManager],
    engine=None,
) -> EvaluationRun:
    """One evaluation, its stages timed into the run by `instrumentation(run)`; the texts written by `engine`
    (default: the evaluator's own, HF generate on `model`) and scored by `model`."""
    run = EvaluationRun()
    before = allocated_memory(device)
    reset_peak_memory(device)
    with instrumentation(run):
        started = clock(device)
        run.records = evaluator.evaluate(model, tokenizer, queries, config, engine=engine, progress=sys.stderr.isatty())
        run.total_seconds = clock(device) - started
    run.memory_detail, run.memory_numbers = memory_detail(device, before)
    return run


def run_evaluation(
    model, tokenizer, queries: Sequence[Query], config: ProbDiffConfig, decode: Callable, device: torch.device
) -> EvaluationRun:
    """One evaluation through the HF decode function `decode`."""

    def instrumentation(run: EvaluationRun) -> contextlib.AbstractContextManager:
        return instrumented(run, decode, config.n_revisions, device)

    return timed_evaluation(model, tokenizer, queries, config, device, instrumentation)


def warm_up(model, tokenizer, queries: Sequence[Query], config: ProbDiffConfig, decode: Callable) -> None:
    """One batch of one new token first: CUDA context, kernel selection and allocator growth stay out of the
    timings."""
    short = dataclasses.replace(config, max_new_tokens=1)
    with patched(evaluator, "sample_continuations", decode):
        evaluator.evaluate(model, tokenizer, queries[: config.batch_size], short, progress=False)


@dataclass
class Floors:
    answer: float
    revision: float
    scoring: float

    @property
    def total(self) -> float:
        return self.answer + self.revision + self.scoring


def evaluation_floors(run: EvaluationRun, tokenizer, cost: ModelCost, hardware: Hardware, cap: int) -> Floors:
    def stage(calls: list[DecodeCall]) -> float:
        return sum(
            decode_floor(cost, hardware, c.prompt_lengths, steps_per_row(c.generated_lengths, cap)).total for c in calls
        )

    response_lengths = [
        [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts] for _, texts in run.scored
    ]
    prompt_lengths = [length for length, _ in run.scored]
    return Floors(
        stage(run.decode_calls["answer"]),
        stage(run.decode_calls["revision"]),
        scoring_floor(cost, hardware, prompt_lengths, response_lengths),
    )


def identical_share(run: EvaluationRun, reference: EvaluationRun | None) -> str:
    if reference is None:
        return ""
    same = sum(
        a["response"] == b["response"] and a["revisions"] == b["revisions"]
        for a, b in zip(run.records, reference.records)
    )
    return f"; texts identical to ours for {same}/{len(run.records)} queries"


def evaluation_figure(
    label: str, run: EvaluationRun, floors: Floors, comparison: str = "", numbers: dict[str, float] | None = None
) -> Figure:
    """The evaluation's wall time against its floor; `comparison` and `numbers` say how it compares with ours."""
    staged = sum(run.seconds.values())
    return Figure(
        f"{label}: evaluation",
        seconds(run.total_seconds),
        f"{plural(len(run.records), 'query', 'queries')}; floor {seconds(floors.total)}, "
        f"{run.total_seconds / floors.total:.2f}x the floor; "
        f"other (prompts, tokenizing) {seconds(run.total_seconds - staged)}; memory {run.memory_detail}" + comparison,
        {
            "seconds_s": run.total_seconds,
            "floor_s": floors.total,
            "ratio_to_floor": run.total_seconds / floors.total,
            **run.memory_numbers,
            **(numbers or {}),
        },
    )


# How a stage's texts were batched: (words, numbers) from its decode calls and its seconds.
Batching = Callable[[list[DecodeCall], float], tuple[str, dict[str, float]]]


def batches_and_steps(cap: int) -> Batching:
    """An HF path's batching: batches decoded in lockstep, each for as many steps as its longest row."""

    def described(calls: list[DecodeCall], took: float) -> tuple[str, dict[str, float]]:
        steps = sum(max(steps_per_row(c.generated_lengths, cap)) for c in calls)
        words = f"{plural(len(calls), 'batch', 'batches')}, {steps} decode steps: {steps / took:.1f} steps/s"
        return words, {"decode_steps": steps, "steps_per_s": steps / took}

    return described


def stage_figure(label: str, stage: str, run: EvaluationRun, floor: float, cap: int, batching: Batching) -> Figure:
    calls = run.decode_calls[stage]
    tokens = sum(sum(c.generated_lengths) for c in calls)
    rows = sum(len(c.generated_lengths) for c in calls)
    at_cap = sum(length == cap for c in calls for length in c.generated_lengths)
    took = run.seconds[stage]
    how, numbers = batching(calls, took)
    return Figure(
        f"{label}: {stage} decoding",
        seconds(took),
        f"{how}; {tokens} tokens: {tokens / took:.1f} tokens/s ({at_cap}/{rows} rows ran to the cap); "
        f"floor {seconds(floor)}, {took / floor:.2f}x the floor",
        {
            "seconds_s": took,
            **numbers,
            "tokens": tokens,
            "tokens_per_s": tokens / took,
            "floor_s": floor,
            "ratio_to_floor": took / floor,
        },
    )


def scoring_figure(label: str, run: EvaluationRun, floors: Floors) -> Figure:
    took = run.seconds["scoring"]
    n_texts = sum(len(texts) for _, texts in run.scored)
    return Figure(
        f"{label}: scoring",
        seconds(took),
        f"{n_texts} texts; compute floor {seconds(floors.scoring)}, {took / floors.scoring:.2f}x the floor",
        {"seconds_s": took, "floor_s": floors.scoring, "ratio_to_floor": took / floors.scoring},
    )


def evaluation_figures(
    label: str, run: EvaluationRun, floors: Floors, cap: int, reference: EvaluationRun | None
) -> list[Figure]:
    """An HF path's rows: the evaluation, its two decoding stages and its scoring."""
    return [
        evaluation_figure(label, run, floors, identical_share(run, reference)),
        stage_figure(label, "answer", run, floors.answer, cap, batches_and_steps(cap)),
        stage_figure(label, "revision", run, floors.revision, cap, batches_and_steps(cap)),
        scoring_figure(label, run, floors),
    ]


def evaluation_section(bench: Bench, model) -> tuple[dict[str, EvaluationRun], list[Figure]]:
    """One evaluation through each decoding path, after a warm-up; stage times against the floor."""
    figures: list[Figure] = []
    cap = bench.workload.max_new_tokens
    queries = cycled_queries(bench.workload.queries)
    config = probdiff_config(bench.recipe, bench.workload)
    paths, skipped = decoding_paths(bench.args.paths, bench.device)
    runs: dict[str, EvaluationRun] = {}
    for name, decode in paths.items():
        say(f"evaluation through {PATHS[name]}: {len(queries)} queries, max_new_tokens {cap}")

        def evaluation(decode: Callable = decode) -> EvaluationRun:
            warm_up(model, bench.tokenizer, queries, config, decode)
            return run_evaluation(model, bench.tokenizer, queries, config, decode, bench.device)

        run = guarded(figures, f"{PATHS[name]}: evaluation", bench.device, evaluation)
        if run is not None:
            runs[name] = run
            floors = evaluation_floors(run, bench.tokenizer, bench.cost, bench.hardware, cap)
            reference = runs.get("ours") if name != "ours" else None
            figures += evaluation_figures(PATHS[name], run, floors, cap, reference)
    return runs, figures + skipped


def decode_batch_section(bench: Bench, model) -> list[Figure]:
    """One evaluation batch of each size through the library's loop: time per query and peak memory."""
    figures: list[Figure] = []
    for batch in bench.workload.decode_batches:
        say(f"decode batch {batch}: one evaluation batch through ours")
        config = probdiff_config(bench.recipe, bench.workload, batch_size=batch)
        queries = cycled_queries(batch)
        measurement = functools.partial(
            run_evaluation, model, bench.tokenizer, queries, config, sample_continuations, bench.device
        )
        run = guarded(figures, f"decode batch {batch}", bench.device, measurement)
        if run is not None:
            figures.append(
                Figure(
                    f"decode batch {batch}",
                    f"{seconds(run.total_seconds / batch)} per query",
                    f"one batch of {batch} queries through ours (answers, revisions, scoring) in "
                    f"{seconds(run.total_seconds)}; memory {run.memory_detail}",
                    {"seconds_per_query_s": run.total_seconds / batch, "seconds_s": run.total_seconds}
                    | run.memory_numbers,
                )
            )
    return figures
