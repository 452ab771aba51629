"""The model a recipe trains: its files, weights (optionally 4-bit), chat template and LoRA adapters."""

from __future__ import annotations

import importlib.util
import os
import time

from train import say
from train.recipe import Recipe, RecipeError


def prepare_model_files(name: str) -> None:
    """Build or unpack the model's files on first use (the `tiny` preset); every rank waits for the one copy."""
    from probdiff_callback.models import resolve_model_path

    try:
        resolve_model_path(name)
    except (FileNotFoundError, ValueError) as err:
        raise RecipeError(f"model={name}: {err}") from None


def quantization_config(recipe: Recipe):
    """The bitsandbytes NF4 config for quantization=4bit, or None; a clear error where it cannot run."""
    if recipe.quantization == "none":
        return None
    import torch

    if not torch.cuda.is_available():
        raise RecipeError(
            "quantization=4bit (QLoRA) needs an NVIDIA GPU with CUDA and the bitsandbytes package "
            "(pip install 'probdiff[qlora]'); this machine has no CUDA device. Use quantization=none."
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise RecipeError(
            "quantization=4bit (QLoRA) needs bitsandbytes: pip install 'probdiff[qlora]' (bitsandbytes>=0.45)"
        )
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16 if recipe.setting("bf16") else torch.float16,
    )


def load_model(recipe: Recipe):
    """(model, tokenizer) as the recipe asks, ready for training."""
    from probdiff_callback.models import ModelUnavailable, load_model_and_tokenizer

    kwargs = {"attn_implementation": recipe.attn_implementation}
    quantization = quantization_config(recipe)
    if quantization is not None:
        kwargs.update(quantization_config=quantization, device_map={"": int(os.environ.get("LOCAL_RANK", "0"))})
    started = time.time()
    try:
        model, tokenizer = load_model_and_tokenizer(recipe.model, dtype=recipe.dtype, **kwargs)
    except ModelUnavailable as err:
        raise RecipeError(f"model={recipe.model}: {err}") from None
    if quantization is not None:
        from peft import prepare_model_for_kbit_training

        checkpointing = bool(recipe.setting("activation_checkpointing"))
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing)
    model.config.use_cache = False  # training; the ProbDiff evaluation turns the cache on for generation
    n_params = sum(p.numel() for p in model.parameters())
    four_bit = ", 4-bit NF4" if quantization is not None else ""
    say(
        f"model: {recipe.model} loaded in {time.time() - started:.0f}s ({n_params / 1e6:,.1f}M parameters, "
        f"{recipe.dtype}{four_bit})"
    )
    return model, tokenizer


ALL_LINEAR = "all-linear"  # peft: every linear layer but the output head (Qwen2, Llama: the 7 projections)


def lora_targets(model, requested: list[str]) -> list[str] | str:
    """peft's `target_modules` for the recipe's list: `all-linear`, which fits any architecture, or module names
    that must each exist in this one (a name that matches nothing would leave those layers untrained)."""
    if list(requested) == [ALL_LINEAR]:
        return ALL_LINEAR
    import torch

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [name for name in requested if name not in names]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise RecipeError(
            f"lora.target_modules: {', '.join(missing)} match no module of {type(model).__name__}; its linear layers "
            f"are {', '.join(linear)}. Name some of those, or write lora.target_modules=[{ALL_LINEAR}]"
        )
    return list(requested)


def lora_config(recipe: Recipe, model):
    """peft's LoraConfig for the recipe's `lora` section, or None to train all weights."""
    if not recipe.lora.enabled:
        say("LoRA off: training all weights")
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=recipe.lora.r,
        lora_alpha=recipe.lora.alpha,
        lora_dropout=recipe.lora.dropout,
        target_modules=lora_targets(model, recipe.lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
