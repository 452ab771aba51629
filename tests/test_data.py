"""training/data.py: the recipe's conversations and held-out queries, the samples fallback, and what truncation leaves
without an assistant token."""

from __future__ import annotations

import re

import pytest

import probdiff_callback.training.data
from probdiff_callback.training import sft
from probdiff_callback.training.data import count_without_assistant_tokens, data_files
from probdiff_callback.training.recipe import RecipeError, load_recipe


@pytest.fixture
def unprepared(tmp_path, monkeypatch):
    """No data/processed/ in the working directory or the project root: the recipe's own data is missing (a file
    named with train_file= or heldout_file= that is missing stops instead: test_newuser_errors.py)."""
    import probdiff_callback.training.data

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(probdiff_callback.training.data, "PROJECT_ROOT", tmp_path)


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


@pytest.mark.parametrize("key", ["train_file", "heldout_file"])
def test_a_named_data_file_that_is_missing_stops_instead_of_training_on_the_samples(
    key, tmp_path, capsys, sft_in_this_process
):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(RecipeError) as raised:
        data_files(load_recipe(["recipe=blog", "model=tiny", f"{key}={missing}"]))
    assert str(raised.value) == (
        f"{key}={missing}: no such file. Give an existing JSON-lines file of conversations (docs/configuration.md, "
        f'"Your own files"), or leave {key} out to use the recipe\'s data '
        f"(data/processed/blog/{key.split('_')[0]}.jsonl)"
    )
    args = ["recipe=blog", "model=tiny", f"{key}={missing}", "report_to=none", f"output_dir={tmp_path}/r"]
    assert sft.main(args) == 2
    assert error_lines(capsys.readouterr().err) == [f"error: {raised.value}"]
    assert not (tmp_path / "r").exists()


def test_a_relative_data_path_says_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    looked = rf"heldout_file=mine/h.jsonl: no such file \(looked in {re.escape(str(tmp_path))} and "
    with pytest.raises(RecipeError, match=looked):
        data_files(load_recipe(["recipe=blog", "heldout_file=mine/h.jsonl"]))
    (tmp_path / "mine").mkdir()
    with pytest.raises(RecipeError, match=r"train_file=mine: is a directory, not a file\. Give an existing"):
        data_files(load_recipe(["recipe=blog", "train_file=mine"]))


def test_the_recipes_own_data_still_falls_back_to_the_samples(tmp_path, monkeypatch):
    """Where data/processed/<task>/ is not prepared (no such folder in the working directory or the project root)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(probdiff_callback.training.data, "PROJECT_ROOT", tmp_path)
    train_file, heldout_file, notices = data_files(load_recipe(["recipe=blog"]))
    assert train_file == probdiff_callback.training.data.SAMPLES_DIR / "blog" / "train.jsonl"
    assert heldout_file == probdiff_callback.training.data.SAMPLES_DIR / "blog" / "heldout.jsonl"
    assert [n.split(":")[0] for n in notices] == ["train data", "heldout data"]
    # the same file named explicitly is the recipe's own data too
    assert data_files(load_recipe(["recipe=blog", "train_file=data/processed/blog/train.jsonl"]))[0] == train_file


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]
