"""AlignBench categories under every name: temperatures, per-category metrics and metric keys agree."""

import math

import pytest
from _records import make_record

from probdiff_callback.callback.metrics import metric_name, metrics_from_summary
from probdiff_callback.cli import main
from probdiff_callback.core.categories import ALIGNBENCH, canonical_category, unmatched_keys
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.metric import summary_of
from probdiff_callback.core.queries import Query

RELEASE_ORDER = ["专业能力", "数学计算", "基本任务", "逻辑推理", "文本写作", "中文理解", "角色扮演", "综合问答"]


def test_every_name_maps_to_the_short_english_label():
    assert [canonical_category(name) for name in RELEASE_ORDER] == list(ALIGNBENCH)
    assert {canonical_category(name) for name in ("Writ.", "Writing Ability", "文本写作", "Writing")} == {"Writing"}
    assert canonical_category("Task-oriented Role Play") == "Roleplay" and canonical_category("Open.") == "Open-ended"
    # other benchmarks' categories and unknown names pass through unchanged (MT-Bench's are lowercase)
    assert canonical_category("writing") == "writing" and canonical_category("cs-en") == "cs-en"
    assert canonical_category(None) is None
    assert Query("1", "q", "角色扮演").category == "Roleplay"


def test_temperature_keys_match_either_name():
    english_keys = ProbDiffConfig(answer_temperature_by_category={"Mathematics": 0.1, "Writing": 0.9})
    assert english_keys.answer_temperature_for("数学计算") == 0.1
    assert english_keys.answer_temperature_for("Writing Ability") == 0.9
    assert english_keys.answer_temperature_for("逻辑推理") == 0.7  # no key: the default
    chinese_keys = ProbDiffConfig().with_overrides(["answer_temperature_by_category.文本写作=0.3"])
    assert chinese_keys.answer_temperature_for("Writing") == 0.3 and chinese_keys.answer_temperature_for(None) == 0.7
    with pytest.raises(ValueError, match=r"'Writing' and '文本写作' name the same category"):
        ProbDiffConfig(answer_temperature_by_category={"Writing": 0.7, "文本写作": 0.1})


def test_a_key_matching_no_category_is_an_error_naming_the_valid_ones():
    config = ProbDiffConfig(answer_temperature_by_category={"Mathematic": 0.1, "Writing": 0.7, "poetry": 0.9})
    with pytest.raises(ValueError) as err:
        config.check_categories(["Writing", "poetry", None])
    message = str(err.value)
    assert "'Mathematic' matches no category" in message
    assert "The queries' categories: Writing (文本写作), poetry" in message
    assert "Mathematics (数学计算)" in message and "Open-ended (综合问答)" in message
    # AlignBench keys are valid even when the queries hold none of their category (a subset of AlignBench)
    ProbDiffConfig(answer_temperature_by_category={"Mathematics": 0.1, "角色扮演": 0.7}).check_categories(["Writing"])
    assert unmatched_keys(["poetry", "Math.", "prose"], ["poetry"]) == ["prose"]


def test_cli_stops_on_an_unmatched_key_before_loading_the_model(tmp_path, capsys):
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"question": "1+1=?", "category": "数学计算"}\n')
    overrides = ["answer_temperature_by_category.Maths=0.1"]
    assert main(["eval", "--queries", str(queries), "--out", str(tmp_path / "o"), *overrides]) == 2
    assert "'Maths' matches no category" in capsys.readouterr().err


def record(category, d):
    return make_record(f"{category}-{d}", d, category=category)


def test_summary_and_metric_keys_merge_both_names():
    records = [record("文本写作", 0.0), record("Writing", -1.0), record("Mathematics", 0.0)]
    summary = summary_of(records, -0.05, [-0.05])
    assert set(summary.by_category) == {"Writing", "Mathematics"}
    assert summary.by_category["Writing"].n == 2 and summary.by_category["Writing"].confidence == 0.5
    metrics = metrics_from_summary(summary, [-0.05], ["Writing", "Mathematics"])
    assert metrics[metric_name("confidence_Writing")] == 0.5 and metrics[metric_name("confidence_Mathematics")] == 1.0
    assert metric_name("confidence_Open-ended") == "eval_probdiff_confidence_Open-ended"
    assert math.isnan(metrics_from_summary(None, [-0.05], ["Writing"])[metric_name("confidence_Writing")])
