"""train/data.py: the recipe's conversations and held-out queries, the samples fallback, and what truncation leaves
without an assistant token."""

from __future__ import annotations

import pytest

from train.data import count_without_assistant_tokens, data_files
from train.recipe import RecipeError, load_recipe


@pytest.fixture
def unprepared(tmp_path, monkeypatch):
    """No data/processed/ in the working directory or the project root: the recipe's own data is missing (a file
    named with train_file= or heldout_file= that is missing stops instead: test_newuser_errors.py)."""
    import train.data

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train.data, "PROJECT_ROOT", tmp_path)


def test_missing_prepared_data_falls_back_to_samples_with_a_notice(unprepared):
    recipe = load_recipe(["recipe=blog"])
    train, heldout, notices = data_files(recipe)
    assert train.parts[-3:] == ("samples", "blog", "train.jsonl") and heldout.name == "heldout.jsonl"
    assert len(notices) == 2 and "python data/prepare.py blog" in notices[0]


def test_missing_alignbench_training_file_stops_with_a_message(unprepared):
    recipe = load_recipe(["recipe=alignbench"])
    expected = r"AlignBench training data not found at .*train.jsonl: run `python data/prepare.py alignbench`, which "
    with pytest.raises(RecipeError, match=expected + r"downloads .*gpt_generate_train.json.*--train FILE"):
        data_files(recipe)
    tiny = load_recipe(["recipe=alignbench", "model=tiny"])
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
