"""The `tiny` preset: a 2-layer Qwen2 model with the real Qwen-14B-Chat vocabulary, pretrained briefly
on the project's sample texts, shipped with the package and unpacked on first use.

A random model's distribution is near uniform, so an answer and its revision score alike (d ~ 0) and
the metric reads it as confident. A short pretraining on chat-formatted samples (`train/build_tiny.py`)
gives it real preferences, and teaches it the chatml turns and to stop with <|im_end|>.

The samples use only ~7,600 of the 152,064 ids, so the model was trained over those ids plus one class
standing for all the others, and ships in that compact form (`assets/tiny.safetensors`). Unpacking
expands it: every unused id gets that class's LM-head row and the mean embedding, plus small noise
drawn from a fixed seed, so the full model's distribution equals the trained one. Every step of the
expansion is element-wise or a copy, so the weights are bit-identical whatever the machine, thread
count or launcher (a test pins their hash).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from probdiff_callback.cache import build_once, cache_dir
from probdiff_callback.tokenizer import SPECIAL_START_ID

TINY_VERSION = "tiny-4"
ASSET = Path(__file__).resolve().parent / "assets" / "tiny.safetensors"
TINY_ARCHITECTURE = dict(
    vocab_size=152064,  # as Qwen-14B-Chat: 213 padded rows past the 151,851 ids with text
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
EXPANSION_SEED = 1234
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = SPECIAL_START_ID, SPECIAL_START_ID + 1, SPECIAL_START_ID + 2
# Tensors of the asset that are not model weights: what the expansion needs.
USED_IDS, EMBED_FILL, EMBED_NOISE_STD, HEAD_NOISE_STD = (
    "tiny.used_ids",
    "tiny.embed_fill",
    "tiny.embed_noise_std",
    "tiny.head_noise_std",
)
EXPANDED_ROWS = ("model.embed_tokens.weight", "lm_head.weight")


def asset_digest(path: Path = ASSET) -> str:
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the `tiny` preset's weights ship inside the probdiff package. "
            "Reinstall it (pip install probdiff, or pip install -e . from a checkout)."
        )
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def tiny_model_dir() -> Path:
    """The unpacked `tiny` model directory (config, weights, tokenizer), unpacked once per machine."""
    target = cache_dir() / "models" / f"{TINY_VERSION}-{asset_digest()}"
    return build_once(target, unpack_tiny_model)


def expanded_state_dict(compact: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full-vocabulary fp32 weights from the compact ones (see the module docstring)."""
    vocab = TINY_ARCHITECTURE["vocab_size"]
    used = compact[USED_IDS]
    generator = torch.Generator().manual_seed(EXPANSION_SEED)
    state = {}
    for name, tensor in compact.items():
        if name.startswith("tiny."):
            continue
        tensor = tensor.to(torch.float32)
        if name in EXPANDED_ROWS:
            if name == "lm_head.weight":
                fill, std, trained = tensor[-1], compact[HEAD_NOISE_STD].float(), tensor[:-1]
            else:
                fill, std, trained = compact[EMBED_FILL].float(), compact[EMBED_NOISE_STD].float(), tensor
            noise = torch.randn((vocab, tensor.shape[1]), generator=generator, dtype=torch.float32)
            full = fill + noise * std
            full[used] = trained
            tensor = full
        state[name] = tensor.contiguous()
    return state


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors' names, shapes, dtypes and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def tiny_config():
    from transformers import Qwen2Config

    return Qwen2Config(**TINY_ARCHITECTURE, bos_token_id=None, eos_token_id=IM_END_ID, pad_token_id=ENDOFTEXT_ID)


def unpack_tiny_model(directory: Path) -> None:
    """Write the expanded model, its generation config and the tokenizer into `directory`."""
    from safetensors.torch import load_file, save_file
    from transformers import GenerationConfig

    from probdiff_callback.tokenizer import load_qwen_tokenizer

    tokenizer = load_qwen_tokenizer()
    print(f"Unpacking the `tiny` model (once per machine) into {directory.parent} ...", flush=True)
    compact = load_file(ASSET)
    state = expanded_state_dict(compact)
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    tiny_config().to_json_file(directory / "config.json")
    GenerationConfig(eos_token_id=[IM_END_ID, IM_START_ID], pad_token_id=ENDOFTEXT_ID).to_json_file(
        directory / "generation_config.json"
    )
    tokenizer.save_pretrained(directory)
    (directory / "probdiff_tiny.json").write_text(
        json.dumps(
            {"version": TINY_VERSION, "asset_sha256_16": asset_digest(), "weights_sha256": weights_digest(state)},
            indent=2,
        )
    )
