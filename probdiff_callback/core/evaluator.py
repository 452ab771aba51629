"""ProbDiff on a model: answer -> revise K times -> score both under the original query.

`evaluate` works on whatever queries it is given, in batches, and returns an `Evaluation`: the records and what each
stage cost (`records.Cost`). As queries finish it can hand their records on (`on_finished`), so that an evaluation
that fails part-way keeps what it finished (`probdiff eval` writes them as they come). Distributed callers give every
rank the same number of queries so every rank makes the same number of decoding and forward calls (ZeRO-3 with
sharded parameters needs that). `summarise` turns the whole query set's records into the summary, with the reference
metrics where the queries have them: the CLI and the callback call it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from tqdm.auto import tqdm

from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.decoding import HFEngine
from probdiff_callback.core.degenerate import answer_degenerate, merge_kinds, revision_degenerate
from probdiff_callback.core.engine import Engine, Generated, GenerationError, GenerationRequest
from probdiff_callback.core.metric import discrepancy, finite_mean, is_confident, summary_of
from probdiff_callback.core.prompts import (
    REFINEMENT_PROMPTS,
    PreparedQuery,
    prepare_queries,
    refinement_prompt_ids,
    refinement_template,
)
from probdiff_callback.core.queries import Query
from probdiff_callback.core.records import Cost, Record, Summary
from probdiff_callback.core.reference_metrics import ReferencePlan, score_records, summarize_references
from probdiff_callback.core.sampling import row_seed
from probdiff_callback.core.scoring import score_texts

T = TypeVar("T")
ABANDONED = "evaluation abandoned"  # in the error every rank sees when any rank abandoned its share


class EvaluationAbandoned(Exception):  # noqa: N818 (not an error: the run was asked to stop)
    """An evaluation given up because the run was asked to stop (preemption); its step is evaluated on resume."""


@dataclass
class Evaluation:
    """What an evaluation gives: one record per query, in the queries' order, and what each stage cost."""

    records: list[Record]
    cost: Cost = field(default_factory=Cost)


def stage_clock(model) -> Callable[[], float]:
    """The clock the stages are timed with: `time.perf_counter`, after the device has finished the work queued on it
    when the model is on a CUDA device (kernels run asynchronously, so the host's time alone would put a stage's work
    in the next one)."""
    device = getattr(model, "device", None)
    if getattr(device, "type", None) != "cuda":
        return time.perf_counter
    import torch

    def synchronized() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return synchronized


@contextlib.contextmanager
def measured_memory(model, cost: Cost):
    """`cost`'s memory fields for the block, where `model` is on a CUDA device (nothing on a CPU): the peak before it
    (since the device's peak was last reset), what tensors held when it began, and its own peak. The device's peak is
    reset when the block begins and when it ends, so that a peak read elsewhere (say the Trainer's, with
    `skip_memory_metrics=false`) spans only what came after the last evaluation."""
    device = getattr(model, "device", None)
    if getattr(device, "type", None) != "cuda":
        yield
        return
    import torch

    cost.peak_memory_before_bytes = torch.cuda.max_memory_allocated(device)
    cost.memory_before_bytes = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        yield
    finally:
        cost.peak_memory_bytes = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)


def raise_if_asked_to_stop(should_stop: Callable[[], bool] | None) -> None:
    if should_stop is not None and should_stop():
        raise EvaluationAbandoned("the run was asked to stop (preemption) during this evaluation")


@contextlib.contextmanager
def inference_mode(model):
    """eval mode with the KV cache on (gradient checkpointing only acts in train mode); restored after."""
    was_training = model.training
    config = getattr(model, "config", None)
    had_cache = getattr(config, "use_cache", None)
    model.eval()
    if config is not None:
        config.use_cache = True
    try:
        yield
    finally:
        if config is not None and had_cache is not None:
            config.use_cache = had_cache
        model.train(was_training)


def _batches(items: list[T], size: int) -> list[list[T]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def build_record(
    prepared: PreparedQuery,
    responses: list[str],
    revisions_by_sample: list[list[str]],
    scores_response: list[tuple[float, int]],
    scores_revised: list[tuple[float, int]],
    delta: float,
    *,
    answer_temperature: float | None = None,
    response_capped: bool | None = None,
    revision_capped: bool | None = None,
    revision_truncated: bool = False,
    refinement_templates: Sequence[str] = tuple(REFINEMENT_PROMPTS.values()),
) -> Record:
    """One query's record from the texts and scores of each of its samples.

    `response_capped` / `revision_capped`: whether an answer / a last revision (of any sample)
    ended at max_new_tokens without a stop token, so was scored cut short. These and
    `answer_temperature` are None for texts generated elsewhere (`pairs.score_pairs`).
    `revision_truncated`: a refinement request was cut to max_prompt_tokens.
    `response_degenerate` / `revision_degenerate`: the kinds of degeneration (`degenerate.py`) an answer / a last
    revision of any sample shows, [] for none; an echo is looked for against `refinement_templates`, the template
    the revisions were made with (for texts generated elsewhere: every shipped one).
    """
    d_samples = [discrepancy(rev[0], resp[0]) for resp, rev in zip(scores_response, scores_revised)]
    d = finite_mean(d_samples)
    several = len(responses) > 1
    return Record(
        id=prepared.query.id,
        category=prepared.query.category,
        query=prepared.query.text,
        response=responses[0],
        revisions=revisions_by_sample[0],
        logp_response=finite_mean([s[0] for s in scores_response]),
        logp_revised=finite_mean([s[0] for s in scores_revised]),
        d=d,
        n_tokens_response=scores_response[0][1],
        n_tokens_revised=scores_revised[0][1],
        confident=is_confident(d, delta),
        truncated=prepared.truncated,
        answer_temperature=answer_temperature,
        response_capped=response_capped,
        revision_capped=revision_capped,
        revision_truncated=revision_truncated,
        response_degenerate=merge_kinds(answer_degenerate(response) for response in responses),
        revision_degenerate=merge_kinds(
            revision_degenerate(revisions[-1], refinement_templates, prepared.query.text, response)
            for response, revisions in zip(responses, revisions_by_sample)
            if revisions
        ),
        responses=responses if several else None,
        revisions_by_sample=revisions_by_sample if several else None,
        d_samples=d_samples if several else None,
    )


@dataclass
class Chain:
    """One answer -> revision(s) -> scores chain of a query, carried through the phases of an evaluation (as
    lm-evaluation-harness's `Instance` carries a request): each phase fills its fields. A query has `n_samples`
    chains; its record is built from them (`records_from_chains`)."""

    prepared: PreparedQuery
    sample: int = 0
    answered: bool = False
    answer: str = ""
    answer_capped: bool = False
    answer_tokens: int = 0  # generated for the answer
    revisions: list[str] = field(default_factory=list)
    revision_capped: bool = False  # the last revision's
    revision_tokens: int = 0  # generated for the revisions, every round
    request_cut: bool = False  # a refinement request was cut to max_prompt_tokens
    score_answer: tuple[float, int] | None = None
    score_revised: tuple[float, int] | None = None

    def seed(self, config: ProbDiffConfig, stage: str) -> int:
        return row_seed(config.seed, self.prepared.query.id, self.sample, stage)

    def last_text(self) -> str:
        return self.revisions[-1] if self.revisions else self.answer

    def generated(self, config: ProbDiffConfig) -> bool:
        """Its answer and every revision round are written."""
        return self.answered and len(self.revisions) == config.n_revisions


def make_chains(tokenizer, queries: Sequence[Query], config: ProbDiffConfig) -> list[Chain]:
    """The chains of `queries` in query order, `n_samples` per query, each query in its chat prompt."""
    prepared = prepare_queries(
        tokenizer, queries, system_prompt=config.system_prompt, max_prompt_tokens=config.max_prompt_tokens
    )
    return [Chain(item, s) for item in prepared for s in range(config.n_samples)]


def generate_answers(
    chains: Sequence[Chain], engine: Engine, config: ProbDiffConfig, should_stop=None, progress=None
) -> None:
    requests = [
        GenerationRequest(
            c.prepared.prompt_ids,
            c.seed(config, "answer"),
            config.answer_temperature_for(c.prepared.query.category),
            config.answer_top_p,
        )
        for c in chains
    ]

    def take(chain: Chain, out: Generated) -> None:
        chain.answer, chain.answer_capped, chain.answer_tokens = out.text, out.capped, out.n_tokens
        chain.answered = True

    _generate_into(chains, requests, take, engine, config, should_stop, progress)


def generate_revisions(
    chains: Sequence[Chain],
    round_: int,
    tokenizer,
    engine: Engine,
    config: ProbDiffConfig,
    should_stop=None,
    progress=None,
) -> None:
    """Revision round `round_` (1-based): each chain's last text revised with the refinement prompt."""
    template = refinement_template(config.refinement_prompt)
    requests = []
    for c in chains:
        ids, cut = refinement_prompt_ids(
            tokenizer, config.system_prompt, template, c.prepared.text, c.last_text(), config.max_prompt_tokens
        )
        c.request_cut = c.request_cut or cut
        seed = c.seed(config, f"revision-{round_}")
        requests.append(GenerationRequest(ids, seed, config.revision_temperature, config.revision_top_p))

    def take(chain: Chain, out: Generated) -> None:
        chain.revisions.append(out.text)
        chain.revision_capped = out.capped
        chain.revision_tokens += out.n_tokens

    _generate_into(chains, requests, take, engine, config, should_stop, progress)


def _generate_into(
    chains: Sequence[Chain],
    requests: list[GenerationRequest],
    take: Callable[[Chain, Generated], None],
    engine: Engine,
    config: ProbDiffConfig,
    should_stop,
    progress,
) -> None:
    """Each request's text handed to its chain by `take`; when the engine fails part-way, the texts it finished are
    handed on before its error goes up."""
    raise_if_asked_to_stop(should_stop)
    try:
        generated = engine.generate(requests, config.max_new_tokens, should_stop, progress)
    except GenerationError as failure:
        for index, out in sorted(failure.finished.items()):
            take(chains[index], out)
        raise
    raise_if_asked_to_stop(should_stop)
    for chain, out in zip(chains, generated):
        take(chain, out)


def score_chains(
    model,
    tokenizer,
    chains: Sequence[Chain],
    config: ProbDiffConfig,
    sync_n_chunks: Callable[[int], int] | None = None,
    progress: Callable[[int], object] | None = None,
) -> None:
    """Each chain's answer and last revision scored by `model` under the query's chat prompt, `batch_size` chains
    at a time; `progress(n)` is told as chains are scored."""
    for batch in _batches(list(chains), config.batch_size):
        prompts = [c.prepared.prompt_ids for c in batch]
        scores = score_texts(
            model, tokenizer, prompts, [[c.answer, c.last_text()] for c in batch], config, sync_n_chunks
        )
        for c, (s_answer, s_revised) in zip(batch, scores):
            c.score_answer, c.score_revised = s_answer, s_revised
        if progress is not None:
            progress(len(batch))


def hand_on_finished(
    chains: Sequence[Chain], config: ProbDiffConfig, handed: set[str], on_finished: Callable[[list[Record]], object]
) -> None:
    """The records of the queries whose chains are all scored and that `handed` (their ids) does not hold yet, to
    `on_finished`, in the chains' order; their ids join `handed`."""
    by_query: dict[str, list[Chain]] = {}
    for c in chains:
        by_query.setdefault(c.prepared.query.id, []).append(c)
    done = [
        c
        for query_id, mine in by_query.items()
        if query_id not in handed and all(c.score_revised is not None for c in mine)
        for c in mine
    ]
    if done:
        handed.update(c.prepared.query.id for c in done)
        on_finished(records_from_chains(done, config))


def records_from_chains(chains: Sequence[Chain], config: ProbDiffConfig) -> list[Record]:
    """One record per query, in the order of the chains' queries."""
    by_query: dict[str, list[Chain]] = {}  # by id: gathered from several ranks, a query's chains are copies
    for c in chains:
        by_query.setdefault(c.prepared.query.id, []).append(c)
    records = []
    for mine in by_query.values():
        item = mine[0].prepared
        records.append(
            build_record(
                item,
                [c.answer for c in mine],
                [c.revisions for c in mine],
                [c.score_answer for c in mine],  # type: ignore[misc]
                [c.score_revised for c in mine],  # type: ignore[misc]
                config.delta,
                answer_temperature=config.answer_temperature_for(item.query.category),
                response_capped=any(c.answer_capped for c in mine),
                revision_capped=any(c.revision_capped for c in mine),
                revision_truncated=any(c.request_cut for c in mine),
                refinement_templates=(refinement_template(config.refinement_prompt),),
            )
        )
    return records


def generate_chains(
    chains: Sequence[Chain],
    tokenizer,
    engine: Engine,
    config: ProbDiffConfig,
    *,
    bar=None,
    should_stop: Callable[[], bool] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Cost:
    """Answers and every revision round for `chains`, `engine.batch_size` chains at a time (no scoring); what they
    cost, timed with `clock`."""
    cost = Cost()
    for batch in _generation_batches(chains, engine):
        _generate_batch(batch, tokenizer, engine, config, bar, should_stop, cost, clock)
    return cost


def _generation_batches(chains: Sequence[Chain], engine: Engine) -> list[list[Chain]]:
    return _by_prompt_length(chains, engine.batch_size or max(len(chains), 1))


def _by_prompt_length(chains: Sequence[Chain], size: int) -> list[list[Chain]]:
    # Similar lengths together waste less padding; the sampler makes the order irrelevant to the texts.
    return _batches(sorted(chains, key=lambda c: -len(c.prepared.prompt_ids)), size)


def query_batches(tokenizer, queries: Sequence[Query], config: ProbDiffConfig) -> list[list[Query]]:
    """`queries` in the batches `evaluate` decodes and scores them in with the HF engine (longest prompts first,
    `batch_size` chains together; a query with several samples goes with its first). `evaluate` on a union of whole
    batches gives each query the same batch partners, hence the same records, as on all of `queries`."""
    seen: set[str] = set()
    batches = []
    for batch in _by_prompt_length(make_chains(tokenizer, queries, config), config.batch_size):
        firsts = []
        for chain in batch:
            if chain.prepared.query.id not in seen:
                seen.add(chain.prepared.query.id)
                firsts.append(chain.prepared.query)
        if firsts:
            batches.append(firsts)
    return batches


def _generate_batch(
    batch: list[Chain], tokenizer, engine: Engine, config: ProbDiffConfig, bar, should_stop, cost: Cost, clock
) -> None:
    """The batch's answers and revisions, their seconds and tokens added to `cost`."""
    progress = None if bar is None else bar.update
    if bar is not None:
        bar.set_postfix_str("answer")
    started = clock()
    generate_answers(batch, engine, config, should_stop, progress)
    cost.answers_seconds += clock() - started
    cost.answer_tokens += sum(c.answer_tokens for c in batch)
    started = clock()
    for round_ in range(1, config.n_revisions + 1):
        if bar is not None:
            bar.set_postfix_str(f"revision {round_}")
        generate_revisions(batch, round_, tokenizer, engine, config, should_stop, progress)
    cost.revisions_seconds += clock() - started
    cost.revision_tokens += sum(c.revision_tokens for c in batch)


def evaluate(
    model,
    tokenizer,
    queries: Sequence[Query],
    config: ProbDiffConfig,
    *,
    engine: Engine | None = None,
    progress: bool = True,
    synced_gpus: bool = False,
    sync_n_chunks: Callable[[int], int] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_finished: Callable[[list[Record]], object] | None = None,
) -> Evaluation:
    """Records for `queries`, in their order, and what each stage cost. A query's texts depend only on (seed, query
    id, sample).

    `on_finished` is handed the records of queries as they finish (after each batch, in the batch's order), so that
    an evaluation that fails part-way keeps them: when the engine fails part-way (`GenerationError`), the queries
    whose texts it had all written are scored and handed on before the error goes up. For one process: not with
    `synced_gpus`, whose ranks must score together.

    `engine` generates the answers and revisions (default: HF `generate` on `model`, `HFEngine`); `model` scores
    them. `should_stop` (a preemption's flag) is checked between phases and, with the HF engine, at every generated
    token; once it is true the evaluation raises `EvaluationAbandoned`. Not with `synced_gpus`, where every
    rank must run the same forward passes: a sharded ZeRO-3 evaluation always finishes.

    Callers that hold the whole query set check `config.check_categories` on it first (the CLI and
    the callback do); here the queries may be one rank's share. On a CUDA model the cost holds the evaluation's peak
    memory too (`measured_memory`, which resets the device's peak when the evaluation begins and ends).
    """
    chains = make_chains(tokenizer, queries, config)
    if engine is None:
        engine = HFEngine(model, tokenizer, config.batch_size, synced_gpus)
    if synced_gpus:
        should_stop = None
    batches = _generation_batches(chains, engine)
    # one unit per generated text and per scored chain (its answer and revision)
    steps = len(chains) * (2 + config.n_revisions)
    bar = tqdm(total=steps, desc="ProbDiff", unit="text", disable=not progress, dynamic_ncols=True)
    cost, clock = Cost(), stage_clock(model)
    handed: set[str] = set()
    with inference_mode(model), contextlib.closing(bar), measured_memory(model, cost):
        for batch in batches:
            raise_if_asked_to_stop(should_stop)
            try:
                _generate_batch(batch, tokenizer, engine, config, bar, should_stop, cost, clock)
            except GenerationError:
                if on_finished is not None:  # keep the queries the engine finished before it failed
                    score_chains(model, tokenizer, [c for c in batch if c.generated(config)], config)
                    hand_on_finished(chains, config, handed, on_finished)
                raise
            raise_if_asked_to_stop(should_stop)
            bar.set_postfix_str("score")
            started = clock()
            score_chains(model, tokenizer, batch, config, sync_n_chunks, progress=bar.update)
            cost.scoring_seconds += clock() - started
            if on_finished is not None:
                hand_on_finished(chains, config, handed, on_finished)
    return Evaluation(records_from_chains(chains, config), cost)


def summarise(
    evaluation: Evaluation, queries: Sequence[Query], config: ProbDiffConfig, plan: ReferencePlan
) -> tuple[Evaluation, Summary]:
    """(the evaluation with its records' reference metrics, where `plan`, the queries' `plan_references`, has any,
    and their seconds in its cost; the summary, with the corpus reference metrics): one function for the CLI and the
    callback, applied to the whole query set's evaluation."""
    records, reference, cost = evaluation.records, None, evaluation.cost
    if plan.active:
        started = time.perf_counter()
        records = score_records(records, queries)
        reference = summarize_references(records)
        cost = cost + Cost(reference_seconds=time.perf_counter() - started)
    summary = summary_of(records, config.delta, config.sweep)
    summary.reference = reference
    return Evaluation(records, cost), summary
