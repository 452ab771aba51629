"""Shared fixtures: models are built once per test session (and the `tiny` preset unpacked once per machine)."""

from __future__ import annotations

import logging
import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:  # tests side by side (pytest-xdist): each worker's torch keeps to its share of the cores
        # and each process its tests start (training, evaluators, `probdiff eval`) takes one thread: one that chose
        # two while the other worker's test paused then waits at torch's barriers for a core that test holds, three
        # to four times the time (docs/benchmarks.md, "Threads on a busy machine")
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(workers)))
    else:  # one test at a time: the processes it starts choose their threads as a user's do
        os.environ.pop("OMP_NUM_THREADS", None)


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


@pytest.fixture(scope="session")
def blog_run(tmp_path_factory, tiny_model_path):
    """`_launch.BlogRun`: one cheap `accelerate launch train/sft.py recipe=blog` run with W&B offline, trained once per
    session (whichever pytest-xdist worker asks first) for the tests that read a whole run (e2e/test_sft_runs.py,
    e2e/test_checkpoints.py, test_wandb_run.py)."""
    from _launch import blog_run_once

    return blog_run_once(tmp_path_factory)


@pytest.fixture
def one_torch_thread():
    """One intra-op thread while the test runs: on 2 shared cores, multi-threaded torch ops (generate's torch.isin
    over the 152k vocabulary) run 10-30x slower under contention than on one thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


@pytest.fixture
def fresh_wandb(tmp_path, monkeypatch):
    """wandb offline in `tmp_path`. Its process-wide settings are dropped before and after: wandb reads the environment
    once per setup, and an earlier test in the same worker process would otherwise keep its own WANDB_DIR."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_PROJECT", "probdiff-test")
    wandb.teardown()
    yield wandb
    wandb.teardown()


# The variables the project's code sets (W&B's environment for the run, the launcher's); the libraries' own
# bookkeeping (wandb's WANDB_SERVICE, torch's PYTORCH_NVML_BASED_CUDA_CHECK) is theirs.
SET_BY_THE_PROJECT = ("WANDB_", "PROBDIFF_", "PET_SIGNALS_TO_HANDLE")
LIBRARIES_OWN = {"WANDB_SERVICE"}


def project_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(SET_BY_THE_PROJECT) and k not in LIBRARIES_OWN}


@pytest.fixture(autouse=True)
def environment_left_as_found():
    """A test that leaves such a variable set changes every later test's runs (a stray WANDB_DIR sent W&B files to
    another test's folder); that test fails here, naming the variables."""
    before = project_environment()
    yield
    after = project_environment()
    changed = sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))
    assert not changed, f"the test left the environment changed: {changed} (use monkeypatch or sft_in_this_process)"
