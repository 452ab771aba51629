"""The vLLM engine (`generation/vllm.py`, `vllm_server.py`, `vllm_common.py`; `use_vllm=true`) end to end on CPU:
vLLM in the evaluating process (colocate) for `probdiff eval`, `probdiff score` and training; a `vllm serve` started
the way a user starts one (server), on 127.0.0.1. The engine in this process itself: test_engines_vllm_colocate.py.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _distributed_eval import build_trainer, held_out_queries, probdiff_config
from _vllm import BLOG, ROOT, cli_eval, needs_vllm, read_records, save_adapter

from probdiff_callback.callback.probdiff import ProbDiffCallback
from probdiff_callback.cli import main
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.engine import GenerationRequest
from probdiff_callback.core.evaluator import evaluate
from probdiff_callback.core.queries import load_queries
from probdiff_callback.generation import vllm, vllm_common, vllm_server

XSUM = str(ROOT / "data/samples/summarization/heldout.jsonl")


def server_processes(model: str) -> set[int]:
    """The pids of vLLM API servers on this machine serving `model` (other tests' servers, side by side, serve `tiny`
    and start and stop at any time)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                if b"vllm.entrypoints.openai.api_server" in cmdline and model.encode() in cmdline:
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


class UserServer:
    """`vllm serve` as a user starts it for vllm_mode=server (its tokenizer loaded, LoRA at run time), stopped at
    the end."""

    def __init__(self, model_path: Path, log: Path, max_lora_rank: int = 16) -> None:
        port = free_port()
        env = {
            **os.environ,
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_LOGGING_LEVEL": "WARNING",
            "OMP_NUM_THREADS": "1",
        }
        self.url = f"http://127.0.0.1:{port}"
        with open(log, "w") as sink:
            self.process = subprocess.Popen(
                # vllm-cpu fails a seeded request whose prompt is prefilled in chunks: each prompt prefilled whole
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path), "--port",
                 str(port), "--host", "127.0.0.1", "--enable-lora", "--max-lora-rank", str(max_lora_rank),
                 "--enforce-eager", "--max-model-len", "4096", "--dtype", "float32", "--no-enable-chunked-prefill",
                 "--max-num-batched-tokens", "4096"],
                stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip
        self.log = log

    def wait(self, tokenizer) -> None:
        import time

        deadline = time.monotonic() + 300
        while True:
            try:
                vllm_server.ServerEngine(self.url, tokenizer, [0], timeout=5)
                return
            except vllm_server.EngineUnavailable:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the test's vLLM server did not start: {self.log.read_text()[-3000:]}"
                    ) from None
                time.sleep(1)

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after 30 s."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    return save_adapter(tmp_path_factory.mktemp("adapter"))


# ---- no vLLM needed ----


def test_a_request_states_its_whole_sampling():
    request = GenerationRequest([1, 2], seed=(1 << 64) - 1, temperature=0.7, top_p=1.0)
    settings = vllm_common.sampling_settings(request, 32, [5, 6])
    assert settings == {
        "temperature": 0.7, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": (1 << 63) - 1, "max_tokens": 32,
        "stop_token_ids": [5, 6],
    }  # fmt: skip


def test_texts_are_cut_at_a_stop_id_and_capped_only_at_the_length_and_their_tokens_counted(tiny_model):
    tokenizer = tiny_model[1]
    ids = tokenizer("hello world", add_special_tokens=False)["input_ids"]
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    cut = vllm_common.decoded(tokenizer, [*ids, stop, 7, 8], "stop", [stop])
    assert cut.text == "hello world" and cut.n_tokens == len(ids)  # the ids before the stop id
    assert vllm_common.decoded(tokenizer, ids, "length", [stop]).capped
    assert not vllm_common.decoded(tokenizer, [*ids, stop], "stop", [stop]).capped


@pytest.mark.slow
def test_merged_weights_equal_peft_merge_and_leave_the_model_as_it_was(tiny_model_path, adapter_dir):
    from peft import PeftModel

    from probdiff_callback.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer("tiny", dtype="float32", device="cpu")
    peft_model = PeftModel.from_pretrained(model, adapter_dir)
    before = {k: v.clone() for k, v in peft_model.state_dict().items()}
    merged = vllm.merged_state_dict(peft_model)
    assert all(torch.equal(v, peft_model.state_dict()[k]) for k, v in before.items())  # untouched
    reference = PeftModel.from_pretrained(
        load_model_and_tokenizer("tiny", dtype="float32", device="cpu")[0], adapter_dir
    ).merge_and_unload()
    expected = reference.state_dict()
    assert set(merged) == set(expected)
    for key, value in merged.items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=1e-6)
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], model.state_dict()[
        "model.layers.0.self_attn.q_proj.base_layer.weight"])  # fmt: skip


@pytest.mark.slow
def test_the_retired_variable_and_an_unreachable_server_are_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PROBDIFF_VLLM_PYTHON", str(tmp_path / "elsewhere" / "python"))  # no longer read: said
    assert cli_eval(tmp_path / "a", "use_vllm=true") == 2
    error = capsys.readouterr().err
    assert "PROBDIFF_VLLM_PYTHON=" in error and "is no longer read" in error and "vllm_mode=server" in error
    assert not (tmp_path / "a").exists()
    monkeypatch.delenv("PROBDIFF_VLLM_PYTHON")
    port = free_port()  # nothing listens there
    assert (
        cli_eval(tmp_path / "b", "use_vllm=true", "vllm_mode=server", f"vllm_server_base_url=http://127.0.0.1:{port}")
        == 2
    )
    error = capsys.readouterr().err
    assert f"vLLM server http://127.0.0.1:{port} cannot be reached" in error and "vllm serve" in error


def test_the_engine_settings_are_checked():
    with pytest.raises(ValueError, match="vllm_mode='remote': use one of colocate, server"):
        ProbDiffConfig(vllm_mode="remote")
    with pytest.raises(ValueError, match="vllm_weight_sync='copy'"):
        ProbDiffConfig(vllm_weight_sync="copy")


# ---- a server the user started (server) ----


@pytest.mark.slow
@needs_vllm
def test_a_users_server_evaluates_an_adapter_by_path_and_training_goes_on_when_it_dies(
    tiny_model_path, tiny_model, adapter_dir, tmp_path
):
    """One `vllm serve` started as a user starts it (one server start for every part). First, the waiting rules'
    metrics (liveness.py): the installed vLLM serves them under the names read, and its counters grow with the work it
    does; a query's texts do not depend on its batch. `probdiff eval` with vllm_mode=server evaluates the base model
    and an adapter by its path, and leaves the server running. Then training evaluates through it, and the server
    dies after the first evaluation: the next evaluations fail soft (NaN metrics, recorded with the error) and training
    ends normally."""
    from probdiff_callback.generation.liveness import Progress

    model, tokenizer = tiny_model
    server = UserServer(tiny_model_path, tmp_path / "vllm.log")
    try:
        server.wait(tokenizer)
        config = ProbDiffConfig(max_new_tokens=16, use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url)
        generation = vllm.VLLMGeneration.start(config, model, tokenizer, scratch_parent=tmp_path)
        engine = generation.engine
        before = Progress.from_metrics(engine.metrics(10))
        prompt = tokenizer("Write a poem about autumn.", add_special_tokens=False)["input_ids"]
        texts = engine.generate([GenerationRequest(prompt, seed, 0.7, 1.0) for seed in range(3)], 8)
        after = Progress.from_metrics(engine.metrics(10))
        assert before.work is not None and (before.running, before.waiting) == (0, 0)
        generated = sum(text.n_tokens for text in texts)
        # at least one prompt prefilled (the others may come from the prefix cache), the tokens, 3 requests finished
        assert after.work - before.work >= len(prompt) + generated + 3
        assert (after.running, after.waiting) == (0, 0)
        queries = load_queries(BLOG)[:6]
        with generation.holding(model, base_model=True) as held:
            whole = evaluate(model, tokenizer, queries, config, engine=held, progress=False).records
            part = evaluate(model, tokenizer, queries[3:5], config, engine=held, progress=False).records
        assert [r.response for r in part] == [r.response for r in whole[3:5]]
        assert [r.revisions for r in part] == [r.revisions for r in whole[3:5]]
        generation.close()

        url = f"vllm_server_base_url={server.url}"
        assert cli_eval(tmp_path / "base", "use_vllm=true", "vllm_mode=server", url) == 0
        assert main(["eval", "--model", "tiny", "--adapter", str(adapter_dir), "--device", "cpu", "--queries", BLOG,
                     "--out", str(tmp_path / "lora"), "--limit", "6", "max_new_tokens=16", "use_vllm=true",
                     "vllm_mode=server", url]) == 0  # fmt: skip
        base, lora = read_records(tmp_path / "base"), read_records(tmp_path / "lora")
        assert [r["response"] for r in base] != [r["response"] for r in lora]
        assert server.process.poll() is None  # a server the user started is left running

        trainer = build_trainer(tiny_model_path, tmp_path / "run", max_steps=3, eval_strategy="steps", eval_steps=1,
                                save_strategy="no")  # fmt: skip
        config = probdiff_config(use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url, n_queries=3)
        callback = ProbDiffCallback(trainer, held_out_queries(), config=config)
        trainer.add_callback(callback)

        from transformers import TrainerCallback

        class StopServerAfterStep1(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == 2:
                    os.killpg(server.process.pid, signal.SIGKILL)
                    server.process.wait()

        trainer.add_callback(StopServerAfterStep1())
        trainer.train()
    finally:
        server.stop()
    rows = [json.loads(line) for line in (tmp_path / "run/probdiff/history.jsonl").read_text().splitlines()]
    assert [row["global_step"] for row in rows] == [0, 1, 2, 3]
    assert [row["error"] is None for row in rows] == [True, True, False, False]
    assert "cannot be reached" in rows[2]["error"]
    assert math.isnan(callback.evaluated[3]["eval_probdiff_confidence"])
    assert trainer.state.global_step == 3


# ---- training ----


@pytest.mark.slow
@needs_vllm
def test_the_training_script_evaluates_every_step_through_vllm(tmp_path):
    """Two processes: each rank's own engine, in its training process (vLLM joins the launcher's process group),
    writes its share's texts, the weights handed over in memory (one process goes the same way without the share;
    training through a server is the test above, `probdiff eval` the first)."""
    from _launch import CHEAP, history_rows, run_sft

    args = [*CHEAP, "max_steps=1", "recipe=blog", f"output_dir={tmp_path / 'run'}", "probdiff.use_vllm=true"]
    result = run_sft(args, ROOT, processes=2, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = history_rows(tmp_path / "run")
    assert [row["global_step"] for row in rows] == [0, 1]  # the base model, then the adapter handed over
    assert all(row["error"] is None and row["summary"]["n"] == 3 for row in rows)
    assert "ProbDiff cost:" in result.stdout + result.stderr
    assert not (tmp_path / "run/probdiff/vllm-server.log").exists()  # no server: the engines ran in the ranks
    assert not list((tmp_path / "run/probdiff").glob("probdiff-vllm-*"))  # no folder of weights


# ZeRO-3 through vLLM (every rank gathers the weights, rank 0 generates): e2e/test_distributed.py, whose ZeRO-3 launch
# evaluates through vLLM during training where vLLM is installed


# ---- a real model ----


@pytest.mark.slow
@needs_vllm
def test_probdiff_eval_through_vllm_answers_in_english_and_score_reproduces_its_logprobs(tmp_path):
    """`probdiff eval --model smollm2 use_vllm=true`: vLLM in this process (no server); the answers and revisions are
    English; the model scores vLLM's texts itself, so `probdiff score` on them gives the same log-probabilities."""
    import sys

    out = tmp_path / "smollm2"
    command = [sys.executable, "-m", "probdiff_callback.cli", "eval", "--model", "smollm2", "--device", "cpu",
               "--queries", XSUM, "--out", str(out), "--limit", "2", "max_new_tokens=16", "use_vllm=true"]  # fmt: skip
    # a process of its own, as a user runs it (and what vLLM keeps of its memory after its engine closed goes with it)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "vLLM (colocate, in this process) started in" in done.stderr and "0 MB written" in done.stderr
    assert not server_processes("smollm2")
    records = read_records(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["use_vllm"] and summary["n"] == 2 and not (out / "vllm-server.log").exists()
    assert all(r["response"] and r["revisions"][0] and math.isfinite(r["d"]) for r in records)
    words = " ".join(r["response"] + " " + r["revisions"][0] for r in records).split()
    english = sum(
        w.strip(".,!?:;\"'()").lower() in {"the", "and", "a", "to", "of", "is", "in", "i", "you"} for w in words
    )
    assert len(words) > 20 and english / len(words) > 0.05, words[:60]

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"id": r["id"], "query": r["query"], "response": r["response"],
                                         "revised": r["revisions"][-1]}) + "\n" for r in records))  # fmt: skip
    scored = tmp_path / "scored"
    assert main(["score", "--model", "smollm2", "--device", "cpu", "--pairs", str(pairs), "--out", str(scored)]) == 0
    for again, generated in zip(read_records(scored), records, strict=True):
        assert abs(again["logp_response"] - generated["logp_response"]) < 1e-4
        assert abs(again["logp_revised"] - generated["logp_revised"]) < 1e-4
