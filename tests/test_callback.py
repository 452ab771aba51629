"""ProbDiffCallback in single-process training runs on the `tiny` preset (CPU, offline)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _distributed_eval import N_QUERIES, build_trainer, held_out_queries, probdiff_config
from _faults import inject
from _records import make_record
from transformers import EarlyStoppingCallback

import probdiff_callback.callback.trainer_evaluation as evaluation_module  # where the callback calls `evaluate`
from probdiff_callback.analysis.select import format_selection, point_best, select_checkpoints
from probdiff_callback.callback.cost import CostReport
from probdiff_callback.callback.metrics import metrics_from_summary
from probdiff_callback.callback.probdiff import ProbDiffCallback
from probdiff_callback.callback.schedule import select_queries
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.core.evaluator import evaluate
from probdiff_callback.core.metric import compare, summary_of
from probdiff_callback.core.queries import DataFileError, Query
from probdiff_callback.core.records import Cost, Record
from probdiff_callback.models.checkpointing import activation_checkpointing_on, set_activation_checkpointing
from probdiff_callback.runs import run_files
from probdiff_callback.runs.run_files import read_records

SWEEP_KEYS = ["0", "-0.02", "-0.05", "-0.1"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def history_rows(run_dir: Path) -> list[dict]:
    """The rows as the file holds them (JSON: null for NaN)."""
    return [row.to_json() for row in run_files.read_history(run_files.history_path(run_dir))]


def probdiff_logs(trainer) -> dict[int, dict]:
    return {entry["step"]: entry for entry in trainer.state.log_history if "eval_probdiff_confidence" in entry}


def assert_same_records(actual: list[Record], expected: list[Record]) -> None:
    assert [r.id for r in actual] == [r.id for r in expected]
    for a, e in zip(actual, expected):
        assert a.response == e.response
        assert a.revisions == e.revisions
        assert abs(a.logp_response - e.logp_response) < 1e-4
        assert abs(a.logp_revised - e.logp_revised) < 1e-4


# ---- helpers, no model ----


def test_the_cost_lines_say_where_the_evaluations_time_went():
    report = CostReport()
    report.training_started(0)
    report.evaluated(9.0, Cost(answers_seconds=3.0, scoring_seconds=1.0), before_training=True)  # the base model's
    stages = Cost(
        answers_seconds=4.0, revisions_seconds=3.0, scoring_seconds=1.0, answer_tokens=1300, revision_tokens=42
    )
    report.evaluated(10.0, stages)
    report.evaluated(12.0, None)  # a failed evaluation: its time counts, no stages
    args, state = SimpleNamespace(eval_strategy="steps"), SimpleNamespace(eval_steps=4, global_step=4)
    message = report.message(args, state, every=1)
    assert message.startswith("ProbDiff: one evaluation takes 10.0s (the base model's took 9.0s, once)")
    assert message.endswith("; that evaluation: answers 4.0s, revisions 3.0s, scoring 1.0s; 1,342 tokens generated")
    totals = report.totals()
    assert totals.startswith("ProbDiff cost: 2 evaluations during training took 0.4 min")
    assert totals.endswith(
        "in the evaluations during training: answers 4.0s, revisions 3.0s, scoring 1.0s; 1,342 tokens generated"
    )
    stages.reference_seconds = 0.3
    assert "scoring 1.0s, reference metrics 0.3s; 1,342" in report.totals()


def test_select_queries_is_a_fixed_subset_in_file_order_without_touching_the_global_rng():
    queries = [Query(f"q{i}", f"text {i}") for i in range(20)]
    random.seed(5)
    before = random.random()
    random.seed(5)
    first = select_queries(queries, 6, seed=1)
    assert random.random() == before  # the global stream is where it was
    assert first == select_queries(queries, 6, seed=1)
    assert first != select_queries(queries, 6, seed=2)
    assert len(first) == 6 and [q.id for q in first] == sorted((q.id for q in first), key=lambda i: int(i[1:]))
    assert select_queries(queries, None, 0) == queries and select_queries(queries, 50, 0) == queries
    with pytest.raises(ValueError, match="unique"):
        select_queries([Query("a", "x"), Query("a", "y")], 1, 0)


def test_metrics_from_summary_names_every_logged_key_and_is_nan_on_failure():
    records = [make_record(i, d, category=c) for i, (c, d) in enumerate([("a b", 0.1), ("a b", -0.2), ("c/d", 0.3)])]
    summary = summary_of(records, -0.05, [0.0, -0.1])
    metrics = metrics_from_summary(summary, [0.0, -0.1], ["a b", "c/d"])
    assert metrics["eval_probdiff_confidence"] == pytest.approx(2 / 3)
    assert metrics["eval_probdiff_confidence_a_b"] == 0.5 and metrics["eval_probdiff_confidence_c_d"] == 1.0
    assert metrics["eval_probdiff_d_mean"] == pytest.approx(0.2 / 3)
    assert metrics["eval_probdiff_confidence_at_-0.1"] == pytest.approx(2 / 3)
    assert metrics["eval_probdiff_confidence_at_0"] == pytest.approx(2 / 3)
    assert metrics["eval_probdiff_n_invalid"] == 0
    failed = metrics_from_summary(None, [0.0, -0.1], ["a b", "c/d"])
    assert set(failed) >= {
        "eval_probdiff_confidence",
        "eval_probdiff_d_mean",
        "eval_probdiff_confidence_a_b",
        "eval_probdiff_confidence_at_-0.1",
        "eval_probdiff_confidence_at_0",
    }
    assert all(math.isnan(v) for v in failed.values())


def test_options_are_validated():
    with pytest.raises(ValueError, match="every=0"):
        ProbDiffConfig(every=0)
    with pytest.raises(ValueError, match="n_queries=0"):
        ProbDiffConfig(n_queries=0)


@pytest.mark.slow
def test_queries_come_from_strings_chats_datasets_or_the_trainers_eval_dataset(tmp_path, tiny_model_path):
    from datasets import Dataset

    trainer = build_trainer(tiny_model_path, tmp_path / "run", max_steps=1)
    config = probdiff_config(n_queries=None)
    from_strings = ProbDiffCallback(trainer, ["Write a haiku about rain", "Name three rivers"], config)
    assert [(q.id, q.text) for q in from_strings.queries] == [
        ("0", "Write a haiku about rain"),
        ("1", "Name three rivers"),
    ]
    chat = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]
    assert ProbDiffCallback(trainer, [chat], config).queries[0].reference == "hi"
    rows = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": "Sum 2 and 3"}], "completion": "5"},
            {"prompt": [{"role": "user", "content": "Sum 1 and 1"}], "completion": "2"},
        ]
    )
    from_dataset = ProbDiffCallback(trainer, rows, config)
    assert [(q.text, q.reference) for q in from_dataset.queries] == [("Sum 2 and 3", "5"), ("Sum 1 and 1", "2")]
    # no queries given: the trainer's eval_dataset (chats of held-out posts, as trl keeps its `messages` column)
    default = ProbDiffCallback(trainer, config=config)
    assert len(default.queries) == len(trainer.eval_dataset) and all(q.reference for q in default.queries)
    outcome = from_strings.evaluate_model()
    assert outcome.error is None and [r.id for r in outcome.records] == ["0", "1"]
    with pytest.raises(DataFileError, match=r"queries\[1\]: got int"):
        ProbDiffCallback(trainer, ["fine", 3], config)
    with pytest.raises(DataFileError, match="no query found"):
        ProbDiffCallback(trainer, Dataset.from_list([{"text": "no prompt column"}]), config)


# ---- training runs ----


@pytest.mark.slow
def test_sft_lora_run_is_evaluated_selected_and_stopped_by_probdiff(tmp_path, tiny_model_path, tiny_model, caplog):
    run = tmp_path / "run"
    trainer = build_trainer(
        tiny_model_path,
        run,
        max_steps=6,
        eval_strategy="steps",
        eval_steps=2,
        save_steps=2,
        metric_for_best_model="probdiff_confidence",
        greater_is_better=True,
        load_best_model_at_end=True,
        # a threshold no confidence gain can pass: the second ProbDiff evaluation stops training
        callbacks=[EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=1.0)],
    )
    queries = held_out_queries()
    callback = ProbDiffCallback(trainer, queries, probdiff_config(n_queries=N_QUERIES))
    trainer.add_callback(callback)  # lands after EarlyStoppingCallback; the callback moves itself
    with caplog.at_level("INFO", logger="probdiff_callback"):  # the callback says everything through its logger
        trainer.train()

    names = [type(cb).__name__ for cb in trainer.callback_handler.callbacks]
    assert names.index("ProbDiffCallback") < names.index("EarlyStoppingCallback")
    assert trainer.state.global_step == 4, "early stopping did not act on eval_probdiff_confidence"
    printed = caplog.text
    # the engine said once, and why: auto keeps the tiny model on HF
    assert printed.count("ProbDiff engine: ") == 1
    assert "ProbDiff engine: HF: a model of 39M parameters: HF writes its texts sooner than vLLM starts" in printed
    assert "ProbDiff: one evaluation takes" in printed and "evaluating every 2 steps adds about" in printed
    assert "(the base model's took" in printed  # the forecast is from an evaluation during training
    assert callback.cost_summary().startswith("ProbDiff cost: 2 evaluations during training took")
    # AlignBench categories have no reference metric: said once, nothing logged for it
    assert printed.count("ProbDiff: no reference metric for") == 1 and "Writing" in printed
    assert not any(key.startswith("eval_ref_") for entry in trainer.state.log_history for key in entry)

    rows = history_rows(run)
    assert [r["global_step"] for r in rows] == [0, 2, 4]
    assert [r["kind"] for r in rows] == ["baseline", "evaluate", "evaluate"]
    assert [r["base_model"] for r in rows] == [True, False, False]
    assert all(r["error"] is None and r["seconds"] > 0 for r in rows)
    # what each stage cost, beside the seconds: every stage took time, and the texts were generated
    costs = [Cost.from_json(r["cost"]) for r in rows]
    assert all(c.answers_seconds > 0 and c.revisions_seconds > 0 and c.scoring_seconds > 0 for c in costs)
    assert all(c.answer_tokens > 0 and c.seconds <= r["seconds"] for c, r in zip(costs, rows))
    subset = [q.id for q in select_queries(queries, N_QUERIES, probdiff_config().seed)]
    config = probdiff_config()
    for row in rows:
        records = read_records(run / "probdiff" / row["records"])
        assert [r.id for r in records] == subset
        assert row["summary"] == summary_of(records, config.delta, config.sweep).to_json()
    for row in rows[1:]:
        assert row["checkpoint"] == str(run / f"checkpoint-{row['global_step']}")
        assert json.loads((run / f"checkpoint-{row['global_step']}" / "probdiff.json").read_text()) == row
    assert rows[0]["checkpoint"] is None
    assert [r["vs_base"] is None for r in rows] == [True, False, False]
    base_records = read_records(run / "probdiff" / rows[0]["records"])
    for row in rows[1:]:
        expected = compare(read_records(run / "probdiff" / row["records"]), base_records, config.delta)
        assert row["vs_base"] == expected.to_json()
        step_logs = [e for e in trainer.state.log_history if e.get("step") == row["global_step"]]
        assert [row["eval_loss"]] == [e["eval_loss"] for e in step_logs if "eval_loss" in e]

    # The baseline is the base model: the adapters were disabled.
    model, tokenizer = tiny_model
    base = evaluate(model, tokenizer, select_queries(queries, N_QUERIES, config.seed), config, progress=False)
    assert_same_records(read_records(run / "probdiff" / rows[0]["records"]), base.records)

    logged = probdiff_logs(trainer)
    assert sorted(logged) == [0, 2, 4]
    categories = sorted({q.category for q in select_queries(queries, N_QUERIES, config.seed)})
    for row in rows:
        entry, summary = logged[row["global_step"]], row["summary"]
        assert entry["eval_probdiff_confidence"] == summary["confidence"]
        assert [entry["eval_probdiff_confidence_ci_low"], entry["eval_probdiff_confidence_ci_high"]] == summary[
            "confidence_ci"
        ]
        assert entry["eval_probdiff_d_mean"] == pytest.approx(summary["d_mean"])
        assert entry["eval_probdiff_d_median"] == pytest.approx(summary["d_median"])
        assert entry["eval_probdiff_logp_response"] == pytest.approx(summary["logp_response_mean"])
        assert entry["eval_probdiff_logp_revised"] == pytest.approx(summary["logp_revised_mean"])
        assert entry["eval_probdiff_n_invalid"] == summary["n_invalid"]
        for key in SWEEP_KEYS:
            assert entry[f"eval_probdiff_confidence_at_{key}"] == summary["confidence_sweep"][key]
        for category in categories:
            assert entry[f"eval_probdiff_confidence_{category}"] == summary["by_category"][category]["confidence"]
        if row["vs_base"] is not None:
            for key in ("win", "tie", "lose"):
                assert entry[f"eval_probdiff_vs_base_{key}"] == row["vs_base"][key]
        else:
            assert math.isnan(entry["eval_probdiff_vs_base_win"])

    # metric_for_best_model: the Trainer kept the first step with the highest confidence.
    trained = rows[1:]
    best_value = max(r["summary"]["confidence"] for r in trained)
    best_step = next(r["global_step"] for r in trained if r["summary"]["confidence"] == best_value)
    assert trainer.state.best_metric == best_value
    assert trainer.state.best_global_step == best_step
    assert trainer.state.best_model_checkpoint == str(run / f"checkpoint-{best_step}")

    selection = select_checkpoints(run)
    assert selection.baseline.global_step == 0
    assert [s.global_step for s in selection.ranked] == sorted(
        [2, 4], key=lambda s: (-rows[s // 2]["summary"]["confidence"], s)
    )
    assert selection.ranked[0].confidence == best_value
    assert selection.best_checkpoint.checkpoint == str(run / f"checkpoint-{selection.ranked[0].global_step}")
    assert selection.best_checkpoint.checkpoint == trainer.state.best_model_checkpoint


@pytest.mark.slow
def test_tied_confidences_select_the_checkpoint_the_trainer_keeps(tmp_path, tiny_model_path, monkeypatch):
    """On 2 queries every step is 100% confident: `probdiff select`, RUN_DIR/best and the Trainer's
    best_model_checkpoint all name the first tied step. With eval_on_start the baseline runs in the Trainer's step-0
    evaluation and its row holds the base model's eval loss; every row is written once, the history read once."""
    history_writes, history_reads = [], []
    real_write, real_read = run_files.write_jsonl, run_files.read_history
    monkeypatch.setattr(
        run_files,
        "write_jsonl",
        lambda path, rows: (path.name == "history.jsonl" and history_writes.append(path)) or real_write(path, rows),
    )
    monkeypatch.setattr(run_files, "read_history", lambda path: history_reads.append(path) or real_read(path))
    run = tmp_path / "run"
    trainer = build_trainer(
        tiny_model_path,
        run,
        max_steps=6,
        eval_strategy="steps",
        eval_steps=2,
        save_steps=2,
        eval_on_start=True,
        metric_for_best_model="probdiff_confidence",
        load_best_model_at_end=True,
    )
    # seed 2: every trained step 100% confident, and a later step with the higher mean d (the sampler's stream decides)
    callback = ProbDiffCallback(trainer, held_out_queries(), probdiff_config(n_queries=2, seed=2))
    trainer.add_callback(callback)
    trainer.train()
    # the baseline ran after training began (in the step-0 evaluation) and still counts as before it
    assert callback.cost_summary().startswith("ProbDiff cost: 3 evaluations during training")
    assert "the base model's evaluation" in callback.cost_summary()
    assert len(history_reads) == 1  # when training began, to continue the history
    monkeypatch.setattr(run_files, "read_history", real_read)

    rows = history_rows(run)
    assert [(r["global_step"], r["kind"]) for r in rows] == [
        (0, "baseline"),
        (2, "evaluate"),
        (4, "evaluate"),
        (6, "evaluate"),
    ]
    assert len(history_writes) == 1 + len(rows)  # the empty history at the start, then each row once, complete
    losses = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    assert [r["eval_loss"] for r in rows] == [losses[0], losses[2], losses[4], losses[6]]
    for row in rows[1:]:
        assert row["checkpoint"] == str(run / f"checkpoint-{row['global_step']}")
        assert json.loads((run / f"checkpoint-{row['global_step']}" / "probdiff.json").read_text()) == row
    trained = rows[1:]
    assert {r["summary"]["confidence"] for r in trained} == {1.0}, "the run was meant to tie"
    # a later step has the higher mean d: the tie-break by mean d would have picked another checkpoint
    assert max(trained, key=lambda r: r["summary"]["d_mean"])["global_step"] != 2

    assert trainer.state.best_model_checkpoint == str(run / "checkpoint-2")
    selection = select_checkpoints(run)
    assert [s.global_step for s in selection.ranked] == [2, 4, 6]
    assert selection.best_checkpoint.checkpoint == trainer.state.best_model_checkpoint
    assert "Best checkpoint: step 2," in format_selection(selection)
    best = point_best(run, selection.best_checkpoint.checkpoint)
    assert best.resolve() == Path(trainer.state.best_model_checkpoint).resolve()


@pytest.mark.slow
def test_training_losses_are_the_same_with_and_without_the_callback_which_evaluates_its_schedule_once(
    tmp_path, tiny_model_path
):
    """The Trainer evaluates at steps 1, 2 and 3; with `every=2` ProbDiff evaluates the 2nd, and the 3rd because it is
    the last step (off the grid of every second evaluation), each logged once; the training losses are those of the
    same run without the callback."""

    def losses(run: Path, with_callback: bool) -> tuple[list[float], object]:
        trainer = build_trainer(
            tiny_model_path, run, max_steps=3, eval_strategy="steps", eval_steps=1, save_strategy="no"
        )
        if with_callback:
            config = probdiff_config(n_queries=N_QUERIES, every=2)
            trainer.add_callback(ProbDiffCallback(trainer, held_out_queries(), config))
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], trainer

    plain, _ = losses(tmp_path / "plain", with_callback=False)
    evaluated, trainer = losses(tmp_path / "evaluated", with_callback=True)
    assert len(plain) == 3
    assert evaluated == plain
    expected = [(0, "baseline"), (2, "evaluate"), (3, "evaluate")]
    assert [(r["global_step"], r["kind"]) for r in history_rows(tmp_path / "evaluated")] == expected
    assert sorted(probdiff_logs(trainer)) == [0, 2, 3]


@pytest.mark.slow
def test_the_last_step_is_evaluated_and_logged_once_at_the_end(tmp_path, tiny_model_path):
    """max_steps ends training inside the first epoch; the epoch-end evaluation comes after on_step_end."""
    run = tmp_path / "run"
    trainer = build_trainer(tiny_model_path, run, save_strategy="no", max_steps=2, eval_strategy="epoch",
                            metric_for_best_model="probdiff_confidence")  # fmt: skip
    callback = ProbDiffCallback(trainer, held_out_queries(), probdiff_config(n_queries=N_QUERIES, baseline=False))
    trainer.add_callback(callback)
    trainer.train()
    rows = history_rows(run)
    assert [(r["global_step"], r["kind"]) for r in rows] == [(2, "end")]
    assert sorted(probdiff_logs(trainer)) == [2]
    # the Trainer's own evaluation at step 2 received the end-of-training result
    assert trainer.state.best_metric == rows[0]["summary"]["confidence"]
    assert sorted(callback.evaluated) == [2]


@pytest.mark.slow
def test_selecting_by_probdiff_refuses_skipped_evaluations(tmp_path, tiny_model_path):
    trainer = build_trainer(
        tiny_model_path,
        tmp_path / "run",
        max_steps=2,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="no",
        metric_for_best_model="probdiff_confidence",
    )
    trainer.add_callback(ProbDiffCallback(trainer, held_out_queries(), probdiff_config(n_queries=N_QUERIES, every=2)))
    with pytest.raises(ValueError, match="every=2"):
        trainer.train()


@pytest.mark.slow
def test_evaluation_leaves_the_model_tokenizer_and_rng_as_found(tmp_path, tiny_model_path, monkeypatch):
    trainer = build_trainer(tiny_model_path, tmp_path / "run", max_steps=1)
    callback = ProbDiffCallback(trainer, held_out_queries(), probdiff_config(n_queries=2))
    model, tokenizer = trainer.model, callback.tokenizer
    model.train()
    set_activation_checkpointing(model, True, {"use_reentrant": False})
    model.config.use_cache = False
    tokenizer.padding_side = "right"
    seen = {}

    def observing_evaluate(m, *args, **kwargs):
        seen["checkpointing"] = activation_checkpointing_on(m)
        return evaluate(m, *args, **kwargs)

    monkeypatch.setattr(evaluation_module, "evaluate", observing_evaluate)
    torch_state, numpy_state = torch.random.get_rng_state(), np.random.get_state()
    outcome = callback.evaluate_model()
    assert outcome.error is None and len(outcome.records) == 2
    assert seen["checkpointing"] is False
    assert model.training and activation_checkpointing_on(model)
    assert model.config.use_cache is False
    assert tokenizer.padding_side == "right"
    assert torch.equal(torch.random.get_rng_state(), torch_state)
    assert np.array_equal(np.random.get_state()[1], numpy_state[1])


class BadQueryTemplate:
    """A chat template that rejects one query, as Llama's rejects roles that do not alternate."""

    def __init__(self, tokenizer, marker: str) -> None:
        self.real, self.marker = tokenizer.apply_chat_template, marker

    def __call__(self, conversation, *args, **kwargs):
        from jinja2.exceptions import TemplateError

        if any(self.marker in str(message.get("content")) for message in conversation):
            raise TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")
        return self.real(conversation, *args, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["NaN logits", "bad query"])
def test_an_evaluation_failing_under_a_fault_is_nan_counted_and_training_goes_on(
    fault, tmp_path, tiny_model_path, monkeypatch
):
    """NaN logits at step 2's evaluation, under a plain Trainer with full fine-tuning; a query the chat template
    rejects, at every evaluation: the step's row holds the error with its traceback, its metrics are NaN, `select`
    counts it and ranks the others, training ends normally. (Out of memory in generation, in a real run:
    e2e/test_faults.py's reference run.)"""
    queries = held_out_queries()[:4]  # every query at every evaluation, in one batch
    plain = {"plain_trainer": True, "lora": False} if fault == "NaN logits" else {}  # SFTTrainer with LoRA otherwise
    trainer = build_trainer(tiny_model_path, tmp_path / "run", max_steps=3, eval_strategy="steps", eval_steps=1,
                            save_strategy="no", metric_for_best_model="probdiff_confidence", **plain)  # fmt: skip
    failing = [2]
    if fault == "NaN logits":

        def nan_in_evaluation(module, inputs, output):
            if trainer.state.global_step == 2 and not module.training:
                return output * math.nan

        trainer.model.get_decoder().norm.register_forward_hook(nan_in_evaluation)
    else:
        queries = [*queries, Query("bad", "A query the template rejects")]
        monkeypatch.setattr(
            trainer.processing_class, "apply_chat_template", BadQueryTemplate(trainer.processing_class, "rejects")
        )
        failing = [0, 1, 2, 3]
    trainer.add_callback(ProbDiffCallback(trainer, queries, probdiff_config(n_queries=None, batch_size=64)))
    trainer.train()

    assert trainer.state.global_step == 3
    rows = history_rows(tmp_path / "run")
    assert [r["global_step"] for r in rows if r["error"]] == failing
    expected = {"NaN logits": "NaN in the model's logits while generating", "bad query": "alternate"}
    assert all(expected[fault] in rows[step]["error"] and rows[step]["summary"] is None for step in failing)
    assert all("Traceback" in rows[step]["error"] and rows[step]["records"] is None for step in failing)
    logged = probdiff_logs(trainer)
    assert all(math.isnan(logged[step]["eval_probdiff_confidence"]) for step in failing)
    selection = select_checkpoints(tmp_path / "run")
    assert selection.failed_steps == failing
    if fault != "bad query":
        trained = [r for r in rows[1:] if r["error"] is None]
        assert sorted(s.global_step for s in selection.ranked) == [r["global_step"] for r in trained] == [1, 3]
        # the NaN never counted as best
        assert trainer.state.best_metric == max(r["summary"]["confidence"] for r in trained)


@pytest.mark.slow
def test_fail_on_error_reraises(tmp_path, tiny_model_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected evaluation failure")

    monkeypatch.setattr(evaluation_module, "evaluate", broken)
    trainer = build_trainer(tiny_model_path, tmp_path / "run", max_steps=2, save_strategy="no")
    trainer.add_callback(
        ProbDiffCallback(trainer, held_out_queries(), probdiff_config(n_queries=N_QUERIES, fail_on_error=True))
    )
    with pytest.raises(RuntimeError, match="fail_on_error=True"):
        trainer.train()
    rows = history_rows(tmp_path / "run")
    assert [r["global_step"] for r in rows] == [0] and "injected evaluation failure" in rows[0]["error"]


@pytest.mark.slow
def test_a_run_vllm_cannot_serve_stops_before_the_first_step(tmp_path, tiny_model_path):
    """Full fine-tuning with a vLLM server you started (it takes adapters only): refused on every rank when training
    begins, before a step or a server call."""
    trainer = build_trainer(tiny_model_path, tmp_path / "run", plain_trainer=True, lora=False, max_steps=1,
                            save_strategy="no")  # fmt: skip
    config = probdiff_config(use_vllm=True, vllm_mode="server", vllm_server_base_url="http://127.0.0.1:9")
    trainer.add_callback(ProbDiffCallback(trainer, held_out_queries(), config))
    with pytest.raises(
        RuntimeError, match="^ProbDiff: use_vllm=true: ValueError: vllm_mode=server takes LoRA adapters"
    ):
        trainer.train()
    assert trainer.state.global_step == 0


@pytest.mark.slow
def test_resumed_run_continues_the_history_without_duplicates(tmp_path, tiny_model_path):
    run = tmp_path / "run"
    settings = dict(max_steps=4, eval_strategy="no", save_steps=2)
    first = build_trainer(tiny_model_path, run, **settings)
    first.add_callback(ProbDiffCallback(first, held_out_queries(), probdiff_config(n_queries=N_QUERIES)))
    first.train()
    before = history_rows(run)
    assert [(r["global_step"], r["kind"]) for r in before] == [(0, "baseline"), (2, "save"), (4, "save")]
    assert [r["checkpoint"] for r in before] == [None, str(run / "checkpoint-2"), str(run / "checkpoint-4")]

    # As if the run had died after step 4's evaluation and were resumed from checkpoint-2.
    resumed = build_trainer(tiny_model_path, run, **settings)
    callback = ProbDiffCallback(resumed, held_out_queries(), probdiff_config(n_queries=N_QUERIES))
    resumed.add_callback(callback)
    resumed.train(resume_from_checkpoint=str(run / "checkpoint-2"))
    after = history_rows(run)
    assert [r["global_step"] for r in after] == [0, 2, 4]
    assert after[:2] == before[:2]  # kept as they were, not evaluated again
    assert sorted(callback.evaluated) == [0, 2, 4]
    assert after[2]["kind"] == "save" and after[2]["error"] is None
    assert json.loads((run / "checkpoint-4" / "probdiff.json").read_text()) == after[2]


# ---- W&B ----


@pytest.mark.slow
def test_wandb_offline_run_has_the_histogram_and_scalars_at_every_evaluated_step(
    tmp_path, tiny_model_path, fresh_wandb
):
    wandb = fresh_wandb
    run = tmp_path / "run"
    trainer = build_trainer(
        tiny_model_path, run, max_steps=4, eval_strategy="steps", eval_steps=2, save_strategy="no", report_to="wandb"
    )
    trainer.add_callback(
        ProbDiffCallback(trainer, held_out_queries(), probdiff_config(n_queries=N_QUERIES, wandb_table_rows=3))
    )
    logged: list[dict] = []
    table_rows: list[tuple[int, str, int]] = []  # the table is one object that grows: its size at each call
    wandb.init()
    log = wandb.log  # the run's own, which wandb.finish() puts back

    def spy(data, *args, **kwargs):
        logged.append(dict(data))
        if "eval/probdiff_records" in data:
            table = data["eval/probdiff_records"]
            table_rows.append((data["train/global_step"], table.log_mode, len(table.data)))
        log(data, *args, **kwargs)

    wandb.log = spy
    try:
        trainer.train()
    finally:
        wandb.finish()
    assert len(list(tmp_path.glob("wandb/offline-run-*"))) == 1
    expected = {r["global_step"]: r["summary"] for r in history_rows(run)}
    assert sorted(expected) == [0, 2, 4]

    scalars = {row["train/global_step"]: row for row in logged if "eval/probdiff_confidence" in row}
    histograms = {row["train/global_step"]: row["eval/probdiff_d"] for row in logged if "eval/probdiff_d" in row}
    assert sorted(scalars) == [0, 2, 4], [sorted(row) for row in logged]
    assert sorted(histograms) == [0, 2, 4], [sorted(row) for row in logged]
    # one table that grows by wandb_table_rows records per evaluated step
    assert table_rows == [(0, "INCREMENTAL", 3), (2, "INCREMENTAL", 6), (4, "INCREMENTAL", 9)]
    for step, summary in expected.items():
        assert scalars[step]["eval/probdiff_confidence"] == summary["confidence"]
        assert scalars[step]["eval/probdiff_d_mean"] == pytest.approx(summary["d_mean"])
        assert scalars[step]["eval/probdiff_confidence_at_-0.05"] == summary["confidence_sweep"]["-0.05"]
        histogram = histograms[step]
        assert isinstance(histogram, wandb.Histogram)
        assert sum(histogram.histogram) == summary["n"] - summary["n_invalid"]
        assert (
            histogram.bins[0] <= summary["d_quantiles"]["0.05"] and histogram.bins[-1] >= summary["d_quantiles"]["0.95"]
        )


@pytest.mark.slow
def test_a_stop_during_the_resumed_steps_evaluation_finishes_it(tmp_path, tiny_model_path, monkeypatch):
    """A preemption abandons step 2's evaluation and saves checkpoint-2. The resumed run is stopped again while it
    evaluates step 2 at its start: it finishes that evaluation (the step's weights exist only until step 3 is
    trained), then saves step 3 and stops; no step's evaluation is lost."""
    from probdiff_callback.callback.preemption import PreemptionCallback

    run = tmp_path / "run"

    def train(resume: Path | None, fault: str) -> PreemptionCallback:
        trainer = build_trainer(tiny_model_path, run, max_steps=4, eval_strategy="steps", eval_steps=1, save_steps=1,
                                eval_on_start=resume is None)  # fmt: skip
        preemption = PreemptionCallback(trainer)
        trainer.add_callback(preemption)
        trainer.add_callback(
            ProbDiffCallback(trainer, held_out_queries(), probdiff_config(n_queries=4), preemption=preemption)
        )
        with monkeypatch.context() as armed:
            inject(fault, armed.setattr)
            trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
        return preemption

    first = train(None, "answers-done:3=TERM")  # one batch an evaluation: the baseline, step 1, step 2
    assert first.stopping and first.checkpoint.endswith("checkpoint-2") and history_rows(run)[-1]["abandoned"]
    second = train(run / "checkpoint-2", "answers-done:1=TERM")  # the resumed step's evaluation, its first
    assert second.stopping and second.checkpoint.endswith("checkpoint-3")
    rows = history_rows(run)
    assert [row["global_step"] for row in rows] == [0, 1, 2, 3]
    assert not rows[2].get("abandoned") and rows[2]["summary"] is not None, rows[2]
