"""The recipe keys that are fields of trl's `SFTConfig`: their types (read from SFTConfig itself), the project's
defaults for them, and the `SFTConfig` a run trains with."""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from pathlib import Path
from typing import Any, Union

# Project defaults for SFTConfig: a layer under the recipe file, only where they differ from trl's defaults.
SFT_DEFAULTS: dict[str, Any] = {
    "learning_rate": 1e-4,
    "per_device_train_batch_size": 1,
    "per_device_eval_batch_size": 1,
    "gradient_accumulation_steps": 16,
    "weight_decay": 0.1,
    "adam_beta2": 0.95,
    "warmup_steps": 0.01,  # a float below 1 is a share of the steps
    "lr_scheduler_type": "cosine",
    "bf16": True,
    "activation_checkpointing": True,  # trl's default, under transformers 5's name (the old one warns)
    "activation_checkpointing_kwargs": {"use_reentrant": False},
    "max_length": 2048,  # Qwen-14B-Chat's trained context
    "assistant_only_loss": True,  # loss on the assistant turns: the chat template's {% generation %} markers
    "eval_steps": 100,  # eval loss + ProbDiff every N optimizer steps
    "save_steps": 100,  # a multiple of eval_steps: every checkpoint has a ProbDiff score to be selected by
    "eval_on_start": True,  # the eval loss of the base model, beside the ProbDiff baseline
    "logging_first_step": True,
    "metric_for_best_model": "probdiff_confidence",
    "report_to": "wandb",  # wandb | tensorboard | none, a comma-separated list or a list
    "ddp_find_unused_parameters": False,  # every trainable weight (adapters or all) gets a gradient each step
}
# Set by train/sft.py: ProbDiff runs at the evaluations, and checkpoints are saved at evaluated steps.
FIXED: dict[str, Any] = {"eval_strategy": "steps", "save_strategy": "steps"}
# Names that SFTConfig no longer has, or keeps only as deprecated aliases that the new name silently overrides.
RENAMED = {
    "max_seq_length": "max_length",
    "gradient_checkpointing": "activation_checkpointing",
    "gradient_checkpointing_kwargs": "activation_checkpointing_kwargs",
    "warmup_ratio": "warmup_steps",  # a float below 1 is a share of the steps
}
SFTCONFIG_DOCS = "https://huggingface.co/docs/trl/sft_trainer#trl.SFTConfig"


@functools.cache
def sft_type_hints() -> dict[str, Any]:
    """SFTConfig's fields (those a recipe may set) and their declared types."""
    from trl import SFTConfig

    hints = typing.get_type_hints(SFTConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(SFTConfig) if f.init and f.name not in RENAMED}


def _members(hint: Any) -> tuple:
    is_union = typing.get_origin(hint) is Union or isinstance(hint, types.UnionType)
    return typing.get_args(hint) if is_union else (hint,)


def _is_enum(member: Any) -> bool:
    return isinstance(member, type) and issubclass(member, enum.Enum)


def _schema_type(hint: Any) -> Any:
    """The closest type OmegaConf can check: numbers, booleans and strings (an enum as its string value);
    containers and everything else unchecked."""
    members = [m for m in _members(hint) if m is not type(None)]
    if len(members) == 1 and members[0] in (int, bool, str):
        base = members[0]
    elif members == [float]:
        base = int | float  # an int stays an int (`eval_steps: 10`, not 10.0)
    elif members and all(m is str or _is_enum(m) for m in members):
        base = str
    else:
        return Any
    return base | None if type(None) in _members(hint) else base


@functools.cache
def sft_schema() -> type:
    """A dataclass with every settable SFTConfig field, typed for OmegaConf; `???` (unset) by default, so that only
    the keys a recipe gives reach SFTConfig."""
    from omegaconf import MISSING

    fields = [(name, _schema_type(hint), dataclasses.field(default=MISSING)) for name, hint in sft_type_hints().items()]
    return dataclasses.make_dataclass("SFTConfigKeys", fields)


def sft_type_name(key: str) -> str:
    hint = sft_type_hints().get(key, "value")
    return getattr(hint, "__name__", str(hint))


def setting(training: dict[str, Any], key: str) -> Any:
    """An SFTConfig key as the run will have it: the recipe's value, else SFTConfig's own default."""
    from trl import SFTConfig

    if key in training:
        return training[key]
    spec = {f.name: f for f in dataclasses.fields(SFTConfig)}[key]
    return spec.default_factory() if spec.default is dataclasses.MISSING else spec.default  # type: ignore[misc]


def report_to_values(value: Any) -> list[str]:
    """`report_to` as a list of names: it may be a comma-separated string or a list."""
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else []
    return [str(item).strip() for item in items if str(item).strip()]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def enum_problems(settings: dict[str, Any]) -> list[str]:
    """Values outside the enum of a field such as `lr_scheduler_type` or `optim`."""
    from probdiff_callback.config import did_you_mean

    problems = []
    for key, value in settings.items():
        for member in filter(_is_enum, _members(sft_type_hints().get(key))):
            allowed = [str(item.value) for item in member]
            if str(value) not in allowed:
                hint = did_you_mean(str(value), allowed)
                problems.append(f"{key}={value!r}{hint}: use one of {', '.join(allowed)}")
    return problems


def training_problems(training: dict[str, Any], probdiff_every: int) -> list[str]:
    """What the project needs of the SFTConfig keys, beyond SFTConfig's own checks (which run when it is built)."""
    value = functools.partial(setting, training)
    problems = enum_problems(training)
    for key, fixed in FIXED.items():
        if training.get(key, fixed) != fixed:
            problems.append(f"{key}={training[key]!r}: train/sft.py sets {key}={fixed} (ProbDiff runs at evaluations)")
    counts = ("eval_steps", "save_steps", "logging_steps", "per_device_train_batch_size", "per_device_eval_batch_size",
              "gradient_accumulation_steps", "max_length")  # fmt: skip
    for key in counts:
        if not (key == "max_length" and value(key) is None) and (not _is_number(value(key)) or value(key) < 1):
            problems.append(f"{key}={value(key)}: must be positive")
    if not _is_number(value("learning_rate")) or value("learning_rate") <= 0:
        problems.append(f"learning_rate={value('learning_rate')}: must be positive")
    if value("max_steps") <= 0 and value("num_train_epochs") <= 0:
        problems.append("set num_train_epochs > 0 or max_steps > 0")
    spacing_valid = all(_is_number(value(key)) and value(key) >= 1 for key in ("eval_steps", "save_steps"))
    if spacing_valid and value("save_steps") % value("eval_steps"):
        problems.append(
            f"save_steps={value('save_steps')} must be a multiple of eval_steps={value('eval_steps')}, "
            "so every checkpoint has a ProbDiff score to be selected by"
        )
    metric = value("metric_for_best_model")
    if metric and metric.removeprefix("eval_").startswith(("probdiff_", "ref_")) and probdiff_every != 1:
        problems.append(f"metric_for_best_model={metric} needs probdiff.every=1 (space evaluations with eval_steps)")
    reports = report_to_values(value("report_to"))
    if not reports or ("none" in reports and len(reports) > 1):
        problems.append(f"report_to={value('report_to')!r}: give `none` or integrations such as wandb, tensorboard")
    return problems


def sft_config(settings: dict[str, Any], run_dir: Path, run_name: str, report_to: list[str]):
    """The run's `trl.SFTConfig`: the recipe's SFTConfig keys, with the run directory, W&B run name and
    integrations the script chose. Build it before the model loads, so that DeepSpeed ZeRO-3 can partition the
    weights while they load."""
    import torch
    from trl import SFTConfig

    metric = settings.get("metric_for_best_model")
    derived = {  # where the recipe does not say
        "use_cpu": not torch.cuda.is_available(),
        "greater_is_better": None if metric is None else not metric.endswith("loss"),
    }
    forced = {**FIXED, "output_dir": str(run_dir), "run_name": run_name, "report_to": report_to or "none"}
    return SFTConfig(**{**derived, **settings, **forced})
