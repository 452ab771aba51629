"""Work shared across the ranks of a training job, through accelerate as trl's callbacks share it: equal shares
(`split_between_processes`), one gathered result that every rank holds (`gather_object`), the main process's value on
every rank (`broadcast`), and the largest count over the ranks for ZeRO-3's sharded forward passes (`max_over_ranks`).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from accelerate.utils import broadcast_object_list, gather_object

from probdiff_callback.core.evaluator import ABANDONED, EvaluationAbandoned
from probdiff_callback.core.records import Cost

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


def run_in_shares(
    accelerator, items: Sequence[Any], work: Callable[[list], tuple[list[T], Cost]]
) -> tuple[list[T], Cost, str | None]:
    """(what `work` gives for `items`, in their order; what the ranks' shares cost side by side; error or None), the
    same on every rank.

    Each rank runs `work` on its contiguous share; shares are padded with the last item so every rank makes the
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
        results, cost = work(share)
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


def any_error(accelerator, error: str | None) -> str | None:
    """Every rank's error (None: none had one), the same on every rank (every rank calls it)."""
    if accelerator.num_processes == 1:
        return error
    errors = [e for e in gather_object([error]) if e is not None]
    return "\n".join(errors) if errors else None


def broadcast(accelerator, value: T) -> T:
    """The main process's `value` on every rank."""
    if accelerator.num_processes == 1:
        return value
    holder = [value]
    broadcast_object_list(holder, from_process=0)
    return holder[0]
