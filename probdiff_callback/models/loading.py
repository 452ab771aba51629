"""One loader for every place a model is named: a preset, a local directory or a hub id."""

from __future__ import annotations

import functools
import importlib
import sys
from pathlib import Path

import torch

from probdiff_callback.models import (
    DTYPES,
    PRESET_HUB_IDS,
    QWEN_V1_HUB_IDS,
    check_adapter,
    check_dtype,
    check_model_name,
    peft_without_deprecated_alias_warning,
)


def resolve_model_path(name: str) -> str:
    """A local directory or hub id for a preset name, a directory or a hub id (a hub id becomes its cached copy where
    the Hub cannot be reached: `hub_model_source`)."""
    check_model_name(name)
    if name == "tiny":
        from probdiff_callback.models.presets import tiny_model_dir

        return str(tiny_model_dir())
    if name == "smollm2":
        from probdiff_callback.models.presets import smollm2_model_dir

        return str(smollm2_model_dir())
    if name in PRESET_HUB_IDS:
        return hub_model_source(PRESET_HUB_IDS[name])
    if Path(name).exists():
        return name
    return hub_model_source(name)  # a hub id (owner/name): check_model_name refused anything else


class ModelUnavailable(FileNotFoundError):
    """A model whose files are neither here nor downloadable now; the message says what to do (callers prefix the
    flag or key that named the model)."""


HUB_PROBE_TIMEOUT_S = 5.0


@functools.cache
def hub_model_source(hub_id: str) -> str:
    """What loads `hub_id`: the id itself where the Hub answers (transformers downloads or revalidates the files),
    else its copy in the Hugging Face cache. Without either it stops at once, where transformers would retry each
    file for about 50 s and end in a traceback."""
    import huggingface_hub

    cache = huggingface_hub.constants.HF_HUB_CACHE
    offline = huggingface_hub.is_offline_mode()
    unreachable = None if offline else hub_unreachable()
    if not offline and unreachable is None:
        return hub_id
    cached = cached_snapshot(hub_id)
    if cached is not None:
        if unreachable is not None:
            print(
                f"note: the Hugging Face Hub cannot be reached ({unreachable}): loading {hub_id} from the cache "
                f"({cached}); HF_HUB_OFFLINE=1 skips this check",
                file=sys.stderr,
            )
        return cached
    if offline:
        raise ModelUnavailable(
            f"a hub id with no copy in the Hugging Face cache ({cache}), and HF_HUB_OFFLINE=1 allows no download: "
            f"give a local model directory, or download it first (`hf download {hub_id}` where there is network)"
        )
    raise ModelUnavailable(
        f"a hub id, but the Hugging Face Hub ({huggingface_hub.constants.ENDPOINT}) cannot be reached ({unreachable}) "
        f"and the cache ({cache}) has no copy of it: give a local model directory, or download it first "
        f"(`hf download {hub_id}` where there is network) and run with HF_HUB_OFFLINE=1"
    )


def hub_unreachable() -> str | None:
    """None when the Hub answers (any HTTP status) within HUB_PROBE_TIMEOUT_S, else why not: one request, through
    huggingface_hub's own client (its proxies and certificates), without its retries."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    session = get_session()
    # huggingface_hub 1.x's client is httpx, 2.x's httpx2: the transport errors of whichever this one is
    client = importlib.import_module(type(session).__module__.partition(".")[0])
    try:
        session.head(constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT_S)
    except client.TransportError as err:  # DNS, refused, timeout, proxy, TLS
        return str(err) or type(err).__name__
    return None


def cached_snapshot(hub_id: str) -> str | None:
    """The directory of `hub_id`'s cached snapshot (its default revision), if the cache holds its config.json."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(hub_id, local_files_only=True)
    except LocalEntryNotFoundError:
        return None
    return folder if (Path(folder) / "config.json").is_file() else None


def is_qwen_v1(path_or_id: str) -> bool:
    from probdiff_callback.models.qwen_v1 import is_qwen_v1_checkpoint

    return path_or_id in QWEN_V1_HUB_IDS or is_qwen_v1_checkpoint(path_or_id)


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str | None:
    check_dtype(dtype)  # a name: one of DTYPES
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in table:
        raise ValueError(f"dtype={dtype!r}: use one of auto, {', '.join(DTYPES)}")
    return table[dtype]


def load_tokenizer(path_or_id: str):
    from transformers import AutoTokenizer

    if is_qwen_v1(path_or_id):
        from probdiff_callback.models.qwen_v1 import load_qwen_v1_tokenizer

        return load_qwen_v1_tokenizer(path_or_id)
    from probdiff_callback.core.chat_format import ensure_pad_token

    tokenizer = AutoTokenizer.from_pretrained(path_or_id)
    notice = ensure_pad_token(tokenizer)
    if notice:
        print(f"note: {notice}", file=sys.stderr)
    return tokenizer


def load_model_and_tokenizer(
    name: str,
    adapter: str | None = None,
    dtype: str | torch.dtype | None = "auto",
    device: str | None = None,
    **model_kwargs,
):
    """(model, tokenizer) for a preset, directory or hub id, with an optional PEFT adapter on top.

    A Qwen v1 checkpoint (model_type `qwen`) is converted to Qwen2ForCausalLM on load.
    """
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name)
    dtype = parse_dtype(dtype)
    try:
        if is_qwen_v1(path):
            from probdiff_callback.models.qwen_v1 import load_qwen_v1

            model, tokenizer = load_qwen_v1(path, torch_dtype=dtype, **model_kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **model_kwargs)
            if name == "tiny":  # our converted Qwen v1 tokenizer: skip AutoTokenizer's JSON parsing in Python
                from probdiff_callback.models.tokenizer import qwen_tokenizer_from_file

                tokenizer = qwen_tokenizer_from_file(Path(path) / "tokenizer.json")
            else:
                tokenizer = load_tokenizer(path)
    except OSError as err:  # transformers' "not a valid model identifier", "no file named model.safetensors", ...
        raise ModelUnavailable(f"cannot be loaded: {' '.join(str(err).split())}") from None
    if adapter is not None:
        from peft import PeftModel

        check_adapter(adapter)
        with peft_without_deprecated_alias_warning():
            model = PeftModel.from_pretrained(model, adapter)
    if device is not None:
        model.to(device)
    model.eval()
    return model, tokenizer


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
