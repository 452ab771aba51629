import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from probdiff_callback.analysis.report import format_summary
from probdiff_callback.cli import main
from probdiff_callback.core.records import Cost, Summary

SAMPLES = "data/samples/alignbench/heldout.jsonl"

QUERIES = str(Path(__file__).resolve().parents[1] / "data" / "samples" / "blog" / "heldout.jsonl")


@pytest.fixture(scope="module")
def eval_dirs(tiny_model_path, tmp_path_factory):
    """Two `probdiff eval` runs (seeds 0 and 1) on the shipped AlignBench-style sample, through the CLI."""
    out = tmp_path_factory.mktemp("cli")
    dirs = []
    for seed in (0, 1):
        target = out / f"seed{seed}"
        code = main(
            [
                "eval",
                "--model",
                "tiny",
                "--device",
                "cpu",
                "--queries",
                SAMPLES,
                "--out",
                str(target),
                "--limit",
                "6",
                "max_new_tokens=12",
                f"seed={seed}",
                "answer_temperature_by_category.Mathematics=0.1",
            ]
        )
        assert code == 0
        dirs.append(target)
    return dirs


@pytest.mark.slow
def test_eval_writes_records_and_summary(eval_dirs, capsys):
    records = [json.loads(line) for line in (eval_dirs[0] / "records.jsonl").read_text().splitlines()]
    summary = json.loads((eval_dirs[0] / "summary.json").read_text())
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
    code = main(
        [
            "eval",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--queries",
            queries,
            "--out",
            str(out),
            "--limit",
            "6",
            "max_new_tokens=8",
        ]
    )
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


def test_score_reproduces_eval_scores(eval_dirs, tmp_path):
    records = [json.loads(line) for line in (eval_dirs[0] / "records.jsonl").read_text().splitlines()]
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


def test_compare_prints_win_tie_lose(eval_dirs, capsys):
    assert main(["compare", str(eval_dirs[0]), str(eval_dirs[1])]) == 0
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
    *("vllm_gpu_memory_utilization", "vllm_weight_sync"),
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


@pytest.mark.slow
def test_console_script_evaluates_in_a_process_of_its_own(tiny_model_path, tmp_path):
    """The console script's path (collector paused while loading, allocator tuned on CPU) gives the same outputs."""
    out = tmp_path / "script"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "probdiff_callback.cli",
            "eval",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--queries",
            SAMPLES,
            "--limit",
            "2",
            "--out",
            str(out),
            "max_new_tokens=6",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    in_process = tmp_path / "in_process"
    assert (
        main(
            [
                "eval",
                "--model",
                "tiny",
                "--device",
                "cpu",
                "--queries",
                SAMPLES,
                "--limit",
                "2",
                "--out",
                str(in_process),
                "max_new_tokens=6",
            ]
        )
        == 0
    )
    read = lambda d: [json.loads(line) for line in (d / "records.jsonl").read_text().splitlines()]  # noqa: E731
    assert [r["response"] for r in read(out)] == [r["response"] for r in read(in_process)]
    assert json.loads((out / "summary.json").read_text())["n"] == 2


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if the model would load: the --out checks come first."""
    import probdiff_callback.cli

    def load(args):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(probdiff_callback.cli, "_load", load)


def source_arguments(command: str, tmp_path: Path) -> list[str]:
    """What `command` reads: eval the sample queries, score a one-pair file."""
    if command == "eval":
        return ["--queries", QUERIES]
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"id": "1", "query": "q", "response": "a", "revised": "b"}) + "\n")
    return ["--pairs", str(path)]


@pytest.mark.parametrize("command", ["eval", "score"])
def test_out_that_is_a_file_stops_before_the_model_loads(command, tmp_path, capsys, no_model):
    source = source_arguments(command, tmp_path)
    a_file = tmp_path / "results"
    a_file.write_text("")
    assert main([command, *source, "--out", str(a_file)]) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"probdiff {command}: error: --out {a_file} is a file: give a directory (it gets records.jsonl and "
        "summary.json)"
    ]
    assert main([command, *source, "--out", str(a_file / "sub")]) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"probdiff {command}: error: --out {a_file / 'sub'} is under {a_file}, a file: give a directory (it gets "
        "records.jsonl and summary.json)"
    ]


@pytest.mark.parametrize("command", ["eval", "score"])
def test_out_with_earlier_results_is_refused_without_overwrite(command, tmp_path, capsys, no_model):
    source = source_arguments(command, tmp_path)
    out = tmp_path / "earlier"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    assert main([command, *source, "--out", str(out)]) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"probdiff {command}: error: --out {out} already holds summary.json of an earlier run: choose another "
        "--out, or add --overwrite to replace them"
    ]
    assert (out / "summary.json").read_text() == "{}"


def test_overwrite_replaces_earlier_results_and_says_so(tmp_path, capsys, tiny_model_path):
    out = tmp_path / "earlier"
    out.mkdir()
    for name in ("records.jsonl", "summary.json"):
        (out / name).write_text("old\n")
    args = ["eval", "--queries", QUERIES, "--limit", "1", "--out", str(out), "max_new_tokens=4", "--overwrite"]
    assert main(args) == 0
    assert f"--overwrite: replacing records.jsonl and summary.json in {out}" in capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["n"] == 1


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]


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


# ---- an evaluation that fails part-way keeps what it finished; --resume finishes it ----


def read_records(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "records.jsonl").read_text().splitlines()]


def assert_same_records(resumed: list[dict], whole: list[dict]) -> None:
    """The records of an uninterrupted run: the same queries in the same order, the same texts, the same scores
    (batches of other compositions pad otherwise: equal within float error)."""
    assert [r["id"] for r in resumed] == [r["id"] for r in whole]
    for record, reference in zip(resumed, whole):
        assert (record["response"], record["revisions"]) == (reference["response"], reference["revisions"])
        assert record["logp_response"] == pytest.approx(reference["logp_response"], abs=1e-5)
        assert record["logp_revised"] == pytest.approx(reference["logp_revised"], abs=1e-5)


@pytest.mark.slow
def test_an_eval_that_fails_keeps_the_batches_it_finished_and_resume_finishes_it(tiny_model_path, tmp_path, capsys):
    """Any error after some batches (here the HF engine's, at the second batch): the first batch's records are kept;
    --resume, with a larger batch (how it runs, not what it writes), ends with an uninterrupted run's records."""
    from probdiff_callback.core.engines import hf

    command = ["eval", "--queries", QUERIES, "--limit", "4", "max_new_tokens=4"]
    whole, out = tmp_path / "whole", tmp_path / "out"
    assert main([*command, "batch_size=2", "--out", str(whole)]) == 0
    generate, calls = hf.HFEngine.generate, []

    def out_of_memory_at_the_second_batch(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the second batch's answers (each batch: answers, revisions)
            raise RuntimeError("CUDA out of memory")
        return generate(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hf.HFEngine, "generate", out_of_memory_at_the_second_batch)
        with pytest.raises(RuntimeError, match="CUDA out of memory"):  # an unexpected error keeps its traceback
            main([*command, "batch_size=2", "--out", str(out)])
    assert (
        f"probdiff eval: 2 of 4 queries were evaluated before the error below; their records are in "
        f"{out / 'records.jsonl'}. The same command with --resume evaluates the other 2 and writes the summary."
    ) in capsys.readouterr().err
    assert len(read_records(out)) == 2 and not (out / "summary.json").exists()
    assert json.loads((out / "unfinished.json").read_text())["error"] == "CUDA out of memory"
    assert main([*command, "batch_size=3", "--out", str(out), "--resume"]) == 0
    assert f"--resume: 2 of 4 queries were evaluated in {out}; evaluating the other 2" in capsys.readouterr().err
    assert_same_records(read_records(out), read_records(whole))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n"] == 4 and summary["resumed"] == 2 and not (out / "unfinished.json").exists()


def test_an_eval_whose_vllm_server_stalls_keeps_what_it_finished(tiny_model_path, tmp_path, capsys):
    """A server you started (vllm_mode=server) answers the 4 answers and 2 of the revisions, then stalls: exit 2 with
    the stall, and the 2 queries it finished are kept. The same command again is refused, and so is --resume with
    other settings than the texts were made with, and `compare`; once the server is back, --resume finishes with an
    uninterrupted run's records."""
    from _fake_vllm import Behaviour, FakeVLLM

    command = ["eval", "--queries", QUERIES, "--limit", "4", "use_vllm=true", "vllm_mode=server", "max_new_tokens=4"]
    out, whole = tmp_path / "out", tmp_path / "whole"
    with FakeVLLM(Behaviour(answered=6)) as stalling:
        server = f"vllm_server_base_url={stalling.url}"
        assert main([*command, server, "vllm_stall_timeout=1", "--out", str(out)]) == 2
    assert (
        f"probdiff eval: 2 of 4 queries were evaluated before the error below; their records are in "
        f"{out / 'records.jsonl'}. The same command with --resume evaluates the other 2 and writes the summary.\n"
        f"probdiff eval: error: vLLM server {stalling.url} stalled: no token generated or prompt processed for 1 s "
        "while 2 requests were running and 0 waiting (vllm_stall_timeout=1: raise it where one step takes longer)\n"
    ) in capsys.readouterr().err
    assert len(read_records(out)) == 2 and not (out / "summary.json").exists()
    assert "stalled" in json.loads((out / "unfinished.json").read_text())["error"]
    assert main([*command, server, "--out", str(out)]) == 2
    assert main([*command[:-1], "max_new_tokens=5", server, "--out", str(out), "--resume"]) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"probdiff eval: error: --out {out} holds an unfinished evaluation (2 queries' records, no summary.json): add "
        "--resume to finish it with `probdiff eval`, or --overwrite to replace it",
        f"probdiff eval: error: --resume: the evaluation in {out} was started otherwise (max_new_tokens=4 then, 5 "
        "now): give what it was started with, or start afresh with --overwrite",
    ]
    assert main(["compare", str(out), str(out)]) == 2  # some of its queries only
    assert error_lines(capsys.readouterr().err) == [
        f"probdiff compare: error: {out} holds an unfinished evaluation (2 queries' records, no summary.json): finish "
        "it first with the same `probdiff eval` and --resume"
    ]
    with FakeVLLM() as back:
        server = f"vllm_server_base_url={back.url}"  # restarted elsewhere: how it runs, not what it writes
        assert main([*command, server, "--out", str(out), "--resume"]) == 0
        assert main([*command, server, "--out", str(whole)]) == 0
    assert_same_records(read_records(out), read_records(whole))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n"] == 4 and summary["resumed"] == 2 and not (out / "unfinished.json").exists()


@pytest.mark.parametrize("earlier", [None, "summary.json"])
def test_resume_needs_an_unfinished_evaluation(earlier, tmp_path, capsys, no_model):
    out = tmp_path / "out"
    out.mkdir()
    if earlier:
        (out / earlier).write_text("{}")
    assert main(["eval", "--queries", QUERIES, "--out", str(out), "--resume"]) == 2
    why = (
        "holds a finished evaluation (summary.json): nothing to resume"
        if earlier
        else "holds no unfinished evaluation (the unfinished.json that `probdiff eval` leaves when it stops part-way)"
    )
    assert error_lines(capsys.readouterr().err) == [f"probdiff eval: error: --resume: --out {out} {why}"]
