"""Qwen v1 (Qwen-7B/14B-Chat, `model_type: qwen`, remote code `QWenLMHeadModel`) as a native
`transformers` `Qwen2ForCausalLM`, so that it loads, trains and saves without `trust_remote_code`.

Within its trained context (`seq_length`, 2,048 tokens) v1 computes exactly what Qwen2 computes:
RMSNorm, rotary embeddings over the full head, q/k/v with bias, o_proj without bias, a SwiGLU MLP
and an untied LM head. Past that length v1 switches on dynamic NTK rotary scaling and logn attention
scaling, which Qwen2 does not have, so the two models diverge beyond 2,048 tokens (prompt + generated).

Three ways in, each converting every tensor by the one weight table `V1_TO_QWEN2` (`qwen_v1_weights`, with the
config mapping):
  * `convert_qwen_checkpoint(src, dst)` writes a plain Qwen2 checkpoint, one input shard at a time, so that
    converting a checkpoint needs about one shard of memory, not the whole model;
  * `load_qwen_v1(path)` hands the converted, still memory-mapped tensors to `Qwen2ForCausalLM.from_pretrained`;
  * `merge_adapter(base, adapter, out)` merges a LoRA adapter trained on the converted form into its base.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from probdiff_callback.models.qwen_v1_weights import (
    QWEN2_LORA_TARGET_MODULES,
    QWEN2_TO_V1_MODULE_NAMES,
    QWEN_V1_STOP_IDS,
    V1_TO_QWEN2,
    check_v1_keys,
    convert_v1_state_dict,
    convert_v1_tensor,
    expected_v1_keys,
    file_keys,
    iter_file_tensors,
    qwen2_config_from_v1,
    qwen2_generation_config,
    qwen2_names,
    v1_weight_files,
)
from probdiff_callback.models.tokenizer import (
    bundled_tiktoken_file,
    load_qwen_tokenizer,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, Qwen2Config


V1_TRAINED_CONTEXT = 2048


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


# --- a v1 checkpoint directory ------------------------------------------------------------
def _v1_source(src: Path) -> tuple[dict[str, Any], Qwen2Config, list[Path]]:
    """Read and check a v1 checkpoint directory: (v1 config, Qwen2 config, weight files)."""
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src / 'config.json'} not found")
    v1_config = _read_json(src / "config.json")
    config = qwen2_config_from_v1(v1_config)
    files, keys = v1_weight_files(src)
    if keys is None:
        keys = [key for path in files for key in file_keys(path)]
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
        for key, tensor in iter_file_tensors(path):
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
    load_qwen_tokenizer(_tiktoken_file(src)).save_pretrained(dst)  # converted once per machine, as for loading
    _copy_licence(src, dst)
    return dst


# --- in-memory conversion -----------------------------------------------------------------
def _qwen2_state_dict(files: list[Path]) -> dict[str, torch.Tensor]:
    """The whole checkpoint under Qwen2 names, as views of the memory-mapped files: nothing is read here."""
    state_dict: dict[str, torch.Tensor] = {}
    for path in files:
        for key, tensor in iter_file_tensors(path):
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


_WRITTEN_BY_SAVE_PRETRAINED = {
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
}


def merge_adapter(
    base_path: str | os.PathLike,
    adapter_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: torch.dtype | str = "auto",
) -> Path:
    """Merge a PEFT (LoRA) adapter trained on the Qwen2 form into its base and save the result.

    `base_path` is a converted checkpoint (or a v1 one, converted in memory). The output holds the
    merged weights, the tokenizer and the generation config, loadable without PEFT.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from probdiff_callback.models import peft_without_deprecated_alias_warning

    base_path, adapter_dir, out_dir = Path(base_path), Path(adapter_dir), Path(out_dir)
    adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    targets = adapter_config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    v1_names = sorted({t for t in targets if t.split(".")[-1] in QWEN2_TO_V1_MODULE_NAMES.values()})
    if v1_names:
        raise ValueError(
            f"adapter target_modules {v1_names} name Qwen v1 modules; this merge expects an adapter trained on the "
            f"converted (Qwen2) model, whose targets are {QWEN2_LORA_TARGET_MODULES}"
        )
    if out_dir.resolve() == base_path.resolve():
        raise ValueError("out_dir must differ from base_path: merging would overwrite the base weights")
    out_dir.mkdir(parents=True, exist_ok=True)
    if is_qwen_v1_checkpoint(base_path):
        base, tokenizer = load_qwen_v1(base_path, torch_dtype=None if dtype == "auto" else dtype)
        tokenizer.save_pretrained(out_dir)
        _copy_licence(base_path, out_dir)
    else:
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
        # Tokenizer files, chat template and licence are copied as they are: re-serialising the
        # 150k-entry tokenizer would only cost time.
        for path in base_path.iterdir():
            weights = path.suffix in (".safetensors", ".bin")
            if path.is_file() and not weights and path.name not in _WRITTEN_BY_SAVE_PRETRAINED:
                shutil.copy2(path, out_dir / path.name)
    with peft_without_deprecated_alias_warning():
        merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    # save_pretrained also writes the base's generation_config (stop ids, suppressed rows).
    merged.save_pretrained(out_dir)
    return out_dir
