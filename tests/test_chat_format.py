"""Any chat model in its own format: three template families (ChatML with a default system prompt, Llama 3, Gemma,
which refuses a system role) on small random models built here; ProbDiff uses each template's own system prompt and
end-of-turn token, and training puts the loss on assistant turns whatever the template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _chat_families import END_OF_TURN, FAMILIES, build_model, build_tokenizer, save_family_model
from _launch import sft_here

from probdiff_callback.core.chat_format import (
    accepts_system_role,
    end_of_turn,
    ensure_pad_token,
    fold_system_turns,
    loss_masking,
    mask_assistant_turns,
    query_messages,
    render,
    stop_token_ids,
)
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.evaluator import evaluate
from probdiff_callback.core.queries import Query
from probdiff_callback.training.recipe import as_installed

ROOT = Path(__file__).resolve().parents[1]
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Summarize the article in one sentence."},
    {"role": "assistant", "content": "The council will build a bridge."},
    {"role": "user", "content": "Shorter?"},
    {"role": "assistant", "content": "A new bridge."},
]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    tokenizer = build_tokenizer(request.param)
    ensure_pad_token(tokenizer)
    return request.param, tokenizer


def test_a_query_takes_the_templates_own_system_prompt_or_the_given_one(family):
    name, tokenizer = family
    default = render(tokenizer, query_messages(tokenizer, None, "Hi"), add_generation_prompt=True)
    given = render(tokenizer, query_messages(tokenizer, "Be brief.", "Hi"), add_generation_prompt=True)
    if name == "chatml":  # its own default system prompt, replaced by a given one
        assert default.startswith("<|im_start|>system\nYou are a helpful AI assistant named Smol<|im_end|>\n")
        assert given.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and "Smol" not in given
        assert default.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    elif name == "llama3":  # no system turn unless one is given
        assert default == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>" + (
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
        assert given.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>")
    else:  # Gemma refuses a system role: a given system prompt heads the user turn, as its own docs do
        assert not accepts_system_role(tokenizer)
        assert default == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
        assert given == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert accepts_system_role(tokenizer) == (name != "gemma")


def test_answers_stop_at_the_templates_end_of_turn_and_the_generation_config_ids(family):
    name, tokenizer = family
    text, token_id = end_of_turn(tokenizer)
    assert text == END_OF_TURN[name] and token_id == tokenizer.convert_tokens_to_ids(text)
    model = build_model(tokenizer, name)
    config_ids = {tokenizer.convert_tokens_to_ids(t) for t in FAMILIES[name][3]}
    assert stop_token_ids(tokenizer, model.generation_config) == sorted(config_ids | {token_id, tokenizer.eos_token_id})
    assert stop_token_ids(tokenizer) == sorted({token_id, tokenizer.eos_token_id})  # no generation config


def test_a_missing_pad_token_is_set_to_eos():
    tokenizer = build_tokenizer("llama3")
    assert tokenizer.pad_token is None
    assert "no pad token" in ensure_pad_token(tokenizer)
    assert tokenizer.pad_token == "<|end_of_text|>" and ensure_pad_token(tokenizer) is None


def masked_text(tokenizer, messages) -> str:
    masked = mask_assistant_turns(tokenizer, messages)
    return tokenizer.decode([t for t, m in zip(masked.input_ids, masked.assistant_masks) if m])


def test_assistant_turns_are_found_in_any_template(family):
    name, tokenizer = family
    messages = fold_system_turns(tokenizer, CONVERSATION)
    assert (messages[0]["role"] == "user" and messages[0]["content"].startswith("Answer briefly.\n\n")) == (
        name == "gemma"
    )
    eot = END_OF_TURN[name]
    # each assistant turn and its end-of-turn token (the model learns to stop); nothing of the user turns
    assert masked_text(tokenizer, messages) == f"The council will build a bridge.{eot}A new bridge.{eot}"
    masked = mask_assistant_turns(tokenizer, messages)
    assert masked.input_ids == tokenizer(render(tokenizer, messages, add_generation_prompt=False))["input_ids"]
    assert loss_masking(tokenizer) == "spans"  # no markers, and not a template trl patches


def test_spans_equal_the_generation_markers_where_a_template_has_them(qwen_tokenizer):
    encoded = qwen_tokenizer.apply_chat_template(
        CONVERSATION, return_dict=True, return_assistant_tokens_mask=True, tokenize=True
    )
    masked = mask_assistant_turns(qwen_tokenizer, CONVERSATION)
    assert masked.input_ids == encoded["input_ids"] and masked.assistant_masks == encoded["assistant_masks"]
    assert loss_masking(qwen_tokenizer) == "markers"


def test_a_template_that_is_not_prefix_preserving_is_refused_with_a_way_out(qwen_tokenizer):
    from probdiff_callback.core.chat_format import ChatTemplateError

    tokenizer = build_tokenizer("chatml")
    # renders an assistant turn differently when it is the last one (as some "thinking" templates do)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}{{ '<|im_start|>assistant\n[old]'"
        " + m['content'] + '<|im_end|>\n' }}{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
        "'<|im_end|>\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
        "{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="assistant_only_loss=false"):
        mask_assistant_turns(tokenizer, CONVERSATION[1:] + [{"role": "user", "content": "Thanks"}])


@pytest.mark.slow
def test_probdiff_evaluates_each_family_and_stops_at_its_end_of_turn(family):
    name, tokenizer = family
    model = build_model(tokenizer, name)
    queries = [Query(id=str(i), text=t) for i, t in enumerate(["Write about autumn.", "Hello!", "Translate: Hund"])]
    config = ProbDiffConfig(max_new_tokens=6, batch_size=2, system_prompt="Be brief." if name == "gemma" else None)
    records = evaluate(model, tokenizer, queries, config, progress=False).records
    assert [r.id for r in records] == ["0", "1", "2"]
    assert all(r.n_tokens_response > 0 and torch.isfinite(torch.tensor(r.logp_response)) for r in records)
    # a model that always emits the end-of-turn token: with only the template to tell (no generation config),
    # every answer stops at once instead of running to the cap
    eot_id = end_of_turn(tokenizer)[1]
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    torch.nn.init.zeros_(head.weight)
    with torch.no_grad():
        head.bias.fill_(-10.0)
        head.bias[eot_id] = 10.0
    model.lm_head = head
    model.generation_config.eos_token_id = None
    records = evaluate(model, tokenizer, queries, config, progress=False).records
    assert all(r.response == "" and r.response_capped is False for r in records)


def test_trl_builds_labels_from_our_masks(family, tmp_path):
    from trl import SFTConfig, SFTTrainer

    from probdiff_callback.training.data import loss_datasets

    name, tokenizer = family
    rows = [{"id": "a", "messages": CONVERSATION}, {"id": "b", "messages": CONVERSATION[1:3]}]
    train, evaluation, masking = loss_datasets(tokenizer, rows, rows[:1], assistant_only=True)
    assert masking == "spans" and set(train.column_names) == {"input_ids", "assistant_masks"}
    args = SFTConfig(
        **as_installed(
            {
                "output_dir": str(tmp_path),
                "use_cpu": True,
                "bf16": False,
                "report_to": "none",
                "max_length": 256,
                "assistant_only_loss": False,
                "activation_checkpointing": False,
            }
        )
    )
    trainer = SFTTrainer(
        model=build_model(tokenizer, name),
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
    )
    first = trainer.train_dataset[0]
    kept = [t for t, label in zip(first["input_ids"], first["labels"]) if label != -100]
    assert tokenizer.decode(kept) == masked_text(tokenizer, fold_system_turns(tokenizer, CONVERSATION))
    _, _, off = loss_datasets(tokenizer, rows, rows[:1], assistant_only=False)
    assert off == "off"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_training_runs_on_each_family(name, tmp_path, monkeypatch, capsys, sft_in_this_process):
    """train/sft.py's `main` in this process (its command line, as a user starts it, is e2e/test_sft_runs.py's)."""

    model_dir = save_family_model(name, tmp_path / f"{name}-model")
    train_file = tmp_path / "train.jsonl"
    rows = [{"id": str(i), "category": "xsum", "messages": CONVERSATION[:3]} for i in range(4)]
    train_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        "recipe=summarization", f"model={model_dir}", "dtype=float32", "bf16=false",
        "activation_checkpointing=false", "report_to=none", "max_steps=1", "eval_steps=1", "save_steps=1",
        "per_device_train_batch_size=2", "max_length=256", "max_eval_samples=2", f"train_file={train_file}",
        "probdiff.n_queries=2", "probdiff.max_new_tokens=4", "probdiff.max_prompt_tokens=256", "threads=1",
    ]  # fmt: skip
    code, stdout, stderr = sft_here(args, tmp_path, monkeypatch, capsys)
    out = stdout + stderr
    assert code == 0, out[-4000:]
    assert "loss on assistant turns only (the chat template has no {% generation %} markers" in out
    assert "LoRA r=16 on down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" in out
    history = [json.loads(line) for line in next(tmp_path.glob("runs/summarization/*/probdiff/history.jsonl")).open()]
    assert [r["global_step"] for r in history] == [0, 1] and all(r["error"] is None for r in history)
