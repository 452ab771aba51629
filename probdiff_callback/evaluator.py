"""ProbDiff on a model: answer -> revise K times -> score both under the original query.

`evaluate` works on whatever queries it is given, in batches; distributed callers give
every rank the same number of queries so every rank makes the same number of
decoding and forward calls (ZeRO-3 with sharded parameters needs that).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

from tqdm.auto import tqdm

from probdiff_callback import faults
from probdiff_callback.chat_format import stop_token_ids
from probdiff_callback.config import ProbDiffConfig
from probdiff_callback.decoding import hit_cap, sample_continuations
from probdiff_callback.metric import discrepancy, finite_mean, is_confident
from probdiff_callback.prompts import PreparedQuery, prepare_queries, refinement_prompt_ids, refinement_template
from probdiff_callback.queries import Query
from probdiff_callback.sampling import row_seed
from probdiff_callback.scoring import score_batch


def generate_texts(
    model,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    max_new_tokens: int,
    synced_gpus: bool = False,
    should_stop: Callable[[], bool] | None = None,
) -> tuple[list[str], list[bool]]:
    """One batch of sampled texts, special tokens stripped, and whether each hit `max_new_tokens`; raises
    `EvaluationAbandoned` when `should_stop()` turns true during the batch (generation stops at the next token)."""
    generated = sample_continuations(
        model,
        prompts,
        seeds,
        temperatures,
        top_ps,
        max_new_tokens=max_new_tokens,
        stop_ids=stop_token_ids(tokenizer, getattr(model, "generation_config", None)),
        pad_token_id=tokenizer.pad_token_id,
        n_valid_ids=len(tokenizer),
        synced_gpus=synced_gpus,
        stop_early=should_stop,
    )
    raise_if_asked_to_stop(should_stop)
    texts = [tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in generated]
    return texts, [hit_cap(ids, max_new_tokens) for ids in generated]


def raise_if_asked_to_stop(should_stop: Callable[[], bool] | None) -> None:
    if should_stop is not None and should_stop():
        raise faults.EvaluationAbandoned("the run was asked to stop (preemption) during this evaluation")


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


def _batches(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i : i + size] for i in range(0, len(indices), size)]


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
) -> dict:
    """One row of records.jsonl from the texts and scores of each sample of a query.

    `response_capped` / `revision_capped`: whether an answer / a last revision (of any sample)
    ended at max_new_tokens without a stop token, so was scored cut short. These and
    `answer_temperature` are None for texts generated elsewhere (`score_pairs`).
    `revision_truncated`: a refinement request was cut to max_prompt_tokens.
    """
    d_samples = [discrepancy(rev[0], resp[0]) for resp, rev in zip(scores_response, scores_revised)]
    d = finite_mean(d_samples)
    record = {
        "id": prepared.query.id,
        "category": prepared.query.category,
        "query": prepared.query.text,
        "response": responses[0],
        "revisions": revisions_by_sample[0],
        "logp_response": finite_mean([s[0] for s in scores_response]),
        "logp_revised": finite_mean([s[0] for s in scores_revised]),
        "d": d,
        "n_tokens_response": scores_response[0][1],
        "n_tokens_revised": scores_revised[0][1],
        "confident": is_confident(d, delta),
        "truncated": prepared.truncated,
        "answer_temperature": answer_temperature,
        "response_capped": response_capped,
        "revision_capped": revision_capped,
        "revision_truncated": revision_truncated,
    }
    if len(responses) > 1:
        record.update(responses=responses, revisions_by_sample=revisions_by_sample, d_samples=d_samples)
    return record


def evaluate(
    model,
    tokenizer,
    queries: Sequence[Query],
    config: ProbDiffConfig,
    *,
    progress: bool = True,
    synced_gpus: bool = False,
    sync_n_chunks: Callable[[int], int] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[dict]:
    """Records for `queries`, in their order. A query's texts depend only on (seed, query id, sample).

    `should_stop` (a preemption's flag) is checked between phases and at every generated token; once it is true
    the evaluation raises `faults.EvaluationAbandoned`. Not with `synced_gpus`, where every rank must run the same
    forward passes: a sharded ZeRO-3 evaluation always finishes.

    Callers that hold the whole query set check `config.check_categories` on it first (the CLI and
    the callback do); here the queries may be one rank's share.
    """
    prepared = prepare_queries(
        tokenizer, queries, system_prompt=config.system_prompt, max_prompt_tokens=config.max_prompt_tokens
    )
    chains = [(qi, s) for qi in range(len(prepared)) for s in range(config.n_samples)]
    # Similar lengths together waste less padding; the sampler makes the order irrelevant to the texts.
    order = sorted(range(len(chains)), key=lambda c: -len(prepared[chains[c][0]].prompt_ids))
    batches = _batches(order, config.batch_size)
    template = refinement_template(config.refinement_prompt)
    answers: list[str] = [""] * len(chains)
    revisions: list[list[str]] = [[] for _ in chains]
    answer_capped: list[bool] = [False] * len(chains)
    revision_capped: list[bool] = [False] * len(chains)  # the last revision's
    request_cut: list[bool] = [False] * len(chains)  # any refinement request cut to max_prompt_tokens
    scores: list[list[tuple[float, int]]] = [[] for _ in chains]

    steps = len(batches) * (2 + config.n_revisions)
    bar = tqdm(total=steps, desc="ProbDiff", unit="batch", disable=not progress, dynamic_ncols=True)
    if synced_gpus:
        should_stop = None
    with inference_mode(model):
        for batch in batches:
            raise_if_asked_to_stop(should_stop)
            bar.set_postfix_str("answer")
            answers_batch, capped_batch = generate_texts(
                model,
                tokenizer,
                [prepared[chains[c][0]].prompt_ids for c in batch],
                [row_seed(config.seed, prepared[chains[c][0]].query.id, chains[c][1], "answer") for c in batch],
                [config.answer_temperature_for(prepared[chains[c][0]].query.category) for c in batch],
                [config.answer_top_p] * len(batch),
                config.max_new_tokens,
                synced_gpus,
                should_stop,
            )
            for c, text, capped in zip(batch, answers_batch, capped_batch):
                answers[c], answer_capped[c] = text, capped
            bar.update()
            faults.reached("answers-done")
            for round_ in range(1, config.n_revisions + 1):
                bar.set_postfix_str(f"revision {round_}")
                last = [revisions[c][-1] if revisions[c] else answers[c] for c in batch]
                requests = [
                    refinement_prompt_ids(
                        tokenizer,
                        config.system_prompt,
                        template,
                        prepared[chains[c][0]].text,
                        prev,
                        config.max_prompt_tokens,
                    )
                    for c, prev in zip(batch, last)
                ]
                for c, (_, cut) in zip(batch, requests):
                    request_cut[c] = request_cut[c] or cut
                revised, capped_batch = generate_texts(
                    model,
                    tokenizer,
                    [ids for ids, _ in requests],
                    [
                        row_seed(config.seed, prepared[chains[c][0]].query.id, chains[c][1], f"revision-{round_}")
                        for c in batch
                    ],
                    [config.revision_temperature] * len(batch),
                    [config.revision_top_p] * len(batch),
                    config.max_new_tokens,
                    synced_gpus,
                    should_stop,
                )
                for c, text, capped in zip(batch, revised, capped_batch):
                    revisions[c].append(text)
                    revision_capped[c] = capped
                bar.update()
            faults.reached("revisions-done")
            raise_if_asked_to_stop(should_stop)
            bar.set_postfix_str("score")
            texts = [answers[c] for c in batch] + [revisions[c][-1] for c in batch]
            prompts = [prepared[chains[c][0]].prompt_ids for c in batch] * 2
            batch_scores = score_texts(model, tokenizer, prompts, texts, config, sync_n_chunks)
            for c, s_answer, s_revised in zip(batch, batch_scores[: len(batch)], batch_scores[len(batch) :]):
                scores[c] = [s_answer, s_revised]
            bar.update()
    bar.close()

    records = []
    for qi, item in enumerate(prepared):
        mine = [c for c, (q, _) in enumerate(chains) if q == qi]
        records.append(
            build_record(
                item,
                [answers[c] for c in mine],
                [revisions[c] for c in mine],
                [scores[c][0] for c in mine],
                [scores[c][1] for c in mine],
                config.delta,
                answer_temperature=config.answer_temperature_for(item.query.category),
                response_capped=any(answer_capped[c] for c in mine),
                revision_capped=any(revision_capped[c] for c in mine),
                revision_truncated=any(request_cut[c] for c in mine),
            )
        )
    return records


def score_texts(
    model,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    texts: Sequence[str],
    config: ProbDiffConfig,
    sync_n_chunks: Callable[[int], int] | None = None,
) -> list[tuple[float, int]]:
    """(mean log-prob, token count) of each text after its chat prompt; the text is tokenized on its own."""
    response_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return score_batch(model, prompts, response_ids, tokenizer.pad_token_id, config.score_chunk_tokens, sync_n_chunks)


def score_pairs(
    model,
    tokenizer,
    pairs: Sequence[tuple[Query, str, str]],
    config: ProbDiffConfig,
    *,
    progress: bool = True,
) -> list[dict]:
    """Records for texts generated elsewhere: rows of (query, response, revised)."""
    prepared = prepare_queries(
        tokenizer,
        [q for q, _, _ in pairs],
        system_prompt=config.system_prompt,
        max_prompt_tokens=config.max_prompt_tokens,
    )
    records = []
    with inference_mode(model):
        for start in tqdm(range(0, len(pairs), config.batch_size), desc="Scoring", unit="batch", disable=not progress):
            chunk = list(range(start, min(start + config.batch_size, len(pairs))))
            texts = [pairs[i][1] for i in chunk] + [pairs[i][2] for i in chunk]
            prompts = [prepared[i].prompt_ids for i in chunk] * 2
            batch_scores = score_texts(model, tokenizer, prompts, texts, config)
            for j, i in enumerate(chunk):
                records.append(
                    build_record(
                        prepared[i],
                        [pairs[i][1]],
                        [[pairs[i][2]]],
                        [batch_scores[j]],
                        [batch_scores[len(chunk) + j]],
                        config.delta,
                    )
                )
    return records
