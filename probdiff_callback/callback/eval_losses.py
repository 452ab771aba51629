"""The eval loss of each held-out conversation, beside the Trainer's mean.

The disagreement alarm grades an eval-loss change with a paired test over the same conversations at two steps, and the
Trainer keeps only their mean. So the callback taps the Trainer's own evaluation (`EvalLossTap`): a forward hook on
the model sees each eval batch's logits and labels as the Trainer computes its loss, and keeps each row's loss,
gathered with `gather_for_metrics` as the Trainer gathers its losses (every rank runs the same forward calls; the
padding of the last batches dropped). No second pass over the eval data, no RNG drawn. The result is in the order of
the eval dataset, so two steps of one run pair conversation by conversation.

Each conversation's loss is the mean cross-entropy over its loss tokens (labels other than -100: the assistant turns
with an assistant-only loss), shifted as transformers' causal-LM loss is. The Trainer's `eval_loss` is the mean over
batches of each batch's token mean: with one conversation per batch the two agree, otherwise they differ a little,
and the alarm prints the Trainer's mean and tests the per-conversation values.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100  # transformers' label for positions without loss


class PerExampleLossUnavailable(ValueError):
    """The eval batches do not hold one conversation per row (padding-free or packed batches)."""


@dataclass(frozen=True)
class ExampleLosses:
    losses: list[float]  # one per eval conversation, in the eval dataset's order; NaN: no loss token
    seconds: float  # what computing them took


def row_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over each row's loss tokens (token t+1 predicted at t); NaN for a row without one.

    One row at a time in float32, so at most one row's logits are ever upcast (the loss of transformers upcasts the
    whole batch's)."""
    losses = []
    for row_logits, row_labels in zip(logits, labels):
        targets = row_labels[1:].to(row_logits.device)
        per_token = torch.nn.functional.cross_entropy(
            row_logits[:-1].float(), targets, ignore_index=IGNORE_INDEX, reduction="sum"
        )
        n_tokens = int((targets != IGNORE_INDEX).sum())
        losses.append(per_token / n_tokens if n_tokens else torch.tensor(math.nan, device=row_logits.device))
    return torch.stack(losses)


def losses_of_output(output, labels: torch.Tensor) -> torch.Tensor:
    """Each row's loss from a forward's output: its logits, or, from trl's fused LM head (SFTTrainer's evaluation:
    `FusedCausalLMOutput`, no logits), each next-token label's log-probability and the mask of the loss tokens."""
    logits = getattr(output, "logits", None)
    if logits is not None:
        return row_losses(logits, labels)
    log_probs, mask = getattr(output, "log_probs", None), getattr(output, "label_mask", None)
    if log_probs is None or mask is None:
        raise PerExampleLossUnavailable("the model's outputs hold neither logits nor each token's log-probability")
    n_tokens = mask.sum(dim=1)
    losses = -(log_probs.float() * mask).sum(dim=1) / n_tokens.clamp(min=1)
    return torch.where(n_tokens > 0, losses, torch.full_like(losses, math.nan))


def _check_one_conversation_per_row(batch: Mapping) -> None:
    if "labels" not in batch:
        raise PerExampleLossUnavailable("the eval batches have no `labels`, so no loss either")
    if "cu_seq_lens_q" in batch or ("position_ids" in batch and "attention_mask" not in batch):
        raise PerExampleLossUnavailable(
            "the eval batches are padding-free or packed (several conversations in one row): the loss of each "
            "conversation needs padded batches (padding_free=false, eval_packing=false)"
        )


class EvalLossTap:
    """Each eval conversation's loss, from the Trainer's evaluation of `model`: a forward call in eval mode, without
    gradients and given `labels` is the Trainer's evaluation (or prediction) step, and nothing else in a run is (not
    training's steps, not ProbDiff's generation or scoring, which pass no labels). `take()` after each evaluation."""

    def __init__(self, model: torch.nn.Module, gather) -> None:
        self._gather = gather  # accelerator.gather_for_metrics
        self._losses: list[float] = []
        self._seconds = 0.0
        self._unavailable: str | None = None
        self._hook = model.register_forward_hook(self._seen, with_kwargs=True)

    def _seen(self, module: torch.nn.Module, args: tuple, kwargs: dict, output) -> None:
        if module.training or torch.is_grad_enabled() or kwargs.get("labels") is None or self._unavailable:
            return
        started = time.perf_counter()
        try:
            _check_one_conversation_per_row(kwargs)
            self._losses += self._gather(losses_of_output(output, kwargs["labels"])).float().cpu().tolist()
        except PerExampleLossUnavailable as why:  # the batches' layout: the same on every rank, none gathers
            self._unavailable = str(why)
        self._seconds += time.perf_counter() - started

    def take(self) -> ExampleLosses:
        """The losses of the evaluation since the last `take()` (PerExampleLossUnavailable when its batches did not
        allow them), and a fresh start for the next one."""
        losses, seconds, unavailable = self._losses, self._seconds, self._unavailable
        self._losses, self._seconds, self._unavailable = [], 0.0, None
        if unavailable is not None:
            raise PerExampleLossUnavailable(unavailable)
        return ExampleLosses(losses, seconds)

    def remove(self) -> None:
        self._hook.remove()
