"""What the kit measures and on what: the blog recipe's settings, its held-out prompts cycled to the recipe's number
of queries; a model of Qwen-14B-Chat's (or another) shape with random weights, built on the device or saved to a
folder for train/sft.py; the device's clock, name and versions."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import subprocess
import time
from collections import namedtuple
from dataclasses import asdict
from pathlib import Path

import torch

from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.queries import Query, load_queries

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "blog.yaml"
BLOG = ROOT / "data" / "samples" / "blog"
# Qwen v1 configs as published (config.json of Qwen/Qwen-14B-Chat and Qwen/Qwen-7B-Chat); the library's converter
# turns them into the Qwen2 config a converted checkpoint has (v1 counts both MLP inputs in intermediate_size).
QWEN_V1 = {
    "qwen-14b": dict(hidden_size=5120, num_attention_heads=40, num_hidden_layers=40, intermediate_size=27392,
                     vocab_size=152064, kv_channels=128, seq_length=2048),
    "qwen-7b": dict(hidden_size=4096, num_attention_heads=32, num_hidden_layers=32, intermediate_size=22016,
                    vocab_size=151936, kv_channels=128, seq_length=8192),
}  # fmt: skip
QWEN_V1_COMMON = dict(model_type="qwen", layer_norm_epsilon=1e-6, rotary_emb_base=10000, rotary_pct=1.0, no_bias=True,
                      scale_attn_weights=True, bf16=True)  # fmt: skip


Workload = namedtuple("Workload", "queries max_new_tokens batch_size decode_batches")
TINY_WORKLOAD = Workload(queries=4, max_new_tokens=8, batch_size=4, decode_batches=(2, 4))


def read_recipe() -> dict:
    """recipes/blog.yaml over the defaults it leaves out, read without the recipe loader (which needs trl)."""
    import yaml  # a dependency of transformers

    from probdiff_callback.training.recipe import SFT_DEFAULTS, RecipeKeys

    body, defaults = yaml.safe_load(RECIPE.read_text(encoding="utf-8")), asdict(RecipeKeys())
    return {**defaults, **SFT_DEFAULTS, **body, **{k: {**defaults[k], **body.get(k, {})} for k in ("lora", "probdiff")}}


def cycled_queries(n: int) -> list[Query]:
    """The held-out blog prompts repeated to `n` queries; each copy has its own id, so its own sampling seeds."""
    base = load_queries(BLOG / "heldout.jsonl")
    copies = [(i // len(base), base[i % len(base)]) for i in range(n)]
    return [Query(f"{q.id}#{copy}", q.text, q.category) for copy, q in copies]


def probdiff_config(recipe: dict, workload: Workload, batch_size: int | None = None) -> ProbDiffConfig:
    settings = {"max_new_tokens": workload.max_new_tokens, "batch_size": batch_size or workload.batch_size}
    return ProbDiffConfig(**{**recipe["probdiff"], **settings})


def model_config(shape: str, layers: int | None = None):
    """The Qwen2 config of `shape` (as the library converts Qwen v1), with `layers` decoder layers if given."""
    from probdiff_callback.models.presets import tiny_config
    from probdiff_callback.models.qwen_v1 import qwen2_config_from_v1

    config = tiny_config() if shape == "tiny" else qwen2_config_from_v1({**QWEN_V1_COMMON, **QWEN_V1[shape]})
    if layers is not None:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = config.layer_types[:layers]
    return config


def build_model(config, device: torch.device, dtype: torch.dtype):
    """Random weights allocated and initialised on `device` itself: a 28 GB model never passes through the host."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()


def make_model(folder: Path, shape: str, layers: int | None) -> dict:
    """A random model of `shape` (`layers` of its layers) saved to `folder` as the `tiny` preset's is laid out, for
    `model=FOLDER`; its numbers, also written to FOLDER/kit_model.json."""
    from transformers import GenerationConfig

    from probdiff_callback.models.presets import ENDOFTEXT_ID, IM_END_ID, IM_START_ID
    from probdiff_callback.models.tokenizer import load_qwen_tokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = model_config(shape, layers)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = None, IM_END_ID, ENDOFTEXT_ID
    started = time.perf_counter()
    model = build_model(config, device, dtype)
    built = time.perf_counter() - started
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    load_qwen_tokenizer().save_pretrained(folder)
    generation = GenerationConfig(eos_token_id=[IM_END_ID, IM_START_ID], pad_token_id=ENDOFTEXT_ID)
    generation.to_json_file(folder / "generation_config.json")
    numbers = {
        "shape": shape, "layers": config.num_hidden_layers, "shape_layers": model_config(shape).num_hidden_layers,
        "dtype": str(dtype).removeprefix("torch."), "parameters": sum(p.numel() for p in model.parameters()),
        "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "per_layer_bytes": sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters()),
        "build_s": round(built, 2), "save_s": round(time.perf_counter() - started - built, 2),
    }  # fmt: skip
    (folder / "kit_model.json").write_text(json.dumps(numbers) + "\n")
    return numbers


def clock(device: torch.device) -> float:
    """Wall time after the device has finished the work queued so far (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return f"{properties.name}, {properties.total_memory / 1024**3:.1f} GiB, CUDA {torch.version.cuda}"
    cpu = platform.processor() or platform.machine()
    return f"CPU: {cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def versions() -> str:
    """Python's and the packages' versions, and this checkout's commit: the kit imports the library from here."""
    parts = [f"python {platform.python_version()}"]
    for name in ("torch", "transformers", "peft", "trl", "accelerate"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            parts.append(f"{name} {importlib.metadata.version(name)}")
    with contextlib.suppress(OSError):  # no git on the machine: a copied checkout
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        parts.append(f"probdiff checkout {commit.stdout.strip()}")
    return ", ".join(parts)
