import json
import math
import re
import subprocess
import sys

import pytest

from probdiff_callback.analysis.report import format_summary
from probdiff_callback.cli import main
from probdiff_callback.core.metric import is_confident
from probdiff_callback.core.records import Cost, Summary

SAMPLES = "data/samples/alignbench/heldout.jsonl"


def tiny_eval(queries, out, *settings: str) -> int:
    """`probdiff eval` of `tiny` on the CPU through the CLI: 6 of `queries` into `out`, ProbDiff `settings` as
    key=value."""
    return main(
        ["eval", "--model", "tiny", "--device", "cpu", "--queries", str(queries), "--out", str(out), "--limit", "6",
         *settings]
    )  # fmt: skip


@pytest.fixture(scope="module")
def eval_dir(tiny_model_path, tmp_path_factory):
    """A `probdiff eval` run on the shipped AlignBench-style sample, through the CLI, with settings on its command
    line."""
    target = tmp_path_factory.mktemp("cli") / "seed0"
    code = tiny_eval(SAMPLES, target, "max_new_tokens=12", "seed=0", "answer_temperature_by_category.Mathematics=0.1")
    assert code == 0
    return target


@pytest.mark.slow
def test_eval_writes_records_and_summary(eval_dir, capsys):
    records = [json.loads(line) for line in (eval_dir / "records.jsonl").read_text().splitlines()]
    summary = json.loads((eval_dir / "summary.json").read_text())
    assert len(records) == 6 and summary["n"] == 6
    assert [r["id"] for r in records] == [f"alignbench-heldout-{i:03d}" for i in range(1, 7)]
    ds = [math.nan if r["d"] is None else r["d"] for r in records]
    assert summary["confidence"] == pytest.approx(sum(d >= -0.05 for d in ds if not math.isnan(d)) / 6)
    assert set(summary["confidence_sweep"]) == {"0", "-0.02", "-0.05", "-0.1"}
    assert summary["config"]["max_new_tokens"] == 12
    assert summary["config"]["answer_temperature_by_category"] == {"Mathematics": 0.1}
    assert list(summary["config"]) == EVAL_KEYS  # the settings that applied, none of the callback's
    assert set(summary["by_category"]) == {r["category"] for r in records}
    assert summary["n_capped"] == sum(r["response_capped"] for r in records)
    assert summary["n_revision_capped"] == sum(r["revision_capped"] for r in records)
    printed = format_summary(Summary.from_json(summary))
    assert f"hit max_new_tokens answers {summary['n_capped']}, revisions {summary['n_revision_capped']}" in printed
    assert "95% CI [" in printed and "(Wilson)" in printed
    for key in (
        "n_invalid",
        "n_truncated",
        "n_capped",
        "n_revision_capped",
        "n_revision_truncated",
        "confidence_ci",
        "d_mean",
        "d_median",
        "d_std",
        "d_quantiles",
        "logp_response_mean",
        "logp_revised_mean",
        "len_response_mean",
        "len_revised_mean",
        "length_changed_share",
    ):
        assert key in summary
    assert "reference" not in summary and all("ref" not in r for r in records)  # AlignBench has no reference metric
    # after what was evaluated and its seconds: what each stage cost
    assert list(summary)[-2:] == ["seconds", "cost"]
    cost = Cost.from_json(summary["cost"])
    assert cost.answers_seconds > 0 and cost.revisions_seconds > 0 and cost.scoring_seconds > 0
    assert cost.reference_seconds == 0 and 0 < cost.answer_tokens <= 6 * 12 and 0 < cost.revision_tokens <= 6 * 12


def test_eval_scores_the_answers_against_the_references_when_the_queries_have_them(tiny_model_path, tmp_path, capsys):
    import sacrebleu

    out = tmp_path / "translation"
    queries = "data/samples/translation/heldout.jsonl"
    code = tiny_eval(queries, out, "max_new_tokens=8")
    assert code == 0
    printed = capsys.readouterr().out
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert all(set(r["ref"]) == {"bleu", "chrf"} and r["reference"] for r in records)
    first = records[0]
    assert first["ref"]["chrf"] == pytest.approx(sacrebleu.sentence_chrf(first["response"], [first["reference"]]).score)
    by_category = summary["reference"]["by_category"]
    assert set(by_category) == {r["category"] for r in records}
    cs_en = [r for r in records if r["category"] == "cs-en"]
    expected = sacrebleu.corpus_bleu([r["response"] for r in cs_en], [[r["reference"] for r in cs_en]]).score
    assert by_category["cs-en"]["bleu"] == pytest.approx(expected)
    assert "reference metrics  BLEU" in printed and "chrF" in printed
    assert summary["cost"]["reference_seconds"] > 0


def test_score_reproduces_eval_scores(eval_dir, tmp_path):
    records = [json.loads(line) for line in (eval_dir / "records.jsonl").read_text().splitlines()]
    pairs = tmp_path / "pairs.json"
    pairs.write_text(
        json.dumps(
            [
                {"id": r["id"], "query": r["query"], "response": r["response"], "revised": r["revisions"][-1]}
                for r in records
            ]
        )
    )
    assert (
        main(["score", "--model", "tiny", "--device", "cpu", "--pairs", str(pairs), "--out", str(tmp_path / "scored")])
        == 0
    )
    scored = [json.loads(line) for line in (tmp_path / "scored" / "records.jsonl").read_text().splitlines()]
    assert list(json.loads((tmp_path / "scored" / "summary.json").read_text())["config"]) == SCORE_KEYS
    for a, b in zip(records, scored):
        if a["d"] is None:
            assert b["d"] is None
        else:
            assert b["d"] == pytest.approx(a["d"], abs=1e-4)


def test_compare_prints_win_tie_lose(eval_dir, tmp_path, capsys):
    """`compare` of two result directories; B holds A's queries with a d of its own: below delta, above it, A's."""
    rows = [json.loads(line) for line in (eval_dir / "records.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows):
        row["d"] = (-1.0, 1.0, row["d"])[i % 3]
        row["confident"] = is_confident(row["d"], -0.05)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "records.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["compare", str(eval_dir), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "6 shared queries at delta -0.05" in out
    assert "A wins" in out and "ties" in out and "loses" in out and "Wilcoxon" in out
    assert "sign test p = " in out and "tests whether one model wins more queries than it loses" in out
    assert "(win - lose)/n = " in out and "95% CI [" in out


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (None, "{bad}:2: no query found"),
        ("delta_typo=1", "unknown key 'delta_typo'"),
        ("dleta=1", "unknown key 'dleta' (did you mean 'delta'?)"),
        ("delta=abc", "command line: wrong type for ProbDiff setting 'delta': got 'abc', expected float"),
    ],
)
def test_bad_input_gives_a_clear_error(setting, message, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "fine"}\n{"promt": "wrong key"}\n')
    assert main(["eval", "--queries", str(bad), "--out", str(tmp_path / "o"), *([setting] if setting else [])]) == 2
    err = capsys.readouterr().err
    assert message.format(bad=bad) in err and "object_type" not in err


EVAL_KEYS = [
    *("delta", "sweep", "n_revisions", "refinement_prompt", "system_prompt"),
    *("answer_temperature", "answer_top_p", "answer_temperature_by_category", "revision_temperature"),
    *("revision_top_p", "n_samples", "seed", "max_new_tokens", "max_prompt_tokens", "batch_size", "score_chunk_tokens"),
    "score_prompt_once",
    *("use_vllm", "vllm_mode", "vllm_server_base_url", "vllm_server_timeout", "vllm_stall_timeout"),
    *("vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "vllm_weight_sync"),
]
SCORE_KEYS = [
    *("delta", "sweep", "system_prompt", "max_prompt_tokens", "batch_size", "score_chunk_tokens", "score_prompt_once")
]
CALLBACK_ONLY = [
    *("n_queries", "every", "baseline", "at_end", "gather_params", "fail_on_error", "wandb_table_rows"),
    *("output_subdir", "progress"),
]


def test_eval_refuses_n_queries_and_points_to_limit(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["eval", "--queries", SAMPLES, "--out", str(out), "n_queries=2"]) == 2
    err = capsys.readouterr().err
    assert (
        "n_queries is a ProbDiffCallback setting (the held-out queries evaluated at each step: a fixed subset drawn "
        "with `seed`; null: all); it applies during training only (recipe `probdiff.n_queries`); for the CLI, use "
        "--limit N" in err
    )
    assert not out.exists()  # refused before loading anything, not evaluated on all queries


@pytest.mark.parametrize("command", ["eval", "score"])
@pytest.mark.parametrize("key", CALLBACK_ONLY)
def test_callback_only_settings_are_refused_by_eval_and_score(command, key, tmp_path, capsys):
    source = ["--queries", SAMPLES] if command == "eval" else ["--pairs", "unused.jsonl"]
    value = {"output_subdir": "x", "n_queries": "2", "every": "2", "wandb_table_rows": "1"}.get(key, "false")
    assert main([command, *source, "--out", str(tmp_path / "o"), f"{key}={value}"]) == 2
    err = capsys.readouterr().err
    assert f"{key} is a ProbDiffCallback setting (" in err and f"recipe `probdiff.{key}`" in err


@pytest.mark.parametrize("key", sorted(set(EVAL_KEYS) - set(SCORE_KEYS)))
def test_score_refuses_what_only_generating_reads(key, tmp_path, capsys):
    item = "answer_temperature_by_category.Writing=0.3" if key == "answer_temperature_by_category" else f"{key}=1"
    assert main(["score", "--pairs", "unused.jsonl", "--out", str(tmp_path / "o"), item]) == 2
    err = capsys.readouterr().err
    assert f"{key} is not read by `probdiff score`, which scores the texts in --pairs as they are" in err


def test_every_refusal_is_named_in_one_error(tmp_path, capsys):
    assert main(["score", "--pairs", "x.jsonl", "--out", str(tmp_path / "o"), "seed=1", "delta=0", "every=2"]) == 2
    err = capsys.readouterr().err
    assert "seed is not read by `probdiff score`" in err and "every is a ProbDiffCallback setting" in err
    assert "delta" not in err.replace("delta=", "")  # the key score reads is not complained about


def _settings_help(command: str, capsys) -> list[str]:
    """The settings `command --help` lists, one `key=default  help` line each, in their order."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    listing = text[text.index("ProbDiff settings (key=value)") :]
    return re.findall(r"^    ([a-z_]+)=", listing, re.M)


@pytest.mark.parametrize(("command", "keys"), [("eval", EVAL_KEYS), ("score", SCORE_KEYS)])
def test_help_lists_only_the_settings_the_command_reads(command, keys, capsys):
    assert _settings_help(command, capsys) == keys


def test_select_and_plot_name_a_missing_run_directory(tmp_path, capsys):
    missing = tmp_path / "runs" / "nope"
    for command in ("select", "plot"):
        assert main([command, str(missing)]) == 2
        assert f"{missing}: no such run directory" in capsys.readouterr().err


@pytest.mark.slow
def test_console_script_help_lists_every_command():
    out = subprocess.run(
        [sys.executable, "-m", "probdiff_callback.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for command in ("eval", "score", "compare", "convert-qwen"):
        assert command in out


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_limit_must_be_a_positive_count(limit, tmp_path, capsys):
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--queries", SAMPLES, "--limit", limit, "--out", str(out)])
    assert exit_.value.code == 2 and not out.exists()  # refused before loading anything
    assert (
        f"argument --limit: {limit} is not a positive count (leave --limit out for every query)"
        in capsys.readouterr().err
    )


def test_help_describes_the_arguments_and_the_query_fields(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "dir_a a `probdiff eval` or `score` output directory (records.jsonl, summary.json): model A" in text
    assert "dir_b another one, on the same query ids: model B" in text
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "query, instruction, question, user, prompt" in text and "conversations, messages, turns, prompt" in text
    assert "reference answer (reference, completion, or the chat's assistant turn)" in text
