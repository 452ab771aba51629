"""The model in training made ready to generate in the middle of training, and left as it was found.

Ready to generate: unwrapped (PEFT wrapper kept) and ZeRO-3 parameters gathered by trl's
`unwrap_model_for_generation`; around it, activation checkpointing off, the base model's LoRA adapters disabled where
asked, and the training RNG streams kept as they were. Not here: eval mode and the KV cache
(`evaluator.inference_mode`, which restores them), and the tokenizer's padding side, which the evaluation never
touches (it pads the ids by hand).
"""

from __future__ import annotations

import contextlib
import random
import warnings
from collections.abc import Iterator

import numpy as np
import torch
from transformers import TrainingArguments

from probdiff_callback.callback.ranks import is_zero3
from probdiff_callback.models.checkpointing import (
    activation_checkpointing_on,
    checkpointing_kwargs,
    set_activation_checkpointing,
)


@contextlib.contextmanager
def preserved_rng_state() -> Iterator[None]:
    """Training RNG streams (python, numpy, torch CPU and CUDA) as they were before: the evaluation must not
    shift dropout masks or data order."""
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    torch_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.random.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


@contextlib.contextmanager
def unwrapped_for_generation(model_wrapped, accelerator, gather_params: bool, args: TrainingArguments):
    """trl's `unwrap_model_for_generation` (the bare model, PEFT wrapper included; under ZeRO-3 the parameters
    gathered once for the whole evaluation and the optimizer's hooks lifted, unless `gather_params` is False),
    with two repairs:

    - activation checkpointing is switched off here, before trl looks, and back on with the run's own settings:
      trl re-enables it through the deprecated `gradient_checkpointing_enable` with `gradient_checkpointing_kwargs`
      only, which would drop the run's `every_n_layers` and `offload` (and warn at every evaluation);
    - trl puts the ZeRO-3 hooks back only when the body returns; an evaluation that fails (recorded, and training
      goes on) would leave the engine without them, so they are put back here.
    """
    from trl.models import utils as trl_utils  # trl's import is slow; only a training process comes here

    unwrapped = accelerator.unwrap_model(model_wrapped)
    checkpointing = activation_checkpointing_on(unwrapped)
    if checkpointing:
        set_activation_checkpointing(unwrapped, False)
    hooks_lifted = False
    try:
        with contextlib.ExitStack() as unwrapping:
            with warnings.catch_warnings():
                # trl asks `is_gradient_checkpointing` (deprecated in transformers 5); it is off by now either way
                warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
                model = unwrapping.enter_context(
                    trl_utils.unwrap_model_for_generation(
                        model_wrapped, accelerator, gather_deepspeed3_params=gather_params
                    )
                )
            hooks_lifted = is_zero3(accelerator) and gather_params
            yield model
        hooks_lifted = False  # the body returned: trl put them back
    finally:
        if hooks_lifted:
            trl_utils.add_hooks(model_wrapped)
        if checkpointing:
            set_activation_checkpointing(unwrapped, True, checkpointing_kwargs(args))


@contextlib.contextmanager
def model_for_evaluation(trainer, *, gather_params: bool, base_model: bool):
    """The trainer's model ready to evaluate (with its LoRA adapters disabled for `base_model`); on exit,
    everything training relies on is as it was."""
    with (
        preserved_rng_state(),
        unwrapped_for_generation(trainer.model_wrapped, trainer.accelerator, gather_params, trainer.args) as model,
    ):
        adapters_off = base_model and hasattr(model, "disable_adapter")
        with model.disable_adapter() if adapters_off else contextlib.nullcontext():
            yield model
