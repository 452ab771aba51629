"""Merging a LoRA adapter trained on the converted (Qwen2) form of a Qwen v1 model into its base."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from probdiff_callback.qwen_v1_weights import (
    QWEN2_LORA_TARGET_MODULES,
    QWEN2_TO_V1_MODULE_NAMES,
)

if TYPE_CHECKING:
    import torch

_WRITTEN_BY_SAVE_PRETRAINED = {
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
}


def merge_adapter(
    base_path: str | os.PathLike,
    adapter_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: torch.dtype | str = "auto",
) -> Path:
    """Merge a PEFT (LoRA) adapter trained on the Qwen2 form into its base and save the result.

    `base_path` is a converted checkpoint (or a v1 one, converted in memory). The output holds the
    merged weights, the tokenizer and the generation config, loadable without PEFT.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from probdiff_callback.models import peft_without_deprecated_alias_warning

    # Imported here, not at the top: qwen_v1 re-exports this function.
    from probdiff_callback.qwen_v1 import (
        _copy_licence,
        is_qwen_v1_checkpoint,
        load_qwen_v1,
    )

    base_path, adapter_dir, out_dir = Path(base_path), Path(adapter_dir), Path(out_dir)
    adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    targets = adapter_config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    v1_names = sorted({t for t in targets if t.split(".")[-1] in QWEN2_TO_V1_MODULE_NAMES.values()})
    if v1_names:
        raise ValueError(
            f"adapter target_modules {v1_names} name Qwen v1 modules; this merge expects an adapter trained on the "
            f"converted (Qwen2) model, whose targets are {QWEN2_LORA_TARGET_MODULES}"
        )
    if out_dir.resolve() == base_path.resolve():
        raise ValueError("out_dir must differ from base_path: merging would overwrite the base weights")
    out_dir.mkdir(parents=True, exist_ok=True)
    if is_qwen_v1_checkpoint(base_path):
        base, tokenizer = load_qwen_v1(base_path, torch_dtype=None if dtype == "auto" else dtype)
        tokenizer.save_pretrained(out_dir)
        _copy_licence(base_path, out_dir)
    else:
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
        # Tokenizer files, chat template and licence are copied as they are: re-serialising the
        # 150k-entry tokenizer would only cost time.
        for path in base_path.iterdir():
            weights = path.suffix in (".safetensors", ".bin")
            if path.is_file() and not weights and path.name not in _WRITTEN_BY_SAVE_PRETRAINED:
                shutil.copy2(path, out_dir / path.name)
    with peft_without_deprecated_alias_warning():
        merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    # save_pretrained also writes the base's generation_config (stop ids, suppressed rows).
    merged.save_pretrained(out_dir)
    return out_dir
