"""`probdiff score`: ProbDiff on texts generated elsewhere, rows of (query, response, revised), each scored under
the query's chat prompt as `evaluator.evaluate` scores its own answer and last revision."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.evaluator import Evaluation, build_record, inference_mode, stage_clock
from probdiff_callback.core.prompts import prepare_queries
from probdiff_callback.core.queries import Query
from probdiff_callback.core.records import Cost
from probdiff_callback.core.scoring import score_texts


def score_pairs(
    model,
    tokenizer,
    pairs: Sequence[tuple[Query, str, str]],
    config: ProbDiffConfig,
    *,
    progress: bool = True,
) -> Evaluation:
    """Records for texts generated elsewhere: rows of (query, response, revised); the cost is the scoring's."""
    prepared = prepare_queries(
        tokenizer,
        [q for q, _, _ in pairs],
        system_prompt=config.system_prompt,
        max_prompt_tokens=config.max_prompt_tokens,
    )
    records = []
    cost, clock = Cost(), stage_clock(model)
    with inference_mode(model):
        for start in tqdm(range(0, len(pairs), config.batch_size), desc="Scoring", unit="batch", disable=not progress):
            chunk = list(range(start, min(start + config.batch_size, len(pairs))))
            prompts = [prepared[i].prompt_ids for i in chunk]
            started = clock()
            batch_scores = score_texts(model, tokenizer, prompts, [[pairs[i][1], pairs[i][2]] for i in chunk], config)
            cost.scoring_seconds += clock() - started
            for i, (s_response, s_revised) in zip(chunk, batch_scores):
                records.append(
                    build_record(prepared[i], [pairs[i][1]], [[pairs[i][2]]], [s_response], [s_revised], config.delta)
                )
    return Evaluation(records, cost)
