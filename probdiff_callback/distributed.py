"""Evaluation across ranks: equal shares through accelerate, one gathered result that every rank holds."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from accelerate.utils import broadcast_object_list, gather_object

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
    accelerator, items: Sequence[Any], evaluate_share: Callable[[list], list[T]]
) -> tuple[list[T], str | None]:
    """(results in the order of `items`, error or None), the same on every rank.

    Each rank evaluates its contiguous share; shares are padded with the last item so every rank makes the
    same number of decoding and forward calls (ZeRO-3 hangs otherwise), and the padding's results are dropped
    before gathering. A failure on any rank is reported on all of them, and then nothing is gathered.
    """
    positions = list(range(len(items)))
    with accelerator.split_between_processes(positions) as own:
        n_own = len(own)
    with accelerator.split_between_processes(positions, apply_padding=True) as padded:
        share = [items[i] for i in padded]
    results: list[T] = []
    error = None
    try:
        results = list(evaluate_share(share))[:n_own]
    except Exception:
        error = f"rank {accelerator.process_index}: {traceback.format_exc()}"
    if accelerator.num_processes > 1:
        errors = [e for e in gather_object([error]) if e is not None]
        error = "\n".join(errors) if errors else None
        results = gather_object(results) if error is None else []
    return (results, None) if error is None else ([], error)


def broadcast(accelerator, value: T) -> T:
    """The main process's `value` on every rank."""
    if accelerator.num_processes == 1:
        return value
    holder = [value]
    broadcast_object_list(holder, from_process=0)
    return holder[0]
