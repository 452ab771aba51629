"""The trainer's model evaluated across ranks, one gathered outcome that every rank holds: every rank generates and
scores an equal share, with HF `generate` or (`use_vllm=true`, vLLM in the evaluating process) its own vLLM engine;
or, through a server, the main process's vLLM writes every text and every rank scores an equal share. Here too: vLLM
started for the trainer's model, where a run can have it.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from probdiff_callback.callback.model_in_training import model_for_evaluation
from probdiff_callback.callback.ranks import broadcast, is_zero3, max_over_ranks, run_in_shares
from probdiff_callback.core import reference_metrics
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.evaluator import (
    ABANDONED,
    Chain,
    Evaluation,
    EvaluationAbandoned,
    evaluate,
    generate_chains,
    inference_mode,
    make_chains,
    records_from_chains,
    score_chains,
    stage_clock,
    summarise,
)
from probdiff_callback.core.queries import Query
from probdiff_callback.core.records import Cost, Record, Summary
from probdiff_callback.generation.vllm import VLLMGeneration, in_this_process


@dataclass
class EvaluationOutcome:
    records: list[Record]
    summary: Summary | None
    error: str | None
    seconds: float
    # each stage's seconds (the slowest rank's; the reference metrics' this rank's own, which every rank computes) and
    # the tokens generated on all ranks; None on failure
    cost: Cost | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    abandoned: bool = False  # given up for a preemption: not a failure, the resumed run evaluates the step


def evaluate_trainer_model(
    trainer,
    tokenizer,
    queries: Sequence[Query],
    config: ProbDiffConfig,
    reference_plan: reference_metrics.ReferencePlan,
    base_model: bool = False,
    should_stop: Callable[[], bool] | None = None,
    vllm: VLLMGeneration | None = None,
) -> EvaluationOutcome:
    """The trainer's current weights evaluated on `queries`, shared across ranks, and summarised with the reference
    metrics `reference_plan` (the queries' `plan_references`) promises; every rank returns the same records (in query
    order), summary, error and cost (but for the reference metrics' seconds, each rank's own). `should_stop` abandons
    the evaluation (`evaluator.evaluate`). With `config.use_vllm`, `vllm` writes the texts: each rank's own (vLLM in
    this process), or the main process's (a server; None on the others)."""
    started = time.perf_counter()
    if config.use_vllm and not in_this_process(config):
        gathered, error = _records_by_vllm(trainer, tokenizer, queries, config, vllm, base_model, should_stop)
    else:
        gathered, error = _records_in_shares(trainer, tokenizer, queries, config, base_model, should_stop, vllm)
    if error is not None:
        return EvaluationOutcome([], None, error, time.perf_counter() - started, abandoned=ABANDONED in error)
    try:  # deterministic on the gathered records: every rank fails alike or not at all
        evaluation, summary = summarise(gathered, queries, config, reference_plan)
    except Exception:
        return EvaluationOutcome([], None, f"summary: {traceback.format_exc()}", time.perf_counter() - started)
    seconds = time.perf_counter() - started
    return EvaluationOutcome(evaluation.records, summary, None, seconds, evaluation.cost)


def _records_in_shares(
    trainer,
    tokenizer,
    queries: Sequence[Query],
    config: ProbDiffConfig,
    base_model: bool,
    should_stop,
    vllm: VLLMGeneration | None = None,
) -> tuple[Evaluation, str | None]:
    """Every rank evaluates an equal share (`evaluator.evaluate`: HF generate or this rank's vLLM engine, then
    scoring); under ZeRO-3 with `gather_params=false` the parameters stay sharded and the ranks generate in step. A
    rank's vLLM gets the weights being evaluated in memory (gathered on every rank under ZeRO-3) and sleeps after its
    share."""
    accelerator = trainer.accelerator
    sharded = is_zero3(accelerator) and not config.gather_params and vllm is None

    def one_share(share: list[Query]) -> tuple[list[Record], Cost]:
        gather = config.gather_params or vllm is not None
        with contextlib.ExitStack() as stack:
            model = stack.enter_context(model_for_evaluation(trainer, gather_params=gather, base_model=base_model))
            engine = None if vllm is None else stack.enter_context(vllm.holding(model, base_model=base_model))
            evaluation = evaluate(
                model,
                tokenizer,
                share,
                config,
                engine=engine,
                progress=config.progress and accelerator.is_main_process,
                synced_gpus=sharded,
                sync_n_chunks=max_over_ranks(accelerator.device) if sharded else None,
                should_stop=should_stop,
            )
        if vllm is not None:
            vllm.sleep()
        return evaluation.records, evaluation.cost

    records, cost, error = run_in_shares(accelerator, queries, one_share)
    return Evaluation(records, cost), error


def _records_by_vllm(
    trainer,
    tokenizer,
    queries: Sequence[Query],
    config: ProbDiffConfig,
    vllm: VLLMGeneration | None,
    base_model: bool,
    should_stop,
) -> tuple[Evaluation, str | None]:
    """A server's vLLM writes every text through the main process (which holds it) while the other ranks wait; then
    every rank scores an equal share with the model in training, as without vLLM. The weights go to vLLM first: under
    ZeRO-3 they are gathered on every rank (a collective), and the main process writes or links them. The cost: the
    main process's writing, then the ranks' scoring side by side."""
    accelerator = trainer.accelerator
    error: str | None = None
    chains, written = None, Cost()
    with model_for_evaluation(trainer, gather_params=True, base_model=base_model) as model:
        if accelerator.is_main_process:
            try:
                with vllm.holding(model, base_model=base_model) as engine:
                    chains = make_chains(tokenizer, queries, config)
                    total = len(chains) * (1 + config.n_revisions)
                    with tqdm(total=total, desc="ProbDiff (vLLM)", unit="text", disable=not config.progress) as bar:
                        written = generate_chains(chains, tokenizer, engine, config, bar=bar, should_stop=should_stop)
                vllm.sleep()
            except EvaluationAbandoned as err:
                error = f"rank 0: {ABANDONED}: {err}"
            except Exception:
                error = f"rank 0 (vLLM): {traceback.format_exc()}"
        chains, written, error = broadcast(accelerator, (chains, written, error))
        if error is not None:
            return Evaluation([]), error

        def scored(share: list[Chain]) -> tuple[list[Chain], Cost]:
            clock = stage_clock(model)
            with inference_mode(model):
                started = clock()
                score_chains(model, tokenizer, share, config)
                return share, Cost(scoring_seconds=clock() - started)

        chains, scoring, error = run_in_shares(accelerator, chains, scored)
    if error is not None:
        return Evaluation([]), error
    return Evaluation(records_from_chains(chains, config), written + scoring), None


def start_vllm(trainer, tokenizer, config: ProbDiffConfig) -> VLLMGeneration:
    """The run's vLLM (`config.vllm_mode`) for the model in `trainer`, on this rank: the engine in this process on the
    base model's folder, or the server you started. Refused where the run cannot hand it the weights."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    if getattr(model, "peft_config", {}).get("default") is None and config.vllm_mode == "server":
        raise ValueError(
            "vllm_mode=server takes LoRA adapters only, and this run fine-tunes all weights: train with LoRA, or use "
            "vllm_mode=colocate (it reloads the whole weights at each evaluation) or the HF engine (use_vllm=false)"
        )
    if is_zero3(trainer.accelerator) and not config.gather_params:
        raise ValueError("use_vllm=true needs the whole weights on the main process: set gather_params=true")
    where = os.path.join(trainer.args.output_dir, config.output_subdir)
    return VLLMGeneration.start(config, model, tokenizer, scratch_parent=where)
