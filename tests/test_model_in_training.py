"""The model in training made ready to generate and left as found (`callback/model_in_training.py`): the RNG
streams, trl's unwrapping with our repairs. The whole round trip through a training run is in test_callback.py
(`test_evaluation_leaves_the_model_tokenizer_and_rng_as_found`)."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest
import torch

from probdiff_callback.callback.model_in_training import preserved_rng_state, unwrapped_for_generation
from probdiff_callback.models.checkpointing import activation_checkpointing_on, set_activation_checkpointing
from probdiff_callback.training.recipe import as_installed


def test_preserved_rng_state_restores_every_stream():
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    expected = (torch.rand(2), np.random.rand(2), random.random())
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    with preserved_rng_state():
        torch.rand(5), np.random.rand(5), random.random()
    assert torch.equal(torch.rand(2), expected[0])
    assert np.array_equal(np.random.rand(2), expected[1]) and random.random() == expected[2]


class Zero3Accelerator:
    """What the unwrapping reads of an accelerator under ZeRO-3 (the model is not really sharded)."""

    state = type("State", (), {"deepspeed_plugin": type("Plugin", (), {"zero_stage": 3})(), "fsdp_plugin": None})()

    def unwrap_model(self, model):
        return model


@pytest.mark.slow
@pytest.mark.parametrize("fails", [False, True])
@pytest.mark.parametrize("gather_params", [True, False])
def test_unwrapping_restores_zero3_hooks_and_the_runs_checkpointing_even_when_evaluation_fails(
    tiny_model_path, monkeypatch, gather_params, fails
):
    """trl's unwrap gathers and lifts the optimizer's hooks; ours puts them back once, also after a failure (trl
    would not), and re-enables checkpointing with the run's every_n_layers (trl's re-enable would drop it)."""
    import sys
    import types

    from transformers import AutoModelForCausalLM, TrainingArguments
    from trl.models import utils as trl_utils

    events = []

    @contextlib.contextmanager
    def gathered(params):  # deepspeed's partitions again on any exit
        events.append("gather")
        try:
            yield
        finally:
            events.append("partition")

    fake_deepspeed = types.ModuleType("deepspeed")
    fake_deepspeed.zero = types.SimpleNamespace(GatheredParameters=gathered)
    monkeypatch.setitem(sys.modules, "deepspeed", fake_deepspeed)
    monkeypatch.setattr(trl_utils, "remove_hooks", lambda m: events.append("remove hooks"))
    monkeypatch.setattr(trl_utils, "add_hooks", lambda m: events.append("add hooks"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    options = {"use_reentrant": False, "every_n_layers": 2}
    args = TrainingArguments(**as_installed({"output_dir": "unused", "activation_checkpointing_kwargs": options}))
    set_activation_checkpointing(model, True, options)
    layers_before = [getattr(m, "gradient_checkpointing", None) for m in model.modules()]
    assert True in layers_before and False in layers_before  # every second layer only

    with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
        with unwrapped_for_generation(model, Zero3Accelerator(), gather_params, args) as unwrapped:
            assert unwrapped is model and not activation_checkpointing_on(unwrapped)
            if fails:
                raise RuntimeError("evaluation failed")
    expected = (  # the hooks back once: on a failure by us, after deepspeed partitioned; else by trl, inside
        ["gather", "remove hooks", "partition", "add hooks"]
        if fails
        else ["gather", "remove hooks", "add hooks", "partition"]
    )
    assert events == (expected if gather_params else [])
    assert [getattr(m, "gradient_checkpointing", None) for m in model.modules()] == layers_before
