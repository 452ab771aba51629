"""The model a recipe trains: its files, weights (optionally 4-bit), chat template and LoRA adapters.

The recipe's `lora.*` keys and `quantization` map onto trl's `ModelConfig` (`model_config`), and trl's
`get_peft_config` and `get_quantization_config` make peft's and bitsandbytes' configs from it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from collections.abc import Iterator

from probdiff_callback.training import say
from probdiff_callback.training.recipe import Recipe, RecipeError


def prepare_model_files(name: str) -> None:
    """Build or unpack the model's files on first use (the `tiny` preset); every rank waits for the one copy."""
    from probdiff_callback.models import resolve_model_path

    with refused_as_the_model(name):
        resolve_model_path(name)


def check_model_name(name: str) -> None:
    """A preset, a model directory or a hub id: what `prepare_model_files` refuses first, without torch."""
    from probdiff_callback.models import check_model_name

    with refused_as_the_model(name):
        check_model_name(name)


@contextlib.contextmanager
def refused_as_the_model(name: str) -> Iterator[None]:
    try:
        yield
    except (FileNotFoundError, ValueError) as err:
        raise RecipeError(f"model={name}: {err}") from None


def model_config(recipe: Recipe, target_modules: list[str] | str | None = None):
    """trl's ModelConfig for the recipe's `lora` section and `quantization=4bit` (NF4 with nested quantization).
    `target_modules`: peft's, once checked against the model (`lora_targets`)."""
    from trl import ModelConfig

    config = ModelConfig(
        model_name_or_path=recipe.model,
        # trl computes 4-bit layers in `dtype`; ours follow the mixed precision: bf16, else fp16
        dtype="bfloat16" if recipe.setting("bf16") else "float16",
        use_peft=recipe.lora.enabled,
        lora_r=recipe.lora.r,
        lora_alpha=recipe.lora.alpha,
        lora_dropout=recipe.lora.dropout,
        load_in_4bit=recipe.quantization == "4bit",
        bnb_4bit_quant_type="nf4",
        use_bnb_nested_quant=True,
    )
    # Set after ModelConfig's __post_init__, which makes a list of one name a str: peft matches a str as a regular
    # expression over the whole module path, so ["q_proj"] would match no module
    config.lora_target_modules = target_modules
    return config


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
    from trl import get_quantization_config

    return get_quantization_config(model_config(recipe))


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
    from trl import get_peft_config

    return get_peft_config(model_config(recipe, lora_targets(model, recipe.lora.target_modules)))
