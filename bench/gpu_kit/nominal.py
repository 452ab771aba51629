"""The floor alone, from nominal bandwidth and FLOP/s (`--floor-only`): no model, no device. Every row is
assumed to run to the cap."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from probdiff_callback.core import prompts
from probdiff_callback.core.config import ProbDiffConfig

from .floor import DecodeFloor, Hardware, ModelCost, cost_figures, decode_floor, scoring_floor, training_floor
from .report import Figure, gib, seconds
from .workload import Workload, cycled_queries, probdiff_config, workload_figure


@dataclass
class ComputedBatch:
    answer: DecodeFloor
    revision: DecodeFloor
    scoring: float
    kv_cache_bytes: float  # the revision stage's cache: every row's prompt and its new tokens

    @property
    def total(self) -> float:
        return self.answer.total + self.revision.total + self.scoring


def computed_batch(
    tokenizer, batch: Sequence[prompts.PreparedQuery], config: ProbDiffConfig, cost: ModelCost, hardware: Hardware
) -> ComputedBatch:
    """The floor of one evaluation batch if every row runs to the cap: answer prompts as the evaluator builds
    them, revision prompts holding a max_new_tokens answer, both texts scored under the answer prompt."""
    cap = config.max_new_tokens
    template = prompts.refinement_template(config.refinement_prompt)
    answer_prompts = [len(q.prompt_ids) for q in batch]
    revision_prompts = [
        len(prompts.chat_prompt_ids(tokenizer, config.system_prompt, prompts.refinement_request(template, q.text, "")))
        + cap
        for q in batch
    ]
    steps = [cap] * len(batch)
    return ComputedBatch(
        decode_floor(cost, hardware, answer_prompts, steps),
        decode_floor(cost, hardware, revision_prompts, steps),
        scoring_floor(cost, hardware, answer_prompts, [[cap, cap]] * len(batch)),
        (sum(revision_prompts) + len(batch) * cap) * cost.kv_bytes_per_token,
    )


def summed(floors: Sequence[DecodeFloor]) -> DecodeFloor:
    return DecodeFloor(*(sum(getattr(f, part) for f in floors) for part in ("prefill", "weights", "kv_cache")))


def split(floor: DecodeFloor) -> str:
    return f"weights {seconds(floor.weights)} + KV cache {seconds(floor.kv_cache)} + prefill {seconds(floor.prefill)}"


def computed_floor_figures(
    tokenizer, cost: ModelCost, hardware: Hardware, recipe: dict, workload: Workload
) -> list[Figure]:
    """The floor of one evaluation, of a LoRA sequence and per query at each decode batch."""
    config = probdiff_config(recipe, workload)

    def prepared(n: int) -> list[prompts.PreparedQuery]:
        return prompts.prepare_queries(
            tokenizer, cycled_queries(n), system_prompt=config.system_prompt, max_prompt_tokens=config.max_prompt_tokens
        )

    queries = sorted(prepared(workload.queries), key=lambda q: -len(q.prompt_ids))  # as the evaluator batches them
    size = workload.batch_size
    batches = [
        computed_batch(tokenizer, queries[i : i + size], config, cost, hardware) for i in range(0, len(queries), size)
    ]
    answer, revision = summed([b.answer for b in batches]), summed([b.revision for b in batches])
    scoring = sum(b.scoring for b in batches)
    total = answer.total + revision.total + scoring
    every_row = f"{len(batches)} batches x {workload.max_new_tokens} steps, every row to the cap"
    figures = [
        Figure("computed floor: answer decoding", seconds(answer.total), f"{every_row}: {split(answer)}",
               {"floor_s": answer.total}),
        Figure("computed floor: revision decoding", seconds(revision.total),
               f"{every_row}, the answer inside the prompt: {split(revision)}", {"floor_s": revision.total}),
        Figure("computed floor: scoring", seconds(scoring), f"{2 * len(queries)} texts, FLOPs / FLOP/s",
               {"floor_s": scoring}),
        Figure("computed floor: evaluation", seconds(total), "the sum", {"floor_s": total}),
    ]  # fmt: skip
    sequences = recipe["per_device_train_batch_size"] * recipe["gradient_accumulation_steps"]
    every = recipe["eval_steps"]
    for tokens in workload.train_tokens:
        sequence = training_floor(cost, hardware, tokens)
        share = total / (total + every * sequences * sequence)
        figures.append(
            Figure(
                f"computed floor: LoRA sequence of {tokens} tokens",
                seconds(sequence),
                f"forward + recomputation + backward; at the floor an evaluation every {every} optimizer steps of "
                f"{sequences} sequences takes {100 * share:.1f}% of training time",
                {"floor_s": sequence, "share_at_floor": share},
            )
        )
    for size in workload.decode_batches:
        batch = computed_batch(tokenizer, prepared(size), config, cost, hardware)
        figures.append(
            Figure(
                f"computed floor: decode batch {size}",
                f"{seconds(batch.total / size)} per query",
                f"one batch of {size} queries; KV cache of its revision stage {gib(batch.kv_cache_bytes)}; revision "
                f"{split(batch.revision)}",
                {"floor_per_query_s": batch.total / size, "kv_cache_bytes": batch.kv_cache_bytes},
            )
        )
    return figures


def floor_only(args: argparse.Namespace, recipe: dict, workload: Workload, tokenizer, cost: ModelCost, dtype):
    hardware = Hardware(args.bandwidth_gbps * 1e9, args.tflops * 1e12)
    figures = [
        Figure("model", f"--shape {args.shape}, {str(dtype).removeprefix('torch.')}"),
        Figure("hardware (nominal)", f"{args.bandwidth_gbps:g} GB/s, {args.tflops:g} TFLOP/s", "given, not measured"),
        workload_figure(workload, recipe["probdiff"]["n_revisions"]),
        *cost_figures(cost),
        *computed_floor_figures(tokenizer, cost, hardware, recipe, workload),
    ]
    return figures, ["Computed from nominal figures, not measured; every row is assumed to run to the cap."]
