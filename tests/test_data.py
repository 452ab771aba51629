"""train/data.py: the recipe's conversations and held-out queries, the samples fallback, and what truncation leaves
without an assistant token."""

from __future__ import annotations

import pytest

from train.data import count_without_assistant_tokens, data_files
from train.recipe import RecipeError, load_recipe


def test_missing_prepared_data_falls_back_to_samples_with_a_notice(tmp_path):
    recipe = load_recipe(["recipe=blog", f"train_file={tmp_path}/none.jsonl", f"heldout_file={tmp_path}/none2.jsonl"])
    train, heldout, notices = data_files(recipe)
    assert train.parts[-3:] == ("samples", "blog", "train.jsonl") and heldout.name == "heldout.jsonl"
    assert len(notices) == 2 and "python data/prepare.py blog" in notices[0]


def test_missing_alignbench_training_file_stops_with_a_message(tmp_path):
    recipe = load_recipe(["recipe=alignbench", f"train_file={tmp_path}/mine.jsonl"])
    expected = r"AlignBench training data not found at .*mine.jsonl: run `python data/prepare.py alignbench`, which "
    with pytest.raises(RecipeError, match=expected + r"downloads .*gpt_generate_train.json.*--train FILE"):
        data_files(recipe)
    tiny = load_recipe(["recipe=alignbench", "model=tiny", f"train_file={tmp_path}/mine.jsonl"])
    train, _, notices = data_files(tiny)
    assert train.parts[-3:] == ("samples", "alignbench", "train.jsonl") and "offline samples" in notices[0]


def test_truncation_leaving_no_assistant_token_is_counted(qwen_tokenizer):
    long_prompt = "word " * 200
    rows = [
        {
            "id": "long",
            "messages": [{"role": "user", "content": long_prompt}, {"role": "assistant", "content": "answer"}],
        },
        {"id": "short", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "answer"}]},
    ]
    assert count_without_assistant_tokens(qwen_tokenizer, rows, max_length=100) == ["long"]
    assert count_without_assistant_tokens(qwen_tokenizer, rows, max_length=4096) == []
