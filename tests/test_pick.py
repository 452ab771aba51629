"""analysis/pick.py and callback/best.py: one decision of the best checkpoint, checked against the installed
transformers' own best-model logic (a real Trainer on a small torch model, its metric handed in at each evaluation),
and the Trainer's state set from it as the Trainer would set it."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from probdiff_callback.analysis.pick import best_step, is_guarded, metric_key
from probdiff_callback.callback.best import set_trainer_best

SEQUENCES = [
    ([0.5, math.nan, 0.75, 0.75, 0.5], True),  # NaN is never best; a tie keeps the first step
    ([0.9, 0.5, 0.6], True),
    ([math.nan, math.nan], True),  # nothing finite: no best
    ([2.0, 1.5, 1.5, 1.75], False),  # a loss: lower is better, the first of equals
    ([1.0, -math.inf, 3.0], True),
]


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x, labels=None):
        return {"loss": ((self.weight * x - labels) ** 2).mean()}


class Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i):
        return {"x": torch.tensor([1.0]), "labels": torch.tensor([1.0])}


class HandIn(TrainerCallback):
    """The metric of each evaluation, handed to the Trainer as ProbDiffCallback hands its metrics (in on_evaluate)."""

    def __init__(self, key: str, values: list[float]) -> None:
        self.key, self.values = key, values

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics[self.key] = self.values[state.global_step - 1]


@pytest.mark.parametrize(("values", "greater"), SEQUENCES)
def test_best_step_is_the_installed_trainers_own_best(tmp_path, values, greater):
    """The Trainer's `_determine_best_metric` and `_save_checkpoint` decide; `best_step` must say the same."""
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=len(values), eval_strategy="steps", eval_steps=1, save_steps=1,
        metric_for_best_model="probdiff_confidence", greater_is_better=greater, per_device_train_batch_size=4,
        learning_rate=0.0, report_to=[], use_cpu=True, logging_steps=1000, save_only_model=True,
    )  # fmt: skip
    trainer = Trainer(model=Tiny(), args=args, train_dataset=Rows(), eval_dataset=Rows())
    trainer.add_callback(HandIn("eval_probdiff_confidence", values))
    trainer.train()
    ours = best_step(dict(enumerate(values, start=1)), greater)
    assert trainer.state.best_global_step == ours
    expected = None if ours is None else str(tmp_path / f"checkpoint-{ours}")
    assert trainer.state.best_model_checkpoint == expected


def test_the_trainers_state_is_set_as_the_trainer_sets_it(tmp_path):
    (tmp_path / "checkpoint-6").mkdir()
    args = SimpleNamespace(save_strategy="steps", output_dir=str(tmp_path))
    state = SimpleNamespace(best_metric=None, best_global_step=None, best_model_checkpoint=None)
    set_trainer_best(state, args, 6, 0.75)
    assert (state.best_metric, state.best_global_step, state.best_model_checkpoint) == (
        0.75, 6, str(tmp_path / "checkpoint-6")
    )  # fmt: skip
    set_trainer_best(state, args, 12, 0.8)  # not saved yet: the Trainer's next save names it
    assert (state.best_global_step, state.best_model_checkpoint) == (12, None)
    set_trainer_best(state, args, None, math.nan)  # no checkpoint may be picked: nothing to load
    assert (state.best_metric, state.best_global_step, state.best_model_checkpoint) == (None, None, None)
    args.save_strategy = "no"
    set_trainer_best(state, args, 6, 0.75)
    assert state.best_global_step is None  # the Trainer keeps no best step without checkpoints


def test_the_metric_names():
    assert metric_key("probdiff_guarded") == metric_key("eval_probdiff_guarded") == "eval_probdiff_guarded"
    assert is_guarded("probdiff_guarded") and is_guarded("eval_probdiff_guarded")
    assert not is_guarded("probdiff_confidence") and not is_guarded(None)


# ---- through the callback and the Trainer's own best-model logic, in the loop ----
# Each step's outcome chosen (the evaluation stands in for the model): its confidence, and the share of its 24 XSum
# queries answered with their reference summary word for word (ROUGE 100; the others 0: an independent measure).
GUARD_PLAN = {
    0: (0.5, 0.5),  # the base model
    1: (1.0, 0.0),  # the highest confidence, every answer wrong: significantly worse than the base model
    2: (0.875, 0.5),  # as good as the base model: the pick, until step 3 gains 50 points on it
    3: (0.625, 1.0),  # every answer right: step 2 now gives up all of the gain, and step 3 is the pick
}
N_GUARD_QUERIES = 24


def xsum_queries():
    from probdiff_callback.core.queries import Query

    return [
        Query(f"doc{i}", f"Summarize document {i}.", "xsum", f"summary{i} about topic{i} and its result{i}")
        for i in range(N_GUARD_QUERIES)
    ]


def planned_evaluate(trainer, plan):
    """An `evaluate` for the callback whose records follow `plan` at the trainer's current step."""
    from _records import make_record

    from probdiff_callback.core.evaluator import Evaluation

    def evaluate(model, tokenizer, queries, config, **kwargs):
        confidence, right = plan[trainer.state.global_step]
        n_confident, n_right = round(confidence * len(queries)), round(right * len(queries))
        records = [
            make_record(
                q.id,
                0.2 if i < n_confident else -0.3,
                delta=config.delta,
                query=q.text,
                category=q.category,
                response=q.reference if i < n_right else "zzz qqq",
            )  # fmt: skip
            for i, q in enumerate(queries)
        ]
        return Evaluation(records)

    return evaluate


class BestAtSaves(TrainerCallback):
    """The Trainer's best-model record after each save (its own comparison and ours are both done by then)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int | None, str | None]] = []

    def on_save(self, args, state, control, **kwargs):
        name = None if state.best_model_checkpoint is None else Path(state.best_model_checkpoint).name
        self.seen.append((state.global_step, state.best_global_step, name))


def guarded_trainer(tmp_path, tiny_model_path, monkeypatch, plan, **training_args):
    from _distributed_eval import build_trainer, probdiff_config

    import probdiff_callback.callback.trainer_evaluation as evaluation_module
    from probdiff_callback.callback.probdiff import ProbDiffCallback

    settings = dict(
        max_steps=3, eval_strategy="steps", eval_steps=1, save_steps=1, eval_on_start=True, learning_rate=0.0,
        metric_for_best_model="probdiff_guarded", load_best_model_at_end=True,
    )  # fmt: skip
    trainer = build_trainer(tiny_model_path, tmp_path / "run", **{**settings, **training_args})
    monkeypatch.setattr(evaluation_module, "evaluate", planned_evaluate(trainer, plan))
    callback = ProbDiffCallback(trainer, xsum_queries(), probdiff_config(n_queries=None))
    trainer.add_callback(callback)
    observer = BestAtSaves()
    trainer.add_callback(observer)
    return trainer, callback, observer


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_in_the_loop_a_checkpoint_that_fails_the_guard_is_never_the_trainers_best(
    tmp_path, tiny_model_path, monkeypatch, caplog, fresh_wandb
):
    """The Trainer's best after each evaluation, the log, `probdiff select`, RUN_DIR/best: step 1 (the highest
    confidence) fails against the base model and is never best; step 2 is, until step 3's gain makes it give up too
    much."""
    import logging

    from probdiff_callback.analysis.select import point_best, select_checkpoints

    trainer, _, observer = guarded_trainer(tmp_path, tiny_model_path, monkeypatch, GUARD_PLAN, report_to="wandb")
    try:
        with caplog.at_level(logging.INFO, logger="probdiff_callback"):
            trainer.train()
        summary = dict(fresh_wandb.run.summary)
    finally:
        fresh_wandb.finish()
    run = tmp_path / "run"
    assert (summary["probdiff/best_step"], summary["probdiff/best_checkpoint"]) == (3, f"{run}/checkpoint-3")
    assert summary["probdiff/pick"].startswith("probdiff_guarded: step 3 (confidence 62.5%)")
    assert observer.seen == [(1, None, None), (2, 2, "checkpoint-2"), (3, 3, "checkpoint-3")]
    assert trainer.state.best_model_checkpoint == str(run / "checkpoint-3") and trainer.state.best_metric == 0.625
    guarded = {e["step"]: e["eval_probdiff_guarded"] for e in trainer.state.log_history if "eval_probdiff_guarded" in e}
    assert math.isnan(guarded[0]) and math.isnan(guarded[1]) and (guarded[2], guarded[3]) == (0.875, 0.625)
    said = caplog.text
    assert (
        "ProbDiff: probdiff_guarded: step 2 (confidence 87.5%), guarded by ROUGE-1, ROUGE-2, ROUGE-L, eval loss" in said
    )
    assert "failed: step 1: ROUGE-1 0.00 against the base model's 50.00 (p = 0.0004) and 2 more" in said
    assert "ProbDiff: probdiff_guarded: step 3 (confidence 62.5%)" in said
    assert "step 2: ROUGE-1 50.00 against step 3's 100.00 (p = 0.0006, 100% of the gain) and 2 more" in said

    selection = select_checkpoints(run)  # what the run selected by: selection.json
    assert selection.pick.metric == "probdiff_guarded" and selection.best_checkpoint.global_step == 3
    assert selection.ranked[0].global_step == 1 and selection.ranked[0].guard.startswith("ROUGE-1 0.00 against")
    assert point_best(run, selection.best_checkpoint.checkpoint).resolve() == Path(trainer.state.best_model_checkpoint)
    assert select_checkpoints(run, metric="probdiff_confidence").best_checkpoint.global_step == 1


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_when_no_checkpoint_passes_nothing_is_best_and_the_model_is_the_base_model_at_the_end(
    tmp_path, tiny_model_path, monkeypatch, caplog
):
    import logging

    from peft import get_peft_model_state_dict

    from probdiff_callback.analysis.select import select_checkpoints
    from probdiff_callback.cli import main

    plan = {0: (0.25, 1.0), 1: (1.0, 0.0), 2: (0.9, 0.25), 3: (0.75, 0.0)}  # every checkpoint far below the base model
    trainer, _, observer = guarded_trainer(tmp_path, tiny_model_path, monkeypatch, plan, learning_rate=5e-3)
    with caplog.at_level(logging.INFO, logger="probdiff_callback"):
        trainer.train()
    run = tmp_path / "run"
    assert [seen[1:] for seen in observer.seen] == [(None, None)] * 3
    # the Trainer's own "nothing best yet" after its comparison at the last evaluation: -inf
    assert trainer.state.best_model_checkpoint is None and trainer.state.best_metric in (None, -math.inf)
    assert "ProbDiff: probdiff_guarded: no checkpoint passes: every one is materially worse than the base model" in (
        caplog.text
    )
    assert "load_best_model_at_end loaded none; the model is the base model again" in caplog.text
    lora_b = {k: v for k, v in get_peft_model_state_dict(trainer.model).items() if "lora_B" in k}
    assert lora_b and all(not v.any() for v in lora_b.values()), "the adapter adds nothing: the base model"
    trained = get_peft_model_state_dict_of(run / "checkpoint-3")
    assert any(v.any() for k, v in trained.items() if "lora_B" in k), "training did move the adapter"

    selection = select_checkpoints(run)
    assert selection.best_checkpoint is None and selection.pick.none_passes
    (run / "best").symlink_to("checkpoint-1")  # an earlier pick's link
    assert main(["select", str(run), "--link"]) == 2
    assert not (run / "best").exists(), "RUN_DIR/best named a damaged checkpoint"


def get_peft_model_state_dict_of(checkpoint: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(checkpoint / "adapter_model.safetensors")
