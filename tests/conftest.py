"""Shared fixtures: models are built once per test session (and the `tiny` preset unpacked once per machine)."""

from __future__ import annotations

import logging
import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def qwen_tokenizer():
    from probdiff_callback.models.tokenizer import load_qwen_tokenizer

    return load_qwen_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_path():
    """Directory of the `tiny` preset (shipped with the package, unpacked under PROBDIFF_CACHE)."""
    from probdiff_callback.models.presets import tiny_model_dir

    return tiny_model_dir()


@pytest.fixture(scope="session")
def tiny_model(tiny_model_path):
    """(model, tokenizer) of the `tiny` preset in fp32 on CPU; tests must not modify it."""
    from probdiff_callback.models import load_model_and_tokenizer

    return load_model_and_tokenizer("tiny", dtype="float32", device="cpu")


@pytest.fixture
def sft_in_this_process(monkeypatch):
    """For tests that call train/sft.py's `main` here: its effects on this process undone afterwards (W&B's
    environment, torch's threads, and the console handlers it gives the library's log, which stops propagating)."""
    import torch

    monkeypatch.setattr(os, "environ", os.environ.copy())
    library = logging.getLogger("probdiff_callback")
    monkeypatch.setattr(library, "handlers", list(library.handlers))
    monkeypatch.setattr(library, "propagate", library.propagate)
    monkeypatch.setattr(library, "level", library.level)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
