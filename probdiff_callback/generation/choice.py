"""Which engine writes the answers and revisions: `use_vllm=true` or `false` as asked, and `auto` (the default) by one
stated rule, decided once where the texts are written (the evaluating process, on its own device) and said in one line.

`auto` takes vLLM where it is installed, can run the model, and is measured faster (docs/vllm.md, "auto"):

1. `vllm_mode=server`: the server you started (asked for by name).
2. vLLM not installed here: HF.
3. In the training loop on a GPU: HF. vLLM would share training's GPU: `use_vllm=true` gives it
   `vllm_gpu_memory_utilization` of the GPU's memory (TRL's colocate mode), freed between evaluations by sleep mode.
4. Small work, where vLLM's start-up costs more than it saves: a model under `MIN_PARAMETERS` (the `tiny` preset: HF
   writes its texts sooner than vLLM starts), or an evaluation that writes at most `MIN_NEW_TOKENS` new tokens
   (`n_queries` x `max_new_tokens` x (1 + `n_revisions`)): HF.
5. A model vLLM has no implementation of (its model registry): HF.
6. Otherwise vLLM; where it then refuses to start on this model (an adapter or dtype it cannot take), HF, and the line
   says what vLLM said (`fallen_back`).

The scores do not depend on the choice: the model scores every text itself (scoring.py); vLLM only writes them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

from probdiff_callback.generation.vllm_common import INSTALL

# Measured on this project's 2-core CPU, whole processes at one thread (bench/bench_vllm.py auto; docs/vllm.md, "auto"):
# the quick start on the `tiny` preset (40M parameters, most of them its Qwen vocabulary) took 147 s with HF and 177 s
# with vLLM; `probdiff eval` on SmolLM2-135M was a tie up to 2,048 new tokens (8 questions of 128 tokens: HF 79 s,
# vLLM 82 s) and faster with vLLM from 4,096 (16 questions: 140 s against 122 s; 32: 262 s against 196 s).
MIN_PARAMETERS = 100_000_000
MIN_NEW_TOKENS = 2_048
AUTO = "auto"


@dataclass(frozen=True)
class EngineChoice:
    """The engine that writes the texts (`use_vllm`) and why, in words a log line can carry."""

    use_vllm: bool
    why: str
    mode: str = "colocate"

    def line(self) -> str:
        engine = f"vLLM ({self.mode})" if self.use_vllm else "HF"
        return f"ProbDiff engine: {engine}: {self.why}"

    def applied(self, config):
        """`config` with `use_vllm` the decided bool: what every later reader of it sees."""
        return dataclasses.replace(config, use_vllm=self.use_vllm)

    def fallen_back(self, refusal: str) -> EngineChoice:
        """HF, where auto's vLLM refused to start on this model."""
        return EngineChoice(False, f"vLLM cannot run this model here ({refusal})")


def new_tokens_per_evaluation(config, queries: int) -> int:
    """The most new tokens one evaluation of `queries` queries writes: each answer and its revisions, up to
    `max_new_tokens` each."""
    return queries * config.max_new_tokens * (1 + config.n_revisions)


def choose_engine(
    config, *, parameters: int, architectures: list[str] | None, queries: int, in_training_loop: bool, on_gpu: bool
) -> EngineChoice:
    """The engine for `config.use_vllm` (`true`, `false` or `auto`) on a model of `parameters` parameters whose
    config names `architectures`, `queries` queries per evaluation, in the training loop or not, on a GPU or not."""
    mode = config.vllm_mode
    where = f"your server at {config.vllm_server_base_url}"
    if config.use_vllm is True:
        return EngineChoice(True, f"use_vllm=true: {where}" if mode == "server" else "use_vllm=true", mode)
    if config.use_vllm is False:
        return EngineChoice(False, "use_vllm=false")
    if mode == "server":
        return EngineChoice(True, f"vllm_mode=server: {where}", mode)
    if importlib.util.find_spec("vllm") is None:
        return EngineChoice(False, f"vLLM is not installed ({INSTALL})")
    if in_training_loop and on_gpu:
        return EngineChoice(
            False,
            "in the training loop on a GPU vLLM would share training's memory (use_vllm=true gives it "
            f"vllm_gpu_memory_utilization={config.vllm_gpu_memory_utilization} of the GPU, freed between evaluations "
            f"while vllm_enable_sleep_mode={str(config.vllm_enable_sleep_mode).lower()}; async_eval=true evaluates on "
            "a device of its own)",
        )
    if parameters < MIN_PARAMETERS:
        return EngineChoice(
            False, f"a model of {parameters / 1e6:.0f}M parameters: HF writes its texts sooner than vLLM starts"
        )
    if (tokens := new_tokens_per_evaluation(config, queries)) <= MIN_NEW_TOKENS:
        return EngineChoice(
            False,
            f"an evaluation writes at most {tokens:,} new tokens, too few for vLLM's start-up to pay "
            f"(auto takes vLLM above {MIN_NEW_TOKENS:,})",
        )
    unknown = [name for name in architectures or [] if name not in supported_architectures()]
    if unknown or not architectures:
        return EngineChoice(False, f"vLLM has no implementation of {', '.join(unknown) or 'a model without one'}")
    return EngineChoice(True, "installed and supported", mode)


def supported_architectures() -> frozenset[str]:
    """The model classes vLLM implements (its public registry)."""
    from vllm import ModelRegistry

    return frozenset(ModelRegistry.get_supported_archs())


def parameters_of(model) -> int:
    """The model's parameters (a PEFT model's base and adapters), counted whole where DeepSpeed ZeRO-3 partitions them
    (`ds_numel`)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def architectures_of(model) -> list[str]:
    """The model classes its config names (`LlamaForCausalLM`), as vLLM's registry knows them; where the config names
    none (a model built in code), its own class's (a PEFT model's base model's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(getattr(base, "config", None), "architectures", None) or [type(base).__name__]
