"""vLLM as the engine that writes answers and revisions (`use_vllm=true`), in TRL's two modes:

- `colocate`: vLLM in the process that evaluates, through its Python API (`vllm_colocate.py`), once per run (or per
  `probdiff eval`); the weights to evaluate go to it in memory (a LoRA run's adapters merged in, or on a GPU the
  adapter by path). On a GPU it sleeps between evaluations, so training gets the memory back.
- `server`: a `vllm serve <base model> --enable-lora` that you started (other GPUs, other cores, another environment
  where vLLM cannot be installed beside the project); the adapter to evaluate is loaded by path through its runtime
  LoRA endpoint (`vllm_server.py`).

This module owns what the evaluator holds, `VLLMGeneration`: which engine `config` asks for, started on the model's
base weights, and the weights of each evaluation handed to it (`weight_sync`: the adapter by path, or the merged
weights, `merged_state_dict`, in memory). The terms every vLLM engine shares
(sampling stated whole, texts decoded from token ids, `EngineUnavailable`) are in `vllm_common.py`.

Scoring does not go through vLLM: the model scores both texts itself, in fp32 (scoring.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from probdiff_callback.core.chat_format import stop_token_ids
from probdiff_callback.generation.vllm_colocate import ColocatedEngine
from probdiff_callback.generation.vllm_common import EngineUnavailable, vllm_problem
from probdiff_callback.generation.vllm_server import ServerEngine

# EngineUnavailable, the error callers of this module catch (`probdiff eval`), is defined in vllm_common.py.
__all__ = [
    "EngineUnavailable",
    "VLLMGeneration",
    "in_this_process",
    "merged_state_dict",
    "merged_weights",
    "vllm_problem",
    "weight_sync",
]


def in_this_process(config) -> bool:
    """Whether `use_vllm=true` runs vLLM in the evaluating process (vllm_mode=colocate): then every training rank holds
    an engine of its own and writes its share's texts, as TRL's colocate mode does. Otherwise the main process speaks
    to your server for every rank."""
    return config.use_vllm is True and config.vllm_mode == "colocate"


def weight_sync(config) -> str:
    """How the engine gets the weights of a LoRA run: `lora` (the adapter by path) or `merged` (the adapters merged
    into the weights, handed over whole). A server you started takes adapters only. `auto`: merged for vLLM in this
    process (in memory, as TRL's colocate mode syncs them: nothing written, and the base model's kernels, where vLLM's
    CPU LoRA kernels are many times slower; docs/vllm.md)."""
    if config.vllm_mode == "server":
        return "lora"
    return "merged" if config.vllm_weight_sync == "auto" else config.vllm_weight_sync


def merged_weights(model) -> Iterator[tuple[str, object]]:
    """The model's weights under the base model's names, one `(name, tensor)` at a time, each LoRA layer's active
    adapters merged in, without touching the model (no merge and unmerge, whose rounding would move the weights being
    trained). One at a time, so that an engine taking them in memory holds one merged layer more than the model, not a
    second model. Tied tensors come once. Under ZeRO-3 the parameters must be gathered (the callback's evaluation
    gathers them)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    lora_layers = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    seen = set()
    for name, param in base.named_parameters():
        if ".lora_" in name or ".original_module." in name:
            continue
        owner, _, leaf = name.rpartition(".")
        tensor = param.detach()
        layer = lora_layers.get(owner.removesuffix(".base_layer"))
        if layer is not None and owner.endswith(".base_layer") and leaf == "weight":
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
        if param.data_ptr() in seen:  # tied (embeddings and LM head)
            continue
        seen.add(param.data_ptr())
        yield name.replace(".base_layer", "").replace(".modules_to_save.default", ""), tensor.contiguous()


def merged_state_dict(model) -> dict:
    """`merged_weights(model)` as one dict, for a file (`write_weights`)."""
    return dict(merged_weights(model))


class VLLMGeneration:
    """vLLM for one model's evaluations, from start to close: the one owner of "start an engine for this model and
    hand it the weights being evaluated", for `probdiff eval`, the callback and a process that evaluates saved
    weights (trl keeps the same for its trainers in its `VLLMGeneration`).

    `start` starts the engine `config` asks for (`vllm_mode`) on the model's base weights; `holding` hands it the
    weights of one evaluation as `vllm_weight_sync` says; `sleep` gives a GPU's memory back between evaluations;
    `close` ends an engine in this process (a server you started is left running).
    """

    def __init__(
        self, engine: ServerEngine | ColocatedEngine, weight_sync: str, scratch_parent: str | os.PathLike | None = None
    ) -> None:
        self.engine, self.weight_sync, self.scratch_parent = engine, weight_sync, scratch_parent
        self.in_memory = isinstance(engine, ColocatedEngine)  # whole weights by reference, never through a folder
        self.handed_over: HandOver | None = None  # the last evaluation's weights: how long, how much written
        self.where = "in this process" if self.in_memory else "your server"

    @classmethod
    def start(
        cls,
        config,
        model,
        tokenizer,
        *,
        dtype: str | None = None,
        lora_rank: int | None = None,
        scratch_parent: str | os.PathLike | None = None,
    ) -> VLLMGeneration:
        """vLLM for `model` (a PEFT model or not): with vllm_mode=colocate in this process on the base model's folder,
        in `dtype` (default: the model's own), with LoRA slots for `lora_rank` (default: the model's adapter's when its
        weights go as an adapter); with vllm_mode=server the server you started. An adapter that goes to an engine
        through a folder goes to one in `scratch_parent` (default: the system's temporary folder), which a server you
        started must be able to read."""
        if problem := vllm_problem(config):
            raise EngineUnavailable(problem)
        import torch

        sync = weight_sync(config)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        stop_ids = stop_token_ids(tokenizer, getattr(base, "generation_config", None))
        if lora_rank is None:
            adapter = getattr(model, "peft_config", {}).get("default")
            lora_rank = int(adapter.r) if adapter is not None and sync == "lora" else 0
        if dtype in (None, "auto"):  # the model's own: vLLM's `auto` runs a float32 model in bfloat16 on a CPU
            dtype = str(next(base.parameters()).dtype).removeprefix("torch.")
        if config.vllm_mode == "server":
            engine = ServerEngine(
                config.vllm_server_base_url,
                tokenizer,
                stop_ids,
                timeout=config.vllm_server_timeout,
                stall_timeout=config.vllm_stall_timeout,
            )
        else:  # colocate: the engine in this process, on the base model's folder
            engine = ColocatedEngine.start(
                base.name_or_path,
                tokenizer,
                stop_ids,
                max_model_len=config.max_prompt_tokens + config.max_new_tokens,
                seed=config.seed,
                dtype=dtype,
                gpu_memory_utilization=config.vllm_gpu_memory_utilization,
                max_lora_rank=lora_rank,
                threads=torch.get_num_threads(),
                sleep_mode=config.vllm_enable_sleep_mode,
            )
        return cls(engine, sync, scratch_parent)

    @contextlib.contextmanager
    def holding(
        self, model, *, base_model: bool = False, adapter: str | os.PathLike | None = None
    ) -> Iterator[ServerEngine | ColocatedEngine]:
        """The engine holding the weights being evaluated while the block runs: the base model's (`base_model`);
        else, with `weight_sync` lora, `model`'s adapter by path (`adapter`, its folder, or saved to a scratch
        folder); else `model`'s weights, its adapters merged in (or fully fine-tuned), handed over in memory (a server
        you started refuses them, naming what to do). A scratch folder is removed after the block. Under ZeRO-3 the
        parameters must be gathered."""
        started, scratch = time.perf_counter(), None
        with contextlib.ExitStack() as stack:
            if base_model:
                self.engine.use_base()
            elif self.weight_sync == "lora" and adapter is not None:
                self.engine.use_adapter(str(Path(adapter).resolve()))
            elif self.weight_sync == "lora" and hasattr(model, "peft_config"):
                scratch = stack.enter_context(_scratch_folder(self.scratch_parent))
                model.save_pretrained(str(scratch))  # the adapter only
                self.engine.use_adapter(str(scratch))
            else:
                self.engine.use_weights(merged_weights(model))
            written = 0 if scratch is None else sum(f.stat().st_size for f in scratch.rglob("*") if f.is_file())
            self.handed_over = HandOver(time.perf_counter() - started, written)
            yield self.engine

    def sleep(self) -> None:
        """Between evaluations on a GPU, an engine in this process gives training the memory back."""
        self.engine.sleep()

    def close(self) -> None:
        self.engine.close()


@dataclasses.dataclass(frozen=True)
class HandOver:
    """How an evaluation's weights reached the engine: seconds from the model in training (or on disk) to the engine
    holding them, and the bytes written to a folder on the way (0: in memory, or an adapter read where it lies)."""

    seconds: float
    bytes_written: int

    def __str__(self) -> str:
        return f"weights handed over in {self.seconds:.1f}s, {self.bytes_written / 1e6:,.0f} MB written"


@contextlib.contextmanager
def _scratch_folder(parent: str | os.PathLike | None) -> Iterator[Path]:
    """A folder in `parent` (default: the system's temporary folder), by its absolute path, removed afterwards."""
    if parent is not None:
        Path(parent).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="probdiff-vllm-", dir=parent, ignore_cleanup_errors=True) as folder:
        yield Path(folder).resolve()
