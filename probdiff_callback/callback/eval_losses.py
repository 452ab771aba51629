"""The eval loss of each held-out conversation, beside the Trainer's mean.

The disagreement alarm grades an eval-loss change with a paired test over the same conversations at two steps, and the
Trainer keeps only their mean. So, when the Trainer has just computed its eval loss, the callback runs the model once
more over the same eval dataloader: no gradients, eval mode, the training RNG streams kept as they were, and every
rank through its own share (the same number of forward calls on each, as the Trainer's evaluation made them), gathered
with `gather_for_metrics` as the Trainer gathers its losses (the padding of the last batches dropped). The result is in
the order of the eval dataset, so two steps of one run pair conversation by conversation.

Each conversation's loss is the mean cross-entropy over its loss tokens (labels other than -100: the assistant turns
with an assistant-only loss), shifted as transformers' causal-LM loss is. The Trainer's `eval_loss` is the mean over
batches of each batch's token mean: with one conversation per batch the two agree, otherwise they differ a little,
and the alarm prints the Trainer's mean and tests the per-conversation values.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from probdiff_callback.callback.model_in_training import preserved_rng_state

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


def _check_one_conversation_per_row(batch: Mapping) -> None:
    if "labels" not in batch:
        raise PerExampleLossUnavailable("the eval batches have no `labels`, so no loss either")
    if "cu_seq_lens_q" in batch or ("position_ids" in batch and "attention_mask" not in batch):
        raise PerExampleLossUnavailable(
            "the eval batches are padding-free or packed (several conversations in one row): the loss of each "
            "conversation needs padded batches (padding_free=false, eval_packing=false)"
        )


def _model_inputs(batch: Mapping, device: torch.device) -> dict:
    inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items() if k != "labels"}
    inputs["use_cache"] = False
    return inputs


@contextlib.contextmanager
def _evaluating(model: torch.nn.Module):
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def losses_over(model: torch.nn.Module, batches: Iterable[Mapping], device: torch.device, gather) -> list[float]:
    """The loss of every conversation in `batches` (padded, one conversation per row), gathered across ranks by
    `gather` (`accelerator.gather_for_metrics`, which must see every batch of the prepared dataloader)."""
    gathered: list[float] = []
    with _evaluating(model):
        for batch in batches:
            _check_one_conversation_per_row(batch)
            logits = model(**_model_inputs(batch, device)).logits
            gathered += gather(row_losses(logits, batch["labels"])).float().cpu().tolist()
    return gathered


def per_example_eval_losses(trainer, dataloader) -> ExampleLosses:
    """The loss of each conversation of the eval dataloader the Trainer just used, with the trainer's model as it
    is; on every rank (each its share), every rank returning all of them."""
    started = time.perf_counter()
    # the model the Trainer's evaluation ran: the DeepSpeed engine under DeepSpeed, else the model itself
    model = trainer.model_wrapped if getattr(trainer, "is_deepspeed_enabled", False) else trainer.model
    with preserved_rng_state():
        losses = losses_over(model, dataloader, trainer.accelerator.device, trainer.accelerator.gather_for_metrics)
    return ExampleLosses(losses, time.perf_counter() - started)
