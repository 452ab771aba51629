"""Activation checkpointing switched on a model under the installed transformers' names: 5.23 renamed the model's
`gradient_checkpointing_*` methods and TrainingArguments' fields to `activation_checkpointing_*` (the old methods
warn there), and the project takes transformers >= 5.17. The same options (the torch checkpoint's kwargs,
`every_n_layers`, `offload`) go through either name, as each release's Trainer passes them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _has_activation_checkpointing_api(model) -> bool:
    return hasattr(model, "activation_checkpointing_enable")


def activation_checkpointing_on(model) -> bool:
    if _has_activation_checkpointing_api(model):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def checkpointing_kwargs(args) -> dict[str, Any]:
    """A run's activation-checkpointing options (TrainingArguments under either release's field name)."""
    return dict(
        getattr(args, "activation_checkpointing_kwargs", None)
        or getattr(args, "gradient_checkpointing_kwargs", None)
        or {}
    )


def set_activation_checkpointing(model, enabled: bool, kwargs: Mapping[str, Any] | None = None) -> None:
    """Switch activation checkpointing; `kwargs` are a run's options (`checkpointing_kwargs`), passed on as the
    Trainer passes them."""
    modern = _has_activation_checkpointing_api(model)
    if not enabled:
        (model.activation_checkpointing_disable if modern else model.gradient_checkpointing_disable)()
        return
    options = dict(kwargs or {})
    every_n_layers, offload = options.pop("every_n_layers", 1), options.pop("offload", False)
    if modern:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=options or None, every_n_layers=every_n_layers, offload=offload
        )
    else:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=options or None, every_n_layers=every_n_layers, offload=offload
        )
