"""generation/choice.py: the engine `use_vllm` gives in each case (installed or not, model supported or not, in the loop
or beside, GPU or CPU, small or large work), and the line a run says it in."""

from __future__ import annotations

import importlib.util

import pytest

from probdiff_callback.core.config import ConfigError, ProbDiffConfig
from probdiff_callback.generation import choice as choice_module
from probdiff_callback.generation.choice import MIN_NEW_TOKENS, MIN_PARAMETERS, choose_engine, new_tokens_per_evaluation

LLAMA = ["LlamaForCausalLM"]
LARGE = 135_000_000  # SmolLM2-135M


@pytest.fixture
def vllm_here(monkeypatch):
    """vLLM installed, its registry knowing Llama and Qwen2 (this machine's vLLM need not be there)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.setattr(choice_module, "supported_architectures", lambda: frozenset(LLAMA + ["Qwen2ForCausalLM"]))


@pytest.fixture
def no_vllm(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))


def choose(config=None, *, parameters=LARGE, architectures=LLAMA, queries=64, in_training_loop=False, on_gpu=False):
    config = config if config is not None else ProbDiffConfig(max_new_tokens=128)
    return choose_engine(config, parameters=parameters, architectures=architectures, queries=queries,
                         in_training_loop=in_training_loop, on_gpu=on_gpu)  # fmt: skip


def test_auto_is_the_default_and_true_false_keep_their_meaning(no_vllm):
    assert ProbDiffConfig().use_vllm == "auto"
    assert choose(ProbDiffConfig(use_vllm=True)).use_vllm  # asked: chosen whatever is installed (its error comes later)
    assert choose(ProbDiffConfig(use_vllm=True)).line() == "ProbDiff engine: vLLM (colocate): use_vllm=true"
    assert choose(ProbDiffConfig(use_vllm=False), on_gpu=True).line() == "ProbDiff engine: HF: use_vllm=false"


def test_a_value_other_than_true_false_or_auto_is_refused():
    with pytest.raises(ConfigError, match=r"use_vllm='fast': use true, false or auto"):
        ProbDiffConfig(use_vllm="fast")


def test_auto_takes_vllm_where_it_is_installed_and_supported_beside_training_and_in_eval(vllm_here):
    for on_gpu in (False, True):
        chosen = choose(on_gpu=on_gpu)
        assert chosen.use_vllm and chosen.line() == "ProbDiff engine: vLLM (colocate): installed and supported"
    assert choose(in_training_loop=True).use_vllm  # in the loop on a CPU: vLLM holds no GPU memory of training's


def test_auto_takes_hf_where_vllm_is_not_installed(no_vllm):
    chosen = choose()
    assert not chosen.use_vllm and chosen.line().startswith("ProbDiff engine: HF: vLLM is not installed (pip install")


def test_auto_takes_hf_in_the_training_loop_on_a_gpu_and_says_what_true_costs(vllm_here):
    chosen = choose(in_training_loop=True, on_gpu=True)
    assert not chosen.use_vllm
    assert "vllm_gpu_memory_utilization=0.55 of the GPU" in chosen.why and "vllm_enable_sleep_mode=true" in chosen.why


def test_auto_takes_hf_for_a_model_vllm_does_not_implement(vllm_here):
    chosen = choose(architectures=["MyOwnForCausalLM"])
    assert not chosen.use_vllm and chosen.why == "vLLM has no implementation of MyOwnForCausalLM"
    assert not choose(architectures=None).use_vllm


def test_small_work_stays_with_hf(vllm_here):
    """The `tiny` preset's 39M parameters; a handful of queries; both just past the line and just within it."""
    tiny = choose(parameters=39_000_000)
    assert not tiny.use_vllm and tiny.why == "a model of 39M parameters: HF writes its texts sooner than vLLM starts"
    assert choose(parameters=MIN_PARAMETERS).use_vllm
    config = ProbDiffConfig(max_new_tokens=128)  # 128 x (1 answer + 1 revision) = 256 new tokens a query at most
    at_line = MIN_NEW_TOKENS // 256
    assert new_tokens_per_evaluation(config, at_line) == MIN_NEW_TOKENS
    few = choose(config, queries=at_line)
    assert not few.use_vllm and few.why.startswith(f"an evaluation writes at most {MIN_NEW_TOKENS:,} new tokens")
    assert choose(config, queries=at_line + 1).use_vllm
    assert choose(ProbDiffConfig(max_new_tokens=128, n_revisions=2), queries=at_line).use_vllm  # 3 texts a query


def test_a_server_you_started_is_taken_by_name(no_vllm):
    chosen = choose(ProbDiffConfig(vllm_mode="server", vllm_server_base_url="http://gpu-node:8000"))
    assert chosen.use_vllm and chosen.line() == (
        "ProbDiff engine: vLLM (server): vllm_mode=server: your server at http://gpu-node:8000"
    )
    asked = choose(ProbDiffConfig(use_vllm=True, vllm_mode="server", vllm_server_base_url="http://gpu-node:8000"))
    assert asked.line() == "ProbDiff engine: vLLM (server): use_vllm=true: your server at http://gpu-node:8000"


def test_a_refusal_at_start_falls_back_to_hf_and_the_settings_follow(vllm_here):
    chosen = choose()
    assert chosen.applied(ProbDiffConfig()).use_vllm is True
    fallen = chosen.fallen_back("head size 24 is not supported")
    assert fallen.line() == "ProbDiff engine: HF: vLLM cannot run this model here (head size 24 is not supported)"
    assert fallen.applied(ProbDiffConfig()).use_vllm is False
