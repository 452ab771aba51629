"""Activation checkpointing under either transformers' names (`models/checkpointing.py`): the options reach the
model's own method whichever release is installed. The real model's layers are checked in test_model_in_training.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from probdiff_callback.models.checkpointing import (
    activation_checkpointing_on,
    checkpointing_kwargs,
    set_activation_checkpointing,
)


class Since523:  # transformers >= 5.23: activation_checkpointing_*
    def __init__(self):
        self.calls, self.is_activation_checkpointing = [], False

    def activation_checkpointing_enable(self, **kwargs):
        self.calls.append(kwargs)
        self.is_activation_checkpointing = True

    def activation_checkpointing_disable(self):
        self.calls.append("off")
        self.is_activation_checkpointing = False


class Before523:  # transformers 5.17 to 5.22: gradient_checkpointing_*, with the same options
    def __init__(self):
        self.calls, self.is_gradient_checkpointing = [], False

    def gradient_checkpointing_enable(self, **kwargs):
        self.calls.append(kwargs)
        self.is_gradient_checkpointing = True

    def gradient_checkpointing_disable(self):
        self.calls.append("off")
        self.is_gradient_checkpointing = False


@pytest.mark.parametrize("model_class, name", [(Since523, "activation"), (Before523, "gradient")])
def test_every_option_reaches_the_installed_method_and_off_switches_it_off(model_class, name):
    model = model_class()
    set_activation_checkpointing(model, True, {"use_reentrant": False, "every_n_layers": 2, "offload": True})
    assert activation_checkpointing_on(model)
    set_activation_checkpointing(model, False)
    assert not activation_checkpointing_on(model)
    set_activation_checkpointing(model, True)
    assert model.calls == [
        {f"{name}_checkpointing_kwargs": {"use_reentrant": False}, "every_n_layers": 2, "offload": True},
        "off",
        {f"{name}_checkpointing_kwargs": None, "every_n_layers": 1, "offload": False},
    ]


def test_a_runs_options_are_read_under_either_field_name():
    assert checkpointing_kwargs(SimpleNamespace(activation_checkpointing_kwargs={"offload": True})) == {"offload": True}
    assert checkpointing_kwargs(SimpleNamespace(gradient_checkpointing_kwargs={"offload": True})) == {"offload": True}
    assert checkpointing_kwargs(SimpleNamespace(activation_checkpointing_kwargs=None)) == {}
