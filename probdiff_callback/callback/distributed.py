"""The model in training, evaluated across ranks: equal shares through accelerate, one gathered result that every
rank holds; and the model made ready to generate in the middle of training and left as it was found.

Ready to generate: unwrapped (PEFT wrapper kept) and ZeRO-3 parameters gathered by trl's
`unwrap_model_for_generation`; around it, activation checkpointing off, the base model's LoRA adapters disabled where
asked, and the training RNG streams kept as they were. Not here: eval mode and the KV cache
(`evaluator.inference_mode`, which restores them), and the tokenizer's padding side, which the evaluation never
touches (it pads the ids by hand).
"""

from __future__ import annotations

import contextlib
import os
import random
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from accelerate.utils import broadcast_object_list, gather_object
from tqdm.auto import tqdm
from transformers import TrainingArguments

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

T = TypeVar("T")


def is_zero3(accelerator) -> bool:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def max_over_ranks(device: torch.device) -> Callable[[int], int]:
    """A function every rank calls with its own count and that returns the largest: sharded ZeRO-3
    generation runs that many chunks on every rank, since each forward pass gathers parameters from all."""

    def sync(count: int) -> int:
        value = torch.tensor([count], dtype=torch.long, device=device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        return int(value.item())

    return sync


def evaluate_sharded(
    accelerator, items: Sequence[Any], evaluate_share: Callable[[list], tuple[list[T], Cost]]
) -> tuple[list[T], Cost, str | None]:
    """(results in the order of `items`, what the ranks' shares cost side by side, error or None), the same on every
    rank.

    Each rank evaluates its contiguous share; shares are padded with the last item so every rank makes the
    same number of decoding and forward calls (ZeRO-3 hangs otherwise), and the padding's results are dropped
    before gathering (its cost was spent, and counts). A failure on any rank is reported on all of them, and then
    nothing is gathered.
    """
    positions = list(range(len(items)))
    with accelerator.split_between_processes(positions) as own:
        n_own = len(own)
    with accelerator.split_between_processes(positions, apply_padding=True) as padded:
        share = [items[i] for i in padded]
    results: list[T] = []
    cost, error = Cost(), None
    try:
        results, cost = evaluate_share(share)
        results = list(results)[:n_own]
    except EvaluationAbandoned as err:
        error = f"rank {accelerator.process_index}: {ABANDONED}: {err}"
    except Exception:
        error = f"rank {accelerator.process_index}: {traceback.format_exc()}"
    if accelerator.num_processes > 1:
        errors = [e for e in gather_object([error]) if e is not None]
        error = "\n".join(errors) if errors else None
        results = gather_object(results) if error is None else []
        cost = Cost.merged(gather_object([cost])) if error is None else Cost()
    return (results, cost, None) if error is None else ([], Cost(), error)


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


def evaluate_in_training(
    trainer,
    tokenizer,
    queries: Sequence[Query],
    config: ProbDiffConfig,
    reference_plan: reference_metrics.ReferencePlan,
    base_model: bool = False,
    should_stop: Callable[[], bool] | None = None,
    engine=None,
) -> EvaluationOutcome:
    """The trainer's current weights evaluated on `queries`, shared across ranks, and summarised with the reference
    metrics `reference_plan` (the queries' `plan_references`) promises; every rank returns the same records (in query
    order), summary, error and cost (but for the reference metrics' seconds, each rank's own). `should_stop` abandons
    the evaluation (`evaluator.evaluate`). With `config.use_vllm`, the main process's `engine` writes the texts
    (`_evaluate_with_engine`)."""
    accelerator = trainer.accelerator
    sharded = is_zero3(accelerator) and not config.gather_params
    started = time.perf_counter()

    def evaluate_share(share: list[Query]) -> tuple[list[Record], Cost]:
        with model_for_evaluation(trainer, gather_params=config.gather_params, base_model=base_model) as model:
            evaluation = evaluate(
                model,
                tokenizer,
                share,
                config,
                progress=config.progress and accelerator.is_main_process,
                synced_gpus=sharded,
                sync_n_chunks=max_over_ranks(accelerator.device) if sharded else None,
                should_stop=should_stop,
            )
        return evaluation.records, evaluation.cost

    if engine is not None or config.use_vllm:
        gathered, error = _evaluate_with_engine(trainer, tokenizer, queries, config, engine, base_model, should_stop)
    else:
        records, cost, error = evaluate_sharded(accelerator, queries, evaluate_share)
        gathered = Evaluation(records, cost)
    if error is not None and ABANDONED in error:
        return EvaluationOutcome([], None, error, time.perf_counter() - started, abandoned=True)
    if error is not None:
        return EvaluationOutcome([], None, error, time.perf_counter() - started)
    try:  # deterministic on the gathered records: every rank fails alike or not at all
        evaluation, summary = summarise(gathered, queries, config, reference_plan)
    except Exception:
        return EvaluationOutcome([], None, f"summary: {traceback.format_exc()}", time.perf_counter() - started)
    seconds = time.perf_counter() - started
    return EvaluationOutcome(evaluation.records, summary, None, seconds, evaluation.cost)


def _evaluate_with_engine(
    trainer, tokenizer, queries: Sequence[Query], config: ProbDiffConfig, engine, base_model: bool, should_stop
) -> tuple[Evaluation, str | None]:
    """vLLM writes every text on the main process (which holds the engine) while the other ranks wait; then every
    rank scores an equal share with the model in training, as without vLLM. The weights go to the engine first:
    under ZeRO-3 they are gathered on every rank (a collective), and the main process writes or links them. The cost:
    the main process's writing, then the ranks' scoring side by side."""
    from probdiff_callback.core.vllm_engine import load_evaluated_weights, scratch_folder, weight_sync

    accelerator = trainer.accelerator
    error: str | None = None
    chains, written = None, Cost()
    with model_for_evaluation(trainer, gather_params=True, base_model=base_model) as model:
        if accelerator.is_main_process:
            try:
                with scratch_folder(os.path.join(trainer.args.output_dir, config.output_subdir)) as scratch:
                    load_evaluated_weights(
                        engine, model, base_model=base_model, sync=weight_sync(config), scratch=scratch
                    )
                    chains = make_chains(tokenizer, queries, config)
                    total = len(chains) * (1 + config.n_revisions)
                    with tqdm(total=total, desc="ProbDiff (vLLM)", unit="text", disable=not config.progress) as bar:
                        written = generate_chains(chains, tokenizer, engine, config, bar=bar, should_stop=should_stop)
                    engine.sleep()
            except EvaluationAbandoned as err:
                error = f"rank 0: {ABANDONED}: {err}"
            except Exception:
                error = f"rank 0 (vLLM): {traceback.format_exc()}"
        chains, written, error = broadcast(accelerator, (chains, written, error))
        if error is not None:
            return Evaluation([]), error

        def score_share(share: list[Chain]) -> tuple[list[Chain], Cost]:
            clock = stage_clock(model)
            with inference_mode(model):
                started = clock()
                score_chains(model, tokenizer, share, config)
                return share, Cost(scoring_seconds=clock() - started)

        scored, scoring, error = evaluate_sharded(accelerator, chains, score_share)
    if error is not None:
        return Evaluation([]), error
    return Evaluation(records_from_chains(scored, config), written + scoring), None


def start_training_engine(trainer, tokenizer, config: ProbDiffConfig):
    """The run's vLLM engine (`config.vllm_mode`) for the model in `trainer`: a server this job starts on the base
    model's folder, with LoRA slots when the weights go to it as an adapter, or the server you started."""
    from probdiff_callback.core import vllm_engine
    from probdiff_callback.core.chat_format import stop_token_ids
    from probdiff_callback.core.vllm_engine import weight_sync

    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    peft_config = getattr(model, "peft_config", {}).get("default")
    if peft_config is None and config.vllm_mode == "server":
        raise ValueError(
            "vllm_mode=server takes LoRA adapters only, and this run fine-tunes all weights: train with LoRA, or use "
            "vllm_mode=colocate (it reloads the whole weights at each evaluation) or the HF engine (use_vllm=false)"
        )
    if is_zero3(trainer.accelerator) and not config.gather_params:
        raise ValueError("use_vllm=true needs the whole weights on the main process: set gather_params=true")
    lora = peft_config is not None and weight_sync(config) == "lora"
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    dtype = str(next(base.parameters()).dtype).removeprefix("torch.")
    return vllm_engine.start_engine(
        config,
        base.name_or_path,
        tokenizer,
        stop_token_ids(tokenizer, getattr(base, "generation_config", None)),
        dtype=dtype,
        max_lora_rank=int(peft_config.r) if lora else 0,
        threads=torch.get_num_threads(),
        log_dir=os.path.join(trainer.args.output_dir, config.output_subdir),
    )


def broadcast(accelerator, value: T) -> T:
    """The main process's `value` on every rank."""
    if accelerator.num_processes == 1:
        return value
    holder = [value]
    broadcast_object_list(holder, from_process=0)
    return holder[0]


@contextlib.contextmanager
def preserved_rng_state() -> Iterator[None]:
    """Training RNG streams (python, numpy, torch CPU and CUDA) as they were before: the evaluation must not
    shift dropout masks or data order."""
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    torch_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.random.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


def _has_activation_checkpointing_api(model) -> bool:
    # transformers 5 renamed gradient_checkpointing_* to activation_checkpointing_* (the old names warn)
    return hasattr(model, "activation_checkpointing_enable")


def activation_checkpointing_on(model) -> bool:
    if _has_activation_checkpointing_api(model):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def set_activation_checkpointing(model, enabled: bool, args: TrainingArguments) -> None:
    """Switch activation checkpointing; re-enabling uses the run's settings as the Trainer does."""
    modern = _has_activation_checkpointing_api(model)
    if not enabled:
        (model.activation_checkpointing_disable if modern else model.gradient_checkpointing_disable)()
        return
    kwargs = dict(
        getattr(args, "activation_checkpointing_kwargs", None)
        or getattr(args, "gradient_checkpointing_kwargs", None)
        or {}
    )
    every_n_layers, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    if modern:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=kwargs or None, every_n_layers=every_n_layers, offload=offload
        )
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)


@contextlib.contextmanager
def unwrapped_for_generation(model_wrapped, accelerator, gather_params: bool, args: TrainingArguments):
    """trl's `unwrap_model_for_generation` (the bare model, PEFT wrapper included; under ZeRO-3 the parameters
    gathered once for the whole evaluation and the optimizer's hooks lifted, unless `gather_params` is False),
    with two repairs:

    - activation checkpointing is switched off here, before trl looks, and back on with the run's own settings:
      trl re-enables it through the deprecated `gradient_checkpointing_enable` with `gradient_checkpointing_kwargs`
      only, which would drop the run's `every_n_layers` and `offload` (and warn at every evaluation);
    - trl puts the ZeRO-3 hooks back only when the body returns; an evaluation that fails (recorded, and training
      goes on) would leave the engine without them, so they are put back here.
    """
    from trl.models import utils as trl_utils  # trl's import is slow; only a training process comes here

    unwrapped = accelerator.unwrap_model(model_wrapped)
    checkpointing = activation_checkpointing_on(unwrapped)
    if checkpointing:
        set_activation_checkpointing(unwrapped, False, args)
    hooks_lifted = False
    try:
        with contextlib.ExitStack() as unwrapping:
            with warnings.catch_warnings():
                # trl asks `is_gradient_checkpointing` (deprecated in transformers 5); it is off by now either way
                warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
                model = unwrapping.enter_context(
                    trl_utils.unwrap_model_for_generation(
                        model_wrapped, accelerator, gather_deepspeed3_params=gather_params
                    )
                )
            hooks_lifted = is_zero3(accelerator) and gather_params
            yield model
        hooks_lifted = False  # the body returned: trl put them back
    finally:
        if hooks_lifted:
            trl_utils.add_hooks(model_wrapped)
        if checkpointing:
            set_activation_checkpointing(unwrapped, True, args)


@contextlib.contextmanager
def model_for_evaluation(trainer, *, gather_params: bool, base_model: bool):
    """The trainer's model ready to evaluate (with its LoRA adapters disabled for `base_model`); on exit,
    everything training relies on is as it was."""
    with (
        preserved_rng_state(),
        unwrapped_for_generation(trainer.model_wrapped, trainer.accelerator, gather_params, trainer.args) as model,
    ):
        adapters_off = base_model and hasattr(model, "disable_adapter")
        with model.disable_adapter() if adapters_off else contextlib.nullcontext():
            yield model
