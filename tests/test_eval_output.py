"""probdiff_callback/runs/eval_output.py: `probdiff eval`'s and `score`'s --out checked before the model loads, earlier
results replaced only with --overwrite; an evaluation that fails part-way keeps what it finished, and --resume
finishes it as an uninterrupted run would have."""

import argparse
import json
from pathlib import Path

import pytest
from _records import make_record

from probdiff_callback.cli import main
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.queries import Query
from probdiff_callback.core.records import dumps
from probdiff_callback.runs.eval_output import (
    UNFINISHED_FILE,
    OutputDirError,
    finished_records,
    keeping_finished,
    kept_records,
    what_is_evaluated,
)

QUERIES = str(Path(__file__).resolve().parents[1] / "data" / "samples" / "blog" / "heldout.jsonl")


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if the model would load: the --out checks come first."""
    import probdiff_callback.cli

    def load(args, own_process):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(probdiff_callback.cli, "load_model", load)


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
    from probdiff_callback.core import decoding as hf

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


@pytest.mark.slow  # six `probdiff` commands on `tiny` through stand-in vLLM servers, one stalled and waited out
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


# ---- the files themselves: what --resume keeps, what a failure leaves ----


def evaluated(**settings) -> dict:
    args = argparse.Namespace(model="tiny", adapter=None, dtype="auto", device=None, queries=QUERIES)
    return what_is_evaluated(args, ProbDiffConfig(**settings))


def unfinished(out: Path, started_with: dict, records: str | None = None) -> str:
    """--out as an evaluation started with `started_with` left it, with `records` as its records.jsonl's text."""
    out.mkdir()
    (out / UNFINISHED_FILE).write_text(json.dumps({**started_with, "n_queries": 3}))
    if records is not None:
        (out / "records.jsonl").write_text(records)
    return str(out)


def test_resume_drops_a_record_half_written_when_the_process_was_killed(tmp_path):
    whole = dumps(make_record("a")) + "\n"
    out = unfinished(tmp_path / "out", evaluated(), whole + dumps(make_record("b"))[:20])
    kept = kept_records(out, evaluated(), [Query("a", "x"), Query("b", "y")])
    assert [record.id for record in kept] == ["a"] and (tmp_path / "out" / "records.jsonl").read_text() == whole


def test_resume_refuses_records_of_queries_it_does_not_evaluate(tmp_path):
    out = unfinished(tmp_path / "out", evaluated(), "".join(dumps(make_record(i)) + "\n" for i in ("a", "z")))
    with pytest.raises(OutputDirError, match=r"records of 1 queries this command does not evaluate \(the first: 'z'\)"):
        kept_records(out, evaluated(), [Query("a", "x")])


def test_resume_may_change_how_the_evaluation_runs_not_what_it_writes(tmp_path):
    out = unfinished(tmp_path / "out", evaluated(batch_size=8))
    assert kept_records(out, evaluated(batch_size=2, vllm_stall_timeout=600), [Query("a", "x")]) == []
    with pytest.raises(OutputDirError, match=r"was started otherwise \(seed=0 then, 1 now\)"):
        kept_records(out, evaluated(batch_size=8, seed=1), [Query("a", "x")])


def test_a_failure_keeps_the_finished_records_and_says_how_to_finish(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(RuntimeError), keeping_finished(str(out), evaluated(), [], 2) as keep:
        keep([make_record("a")])
        raise RuntimeError("out of memory")
    assert [json.loads(line)["id"] for line in (out / "records.jsonl").read_text().splitlines()] == ["a"]
    assert json.loads((out / UNFINISHED_FILE).read_text())["error"] == "out of memory"
    assert "probdiff eval: 1 of 2 queries were evaluated before the error below" in capsys.readouterr().err


def test_a_failure_before_any_query_finished_leaves_no_results(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(RuntimeError), keeping_finished(str(out), evaluated(), [], 2):
        raise RuntimeError("at once")
    assert list(out.iterdir()) == []


def test_compare_reads_only_directories_with_results(tmp_path):
    with pytest.raises(FileNotFoundError, match="give directories written by `probdiff eval` or `probdiff score`"):
        finished_records(str(tmp_path))


def interrupted_after(monkeypatch, finished: int):
    """`probdiff eval` on a stand-in model (one linear layer: the engine choice reads its parameters and takes HF),
    whose evaluation hands on `finished` queries' records, then meets Ctrl-C."""
    import torch

    import probdiff_callback.cli
    import probdiff_callback.core.evaluator as evaluator

    monkeypatch.setattr(probdiff_callback.cli, "load_model", lambda args, own_process: (torch.nn.Linear(1, 1), None))

    def evaluate(model, tokenizer, queries, config, engine=None, on_finished=None, **options):
        if finished:
            on_finished([make_record(query.id, 0.1, query=query.text) for query in queries[:finished]])
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluator, "evaluate", evaluate)


def test_ctrl_c_keeps_what_was_finished_in_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    interrupted_after(monkeypatch, 2)
    assert main(["eval", "--queries", QUERIES, "--limit", "4", "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.rstrip().endswith("probdiff eval: interrupted (Ctrl-C)")
    assert (
        f"probdiff eval: 2 of 4 queries were evaluated before it was interrupted; their records are in "
        f"{out / 'records.jsonl'}. The same command with --resume evaluates the other 2"
    ) in err
    assert len(read_records(out)) == 2 and (out / UNFINISHED_FILE).is_file() and not (out / "summary.json").exists()

    import probdiff_callback.core.evaluator as evaluator
    from probdiff_callback.core.evaluator import Evaluation

    def finish(model, tokenizer, queries, config, engine=None, on_finished=None, **options):
        records = [make_record(query.id, 0.1, query=query.text) for query in queries]
        on_finished(records)
        return Evaluation(records)

    monkeypatch.setattr(evaluator, "evaluate", finish)
    assert main(["eval", "--queries", QUERIES, "--limit", "4", "--out", str(out), "--resume"]) == 0
    assert "--resume: 2 of 4 queries were evaluated" in capsys.readouterr().err
    assert len(read_records(out)) == 4 and (out / "summary.json").is_file() and not (out / UNFINISHED_FILE).exists()


def test_ctrl_c_before_any_record_leaves_no_folder(tmp_path, capsys, monkeypatch):
    out = tmp_path / "new" / "out"
    interrupted_after(monkeypatch, 0)
    assert main(["eval", "--queries", QUERIES, "--limit", "4", "--out", str(out)]) == 130
    assert not (tmp_path / "new").exists(), "the folders made for the results are gone"
    existing = tmp_path / "mine"
    existing.mkdir()
    assert main(["eval", "--queries", QUERIES, "--limit", "4", "--out", str(existing)]) == 130
    assert existing.is_dir() and list(existing.iterdir()) == [], "a folder the user made stays"


def test_ctrl_c_while_the_model_loads_leaves_no_folder(tmp_path, monkeypatch):
    import probdiff_callback.cli

    def load(args, own_process):
        raise KeyboardInterrupt

    monkeypatch.setattr(probdiff_callback.cli, "load_model", load)
    assert main(["eval", "--queries", QUERIES, "--out", str(tmp_path / "out")]) == 130
    assert not (tmp_path / "out").exists()
