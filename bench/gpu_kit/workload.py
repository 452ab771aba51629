"""What a run measures: the blog recipe's settings, its held-out prompts cycled to the recipe's number of
queries, its training conversations, and a model of Qwen-14B-Chat's (or another) shape with random weights."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch

from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.queries import Query, load_queries
from probdiff_callback.models.presets import TINY_ARCHITECTURE

from . import ROOT
from .device import allocated_memory, clock
from .floor import Hardware, ModelCost
from .report import Figure, gib, say, seconds

RECIPE = ROOT / "recipes" / "blog.yaml"
HELDOUT_PROMPTS = ROOT / "data" / "samples" / "blog" / "heldout.jsonl"
TRAIN_SAMPLES = ROOT / "data" / "samples" / "blog" / "train.jsonl"

# Qwen v1 configs as published (config.json of Qwen/Qwen-14B-Chat and Qwen/Qwen-7B-Chat); the library's own
# converter turns them into the Qwen2 config a converted checkpoint has. v1 counts both MLP inputs in
# intermediate_size: 27,392 -> 13,696 and 22,016 -> 11,008.
QWEN_V1_CONFIGS = {
    "qwen-14b": dict(hidden_size=5120, num_attention_heads=40, num_hidden_layers=40, intermediate_size=27392,
                     vocab_size=152064, kv_channels=128, seq_length=2048),
    "qwen-7b": dict(hidden_size=4096, num_attention_heads=32, num_hidden_layers=32, intermediate_size=22016,
                    vocab_size=151936, kv_channels=128, seq_length=8192),
}  # fmt: skip
QWEN_V1_COMMON = dict(model_type="qwen", layer_norm_epsilon=1e-6, rotary_emb_base=10000, rotary_pct=1.0, no_bias=True,
                      scale_attn_weights=True, bf16=True)  # fmt: skip
SHAPES = ("qwen-14b", "qwen-7b", "tiny")
# Mean length of the paper's 469 Xiaohongshu training conversations, chat-formatted, in Qwen v1 tokens (measured
# on ../shared/data, which is not shipped). The recipe trains on one conversation per sequence, so a real step is
# this long, not max_length.
BLOG_CONVERSATION_TOKENS = 340


@dataclass(frozen=True)
class Workload:
    """What one run measures; the qwen shapes take the blog recipe's settings, `tiny` small ones for a CPU."""

    queries: int
    max_new_tokens: int
    batch_size: int
    decode_batches: tuple[int, ...]
    train_tokens: tuple[int, ...]


TINY_WORKLOAD = Workload(queries=4, max_new_tokens=8, batch_size=4, decode_batches=(2, 4), train_tokens=(64,))


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


def read_recipe() -> dict:
    """recipes/blog.yaml over the defaults it leaves out (SFT_DEFAULTS, RecipeKeys with its ProbDiffConfig), read
    without the recipe loader, which needs trl that a GPU machine may lack."""
    import yaml  # a dependency of transformers

    from probdiff_callback.training.recipe import SFT_DEFAULTS, RecipeKeys

    body, defaults = yaml.safe_load(RECIPE.read_text(encoding="utf-8")), asdict(RecipeKeys())
    return {**defaults, **SFT_DEFAULTS, **body, **{k: {**defaults[k], **body.get(k, {})} for k in ("lora", "probdiff")}}


def recipe_workload(recipe: dict) -> Workload:
    probdiff = recipe["probdiff"]
    return Workload(
        queries=probdiff["n_queries"],
        max_new_tokens=probdiff["max_new_tokens"],
        batch_size=probdiff["batch_size"],
        decode_batches=(16, 32, 64),
        train_tokens=(recipe["max_length"], BLOG_CONVERSATION_TOKENS),
    )


def cycled_queries(n: int) -> list[Query]:
    """The held-out blog prompts repeated to `n` queries; each copy has its own id, so its own sampling seeds."""
    base = load_queries(HELDOUT_PROMPTS)
    copies = [(i // len(base), base[i % len(base)]) for i in range(n)]
    return [Query(f"{q.id}#{copy}", q.text, q.category) for copy, q in copies]


def probdiff_config(recipe: dict, workload: Workload, batch_size: int | None = None) -> ProbDiffConfig:
    settings = {"max_new_tokens": workload.max_new_tokens, "batch_size": batch_size or workload.batch_size}
    return ProbDiffConfig(**{**recipe["probdiff"], **settings})


def training_batch(tokenizer, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) [1, n_tokens]: blog training conversations, chat-formatted as trl formats them, one after
    another, cut at n_tokens, with labels on the assistant tokens only (the recipe's assistant_only_loss)."""
    conversations = []
    for line in TRAIN_SAMPLES.read_text(encoding="utf-8").splitlines():
        if line.strip():
            encoded = tokenizer.apply_chat_template(
                json.loads(line)["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            conversations.append((list(encoded["input_ids"]), list(encoded["assistant_masks"])))
    ids: list[int] = []
    labels: list[int] = []
    while len(ids) < n_tokens:
        for conversation_ids, mask in conversations:
            ids.extend(conversation_ids)
            labels.extend(token if keep else -100 for token, keep in zip(conversation_ids, mask))
    return torch.tensor([ids[:n_tokens]]), torch.tensor([labels[:n_tokens]])


def workload_figure(workload: Workload, n_revisions: int) -> Figure:
    return Figure(
        "workload",
        f"{workload.queries} queries x (answer + {n_revisions} revision), max_new_tokens {workload.max_new_tokens}, "
        f"batch {workload.batch_size}",
        f"the {HELDOUT_PROMPTS.relative_to(ROOT)} prompts cycled; settings of {RECIPE.relative_to(ROOT)}",
    )


def model_config(shape: str):
    from transformers import Qwen2Config

    from probdiff_callback.models.qwen_v1 import qwen2_config_from_v1

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
