"""Qwen v1 (Qwen-7B/14B-Chat, `model_type: qwen`, remote code `QWenLMHeadModel`) as a native
`transformers` `Qwen2ForCausalLM`, so that it loads, trains and saves without `trust_remote_code`.

Within its trained context (`seq_length`, 2,048 tokens) v1 computes exactly what Qwen2 computes:
RMSNorm, rotary embeddings over the full head, q/k/v with bias, o_proj without bias, a SwiGLU MLP
and an untied LM head. Past that length v1 switches on dynamic NTK rotary scaling and logn attention
scaling, which Qwen2 does not have, so the two models diverge beyond 2,048 tokens (prompt + generated).

Two ways in, both reading the one weight table `V1_TO_QWEN2`:
  * `convert_qwen_checkpoint(src, dst)` writes a plain Qwen2 checkpoint, one input shard at a time, so that
    converting a checkpoint needs about one shard of memory, not the whole model;
  * `load_qwen_v1(path)` hands the converted, still memory-mapped tensors to `Qwen2ForCausalLM.from_pretrained`.
The config mapping lives in `qwen_v1_config`, the adapter merge in `qwen_v1_merge`; this module re-exports both.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from probdiff_callback.qwen_v1_config import QWEN_V1_STOP_IDS, qwen2_config_from_v1, qwen2_generation_config
from probdiff_callback.qwen_v1_merge import merge_adapter
from probdiff_callback.tokenizer import bundled_tiktoken_file, convert_qwen_tiktoken, load_qwen_tokenizer

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, Qwen2Config

V1_TRAINED_CONTEXT = 2048

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


# --- detection ----------------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def is_qwen_v1_checkpoint(path: str | os.PathLike) -> bool:
    """True for a local directory whose config.json says `model_type: qwen` (Qwen v1)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return False
    try:
        return _read_json(config_file).get("model_type") == "qwen"
    except (OSError, ValueError):
        return False


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
def _v1_weight_files(src: Path) -> tuple[list[Path], list[str] | None]:
    """The checkpoint's weight files in index order (safetensors preferred when both exist), and the
    weight names its index lists (None without an index)."""
    for index_name, single_name in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        index_file = src / index_name
        if index_file.is_file():
            weight_map = _read_json(index_file)["weight_map"]
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


def _file_keys(path: Path) -> list[str]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(path, framework="pt") as handle:
            return list(handle.keys())
    return list(_load_bin(path).keys())


def _iter_file_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
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


def _v1_source(src: Path) -> tuple[dict[str, Any], Qwen2Config, list[Path]]:
    """Read and check a v1 checkpoint directory: (v1 config, Qwen2 config, weight files)."""
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src / 'config.json'} not found")
    v1_config = _read_json(src / "config.json")
    config = qwen2_config_from_v1(v1_config)
    files, keys = _v1_weight_files(src)
    if keys is None:
        keys = [key for path in files for key in _file_keys(path)]
    check_v1_keys(keys, config.num_hidden_layers)
    return v1_config, config, files


def _tiktoken_file(src: Path) -> Path:
    own = src / "qwen.tiktoken"
    if own.is_file():
        return own
    bundled = bundled_tiktoken_file()
    print(f"{src} has no qwen.tiktoken; using the Qwen v1 vocabulary bundled with qwen-tokenizer ({bundled})")
    return bundled


def _v1_generation_config(src: Path) -> dict[str, Any] | None:
    path = src / "generation_config.json"
    return _read_json(path) if path.is_file() else None


# --- streaming conversion -----------------------------------------------------------------
def _size_in_bytes(size: int | str) -> int:
    from transformers.utils.hub import convert_file_size_to_int

    return convert_file_size_to_int(size)


def _write_qwen2_shards(files: list[Path], dst: Path, max_shard_bytes: int, progress: bool = True) -> None:
    """Convert `files` one at a time into safetensors shards plus `model.safetensors.index.json` in `dst`."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    written: list[tuple[Path, list[str]]] = []
    total_size = 0
    buffer: dict[str, torch.Tensor] = {}
    buffered_bytes = 0

    def flush() -> None:
        nonlocal buffer, buffered_bytes
        if not buffer:
            return
        # The final names need the shard count, known only at the end.
        part = dst / f".qwen2-part-{len(written):05d}.safetensors"
        save_file(buffer, part, metadata={"format": "pt"})
        written.append((part, list(buffer)))
        buffer, buffered_bytes = {}, 0

    for path in tqdm(files, desc="Converting Qwen v1 shards", unit="shard", disable=not progress):
        for key, tensor in _iter_file_tensors(path):
            for new_key, new_tensor in convert_v1_tensor(key, tensor):
                size = new_tensor.numel() * new_tensor.element_size()
                if buffer and buffered_bytes + size > max_shard_bytes:
                    flush()
                buffer[new_key] = new_tensor.contiguous()
                buffered_bytes += size
                total_size += size
            del tensor
        # Flushing at every input shard keeps at most one shard's tensors alive.
        flush()

    weight_map: dict[str, str] = {}
    for number, (part, keys) in enumerate(written, start=1):
        name = f"model-{number:05d}-of-{len(written):05d}.safetensors"
        os.replace(part, dst / name)
        weight_map.update({key: name for key in keys})
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def _copy_licence(src: Path, dst: Path) -> None:
    # The Tongyi Qianwen licence asks that it travel with the weights.
    for pattern in ("LICENSE*", "NOTICE*"):
        for path in src.glob(pattern):
            if path.is_file():
                shutil.copy2(path, dst / path.name)


def convert_qwen_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    max_shard_size: int | str = "5GB",
    *,
    progress: bool = True,
) -> Path:
    """Write the v1 checkpoint at `src` as a plain Qwen2 checkpoint in `dst` (created, must not hold one).

    Streams: one v1 weight file at a time is read, converted and written out, so memory grows by
    about one input shard (or `max_shard_size`, whichever is smaller), never by the whole model.
    Output shards follow the input shards, split further where one exceeds `max_shard_size`.
    """
    src, dst = Path(src), Path(dst)
    _, config, files = _v1_source(src)
    if dst.resolve() == src.resolve():
        raise ValueError("dst must differ from src: the converted weights would overwrite the v1 ones")
    if (dst / "config.json").exists() or any(dst.glob("*.safetensors")):
        raise FileExistsError(f"{dst} already holds a checkpoint; pass an empty or new directory")
    dst.mkdir(parents=True, exist_ok=True)
    _write_qwen2_shards(files, dst, _size_in_bytes(max_shard_size), progress=progress)
    config.save_pretrained(dst)
    qwen2_generation_config(_v1_generation_config(src), config.vocab_size).save_pretrained(dst)
    convert_qwen_tiktoken(_tiktoken_file(src)).save_pretrained(dst)
    _copy_licence(src, dst)
    return dst


# --- in-memory conversion -----------------------------------------------------------------
def _qwen2_state_dict(files: list[Path]) -> dict[str, torch.Tensor]:
    """The whole checkpoint under Qwen2 names, as memory-mapped views: nothing is read or copied here."""
    state_dict: dict[str, torch.Tensor] = {}
    for path in files:
        for key, tensor in _iter_file_tensors(path):
            state_dict.update(convert_v1_tensor(key, tensor))
    return state_dict


def _resolve_checkpoint(path_or_hub_id: str | os.PathLike) -> Path:
    path = Path(path_or_hub_id)
    if path.is_dir():
        return path
    if os.path.exists(path_or_hub_id) or str(path_or_hub_id).count("/") != 1:
        raise FileNotFoundError(
            f"{path_or_hub_id} is neither a checkpoint directory nor a hub id like Qwen/Qwen-14B-Chat"
        )
    from huggingface_hub import list_repo_files, snapshot_download

    weights = ["*.safetensors", "model.safetensors.index.json"]
    try:
        if not any(name.endswith(".safetensors") for name in list_repo_files(str(path_or_hub_id))):
            weights = ["*.bin", "pytorch_model.bin.index.json"]
    except Exception:  # offline: snapshot_download below answers from the local cache, if anything
        pass
    # Only what the conversion reads: no remote code, and one weight format.
    patterns = ["config.json", "generation_config.json", "qwen.tiktoken", "LICENSE*", "NOTICE*", *weights]
    return Path(snapshot_download(str(path_or_hub_id), allow_patterns=patterns))


def load_qwen_v1(
    path_or_hub_id: str | os.PathLike,
    torch_dtype: torch.dtype | str | None = None,
    device_map: str | dict | None = None,
    **kwargs: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a Qwen v1 checkpoint as `Qwen2ForCausalLM` (converted while loading) and its tokenizer.

    `kwargs` go to `from_pretrained` (e.g. `quantization_config`, `attn_implementation`). The
    model is a plain `Qwen2ForCausalLM`: `save_pretrained` writes a native Qwen2 checkpoint.
    """
    from transformers import Qwen2ForCausalLM

    if torch_dtype is not None and "dtype" in kwargs:
        raise ValueError("pass either torch_dtype or dtype, not both")
    dtype = kwargs.pop("dtype", torch_dtype if torch_dtype is not None else "auto")
    path = _resolve_checkpoint(path_or_hub_id)
    if not is_qwen_v1_checkpoint(path):
        raise ValueError(f"{path} is not a Qwen v1 checkpoint (config.json model_type is not 'qwen')")
    _, config, files = _v1_source(path)
    print(
        f"Qwen v1 checkpoint detected at {path}: converting to Qwen2ForCausalLM in memory "
        f"(exact within {V1_TRAINED_CONTEXT:,} tokens)"
    )
    # Tensors handed over under Qwen2 names: transformers then records no load-time conversion, which
    # `save_pretrained` would otherwise undo into v1 names.
    model, info = Qwen2ForCausalLM.from_pretrained(
        None,
        config=config,
        state_dict=_qwen2_state_dict(files),
        dtype=dtype,
        device_map=device_map,
        output_loading_info=True,
        **kwargs,
    )
    problems = {name: sorted(info.get(name) or []) for name in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    problems = {name: keys for name, keys in problems.items() if keys}
    if problems:
        raise ValueError(f"converting {path} in memory left weights unmatched: {problems}")
    # from_pretrained recorded the None it was given; PEFT's adapter_config and model cards name the base from this.
    model.name_or_path = model.config.name_or_path = str(path)
    model.generation_config = qwen2_generation_config(_v1_generation_config(path), config.vocab_size)
    return model, load_qwen_v1_tokenizer(path)


def load_qwen_v1_tokenizer(path_or_hub_id: str | os.PathLike) -> PreTrainedTokenizerBase:
    """The fast tokenizer for a v1 checkpoint directory or hub id, from its own `qwen.tiktoken`.

    For a hub id only that one file is fetched; when it cannot be (offline), the identical
    vocabulary bundled with `qwen-tokenizer` is used, with a notice.
    """
    path = Path(path_or_hub_id)
    if path.is_dir():
        return load_qwen_tokenizer(_tiktoken_file(path))
    try:
        from huggingface_hub import hf_hub_download

        tiktoken_file = Path(hf_hub_download(str(path_or_hub_id), "qwen.tiktoken"))
    except Exception as err:  # offline, gated or missing: every v1 model shares one vocabulary
        tiktoken_file = bundled_tiktoken_file()
        print(
            f"could not fetch qwen.tiktoken of {path_or_hub_id} ({type(err).__name__}); "
            "using the bundled Qwen v1 vocabulary"
        )
    return load_qwen_tokenizer(tiktoken_file)


__all__ = [
    "QWEN2_LORA_TARGET_MODULES",
    "QWEN2_TO_V1_MODULE_NAMES",
    "QWEN_V1_STOP_IDS",
    "V1_TO_QWEN2",
    "V1_TRAINED_CONTEXT",
    "check_v1_keys",
    "convert_qwen_checkpoint",
    "convert_v1_state_dict",
    "convert_v1_tensor",
    "expected_v1_keys",
    "is_qwen_v1_checkpoint",
    "load_qwen_v1",
    "load_qwen_v1_tokenizer",
    "merge_adapter",
    "qwen2_config_from_v1",
    "qwen2_generation_config",
    "qwen2_names",
]
