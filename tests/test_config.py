"""probdiff_callback/core/config.py: the ProbDiff settings, their one validator (the CLI's and the recipes'), the help
each field carries and the tables docs/configuration.md makes from it."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest

from probdiff_callback.core.config import ConfigError, ProbDiffConfig, config_for_command
from probdiff_callback.core.settings_docs import settings_table
from probdiff_callback.training.recipe import LoraArgs, RecipeError, RecipeKeys, load_recipe

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
TABLES = {"ProbDiffConfig": (ProbDiffConfig, ""), "RecipeKeys": (RecipeKeys, ""), "LoraArgs": (LoraArgs, "lora.")}


def cli_error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        config_for_command("eval", overrides)
    return str(err.value)


def recipe_error(overrides: list[str]) -> str:
    with pytest.raises(RecipeError) as err:
        load_recipe(["recipe=blog", "model=tiny", *overrides])
    return str(err.value)


def test_overrides_are_typed_as_yaml_reads_them():
    config = ProbDiffConfig().with_overrides(
        ["delta=-0.02", "n_samples=2", "answer_temperature_by_category.Writing=0.7", "sweep=[0,-0.1]"]
    )
    assert config.delta == -0.02 and config.n_samples == 2 and config.answer_temperature_by_category == {"Writing": 0.7}
    assert config.sweep == [0.0, -0.1] and all(type(x) is float for x in config.sweep)
    assert ProbDiffConfig(delta=0).delta == 0.0 and type(ProbDiffConfig(delta=0).delta) is float
    with pytest.raises(ConfigError, match=r"unknown key 'deltaa' \(did you mean 'delta'\?\)\. Valid ProbDiff settings"):
        ProbDiffConfig().with_overrides(["deltaa=1"])
    with pytest.raises(ConfigError, match=r"wrong type for ProbDiff setting 'n_samples': got 'many', expected int"):
        ProbDiffConfig().with_overrides(["n_samples=many"])
    with pytest.raises(ConfigError, match=r"'delta' is not key=value"):
        ProbDiffConfig().with_overrides(["delta"])
    with pytest.raises(ConfigError, match="refinement_prompt"):
        ProbDiffConfig(refinement_prompt="rewrite it")
    assert ProbDiffConfig(refinement_prompt="Fix {response} for {instruction}").refinement_prompt


def test_python_construction_goes_through_the_same_check():
    with pytest.raises(ConfigError, match=r"^wrong type for ProbDiff setting 'delta': got 'abc', expected float$"):
        ProbDiffConfig(delta="abc")
    with pytest.raises(ConfigError, match=r"^Invalid ProbDiff config: n_revisions=0: needs at least 1 revision$"):
        ProbDiffConfig(n_revisions=0)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("delta", "abc", "command line: wrong type for ProbDiff setting 'delta': got 'abc', expected float"),
        # quoted, a number is text on both paths (YAML's typing): refused, where it once passed the CLI only
        ("delta", "'-0.02'", "command line: wrong type for ProbDiff setting 'delta': got '-0.02', expected float"),
        ("max_new_tokens", "'64'", "command line: wrong type for ProbDiff setting 'max_new_tokens': got '64'"),
        ("max_new_tokens", "64.5", "command line: wrong type for ProbDiff setting 'max_new_tokens': got 64.5"),
        ("dleta", "1", "command line: unknown key 'dleta' (did you mean 'delta'?)"),
        ("n_revisions", "0", "Invalid ProbDiff config: n_revisions=0: needs at least 1 revision"),
        # an enumeration is a Literal: refused by the same typed check, with the choices
        ("vllm_mode", "colocat",
         "command line: vllm_mode='colocat' (did you mean 'colocate'?): use one of colocate, server"),
    ],
)  # fmt: skip
def test_the_cli_and_the_recipe_refuse_a_setting_with_the_same_message(key, value, message):
    from_cli, from_recipe = cli_error([f"{key}={value}"]), recipe_error([f"probdiff.{key}={value}"])
    assert from_cli.startswith(message) and from_recipe.startswith(message)
    if "unknown key" not in message:  # the CLI lists the keys `eval` reads, the recipe every setting
        assert from_cli == from_recipe


def test_a_recipe_file_names_itself_in_the_message(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("task: blog\nprobdiff: {delta: high}\n")
    with pytest.raises(RecipeError, match=rf"^{re.escape(str(mine))}: wrong type for ProbDiff setting 'delta'"):
        load_recipe([f"recipe={mine}"])


def test_selecting_by_probdiff_needs_every_evaluation_on_both_paths():
    from transformers import TrainingArguments

    from probdiff_callback.callback.schedule import check_selection_setup

    expected = "metric_for_best_model=probdiff_guarded needs ProbDiff at every evaluation, but every=2"
    assert expected in recipe_error(["probdiff.every=2"])  # the recipes' default
    args = TrainingArguments("out", eval_strategy="steps", metric_for_best_model="probdiff_guarded", use_cpu=True)
    with pytest.raises(ValueError, match=expected):
        check_selection_setup(args, ProbDiffConfig(every=2))
    check_selection_setup(args, ProbDiffConfig(every=1))


@pytest.mark.parametrize("cls", [ProbDiffConfig, RecipeKeys, LoraArgs])
def test_every_setting_carries_its_help(cls):
    missing = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("help")]
    assert not missing, f"{cls.__name__} fields without metadata['help']: {missing}"


def test_eval_help_lists_each_setting_with_its_help(capsys):
    from probdiff_callback.cli import main

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in ProbDiffConfig.keys_read_by("eval"):
        assert f"{name}=" in text, name
    assert "confident when d ≥ delta" in text
    assert "n_queries" not in text  # training only


def _generated(text: str, name: str) -> tuple[int, int]:
    start, end = f"<!-- generated: {name} -->\n", f"<!-- end: {name} -->"
    assert start in text and end in text, f"docs/configuration.md lacks the markers of the {name} table"
    return text.index(start) + len(start), text.index(end)


def test_the_docs_tables_are_made_from_the_fields():
    """Set PROBDIFF_UPDATE_DOCS=1 to rewrite the tables after changing a field's default or help."""
    text = DOCS.read_text(encoding="utf-8")
    for name, (cls, prefix) in TABLES.items():
        start, end = _generated(text, name)
        table = settings_table(cls, prefix) + "\n"
        if os.environ.get("PROBDIFF_UPDATE_DOCS") == "1":
            text = text[:start] + table + text[end:]
            DOCS.write_text(text, encoding="utf-8")
        else:
            assert text[start:end] == table, (
                f"the {name} table in docs/configuration.md is not the fields' own: rerun with PROBDIFF_UPDATE_DOCS=1"
            )
