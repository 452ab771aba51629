"""The Trainer's best-model record after ProbDiff results, for both ways of evaluating (in the loop and beside
training): the one writer of `state.best_metric`, `best_global_step` and `best_model_checkpoint` from ProbDiff's
metrics, with the decision `analysis.pick.decide` takes for `probdiff select` too.

After each result the pick is decided again over every step known so far (main process: it reads the steps' files;
every rank gets the same `Pick`) and the Trainer's state is set to it, so `load_best_model_at_end` loads it. Where the
Trainer evaluates a step itself and compares its metric next (`_determine_best_metric`, after `on_evaluate`), the
state holds the pick over the other steps and the metrics the step's value now: the Trainer's own comparison then
ends at the same pick (and `save_strategy="best"` saves where it should). Where no checkpoint may be picked (every
one materially worse than the base model), the state holds none: the Trainer loads nothing, and a PEFT adapter is
put back to its weights before the first step (`restore_base`), the base model.
"""

from __future__ import annotations

import logging
import math
import os

from transformers import TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

from probdiff_callback.analysis.pick import Pick, best_step, decide, is_guarded, metric_key
from probdiff_callback.analysis.select import confidence_pick, ranked_rows, resolve_checkpoint
from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.runs.run_files import HistoryRow, step_files

logger = logging.getLogger(__name__)


def selects_by_probdiff(args: TrainingArguments) -> bool:
    """Whether `metric_for_best_model` is one of the callback's metrics (ProbDiff's or a reference metric)."""
    name = args.metric_for_best_model
    return name is not None and metric_key(name).removeprefix("eval_").startswith(("probdiff_", "ref_"))


def set_trainer_best(state: TrainerState, args: TrainingArguments, step: int | None, value: float) -> None:
    """The Trainer's best-model record at `step` (None: no best): `best_metric`, `best_global_step` where checkpoints
    are saved by steps, epochs or best (as the Trainer keeps it), and `best_model_checkpoint` where that checkpoint is
    on disk (else the Trainer's next save sets it, as after its own evaluations)."""
    state.best_metric = None if step is None else value
    if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST):
        state.best_global_step = step
    folder = None if step is None else os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
    state.best_model_checkpoint = folder if folder is not None and os.path.isdir(folder) else None


class TrainerBest:
    """The best-model record of one `ProbDiffCallback`'s trainer; every rank calls the same methods."""

    def __init__(self, trainer, config: ProbDiffConfig, outputs) -> None:
        self.trainer, self.config, self.outputs = trainer, config, outputs
        self.pick: Pick | None = None  # the last decision, the same on every rank
        self.restored_base = False  # no checkpoint passed: the model was put back to the base model at the end
        self._grades: dict = {}  # the guard's paired tests, each run once per pair of steps (main process)
        self._said: str | None = None

    @property
    def metric(self) -> str | None:
        args = self.trainer.args
        return args.metric_for_best_model if selects_by_probdiff(args) else None

    @property
    def guarded(self) -> bool:
        return is_guarded(self.metric)

    def decide(self, rows: list[HistoryRow] | None, pending_step: int | None = None) -> Pick | None:
        """The pick over the main process's `rows` (the run's history so far; ignored on the other ranks), the same
        on every rank; `pending_step`: a step whose checkpoint the Trainer is about to save counts as on disk."""
        if self.metric is None:
            return None
        pick = None
        if self.outputs.is_main and rows is not None:
            pick = self._decide(rows, pending_step)
        self.pick = self.outputs.broadcast(pick)
        return self.pick

    def _decide(self, rows: list[HistoryRow], pending_step: int | None) -> Pick:
        args = self.trainer.args
        run_dir = args.output_dir
        directory = self.outputs.files_directory
        by_step = {row.global_step: row for row in rows}
        key = metric_key(self.metric)

        saves = args.save_strategy != SaveStrategy.NO

        def usable(row: HistoryRow) -> bool:
            # a run that saves no checkpoint has nothing to load: its best is over its steps, as the Trainer's own
            # best_metric is (and EarlyStoppingCallback compares with it)
            return not saves or row.global_step == pending_step or resolve_checkpoint_of(run_dir, row) is not None

        return decide(
            rows,
            lambda step: step_files(directory, by_step[step]),
            self.metric,
            lambda row: self.outputs.metrics(row.summary, row.vs_base).get(key, math.nan),
            greater_is_better=bool(args.greater_is_better),
            gain_share=self.config.alarm_gain_share,
            usable=usable,
            grades=self._grades,
        )

    def alarm_pick(self, rows: list[HistoryRow]) -> int | None:
        """The step the disagreement alarm holds against the measures: the pick; for a run that selects by another
        metric, the highest confidence among the checkpoints on disk (main process)."""
        if self.pick is not None:
            return self.pick.step
        return confidence_pick(ranked_rows(rows), self.trainer.args.output_dir)

    def value_at(self, step: int) -> float:
        """The step's value of `probdiff_guarded` by the last decision (NaN: it fails the guard, or no decision)."""
        if self.pick is None or not self.guarded:
            return math.nan
        return self.pick.values.get(step, math.nan)

    def apply(self) -> None:
        """The Trainer's state at the last pick (every rank); the pick said where it changed (main process)."""
        if self.pick is None:
            return
        set_trainer_best(self.trainer.state, self.trainer.args, self.pick.step, self.pick.value)
        self._say()

    def before_trainer_compares(self, step: int, metrics: dict[str, float]) -> None:
        """The Trainer evaluated `step` and compares `metrics` next: the step's value now in `metrics`, and the state
        at the pick over the other steps, so that the Trainer's own comparison ends at the pick."""
        if self.pick is None or step not in self.pick.values:
            return
        key = metric_key(self.pick.metric)
        if key in metrics:
            metrics[key] = self.pick.values[step]
        candidates = {s: v for s, v in self.pick.candidates.items() if s != step}
        others = best_step(candidates, bool(self.trainer.args.greater_is_better))
        value = math.nan if others is None else candidates[others]
        set_trainer_best(self.trainer.state, self.trainer.args, others, value)

    def at_train_end(self, model) -> None:
        """With `load_best_model_at_end`, after the Trainer loaded the best checkpoint: where no checkpoint may be
        picked it loaded none, and the model would stay at the last step's weights, which failed the guard too; the
        base model is what the measures favour, so a LoRA adapter is put back to where it started (every rank)."""
        if self.pick is None or not self.pick.none_passes:
            return
        why_not = restore_base_adapter(model)
        self.restored_base = why_not is None
        if self.outputs.is_main:
            held = (
                "the model is the base model again (its LoRA adapter put back to where it started: B = 0), so what "
                "is saved or evaluated after training is the base model"
                if why_not is None
                else f"the model keeps the last step's weights, which failed the guard too ({why_not}): use the base "
                "model"
            )
            logger.warning(f"ProbDiff: no checkpoint passes the guard, so load_best_model_at_end loaded none; {held}")

    def _say(self) -> None:
        """The pick's line where it changed, in the log and in W&B's summary (main process)."""
        pick = self.pick
        if pick is None or not self.outputs.is_main:
            return
        line = pick.line()
        said = f"{pick.step}|{line}"
        if said == self._said:
            return
        self._said = said
        if line:
            (logger.warning if pick.none_passes or pick.failed_steps() else logger.info)(f"ProbDiff: {line}")
        self.outputs.pick_to_wandb(pick, self.trainer.args.output_dir)


def resolve_checkpoint_of(run_dir: str | os.PathLike, row: HistoryRow) -> str | None:
    from pathlib import Path

    return resolve_checkpoint(Path(run_dir), row.checkpoint)


def restore_base_adapter(model) -> str | None:
    """A PEFT LoRA model put back to the base model in place: every `lora_B` weight zero (LoRA starts there, so the
    adapter adds nothing); None when done, else why it cannot be (not a LoRA model, an initialisation that changes
    the base weights or does not start at B = 0, modules trained whole, weights held in ZeRO-3 shards)."""
    import torch
    from peft import PeftModel, PeftType, get_peft_model_state_dict, set_peft_model_state_dict

    if not isinstance(model, PeftModel):
        return "all weights were trained: the base model is the one the run started from"
    config = model.peft_config[model.active_adapter]
    if config.peft_type != PeftType.LORA:
        return f"a {config.peft_type} adapter, not LoRA"
    if getattr(config, "init_lora_weights", True) not in (True, "gaussian") or getattr(config, "use_dora", False):
        return f"init_lora_weights={config.init_lora_weights!r}, use_dora={config.use_dora}: B = 0 is not the start"
    if getattr(config, "modules_to_save", None):
        return f"modules_to_save={config.modules_to_save} were trained whole"
    state = get_peft_model_state_dict(model)
    if any(tensor.numel() == 0 for tensor in state.values()):
        return "ZeRO-3 holds the adapter in shards"
    with torch.no_grad():
        zeroed = {key: torch.zeros_like(value) if "lora_B" in key else value for key, value in state.items()}
        set_peft_model_state_dict(model, zeroed)
    return None
