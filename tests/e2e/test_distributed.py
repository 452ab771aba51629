"""ProbDiffCallback on 2 processes (CPU, gloo): DDP and DeepSpeed ZeRO-3 + LoRA.

Each launch runs tests/_distributed_eval.py once (2 LoRA steps with the callback and the
Trainer's eval loss, then the final weights evaluated again, and a failure injected on
rank 1); the tests share the launches and compare what each rank saw with a single-process
evaluation of the same weights. Where vLLM is installed, the ZeRO-3 launch evaluates
through vLLM during training (the whole weights gathered on every rank, rank 0 generating)
and with HF `generate` after it, gathered and sharded; DDP evaluates with HF in the loop.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from _distributed_eval import (
    EVAL_LOSS_ROWS,
    N_QUERIES,
    build_trainer,
    eval_losses_by_a_pass_of_their_own,
    held_out_queries,
    load_tiny,
    probdiff_config,
)
from _once import made_once
from _vllm import needs_vllm, vllm_installed

from probdiff_callback.callback.schedule import select_queries
from probdiff_callback.core.evaluator import evaluate
from probdiff_callback.core.queries import read_jsonl
from probdiff_callback.runs import run_files
from probdiff_callback.runs.run_files import read_run

SCRIPT = Path(__file__).resolve().parents[1] / "_distributed_eval.py"
LAUNCH_TIMEOUT_S = 420  # a hang (unequal collective calls) fails the test instead of blocking CI

LAUNCHERS = {
    # on CPU, --multi_gpu is what makes accelerate start 2 processes (DDP over gloo)
    "ddp": ["--multi_gpu"],
    "zero3": ["--use_deepspeed", "--zero_stage", "3"],
}

pytestmark = [
    pytest.mark.slow,  # every test here starts processes
    pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher"),
]


def launch(mode: str, model_path: Path, out: Path) -> list[dict]:
    command = [
        "accelerate",
        "launch",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--main_process_port",
        "0",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        *LAUNCHERS[mode],
        str(SCRIPT),
        "--mode",
        mode,
        "--model",
        str(model_path),
        "--out",
        str(out),
        *(["--vllm"] if mode == "zero3" and vllm_installed() else []),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": str(SCRIPT.parents[1])}
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        pytest.fail(
            f"{mode}: the 2-process run did not finish in {LAUNCH_TIMEOUT_S}s (a hang?)\n{(err.stderr or b'')[-4000:]}"
        )
    assert done.returncode == 0, f"{mode} launch failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in (0, 1)]


def launched_once(mode: str, model_path: Path, tmp_path_factory) -> tuple[Path, list[dict]]:
    """(its folder, what each rank saw) of the launch in `mode`, once per session whichever worker asks first (two
    tests read each launch, and pytest-xdist may run them on both workers)."""

    def make(folder: Path) -> None:
        launch(mode, model_path, folder)

    out = made_once(tmp_path_factory, f"distributed-{mode}", make)
    return out, [json.loads((out / f"rank-{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def ddp_run(tiny_model_path, tmp_path_factory):
    return launched_once("ddp", tiny_model_path, tmp_path_factory)


@pytest.fixture(scope="module")
def zero3_run(tiny_model_path, tmp_path_factory):
    pytest.importorskip("deepspeed", reason="ZeRO-3 runs need the deepspeed extra: pip install -e '.[deepspeed]'")
    return launched_once("zero3", tiny_model_path, tmp_path_factory)


@pytest.fixture(scope="module")
def single_process_records(tiny_model_path):
    """Single-process evaluations: of the base model, and (per run directory) of its checkpoint-2 adapter."""
    from peft import PeftModel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the launched ranks; contention on 2 shared cores slows threaded ops badly
    queries = select_queries(held_out_queries(), N_QUERIES, probdiff_config().seed)
    cache = {}

    def evaluate_weights(adapter: Path | None) -> list[dict]:
        """The records as the ranks' files hold them (JSON)."""
        if adapter not in cache:
            model, tokenizer = load_tiny(tiny_model_path)
            if adapter is not None:
                model = PeftModel.from_pretrained(model, str(adapter))
            evaluation = evaluate(model, tokenizer, queries, probdiff_config(), progress=False)
            cache[adapter] = [record.to_json() for record in evaluation.records]
        return cache[adapter]

    yield evaluate_weights
    torch.set_num_threads(threads)


def assert_same_records(actual: list[dict], expected: list[dict]) -> None:
    """Same texts, log-probs within float noise (batch composition differs between 1 and 2 ranks)."""
    assert [r["id"] for r in actual] == [r["id"] for r in expected]
    for a, e in zip(actual, expected):
        assert (a["response"], a["revisions"]) == (e["response"], e["revisions"]), a["id"]
        assert abs(a["logp_response"] - e["logp_response"]) < 1e-4, a["id"]
        assert abs(a["logp_revised"] - e["logp_revised"]) < 1e-4, a["id"]


def check_run(out: Path, ranks: list[dict], single_process_records, paths: list[str]) -> None:
    assert [seen["world_size"] for seen in ranks] == [2, 2]
    for path in paths:
        first, second = ranks[0][path], ranks[1][path]
        assert first["error"] is None and second["error"] is None
        assert len(first["records"]) == N_QUERIES  # the padding was dropped
        assert first["records"] == second["records"] and first["summary"] == second["summary"]
        assert_same_records(first["records"], single_process_records(out / "run" / "checkpoint-2"))
        # what it cost, merged over the ranks: the same on both, each stage timed, the tokens of both shares
        assert first["cost"] == second["cost"] and first["cost"]["scoring_seconds"] > 0
        assert first["cost"]["answer_tokens"] > 0 and first["cost"]["revision_tokens"] > 0
    # the metric handed to the Trainer was the same on both ranks at every evaluated step
    assert ranks[0]["history_metrics"] == ranks[1]["history_metrics"]
    assert sorted(ranks[0]["history_metrics"], key=int) == ["0", "2"]

    rows = [r.to_json() for r in run_files.read_history(run_files.history_path(out / "run"))]
    assert [(r["global_step"], r["kind"], r["error"]) for r in rows] == [(0, "baseline", None), (2, "evaluate", None)]
    if "last" not in ranks[0]:  # HF in the loop (with vLLM: test_zero3_through_vllm_... below)
        assert_same_records(read_jsonl(out / "run" / "probdiff" / rows[0]["records"]), single_process_records(None))
        assert_same_records(
            read_jsonl(out / "run" / "probdiff" / rows[1]["records"]),
            single_process_records(out / "run" / "checkpoint-2"),
        )
    assert rows[1]["summary"]["confidence"] == ranks[0]["history_metrics"]["2"]["eval_probdiff_confidence"]
    assert all(r["cost"]["answers_seconds"] > 0 for r in rows)

    # a failure on rank 1 reached both ranks, and neither hung
    for seen in ranks:
        assert "rank 1" in seen["failed"]["error"] and "injected failure on rank 1" in seen["failed"]["error"]
        assert seen["failed"]["records"] == []
        assert seen["failed"]["metrics"]["eval_probdiff_confidence"] is None  # NaN, written as null


def test_ddp_two_ranks_match_a_single_process(ddp_run, single_process_records):
    out, ranks = ddp_run
    check_run(out, ranks, single_process_records, ["gathered"])


def test_zero3_lora_gathered_and_sharded_match_a_single_process(zero3_run, single_process_records):
    out, ranks = zero3_run
    check_run(out, ranks, single_process_records, ["gathered", "sharded"])


@needs_vllm
def test_zero3_through_vllm_gathers_the_weights_on_every_rank_and_rank_0_generates(zero3_run):
    """use_vllm=true under ZeRO-3: every rank gathers the whole weights, rank 0's engine writes the texts, and every
    rank holds the same result; the history names each evaluation's records (the base model's and step 2's differ)."""
    out, ranks = zero3_run
    assert ranks[0]["last"]["error"] is None and ranks[0]["last"] == ranks[1]["last"]  # every rank holds the same
    records = ranks[0]["last"]["records"]
    assert len(records) == N_QUERIES and all(r["response"] and r["revisions"][0] for r in records)
    rows = [r.to_json() for r in run_files.read_history(run_files.history_path(out / "run"))]
    texts = [[r["response"] for r in read_jsonl(out / "run" / "probdiff" / row["records"])] for row in rows]
    assert texts[1] == [r["response"] for r in records] and texts[0] != texts[1]  # step 2's weights were handed over


# ---- the Trainer's eval loss, kept per conversation ----
@pytest.fixture(scope="module")
def single_process_eval_losses(tiny_model_path, tmp_path_factory) -> list[float]:
    """The base model's per-conversation eval losses computed in this process, one rank, by a pass of their own."""
    trainer = build_trainer(tiny_model_path, tmp_path_factory.mktemp("single"), eval_rows=EVAL_LOSS_ROWS)
    return eval_losses_by_a_pass_of_their_own(trainer)


@pytest.mark.parametrize("mode", ["ddp", "zero3"])
def test_two_processes_gather_every_conversation_once_in_order(mode, request, single_process_eval_losses):
    """Every rank holds all 5 (the padding of the last batches dropped), in the eval dataset's order; under ZeRO-3
    the forward passes gather the sharded parameters on both ranks in step."""
    out, ranks = request.getfixturevalue(f"{mode}_run")
    run = read_run(out / "run")
    assert ranks[0]["final_losses"] == ranks[1]["final_losses"]
    # the callback's, tapped from the Trainer's evaluation (trl's fused LM head, which sums the 152k-token vocabulary
    # in chunks), against passes of their own (the logits at once): float32 rounding apart, up to 1.1e-5 seen (the
    # closest two conversations' losses are 5.6e-4 apart: a row out of place or counted twice is far outside)
    assert ranks[0]["final_losses"] == pytest.approx(run.eval_losses[2], rel=5e-5)  # step 2: the final weights
    assert len(run.eval_losses[0]) == len(EVAL_LOSS_ROWS)
    assert run.eval_losses[0] == pytest.approx(single_process_eval_losses, rel=5e-5)  # step 0: the base model
