"""training/model_setup.py: LoRA targets on the model's own modules; the lora keys and QLoRA through trl's ModelConfig;
QLoRA's need of CUDA."""

from __future__ import annotations

import pytest

from probdiff_callback.training.model_setup import quantization_config
from probdiff_callback.training.recipe import RecipeError, load_recipe


def test_lora_targets_fit_the_architecture(tiny_model):
    from peft import LoraConfig, get_peft_model

    from probdiff_callback.training.model_setup import lora_targets

    model, _ = tiny_model
    assert lora_targets(model, ["all-linear"]) == "all-linear"
    assert lora_targets(model, ["q_proj", "v_proj"]) == ["q_proj", "v_proj"]
    with pytest.raises(
        RecipeError, match=r"c_attn match no module of Qwen2ForCausalLM; its linear layers are .*q_proj"
    ):
        lora_targets(model, ["q_proj", "c_attn"])
    # all-linear on Qwen2 is the paper setup's 7 projections, not the LM head
    import copy

    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules="all-linear"))
    targets = {name.rsplit(".", 1)[-1] for name in peft_model.peft_config["default"].target_modules}
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_qlora_needs_cuda_here():
    import torch

    recipe = load_recipe(["recipe=blog", "quantization=4bit"])
    if torch.cuda.is_available():
        pytest.skip("checks the error CPU-only machines give; with CUDA, 4-bit loading is allowed")
    with pytest.raises(RecipeError, match="needs an NVIDIA GPU with CUDA and the bitsandbytes package"):
        quantization_config(recipe)


def test_the_lora_keys_reach_peft_through_trls_model_config(tiny_model):
    from probdiff_callback.training.model_setup import lora_config

    model, _ = tiny_model
    recipe = load_recipe(
        ["recipe=blog", "lora.r=8", "lora.alpha=16", "lora.dropout=0.1", "lora.target_modules=[q_proj]"]
    )
    config = lora_config(recipe, model)
    assert (config.r, config.lora_alpha, config.lora_dropout, config.bias) == (8, 16, 0.1, "none")
    # one module name stays a name: as the str ModelConfig would make of it, peft would match it as a whole path
    assert config.target_modules == {"q_proj"} and config.task_type == "CAUSAL_LM"
    assert lora_config(load_recipe(["recipe=blog", "lora.enabled=false"]), model) is None


@pytest.mark.parametrize(("bf16", "compute"), [("true", "bfloat16"), ("false", "float16")])
def test_qlora_is_nf4_with_nested_quantization_through_trls_model_config(bf16, compute):
    import torch
    from trl import get_quantization_config

    from probdiff_callback.training.model_setup import model_config

    recipe = load_recipe(["recipe=blog", "quantization=4bit", f"bf16={bf16}"])
    config = get_quantization_config(model_config(recipe))
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4" and config.bnb_4bit_use_double_quant
    assert config.bnb_4bit_compute_dtype == getattr(torch, compute)
    assert get_quantization_config(model_config(load_recipe(["recipe=blog"]))) is None
