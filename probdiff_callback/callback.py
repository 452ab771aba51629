"""ProbDiffCallback: the core evaluator run on the model being trained, at every evaluation or checkpoint.

A thin adapter between the Trainer's hooks and the core (`evaluator.evaluate`,
`metric.summarize`). Hooks receive neither the trainer nor its accelerator, so, as trl's
callbacks do, the callback is built with the trainer:

    ProbDiffCallback.attach(trainer, queries, config)

Distributed runs: every rank evaluates an equal share of the queries (padded so every
rank makes the same number of decoding and forward calls, which ZeRO-3 needs), the
records are gathered in query order and every rank summarises the same records, so
the metric handed to the Trainer is identical on all ranks.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import (
    EarlyStoppingCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from probdiff_callback import history, reference_metrics, versus_base
from probdiff_callback.config import ProbDiffConfig
from probdiff_callback.evaluator import evaluate
from probdiff_callback.io import Query, queries_from, read_jsonl
from probdiff_callback.metric import delta_key, summarize

logger = logging.getLogger(__name__)

METRIC_PREFIX = "eval_probdiff_"
WANDB_HISTOGRAM_KEY = "eval/probdiff_d"
WANDB_TABLE_KEY = "eval/probdiff_records"
WANDB_TABLE_COLUMNS = ["step", "id", "category", "query", "response", "revision", "logp_response", "logp_revised", "d"]


@dataclass
class EvaluationOutcome:
    records: list[dict]
    summary: dict | None
    error: str | None
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)


def select_queries(queries: Sequence[Query], n_queries: int | None, seed: int) -> list[Query]:
    """A fixed subset of `n_queries`, drawn once with `seed`, kept in file order (without
    touching the global RNG, which drives training)."""
    ids = [q.id for q in queries]
    if len(set(ids)) != len(ids):
        raise ValueError("query ids must be unique: evaluations are compared query by query")
    if not queries:
        raise ValueError("ProbDiffCallback needs at least one held-out query")
    if n_queries is None or n_queries >= len(queries):
        return list(queries)
    chosen = sorted(random.Random(seed).sample(range(len(queries)), n_queries))
    return [queries[i] for i in chosen]


def pad_to_equal_shards(items: Sequence[Any], n_shards: int) -> list[list[Any]]:
    """Contiguous shards of equal length: the last item repeats as padding, so every rank
    makes the same number of decoding and forward calls. Concatenated shards start with `items`."""
    if not items:
        raise ValueError("nothing to shard")
    per_shard = math.ceil(len(items) / n_shards)
    padded = list(items) + [items[-1]] * (per_shard * n_shards - len(items))
    return [padded[i * per_shard : (i + 1) * per_shard] for i in range(n_shards)]


def metric_name(part: str) -> str:
    """A metric key safe for W&B and TensorBoard (categories may hold spaces or slashes)."""
    return METRIC_PREFIX + "".join(c if c.isalnum() or c in "-._" else "_" for c in part)


def metrics_from_summary(summary: dict | None, sweep: Sequence[float], categories: Sequence[str]) -> dict[str, float]:
    """The eval_probdiff_* metrics of a summary; NaN everywhere for a failed evaluation
    (a missing key would make the Trainer raise KeyError in `_determine_best_metric`)."""
    nan = math.nan
    if summary is None:
        summary = {"confidence": nan, "confidence_ci": [nan, nan], "d_mean": nan, "d_median": nan, "n_invalid": nan,
                   "logp_response_mean": nan, "logp_revised_mean": nan, "by_category": {},
                   "confidence_sweep": {delta_key(d): nan for d in sweep}}

    def number(value) -> float:
        return nan if value is None else float(value)

    metrics = {
        metric_name("confidence"): number(summary["confidence"]),
        metric_name("confidence_ci_low"): number(summary["confidence_ci"][0]),
        metric_name("confidence_ci_high"): number(summary["confidence_ci"][1]),
        metric_name("d_mean"): number(summary["d_mean"]),
        metric_name("d_median"): number(summary["d_median"]),
        metric_name("logp_response"): number(summary["logp_response_mean"]),
        metric_name("logp_revised"): number(summary["logp_revised_mean"]),
        metric_name("n_invalid"): number(summary["n_invalid"]),
    }
    for key, value in summary["confidence_sweep"].items():
        metrics[metric_name(f"confidence_at_{key}")] = number(value)
    for category in categories:
        metrics[metric_name(f"confidence_{category}")] = number(summary["by_category"].get(category, {}).get("confidence"))
    return metrics


@contextlib.contextmanager
def preserved_rng_state() -> Iterator[None]:
    """Training RNG streams (python, numpy, torch CPU and CUDA) as they were before: the
    evaluation must not shift dropout masks or data order."""
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


@contextlib.contextmanager
def preserved_padding_side(tokenizer) -> Iterator[None]:
    side = getattr(tokenizer, "padding_side", None)
    try:
        yield
    finally:
        if side is not None:
            tokenizer.padding_side = side


def is_zero3(accelerator) -> bool:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def _has_activation_checkpointing_api(model) -> bool:
    # transformers 5.x renamed gradient_checkpointing_* to activation_checkpointing_* (the old names warn)
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
    kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None) or getattr(args, "gradient_checkpointing_kwargs", None) or {})
    every_n_layers, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    if modern:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None, every_n_layers=every_n_layers, offload=offload)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)


@contextlib.contextmanager
def unwrapped_for_evaluation(model_wrapped, accelerator, gather_params: bool, args: TrainingArguments):
    """The bare model (PEFT wrapper included) ready for generate, as trl's
    `unwrap_model_for_generation`: activation checkpointing off, and under ZeRO-3 the
    parameters gathered once for the whole evaluation unless `gather_params` is False."""
    unwrapped = accelerator.unwrap_model(model_wrapped)
    checkpointing = activation_checkpointing_on(unwrapped)
    if checkpointing:
        set_activation_checkpointing(unwrapped, False, args)
    try:
        if is_zero3(accelerator) and gather_params:
            import deepspeed
            from trl.models.utils import add_hooks, remove_hooks

            with deepspeed.zero.GatheredParameters(model_wrapped.parameters()):
                remove_hooks(model_wrapped)
                try:
                    yield unwrapped
                finally:
                    add_hooks(model_wrapped)
        else:
            yield unwrapped
    finally:
        if checkpointing:
            set_activation_checkpointing(unwrapped, True, args)


def _max_over_ranks(device: torch.device):
    def sync(count: int) -> int:
        value = torch.tensor([count], dtype=torch.long, device=device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        return int(value.item())

    return sync


def planned_evaluations(args: TrainingArguments, state: TrainerState, every: int, at_end: bool) -> int:
    """How many evaluations the run's schedule will trigger after the baseline (the last step
    included when `at_end` adds it)."""
    if args.eval_strategy == "steps" and state.eval_steps:
        interval, triggers = state.eval_steps, state.max_steps // state.eval_steps
    elif args.eval_strategy == "no" and args.save_strategy == "steps" and state.save_steps:
        interval, triggers = state.save_steps, state.max_steps // state.save_steps
    elif args.eval_strategy == "epoch" or (args.eval_strategy == "no" and args.save_strategy == "epoch"):
        steps_per_epoch = max(round(state.max_steps / max(state.num_train_epochs, 1)), 1)
        interval, triggers = steps_per_epoch, state.max_steps // steps_per_epoch
    else:
        return int(at_end)
    evaluated = triggers // every
    last_is_evaluated = evaluated > 0 and (state.max_steps % (interval * every) == 0)
    return evaluated + int(at_end and not last_is_evaluated)


class ProbDiffCallback(TrainerCallback):
    """Evaluates the model being trained with ProbDiff and hands the metric to the Trainer.

    `ProbDiffCallback.attach(trainer, queries, config, n_queries=32)` builds it and adds
    it before any `EarlyStoppingCallback` (early stopping reads the metric in its own
    `on_evaluate`, so it must run after this one). `trainer.add_callback(ProbDiffCallback(...))`
    works too: the callback moves itself before early stopping when training begins.
    """

    def __init__(self, trainer, queries: Any = None, config: ProbDiffConfig | None = None, *, tokenizer=None) -> None:
        self.trainer = trainer
        self.config = config if config is not None else ProbDiffConfig()
        self.tokenizer = tokenizer if tokenizer is not None else getattr(trainer, "processing_class", None)
        self.tokenizer = getattr(self.tokenizer, "tokenizer", self.tokenizer)  # a processor wraps the tokenizer
        if self.tokenizer is None or not callable(getattr(self.tokenizer, "apply_chat_template", None)):
            raise ValueError("ProbDiffCallback needs the chat tokenizer: give `tokenizer=` or build the trainer with processing_class")
        all_queries = queries_from(trainer.eval_dataset if queries is None else queries)
        self.config.check_categories(q.category for q in all_queries)  # all of them: the subset may miss a category
        self.queries = select_queries(all_queries, self.config.n_queries, self.config.seed)
        self.categories = sorted({q.category for q in self.queries if q.category is not None})
        self.reference_plan = reference_metrics.plan_references(self.queries)
        self.evaluated: dict[int, dict[str, float]] = {}  # global step -> its metrics
        self._baseline_records: list[dict] | None = None
        self._reference_notice_shown = False
        self.last_outcome: EvaluationOutcome | None = None
        self._triggers = 0
        self._wandb_table = None
        self._evaluation_seconds: float | None = None
        self._train_started_at: float | None = None
        self._seconds_evaluating_in_training = 0.0
        self._train_start_step = 0
        self._cost_reported = False

    # ---- paths ----
    @property
    def _output_dir(self) -> str:
        return self.trainer.args.output_dir

    @property
    def _history_path(self):
        return history.history_path(self._output_dir, self.config.output_subdir)

    def _is_main(self) -> bool:
        return self.trainer.state.is_world_process_zero

    # ---- hooks ----
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._place_before_early_stopping()
        self._check_selection_setup(args)
        self._train_start_step = state.global_step
        self._triggers = 0
        self._show_reference_notice()
        kept: list[dict] = []
        baseline_records = None
        if self._is_main():
            kept, dropped = history.continue_history(self._history_path, state.global_step)
            baseline_records = self._read_baseline_records(kept)
            if dropped and state.global_step == 0:
                logger.warning(f"ProbDiff: a new run in {self._output_dir}: replacing the {dropped} rows of an earlier history")
            elif dropped:
                logger.warning(
                    f"ProbDiff: resumed at step {state.global_step}; dropped {dropped} history rows of later steps "
                    "(they are trained and evaluated again)"
                )
        kept, self._baseline_records = self._broadcast((kept, baseline_records))
        self.evaluated = {row["global_step"]: self._metrics(row["summary"], row.get("vs_base")) for row in kept}
        if self.config.baseline and state.global_step == 0 and 0 not in self.evaluated:
            self._run(state, kind="baseline", base_model=True)
            self._report_planned_cost(args, state)
        self._train_started_at = time.perf_counter()
        self._seconds_evaluating_in_training = 0.0

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._report_training_share(args, state)
        # The Trainer loads the best model before on_train_end, so the last step's weights are
        # evaluated here, when DefaultFlowCallback (which runs first) has decided this is the end.
        if (
            self.config.at_end
            and control.should_training_stop
            and state.global_step not in self.evaluated
            and not control.should_evaluate
            and not (args.eval_strategy == "no" and control.should_save)
        ):
            self._run(state, kind="end")

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, metrics: dict[str, float] | None = None, **kwargs: Any
    ) -> None:
        if metrics is None:
            return
        step = state.global_step
        if step not in self.evaluated:
            self._triggers += 1
            final = control.should_training_stop or state.global_step >= state.max_steps > 0
            if self._triggers % self.config.every != 0 and not (final and self.config.at_end):
                return
            self._run(state, kind="evaluate")
        metrics.update(self.evaluated[step])
        if self._is_main() and metrics.get("eval_loss") is not None:
            history.update_row(self._history_path, step, eval_loss=float(metrics["eval_loss"]))

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        step = state.global_step
        checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        if step not in self.evaluated and args.eval_strategy == "no":
            self._triggers += 1
            final = control.should_training_stop or step >= state.max_steps > 0
            if self._triggers % self.config.every == 0 or (final and self.config.at_end):
                self._run(state, kind="save", checkpoint=checkpoint)
                return
        if step in self.evaluated and self._is_main() and os.path.isdir(checkpoint):
            row = history.set_checkpoint(self._history_path, step, checkpoint)
            if row is not None:
                history.write_checkpoint_summary(checkpoint, row)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        # Only when the loaded weights are still the last step's (see on_step_end).
        if self.config.at_end and not args.load_best_model_at_end and state.global_step not in self.evaluated:
            self._run(state, kind="end")

    # ---- setup checks ----
    def _place_before_early_stopping(self) -> None:
        handler = self.trainer.callback_handler
        callbacks = list(handler.callbacks)
        if self not in callbacks:
            return
        early = [i for i, cb in enumerate(callbacks) if isinstance(cb, EarlyStoppingCallback)]
        mine = callbacks.index(self)
        if early and early[0] < mine:
            callbacks.pop(mine)
            callbacks.insert(early[0], self)
            # A new list, not an in-place edit: the handler may be iterating over the old one right now.
            handler.callbacks = callbacks
            logger.info("ProbDiff: moved ProbDiffCallback before EarlyStoppingCallback so early stopping sees its metric")

    def _check_selection_setup(self, args: TrainingArguments) -> None:
        metric = args.metric_for_best_model or ""
        if metric.removeprefix("eval_").startswith(("probdiff_", "ref_")) and args.eval_strategy != "no":
            if self.config.every != 1:
                raise ValueError(
                    f"metric_for_best_model={metric!r} needs ProbDiff at every evaluation, but every={self.config.every}: "
                    "set every=1 and space evaluations with eval_steps instead"
                )

    # ---- one evaluation ----
    def _run(self, state: TrainerState, *, kind: str, base_model: bool = False, checkpoint: str | None = None) -> EvaluationOutcome:
        outcome = self.evaluate_model(base_model=base_model)
        step = state.global_step
        if kind == "baseline" and outcome.error is None:
            self._baseline_records = outcome.records
        vs_base = None
        if kind != "baseline":
            vs_base = versus_base.compare_to_base(outcome.records, self._baseline_records, self.config.delta)
        outcome.metrics = self._metrics(outcome.summary, vs_base)
        self.evaluated[step] = outcome.metrics
        self.last_outcome = outcome
        if kind == "baseline" or self._evaluation_seconds is None:
            self._evaluation_seconds = outcome.seconds
        if self._train_started_at is not None:
            self._seconds_evaluating_in_training += outcome.seconds
        if outcome.error is not None:
            logger.error(f"ProbDiff evaluation at step {step} failed; training goes on:\n{outcome.error}")
        self._log(state, outcome)
        if self._is_main():
            self._persist(state, kind, base_model, checkpoint, outcome, vs_base)
        if outcome.error is not None and self.config.fail_on_error:
            raise RuntimeError(f"ProbDiff evaluation at step {step} failed (fail_on_error=True):\n{outcome.error}")
        return outcome

    def evaluate_model(self, *, base_model: bool = False) -> EvaluationOutcome:
        """Evaluate the current weights on the query subset, on all ranks; every rank returns
        the same records (in query order), summary, metrics and error."""
        trainer = self.trainer
        accelerator = trainer.accelerator
        n_ranks = accelerator.num_processes
        sharded = is_zero3(accelerator) and not self.config.gather_params
        started = time.perf_counter()
        records: list[dict] = []
        error = None
        try:
            with preserved_rng_state(), preserved_padding_side(self.tokenizer), unwrapped_for_evaluation(
                trainer.model_wrapped, accelerator, self.config.gather_params, trainer.args
            ) as model:
                adapters_off = model.disable_adapter() if base_model and hasattr(model, "disable_adapter") else contextlib.nullcontext()
                with adapters_off:
                    records = evaluate(
                        model,
                        self.tokenizer,
                        pad_to_equal_shards(self.queries, n_ranks)[accelerator.process_index],
                        self.config,
                        progress=self.config.progress and accelerator.is_main_process,
                        synced_gpus=sharded,
                        sync_n_chunks=_max_over_ranks(accelerator.device) if sharded else None,
                    )
        except Exception:
            error = f"rank {accelerator.process_index}: {traceback.format_exc()}"
        if n_ranks > 1:
            from accelerate.utils import gather_object

            # Every rank learns of a failure anywhere, and only then do all gather the records.
            errors = [e for e in gather_object([error]) if e is not None]
            error = "\n".join(errors) if errors else None
            records = gather_object(records) if error is None else []
        records = records[: len(self.queries)] if error is None else []
        summary = None
        if error is None:
            try:  # deterministic on the gathered records: every rank fails alike or not at all
                if self.reference_plan.active:
                    records = reference_metrics.score_records(records, self.queries)
                summary = summarize(records, self.config.delta, self.config.sweep)
                reference = reference_metrics.summarize_references(records)
                if reference is not None:
                    summary["reference"] = reference
            except Exception:
                error, records = f"summary: {traceback.format_exc()}", []
        return EvaluationOutcome(
            records=records,
            summary=summary,
            error=error,
            seconds=time.perf_counter() - started,
            metrics=self._metrics(summary, None),
        )

    def _metrics(self, summary: dict | None, vs_base: dict | None) -> dict[str, float]:
        """Every metric of one evaluation for the Trainer: eval_probdiff_*, eval_ref_* (where the queries
        have reference metrics) and eval_probdiff_vs_base_* (when the baseline is evaluated)."""
        metrics = metrics_from_summary(summary, self.config.sweep, self.categories)
        reference = None if summary is None else summary.get("reference")
        metrics.update(reference_metrics.trainer_metrics(reference, self.reference_plan))
        if self.config.baseline:
            metrics.update(versus_base.trainer_metrics(vs_base))
        return metrics

    def _read_baseline_records(self, rows: Sequence[dict]) -> list[dict] | None:
        row = next((r for r in rows if r.get("kind") == "baseline" and r.get("records")), None)
        if row is None:
            return None
        path = history.probdiff_dir(self._output_dir, self.config.output_subdir) / row["records"]
        return read_jsonl(path) if path.is_file() else None

    def _show_reference_notice(self) -> None:
        notice = self.reference_plan.notice()
        if notice and not self._reference_notice_shown and self._is_main():
            print(f"ProbDiff: {notice}", flush=True)
        self._reference_notice_shown = True

    def _broadcast(self, value: Any) -> Any:
        accelerator = self.trainer.accelerator
        if accelerator.num_processes == 1:
            return value
        from accelerate.utils import broadcast_object_list

        holder = [value]
        broadcast_object_list(holder, from_process=0)
        return holder[0]

    # ---- logging and files ----
    def _log(self, state: TrainerState, outcome: EvaluationOutcome) -> None:
        # Trainer.evaluate logs its metrics before on_evaluate, so ours need their own log call
        # (W&B, TensorBoard and log_history then get them at this step).
        self.trainer.log(dict(outcome.metrics))
        if self._is_main() and "wandb" in (self.trainer.args.report_to or []):
            try:
                self._log_wandb(state.global_step, outcome)
            except Exception:  # the scalars went through trainer.log; the extras are not worth the run
                logger.exception(f"ProbDiff: logging the histogram and table of step {state.global_step} to W&B failed")

    def _log_wandb(self, step: int, outcome: EvaluationOutcome) -> None:
        import wandb

        if wandb.run is None:
            return
        payload: dict[str, Any] = {"train/global_step": step}
        ds = [r["d"] for r in outcome.records if r["d"] is not None and math.isfinite(r["d"])]
        if ds:  # wandb.Histogram raises on NaN; the invalid ones are counted in eval/probdiff_n_invalid
            payload[WANDB_HISTOGRAM_KEY] = wandb.Histogram(ds)
        if self.config.wandb_table_rows and outcome.records:
            if self._wandb_table is None:
                self._wandb_table = wandb.Table(columns=WANDB_TABLE_COLUMNS, log_mode="INCREMENTAL")
            for record in outcome.records[: self.config.wandb_table_rows]:
                self._wandb_table.add_data(
                    step, record["id"], record["category"], record["query"], record["response"],
                    record["revisions"][-1] if record["revisions"] else "", record["logp_response"], record["logp_revised"], record["d"],
                )
            payload[WANDB_TABLE_KEY] = self._wandb_table
        if len(payload) > 1:
            wandb.log(payload)

    def _persist(
        self,
        state: TrainerState,
        kind: str,
        base_model: bool,
        checkpoint: str | None,
        outcome: EvaluationOutcome,
        vs_base: dict | None,
    ) -> None:
        step = state.global_step
        records_path = history.step_records_path(self._output_dir, step, self.config.output_subdir)
        if outcome.error is None:
            history.write_step_records(records_path, outcome.records)
        if checkpoint is not None and not os.path.isdir(checkpoint):
            checkpoint = None
        row = {
            "global_step": step,
            "epoch": state.epoch,
            "kind": kind,
            "base_model": base_model,
            "checkpoint": checkpoint,
            "records": str(records_path.relative_to(history.probdiff_dir(self._output_dir, self.config.output_subdir)))
            if outcome.error is None
            else None,
            "summary": outcome.summary,
            "error": outcome.error,
            "seconds": round(outcome.seconds, 3),
            "vs_base": vs_base,
        }
        history.upsert_history_row(self._history_path, row)
        if checkpoint is not None:
            history.write_checkpoint_summary(checkpoint, row)

    # ---- cost report ----
    def _report_planned_cost(self, args: TrainingArguments, state: TrainerState) -> None:
        if not self._is_main() or self._evaluation_seconds is None:
            return
        planned = planned_evaluations(args, state, self.config.every, self.config.at_end)
        print(
            f"ProbDiff: one evaluation ({len(self.queries)} queries, max_new_tokens={self.config.max_new_tokens}) "
            f"took {self._evaluation_seconds:.1f}s; about {planned} more planned, "
            f"{planned * self._evaluation_seconds:.0f}s in all. Their share of the training time is printed after the first steps.",
            flush=True,
        )

    def _report_training_share(self, args: TrainingArguments, state: TrainerState) -> None:
        if self._cost_reported or self._train_started_at is None or self._evaluation_seconds is None or not self._is_main():
            return
        done = state.global_step - self._train_start_step
        remaining = state.max_steps - self._train_start_step
        if done < min(3, remaining):
            return
        self._cost_reported = True
        # Evaluations run since train begin are not training time.
        train_seconds = time.perf_counter() - self._train_started_at - self._seconds_evaluating_in_training
        per_step = max(train_seconds, 0.0) / done
        planned_training = per_step * remaining
        planned = planned_evaluations(args, state, self.config.every, self.config.at_end)
        evaluation_total = planned * self._evaluation_seconds
        added = f"{100 * evaluation_total / planned_training:.0f}% of the training time" if planned_training > 0 else "all of the run's time"
        print(
            f"ProbDiff: training {per_step:.2f}s/step, about {planned_training:.0f}s for {remaining} steps; "
            f"{planned} evaluations of {self._evaluation_seconds:.1f}s add {evaluation_total:.0f}s, {added}",
            flush=True,
        )
