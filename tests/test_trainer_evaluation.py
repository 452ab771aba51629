"""The trainer's model evaluated across ranks (`callback/trainer_evaluation.py`): what a run refuses before it starts
vLLM. The evaluations themselves run through the callback: test_callback.py, e2e/test_distributed.py, and
test_engines_vllm.py where vLLM is installed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from probdiff_callback.callback.trainer_evaluation import start_vllm
from probdiff_callback.core.config import ProbDiffConfig

FULL_WEIGHTS = object()  # a model without a PEFT adapter
LORA = SimpleNamespace(peft_config={"default": SimpleNamespace(r=8)})


def trainer_of(model, tmp_path, zero_stage: int | None = None) -> SimpleNamespace:
    """What `start_vllm` reads of a trainer: its accelerator (ZeRO's stage), the model and the output folder."""
    plugin = None if zero_stage is None else SimpleNamespace(zero_stage=zero_stage)
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin), unwrap_model=lambda wrapped: wrapped)
    return SimpleNamespace(accelerator=accelerator, model_wrapped=model, args=SimpleNamespace(output_dir=str(tmp_path)))


def test_a_server_you_started_is_refused_for_a_run_that_fine_tunes_all_weights(tmp_path):
    config = ProbDiffConfig(use_vllm=True, vllm_mode="server")
    expected = (
        "vllm_mode=server takes LoRA adapters only, and this run fine-tunes all weights: train with LoRA, or use "
        "vllm_mode=colocate (it reloads the whole weights at each evaluation) or the HF engine (use_vllm=false)"
    )
    with pytest.raises(ValueError) as refused:
        start_vllm(trainer_of(FULL_WEIGHTS, tmp_path), None, config)
    assert str(refused.value) == expected


def test_zero3_is_refused_unless_the_parameters_are_gathered(tmp_path):
    config = ProbDiffConfig(use_vllm=True, gather_params=False)
    with pytest.raises(ValueError) as refused:
        start_vllm(trainer_of(LORA, tmp_path, zero_stage=3), None, config)
    assert str(refused.value) == "use_vllm=true needs the whole weights on the main process: set gather_params=true"
