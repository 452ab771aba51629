"""One ProbDiff evaluation through an engine, timed by the evaluator itself (`Evaluation.cost`: answer decoding,
revision decoding, scoring) and each stage against its floor; one per HF decoding path, then one evaluation batch of
each decode batch size."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.engine import Engine
from probdiff_callback.core.evaluator import evaluate
from probdiff_callback.core.prompts import prepare_queries
from probdiff_callback.core.queries import Query
from probdiff_callback.core.records import Cost, Record

from .device import allocated_memory, clock, guarded, memory_detail, reset_peak_memory
from .floor import decode_floor, scoring_floor, steps_per_row
from .paths import HF_ENGINES, PATHS, Call, Recording, hf_paths, stage_calls
from .report import Figure, plural, say, seconds
from .workload import Bench, cycled_queries, probdiff_config


@dataclass
class Measured:
    """One evaluation: its records, what each stage cost (the evaluator's own timing), its wall time, the engine's
    calls by stage, and the peak memory."""

    records: list[Record]
    cost: Cost
    seconds: float
    calls: dict[str, list[Call]]
    memory_detail: str
    memory_numbers: dict[str, float]


def warm_up(model, tokenizer, queries: Sequence[Query], config: ProbDiffConfig, engine: Engine) -> None:
    """One batch of one new token first: CUDA context, kernel selection, allocator growth (and vLLM's adapter
    loading) stay out of the timings."""
    short = dataclasses.replace(config, max_new_tokens=1)
    evaluate(model, tokenizer, queries[: config.batch_size], short, engine=engine, progress=False)


def measure(bench: Bench, model, queries: Sequence[Query], config: ProbDiffConfig, engine: Engine) -> Measured:
    """One evaluation with its texts written by `engine` and scored by `model`."""
    recording = Recording(engine)
    before = allocated_memory(bench.device)
    reset_peak_memory(bench.device)
    started = clock(bench.device)
    evaluation = evaluate(model, bench.tokenizer, queries, config, engine=recording, progress=sys.stderr.isatty())
    took = clock(bench.device) - started
    detail, numbers = memory_detail(bench.device, before)
    calls = stage_calls(recording.calls, config.n_revisions)
    for stage, tokens in (("answer", evaluation.cost.answer_tokens), ("revision", evaluation.cost.revision_tokens)):
        recorded = sum(sum(c.generated_lengths) for c in calls[stage])
        if recorded != tokens:  # the calls did not come in the order stage_calls reads them
            raise RuntimeError(f"{stage} calls generated {recorded} tokens; the evaluator counted {tokens}")
    return Measured(evaluation.records, evaluation.cost, took, calls, detail, numbers)


@dataclass(frozen=True)
class Floors:
    answer: float
    revision: float
    scoring: float

    @property
    def total(self) -> float:
        return self.answer + self.revision + self.scoring


def floors_of(run: Measured, bench: Bench, queries: Sequence[Query], config: ProbDiffConfig) -> Floors:
    """Decoding: each call's rows as they ran; scoring: each record's two texts, as many tokens as were scored, after
    its query's chat prompt (prepared as the evaluator prepares it), the prompt run once for both."""
    cap = config.max_new_tokens

    def decoding(calls: list[Call]) -> float:
        return sum(
            decode_floor(bench.cost, bench.hardware, c.prompt_lengths, steps_per_row(c.generated_lengths, cap)).total
            for c in calls
        )

    prepared = prepare_queries(
        bench.tokenizer, queries, system_prompt=config.system_prompt, max_prompt_tokens=config.max_prompt_tokens
    )
    prompt_length = {p.query.id: len(p.prompt_ids) for p in prepared}
    prompts = [prompt_length[r.id] for r in run.records]
    texts = [[r.n_tokens_response, r.n_tokens_revised] for r in run.records]
    scoring = scoring_floor(bench.cost, bench.hardware, prompts, texts)
    return Floors(decoding(run.calls["answer"]), decoding(run.calls["revision"]), scoring)


def compared_with_ours(run: Measured, ours: Measured | None, same_sampler: bool) -> tuple[str, dict[str, float]]:
    """The run's speed against ours, and where both drew with the library's sampler, for how many queries the texts
    came out the same."""
    if ours is None:
        return "", {}
    speed = ours.seconds / run.seconds
    words = f"; {speed:.2f}x the speed of ours ({seconds(ours.seconds)})"
    if same_sampler:
        same = sum(a.response == b.response and a.revisions == b.revisions for a, b in zip(run.records, ours.records))
        words += f"; texts identical to ours for {same}/{len(run.records)} queries"
    return words, {"speed_vs_ours": speed}


def stage_figure(label: str, stage: str, took: float, calls: list[Call], floor: float, cap: int, vllm: bool) -> Figure:
    """A decoding stage: HF batches decode in lockstep, each for as many steps as its longest row; vLLM (`vllm`) was
    handed the stage's requests at once and batched them itself."""
    lengths = [length for c in calls for length in c.generated_lengths]
    tokens, at_cap = sum(lengths), sum(length == cap for length in lengths)
    if vllm:
        how = f"{plural(len(lengths), 'request', 'requests')} handed over at once, batched by vLLM (floor: one batch)"
        numbers: dict[str, float] = {}
    else:
        steps = sum(max(steps_per_row(c.generated_lengths, cap)) for c in calls)
        how = f"{plural(len(calls), 'batch', 'batches')}, {steps} decode steps: {steps / took:.1f} steps/s"
        numbers = {"decode_steps": steps, "steps_per_s": steps / took}
    return Figure(
        f"{label}: {stage} decoding",
        seconds(took),
        f"{how}; {tokens} tokens: {tokens / took:.1f} tokens/s ({at_cap}/{len(lengths)} rows ran to the cap); "
        f"floor {seconds(floor)}, {took / floor:.2f}x the floor",
        {"seconds_s": took, **numbers, "tokens": tokens, "tokens_per_s": tokens / took, "floor_s": floor}
        | {"ratio_to_floor": took / floor},
    )


def evaluation_figures(
    label: str, run: Measured, floors: Floors, cap: int, ours: Measured | None, vllm: bool = False
) -> list[Figure]:
    """A path's rows: the evaluation (next to ours, where given), its two decoding stages and its scoring, each
    against its floor. `vllm`: the texts came from vLLM, with its own sampler and batching."""
    comparison, compared = compared_with_ours(run, ours, same_sampler=not vllm)
    scoring = run.cost.scoring_seconds
    return [
        Figure(
            f"{label}: evaluation",
            seconds(run.seconds),
            f"{plural(len(run.records), 'query', 'queries')}; floor {seconds(floors.total)}, "
            f"{run.seconds / floors.total:.2f}x the floor; other (prompts, tokenizing) "
            f"{seconds(run.seconds - run.cost.seconds)}; memory {run.memory_detail}{comparison}",
            {"seconds_s": run.seconds, "floor_s": floors.total, "ratio_to_floor": run.seconds / floors.total}
            | run.memory_numbers
            | compared,
        ),
        stage_figure(label, "answer", run.cost.answers_seconds, run.calls["answer"], floors.answer, cap, vllm),
        stage_figure(label, "revision", run.cost.revisions_seconds, run.calls["revision"], floors.revision, cap, vllm),
        Figure(
            f"{label}: scoring",
            seconds(scoring),
            f"{2 * len(run.records)} texts; compute floor {seconds(floors.scoring)}, "
            f"{scoring / floors.scoring:.2f}x the floor",
            {"seconds_s": scoring, "floor_s": floors.scoring, "ratio_to_floor": scoring / floors.scoring},
        ),
    ]


def evaluation_section(bench: Bench, model) -> tuple[dict[str, Measured], list[Figure]]:
    """One evaluation through each HF decoding path, after a warm-up; stage times against the floor."""
    figures: list[Figure] = []
    queries = cycled_queries(bench.workload.queries)
    config = probdiff_config(bench.recipe, bench.workload)
    paths, skipped = hf_paths(bench.args.paths, bench.device)
    runs: dict[str, Measured] = {}
    for name, make_engine in paths.items():
        say(f"evaluation through {PATHS[name]}: {len(queries)} queries, max_new_tokens {config.max_new_tokens}")
        engine = make_engine(model, bench.tokenizer, config.batch_size)

        def evaluation(engine: Engine = engine) -> Measured:
            warm_up(model, bench.tokenizer, queries, config, engine)
            return measure(bench, model, queries, config, engine)

        run = guarded(figures, f"{PATHS[name]}: evaluation", bench.device, evaluation)
        if run is not None:
            runs[name] = run
            floors = floors_of(run, bench, queries, config)
            ours = runs.get("ours") if name != "ours" else None
            figures += evaluation_figures(PATHS[name], run, floors, config.max_new_tokens, ours)
    return runs, figures + skipped


def decode_batch_section(bench: Bench, model) -> list[Figure]:
    """One evaluation batch of each size through ours: time per query and peak memory."""
    figures: list[Figure] = []
    for batch in bench.workload.decode_batches:
        say(f"decode batch {batch}: one evaluation batch through ours")
        config = probdiff_config(bench.recipe, bench.workload, batch_size=batch)
        engine = HF_ENGINES["ours"](model, bench.tokenizer, batch)

        def evaluation(config: ProbDiffConfig = config, engine: Engine = engine, batch: int = batch) -> Measured:
            return measure(bench, model, cycled_queries(batch), config, engine)

        run = guarded(figures, f"decode batch {batch}", bench.device, evaluation)
        if run is not None:
            figures.append(
                Figure(
                    f"decode batch {batch}",
                    f"{seconds(run.seconds / batch)} per query",
                    f"one batch of {batch} queries through ours (answers, revisions, scoring) in "
                    f"{seconds(run.seconds)}; memory {run.memory_detail}",
                    {"seconds_per_query_s": run.seconds / batch, "seconds_s": run.seconds} | run.memory_numbers,
                )
            )
    return figures
