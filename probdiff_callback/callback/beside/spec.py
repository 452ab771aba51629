"""What training tells the evaluator when it starts (the spec: the base model's folder and dtype, the settings, the
step it starts from), and what it checks first (whole weights under ZeRO-3)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.runs.queue import EvaluatorSpec


def base_model_of(model) -> Any:
    """The model whose weights every request starts from: a PEFT model's base, else the model itself."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) and hasattr(model, "peft_config") else model


def lora_rank_of(model) -> int | None:
    """The rank of the model's active LoRA adapter (vLLM sizes its LoRA slots by it); None without one."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or not configs:
        return None
    active = getattr(model, "active_adapter", None)
    config = configs.get(active) if isinstance(active, str) else None
    rank = getattr(config if config is not None else next(iter(configs.values())), "r", None)
    return rank if isinstance(rank, int) else None


def evaluator_spec(model, config: ProbDiffConfig, run_dir: Path, started_at_step: int, local: bool) -> EvaluatorSpec:
    """The spec of this training start: the base model's folder and dtype, the settings, the step it starts from."""
    base = base_model_of(model)
    return EvaluatorSpec(
        model=str(base.name_or_path),
        dtype=str(base.dtype).removeprefix("torch."),
        config=asdict(config),
        output_dir=str(run_dir),
        started_at_step=started_at_step,
        training_pid=os.getpid() if local else None,
        lora_rank=lora_rank_of(model),
    )


def whole_weights_problem(accelerator) -> str | None:
    """Why the weights saved at a step would not be whole (the evaluator loads them): ZeRO-3 gathers them for a save
    only with `stage3_gather_16bit_weights_on_model_save`; else None."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None or plugin.zero_stage != 3:
        return None
    zero = (plugin.deepspeed_config or {}).get("zero_optimization", {})
    if plugin.zero3_save_16bit_model or zero.get("stage3_gather_16bit_weights_on_model_save") is True:
        return None
    return (
        "ProbDiff: async_eval under ZeRO-3 needs whole weights at every queued step: set "
        "zero_optimization.stage3_gather_16bit_weights_on_model_save: true (accelerate: zero3_save_16bit_model: true)"
    )
