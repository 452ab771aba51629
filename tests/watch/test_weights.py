"""The evaluator's models (`beside/weights.py`): each request's weights on the one base model."""

from __future__ import annotations

from probdiff_callback.watch.weights import Weights


def test_adapters_are_swapped_on_the_one_base_model_and_disabled_for_the_base(tmp_path, tiny_model):
    """Each step's adapter goes onto the base model loaded once (the previous one deleted), the base model's request
    disables them, and whole weights are loaded for their request: the logits are those of each model loaded alone."""
    import copy

    import torch
    from peft import LoraConfig, PeftModel, get_peft_model

    model, tokenizer = tiny_model
    ids = torch.tensor([tokenizer("Name three rivers of China")["input_ids"]])

    def logits(m) -> torch.Tensor:
        with torch.no_grad():
            return m(input_ids=ids).logits

    for seed, name in ((1, "a"), (2, "b")):
        torch.manual_seed(seed)
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM")
        get_peft_model(copy.deepcopy(model), lora).save_pretrained(tmp_path / name)
    whole = copy.deepcopy(model)
    with torch.no_grad():
        whole.model.norm.weight.mul_(1.5)
    whole.save_pretrained(tmp_path / "whole")

    weights = Weights(copy.deepcopy(model), tokenizer, key=(), device="cpu", dtype="float32")
    seen = {}
    for step, folder in ((0, None), (2, tmp_path / "a"), (4, tmp_path / "b"), (6, tmp_path / "whole"), (8, None)):
        with weights.holding(folder) as held:
            seen[step] = logits(held)
    assert list(weights.peft.peft_config) == [weights.adapter]  # step 2's adapter was deleted when step 4's came
    alone = {
        2: PeftModel.from_pretrained(copy.deepcopy(model), str(tmp_path / "a")),
        4: PeftModel.from_pretrained(copy.deepcopy(model), str(tmp_path / "b")),
    }
    for step, expected in alone.items():
        assert torch.equal(seen[step], logits(expected.eval()))
    assert torch.equal(seen[6], logits(whole.eval()))
    assert torch.equal(seen[0], logits(model)) and torch.equal(seen[8], seen[0])
    assert not torch.allclose(seen[2], seen[0]) and not torch.allclose(seen[4], seen[2])
