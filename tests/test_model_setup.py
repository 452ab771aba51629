"""train/model_setup.py: LoRA targets on the model's own modules; QLoRA's need of CUDA."""

from __future__ import annotations

import pytest

from train.model_setup import quantization_config
from train.recipe import RecipeError, load_recipe


def test_lora_targets_fit_the_architecture(tiny_model):
    from peft import LoraConfig, get_peft_model

    from train.model_setup import lora_targets

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
