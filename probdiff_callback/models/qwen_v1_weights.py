"""The Qwen v1 checkpoint as Qwen2 sees it: what its config.json and generation_config.json become, the one table of
its weights' Qwen2 names, the conversion of each tensor by it, the checks that a checkpoint converts completely, and
the reading of a checkpoint's files, memory-mapped."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from probdiff_callback.models.tokenizer import QWEN_VOCAB_WITH_TEXT, SPECIAL_START_ID

if TYPE_CHECKING:
    import torch
    from transformers import GenerationConfig, Qwen2Config


ENDOFTEXT_ID = SPECIAL_START_ID  # 151643
IM_START_ID = SPECIAL_START_ID + 1  # 151644
IM_END_ID = SPECIAL_START_ID + 2  # 151645
# v1's `chat()` stops on <|im_end|> and <|im_start|> (its stop_words_ids) and on <|endoftext|>
# (its generation_config eos); a plain `generate` must stop on all three to behave the same.
QWEN_V1_STOP_IDS = [IM_END_ID, IM_START_ID, ENDOFTEXT_ID]

_V1_REQUIRED_CONFIG_KEYS = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "intermediate_size",
    "vocab_size",
    "layer_norm_epsilon",
    "rotary_emb_base",
    "seq_length",
)
# What a converted checkpoint keeps from v1's generation_config.json: its chat sampling defaults.
_V1_SAMPLING_KEYS = ("do_sample", "top_k", "top_p", "temperature", "repetition_penalty", "max_new_tokens")


def qwen2_config_from_v1(v1_config: Mapping[str, Any]) -> Qwen2Config:
    """The `Qwen2Config` that computes what a v1 config computes within its trained context.

    Raises `ValueError` naming the key for anything Qwen2 cannot express.
    """
    from transformers import Qwen2Config

    if v1_config.get("model_type") != "qwen":
        raise ValueError(f"model_type is {v1_config.get('model_type')!r}, not 'qwen': this is not a Qwen v1 config")
    if v1_config.get("quantization_config"):
        quantization = v1_config["quantization_config"]
        method = quantization.get("quant_method", "unknown") if isinstance(quantization, Mapping) else "unknown"
        raise ValueError(
            f"quantization_config ({method}) found: quantized Qwen v1 checkpoints (e.g. Qwen-14B-Chat-Int4) "
            "cannot be converted; convert the unquantized checkpoint and quantize afterwards."
        )
    missing = [key for key in _V1_REQUIRED_CONFIG_KEYS if key not in v1_config]
    if missing:
        raise ValueError(f"Qwen v1 config lacks {', '.join(missing)}")
    rotary_pct = float(v1_config.get("rotary_pct", 1.0))
    if rotary_pct != 1.0:
        raise ValueError(
            f"rotary_pct is {rotary_pct}: Qwen2 applies rotary embeddings to the whole head (rotary_pct 1.0)"
        )
    hidden, heads = int(v1_config["hidden_size"]), int(v1_config["num_attention_heads"])
    if hidden % heads:
        raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    if "kv_channels" in v1_config and int(v1_config["kv_channels"]) != hidden // heads:
        raise ValueError(
            f"kv_channels is {v1_config['kv_channels']}, but Qwen2's head size is "
            f"hidden_size / num_attention_heads = {hidden // heads}"
        )
    if int(v1_config["intermediate_size"]) % 2:
        raise ValueError(f"intermediate_size {v1_config['intermediate_size']} is odd; v1 stores twice the MLP width")
    # These change the computation in ways Qwen2 has no switch for.
    if v1_config.get("no_bias") is False:
        raise ValueError("no_bias is false: Qwen2's o_proj and MLP have no bias")
    if v1_config.get("scale_attn_weights") is False:
        raise ValueError("scale_attn_weights is false: Qwen2 always scales attention by 1/sqrt(head_dim)")
    vocab = int(v1_config["vocab_size"])
    if vocab < QWEN_VOCAB_WITH_TEXT:
        raise ValueError(f"vocab_size {vocab} is smaller than the {QWEN_VOCAB_WITH_TEXT} ids of the Qwen v1 tokenizer")

    n_layers = int(v1_config["num_hidden_layers"])
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        # v1's `intermediate_size` counts w1 and w2 together.
        intermediate_size=int(v1_config["intermediate_size"]) // 2,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        hidden_act="silu",
        max_position_embeddings=int(v1_config["seq_length"]),
        initializer_range=float(v1_config.get("initializer_range", 0.02)),
        rms_norm_eps=float(v1_config["layer_norm_epsilon"]),
        use_cache=bool(v1_config.get("use_cache", True)),
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": float(v1_config["rotary_emb_base"])},
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=n_layers,
        attention_dropout=float(v1_config.get("attn_dropout_prob", 0.0)),
        bos_token_id=None,
        eos_token_id=IM_END_ID,
        # Not <|endoftext|>: Qwen2 would make it the embedding's padding_idx and freeze that row,
        # which v1 trained as its document separator. Padding lives in the tokenizer and generation config.
        pad_token_id=None,
        architectures=["Qwen2ForCausalLM"],
        dtype=_v1_dtype(v1_config),
    )


def _v1_dtype(v1_config: Mapping[str, Any]) -> str | None:
    if v1_config.get("torch_dtype"):
        return str(v1_config["torch_dtype"]).removeprefix("torch.")
    # Older v1 configs only carry these switches.
    for flag, dtype in (("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32")):
        if v1_config.get(flag) is True:
            return dtype
    return None


def qwen2_generation_config(v1_generation_config: Mapping[str, Any] | None, vocab_size: int) -> GenerationConfig:
    """Generation defaults for the converted model.

    Keeps v1's chat sampling settings, stops where v1's `chat()` stops, and suppresses the padded
    embedding rows (ids `QWEN_VOCAB_WITH_TEXT`..`vocab_size-1`): they have no text, were never
    trained, and a plain `generate` would otherwise sample them now and then.
    """
    from transformers import GenerationConfig

    kept = {key: (v1_generation_config or {})[key] for key in _V1_SAMPLING_KEYS if key in (v1_generation_config or {})}
    if not kept.get("do_sample", False):
        # Sampling knobs without sampling only earn a warning from GenerationConfig.validate.
        kept = {key: kept[key] for key in ("do_sample", "repetition_penalty", "max_new_tokens") if key in kept}
    return GenerationConfig(
        **kept,
        eos_token_id=list(QWEN_V1_STOP_IDS),
        pad_token_id=ENDOFTEXT_ID,
        bos_token_id=None,
        suppress_tokens=list(range(QWEN_VOCAB_WITH_TEXT, vocab_size)) or None,
    )


__all__ = ["QWEN_V1_STOP_IDS", "qwen2_config_from_v1", "qwen2_generation_config"]


QWEN2_LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# --- the one weight table -----------------------------------------------------------------
# Every v1 weight and its Qwen2 name(s); `{i}` stands for the layer index. A weight with several Qwen2
# names is split into that many equal row blocks, in order (v1's c_attn rows are q | k | v).
# Both ways in (`convert_qwen_checkpoint` and `load_qwen_v1`) read this table and nothing else.
V1_TO_QWEN2: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("transformer.wte.weight", ("model.embed_tokens.weight",)),
    ("transformer.ln_f.weight", ("model.norm.weight",)),
    ("lm_head.weight", ("lm_head.weight",)),
    ("transformer.h.{i}.ln_1.weight", ("model.layers.{i}.input_layernorm.weight",)),
    ("transformer.h.{i}.ln_2.weight", ("model.layers.{i}.post_attention_layernorm.weight",)),
    ("transformer.h.{i}.attn.c_attn.weight", tuple(f"model.layers.{{i}}.self_attn.{x}_proj.weight" for x in "qkv")),
    ("transformer.h.{i}.attn.c_attn.bias", tuple(f"model.layers.{{i}}.self_attn.{x}_proj.bias" for x in "qkv")),
    ("transformer.h.{i}.attn.c_proj.weight", ("model.layers.{i}.self_attn.o_proj.weight",)),
    # v1 computes c_proj(w1(x) * silu(w2(x))): w2 is the gated branch.
    ("transformer.h.{i}.mlp.w2.weight", ("model.layers.{i}.mlp.gate_proj.weight",)),
    ("transformer.h.{i}.mlp.w1.weight", ("model.layers.{i}.mlp.up_proj.weight",)),
    ("transformer.h.{i}.mlp.c_proj.weight", ("model.layers.{i}.mlp.down_proj.weight",)),
)
_V1_TABLE = dict(V1_TO_QWEN2)
_V1_LAYER_INDEX = re.compile(r"^transformer\.h\.(\d+)\.")
# v1 fuses q/k/v into one `c_attn`, and uses the name `c_proj` twice (attn.c_proj and mlp.c_proj).
QWEN2_TO_V1_MODULE_NAMES = {
    qwen2.split(".")[-2]: v1.split(".")[-2]
    for v1, names in V1_TO_QWEN2
    for qwen2 in names
    if qwen2.split(".")[-2] in QWEN2_LORA_TARGET_MODULES
}
# Recomputed from the config by Qwen2; some exports carry it as a buffer.
_V1_DROPPABLE = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
# GPTQ/AWQ/bitsandbytes/int8 artefacts: these weights are not plain matrices and cannot be renamed.
_QUANTIZED_NAME = re.compile(r"\.(qweight|qzeros|scales|g_idx|SCB|weight_format|absmax|quant_map|quant_state\S*)$")


# --- the weight mapping -------------------------------------------------------------------
def _refuse_quantized_key(key: str) -> None:
    if _QUANTIZED_NAME.search(key):
        raise ValueError(
            f"{key}: quantized (GPTQ/int4/int8) weights cannot be converted; convert the unquantized checkpoint"
        )


def qwen2_names(key: str) -> tuple[str, ...]:
    """The Qwen2 name(s) of v1 weight `key`, from `V1_TO_QWEN2`: none for a dropped buffer."""
    _refuse_quantized_key(key)
    if _V1_DROPPABLE.search(key):
        return ()
    layer = _V1_LAYER_INDEX.match(key)
    names = _V1_TABLE.get(_V1_LAYER_INDEX.sub("transformer.h.{i}.", key, count=1))
    if names is None:
        raise ValueError(f"{key}: not a Qwen v1 weight name this converter knows (Qwen v1 with no_bias=true expected)")
    return tuple(name.format(i=layer.group(1) if layer else None) for name in names)


def convert_v1_tensor(key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One v1 tensor -> its Qwen2 tensor(s). `c_attn.weight`/`.bias` become three; a dropped buffer none.

    Each tensor converts on its own, so a shard (or a c_attn weight and bias in different shards)
    needs nothing from elsewhere. Split blocks are views of `tensor`: a memory-mapped tensor is
    not read here, only by whoever uses the blocks (safetensors saves disjoint views as they are).
    """
    names = qwen2_names(key)
    if len(names) < 2:
        return [(name, tensor) for name in names]
    if tensor.shape[0] % len(names):
        raise ValueError(f"{key} has {tensor.shape[0]} rows; q, k and v need a multiple of {len(names)}")
    return list(zip(names, tensor.chunk(len(names))))


def convert_v1_state_dict(
    tensors: Mapping[str, torch.Tensor], hidden_size: int | None = None
) -> dict[str, torch.Tensor]:
    """Rename/split a v1 state dict (or any part of one, e.g. one shard) into Qwen2 names.

    `hidden_size`, when given, checks that each c_attn splits into three `hidden_size`-row blocks.
    """
    converted: dict[str, torch.Tensor] = {}
    expected = (3 * hidden_size, hidden_size) if hidden_size is not None else None
    for key, tensor in tensors.items():
        if expected and key.endswith("attn.c_attn.weight") and tuple(tensor.shape) != expected:
            raise ValueError(f"{key} has shape {tuple(tensor.shape)}, expected {expected}")
        converted.update(convert_v1_tensor(key, tensor))
    return converted


def expected_v1_keys(num_hidden_layers: int) -> set[str]:
    """Every weight a v1 checkpoint with `num_hidden_layers` layers must hold: the table's names, per layer."""
    return {v1.format(i=i) for v1, _ in V1_TO_QWEN2 for i in (range(num_hidden_layers) if "{i}" in v1 else [None])}


def check_v1_keys(keys: Iterable[str], num_hidden_layers: int) -> None:
    """Refuse, before anything is read or written, a key set that would not convert completely."""
    keys = set(keys)
    for key in sorted(keys):
        _refuse_quantized_key(key)
    missing = expected_v1_keys(num_hidden_layers) - keys
    if missing:
        shown = ", ".join(sorted(missing)[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"the checkpoint lacks expected Qwen v1 weights: {shown}")
    unknown = keys - expected_v1_keys(num_hidden_layers)
    unknown = {key for key in unknown if not _V1_DROPPABLE.search(key)}
    if unknown:
        shown = ", ".join(sorted(unknown)[:5])
        raise ValueError(f"the checkpoint holds weights a Qwen2 model has no place for: {shown}")


# --- reading a v1 checkpoint --------------------------------------------------------------
def v1_weight_files(src: Path) -> tuple[list[Path], list[str] | None]:
    """The checkpoint's weight files in index order (safetensors preferred when both exist), and the
    weight names its index lists (None without an index)."""
    for index_name, single_name in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        index_file = src / index_name
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
            files = list(dict.fromkeys(weight_map.values()))
            absent = [name for name in files if not (src / name).is_file()]
            if absent:
                raise FileNotFoundError(f"{index_file} names shards that are not there: {', '.join(absent)}")
            return [src / name for name in files], list(weight_map)
        if (src / single_name).is_file():
            return [src / single_name], None
    raise FileNotFoundError(
        f"{src} holds no model.safetensors(.index.json) or pytorch_model.bin(.index.json); is the download complete?"
    )


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    import torch

    try:
        # mmap: tensors stay file-backed, so a shard is not copied into memory before conversion.
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as err:
        if "mmap" not in str(err):
            raise
        # Files written before torch 1.6's zip format cannot be mapped.
        return torch.load(path, map_location="cpu", weights_only=True)


def file_keys(path: Path) -> list[str]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(path, framework="pt") as handle:
            return list(handle.keys())
    return list(_load_bin(path).keys())


def iter_file_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of one weight file, one at a time, memory-mapped (safetensors' `get_tensor`, and
    `torch.load(mmap=True)` for .bin): a tensor's bytes are read from disk only when something uses them."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                yield key, handle.get_tensor(key)
    else:
        state_dict = _load_bin(path)
        for key in list(state_dict):
            yield key, state_dict.pop(key)
