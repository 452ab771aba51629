"""What a Qwen v1 config.json and generation_config.json become for the converted `Qwen2ForCausalLM`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from probdiff_callback.tokenizer import QWEN_VOCAB_WITH_TEXT, SPECIAL_START_ID

if TYPE_CHECKING:
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
