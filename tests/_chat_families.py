"""Small random chat models of three template families, built from configs in the test (no download): ChatML with a
default system prompt (SmolLM2's template), Llama 3 (header tokens, <|eot_id|>, no pad token) and Gemma (refuses a
system role, the assistant is "model"). None of their templates has {% generation %} markers."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "Summarize the article in one sentence. The city council voted on Tuesday to build a new bridge.",
    "Translate the sentence into English: Der Hund schläft im Garten. Write a short post about autumn.",
    "You are a helpful assistant. I want you to act as a Response Rewriter. Hello! How can I help you today?",
]

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named Smol<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

FAMILIES = {
    # name: (chat template, special tokens, tokenizer settings, generation-config end ids by token)
    "chatml": (
        CHATML,
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"},
        ["<|im_end|>"],
    ),
    "llama3": (
        LLAMA3,
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},  # no pad token, as Llama 3
        ["<|end_of_text|>", "<|eot_id|>"],
    ),
    "gemma": (
        GEMMA,
        ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
        ["<eos>", "<end_of_turn>"],
    ),
}
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>"}


def build_tokenizer(family: str):
    """A byte-level BPE tokenizer trained on a few sentences, with the family's special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template, specials, settings, _ = FAMILIES[family]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False, **settings)
    tokenizer.chat_template = template
    return tokenizer


def build_model(tokenizer, family: str, seed: int = 0):
    """A 2-layer Llama with grouped-query attention over the tokenizer's vocabulary, random weights."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    end_ids = [tokenizer.convert_tokens_to_ids(t) for t in FAMILIES[family][3]]
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=end_ids, pad_token_id=tokenizer.pad_token_id
    )
    return model


def save_family_model(family: str, directory: Path) -> Path:
    tokenizer = build_tokenizer(family)
    build_model(tokenizer, family).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
