"""The ProbDiff settings as one typed object, and the one check of them.

`ProbDiffConfig` holds the metric, sampling, lengths and batching, the generation engine and the callback's schedule.
Each field states its default and its help once, in its definition (`metadata["help"]`, as trl's configs do); `probdiff
eval --help` and the table in docs/configuration.md are made from them. Each field also names its group and who reads
it: the CLI refuses a key its command would not read rather than accept it and do nothing with it.

Constructing a `ProbDiffConfig` is the one check of these settings: OmegaConf types each value against its field
(enumerations are `Literal`s), then the ranges a type cannot state are checked. `probdiff eval|score key=value` and a
recipe's `probdiff.*` keys both come in through `from_values`, so a bad value gets the same message on both paths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from probdiff_callback.core.categories import ALIGNBENCH, canonical_category, describe, unmatched_keys
from probdiff_callback.core.prompts import REFINEMENT_PROMPTS
from probdiff_callback.runtime.config_layers import SettingError, did_you_mean, merge, parse_items, typed

# Who reads a setting: `probdiff eval`, `probdiff score`, and ProbDiffCallback, which runs eval's evaluation during
# training (so it reads everything eval reads) on its own schedule.
EVAL, SCORE, CALLBACK = "eval", "score", "callback"
_EVERYWHERE = frozenset({EVAL, SCORE, CALLBACK})
_GENERATING = frozenset({EVAL, CALLBACK})  # score is given its texts: nothing is sampled, revised or capped
_TRAINING = frozenset({CALLBACK})

METRIC, SAMPLING, LENGTHS, ENGINE, SCHEDULE, BESIDE = (
    "metric", "sampling", "lengths and batching", "generation engine", "training schedule", "evaluation beside training"
)  # fmt: skip
DEFAULT_SUBDIR = "probdiff"  # a run's ProbDiff files: <output_dir>/probdiff/
# The disagreement alarm's size (analysis/materiality.py): the pick may give up this share of what training gained on an
# independent measure (its best checkpoint against the base model) before a significant change alarms. In the trust
# study's clean run (docs/agreement.md) the pick gave up 3.0% of the eval loss's gain (significant), 6.6% of ROUGE-L's
# and 12.9% of ROUGE-1's (within noise): the cost of choosing among good checkpoints. A quarter is about twice the
# largest, so another healthy run's spread stays a note, and a pick that throws away a quarter of what training bought
# is worth a user's look. Damage (the pick significantly worse than the base model) alarms whatever the share.
DEFAULT_ALARM_GAIN_SHARE = 0.25


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the key, where it came from and what is valid. `key`: the
    setting a wrong type or value was given to (None for the ranges and for unknown keys)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


def _setting(default=dataclasses.MISSING, *, help: str, group: str, read_by: frozenset[str], cli: str = "", **kw):
    """A field with its help and scope: `group` (its section in the docs and in `--help`), `read_by` (the commands
    and the callback that read it) and, for a training-only setting, `cli`: how the CLI gets the same, where it can."""
    return field(default=default, metadata={"help": help, "group": group, "read_by": read_by, "cli": cli}, **kw)


@dataclass
class ProbDiffConfig:
    # --- the metric (paper defaults: camera-ready version) ---
    delta: float = _setting(-0.05, help="confident when d ≥ delta", group=METRIC, read_by=_EVERYWHERE)
    sweep: list[float] = _setting(
        help="thresholds reported in `confidence_sweep`",
        group=METRIC,
        read_by=_EVERYWHERE,
        default_factory=lambda: [0.0, -0.02, -0.05, -0.1],
    )
    n_revisions: int = _setting(1, help="K, revisions of the last revision", group=METRIC, read_by=_GENERATING)
    refinement_prompt: str = _setting(
        "rewriter",
        help="`rewriter`, `rewriter-translation`, `simple` (appendix C), or a template with {instruction} and "
        "{response}",
        group=METRIC,
        read_by=_GENERATING,
    )
    system_prompt: str | None = _setting(
        None,
        help="null: the chat template's own default (for Qwen, the paper's \"You are a helpful assistant.\"); score "
        "reads it too: both texts are scored under the query's chat prompt",
        group=METRIC,
        read_by=_EVERYWHERE,
    )
    # --- sampling (the reference code's: generation_task/vllm_inference.py and vllm_modify.py) ---
    # Temperature only: the reference code samples with top_p 1 and top_k -1 (off), and its runs produced the
    # published tables. The submission version of the paper states top_p 0.8 for answers and 0.9 for revisions.
    answer_temperature: float = _setting(
        0.7, help="temperature of the answers, as the paper's code", group=SAMPLING, read_by=_GENERATING
    )
    answer_top_p: float = _setting(
        1.0, help="top_p of the answers (the submission paper's 0.8 on request)", group=SAMPLING, read_by=_GENERATING
    )
    answer_temperature_by_category: dict[str, float] = _setting(
        help="e.g. AlignBench's official ones: `answer_temperature_by_category.Mathematics=0.1`; any name of a "
        "category (数学计算, Math.); a key that matches no category stops",
        group=SAMPLING,
        read_by=_GENERATING,
        default_factory=dict,
    )
    revision_temperature: float = _setting(
        0.1, help="temperature of the revisions", group=SAMPLING, read_by=_GENERATING
    )
    revision_top_p: float = _setting(
        1.0, help="top_p of the revisions (the submission paper's 0.9 on request)", group=SAMPLING, read_by=_GENERATING
    )
    n_samples: int = _setting(
        1,
        help="average d over n independent answer → revise chains per query (beyond the paper)",
        group=SAMPLING,
        read_by=_GENERATING,
    )
    seed: int = _setting(
        0,
        help="texts depend only on (seed, query id, sample); the callback also draws its query subset with it",
        group=SAMPLING,
        read_by=_GENERATING,
    )
    # --- lengths and batching ---
    max_new_tokens: int = _setting(
        512,
        help="cap of an answer or revision (the reference code's: 2,048, AlignBench 1,024); capped ones are flagged "
        "and counted",
        group=LENGTHS,
        read_by=_GENERATING,
    )
    max_prompt_tokens: int = _setting(
        2048,
        help="longer queries and refinement requests are cut in the middle, counted and reported",
        group=LENGTHS,
        read_by=_EVERYWHERE,
    )
    batch_size: int = _setting(16, help="rows decoded or scored together", group=LENGTHS, read_by=_EVERYWHERE)
    score_chunk_tokens: int = _setting(
        512, help="positions per LM-head chunk when scoring", group=LENGTHS, read_by=_EVERYWHERE
    )
    score_prompt_once: bool = _setting(
        True,
        help="score an answer and its revision in one pass over their shared prompt (its KV cache once); false: each "
        "as a whole sequence (docs/method.md)",
        group=LENGTHS,
        read_by=_EVERYWHERE,
    )
    # --- the generation engine (docs/vllm.md); scoring always stays with the model itself, in fp32 ---
    use_vllm: bool | str = _setting(
        "auto",
        help="answers and revisions from vLLM instead of HF generate; `auto`: vLLM where it is installed, runs the "
        "model and is faster (not in the loop on a GPU, not for small work: docs/vllm.md); the model always scores",
        group=ENGINE,
        read_by=_GENERATING,
    )
    vllm_mode: Literal["colocate", "server"] = _setting(
        "colocate",
        help="`colocate`: vLLM in the evaluating process; `server`: a `vllm serve` you started",
        group=ENGINE,
        read_by=_GENERATING,
    )
    vllm_server_base_url: str = _setting(
        "http://127.0.0.1:8000", help="`server` mode: where your server listens", group=ENGINE, read_by=_GENERATING
    )
    vllm_server_timeout: float = _setting(
        240.0,
        help="seconds a server must answer within: a server you started (`server` mode) that does not answer at all, "
        "its metrics, and a request that generates nothing (the model list, loading weights, sleep)",
        group=ENGINE,
        read_by=_GENERATING,
    )
    vllm_stall_timeout: float = _setting(
        240.0,
        help="a server's texts are waited for as long as it makes progress; it counts as stalled after this many "
        "seconds without a token generated or a prompt processed (its /metrics; docs/vllm.md); a server this job "
        "starts, after this many seconds without a line added to its log",
        group=ENGINE,
        read_by=_GENERATING,
    )
    # Not TRL's 0.3: Qwen-14B-Chat's bf16 weights alone are 0.35 of an 80 GB GPU; 0.55 leaves them 16 GB of KV cache
    # beside the model in training (docs/gpu.md)
    vllm_gpu_memory_utilization: float = _setting(
        0.55, help="`colocate` on a GPU: vLLM's share of its memory", group=ENGINE, read_by=_GENERATING
    )
    # TRL's name; on by default here (TRL's is off): an evaluation comes every few hundred steps, not every step as
    # GRPO's generation does, so the engine's weights and KV cache go back to training between evaluations
    vllm_enable_sleep_mode: bool = _setting(
        True,
        help="`colocate` on a GPU: the engine frees its weights and KV cache between evaluations and takes them "
        "again at the next",
        group=ENGINE,
        read_by=_GENERATING,
    )
    vllm_weight_sync: Literal["auto", "merged", "lora"] = _setting(
        "auto",
        help="how a colocated engine gets the evaluated weights: `merged` (the adapters merged in, handed over in "
        "memory), `lora` (the adapter by path, vLLM's LoRA kernels); `auto`: merged (a server of this job's on a "
        "GPU: lora)",
        group=ENGINE,
        read_by=_GENERATING,
    )
    # --- the callback's schedule (ProbDiffCallback only: the CLI has its own flags or behaviour for these) ---
    n_queries: int | None = _setting(
        64,
        help="the held-out queries evaluated at each step: a fixed subset drawn with `seed`; null: all",
        group=SCHEDULE,
        read_by=_TRAINING,
        cli="use --limit N",
    )
    every: int = _setting(
        1,
        help="evaluate at every N-th evaluation, or checkpoint save when the run has no evaluation",
        group=SCHEDULE,
        read_by=_TRAINING,
    )
    baseline: bool = _setting(
        True,
        help="evaluate the base model before the first step (a PEFT model with its adapters disabled)",
        group=SCHEDULE,
        read_by=_TRAINING,
        cli="run `probdiff eval` without --adapter",
    )
    at_end: bool = _setting(
        True,
        help="evaluate the last step if it would not be evaluated otherwise",
        group=SCHEDULE,
        read_by=_TRAINING,
    )
    gather_params: bool = _setting(
        True,
        help="ZeRO-3: gather the whole model once per evaluation (false: keep it sharded)",
        group=SCHEDULE,
        read_by=_TRAINING,
    )
    fail_on_error: bool = _setting(
        False,
        help="re-raise a failed evaluation instead of recording it and training on",
        group=SCHEDULE,
        read_by=_TRAINING,
        cli="an error always stops the command",
    )
    wandb_table_rows: int = _setting(
        8,
        help="records per evaluated step added to the W&B table",
        group=SCHEDULE,
        read_by=_TRAINING,
        cli="every record goes to records.jsonl",
    )
    output_subdir: str = _setting(
        DEFAULT_SUBDIR,
        help="history and records under <output_dir>/<output_subdir>",
        group=SCHEDULE,
        read_by=_TRAINING,
        cli="use --out DIR",
    )
    progress: bool = _setting(
        False,
        help="a progress bar on the main process",
        group=SCHEDULE,
        read_by=_TRAINING,
        cli="the progress bar is always shown",
    )
    alarm_gain_share: float = _setting(
        DEFAULT_ALARM_GAIN_SHARE,
        help="the disagreement alarm: the share of what training gained on an independent measure (its best checkpoint "
        "against the base model) that the pick may give up, significantly, before it alarms; a pick significantly "
        "worse than the base model always alarms, other significant changes are notes (docs/callback.md)",
        group=SCHEDULE,
        read_by=_TRAINING,
        cli="use `probdiff select --alarm-gain-share`",
    )

    # --- the evaluation beside training (docs/async.md): checkpoints queued in the run directory, one evaluator ---
    async_eval: bool = _setting(
        False,
        help="evaluate in a process of its own beside training (`probdiff watch`): training saves and queues the "
        "weights of each scheduled step and never waits for an evaluation, except for what is left at the end",
        group=BESIDE,
        read_by=_TRAINING,
        cli="`probdiff watch RUN_DIR` is that process",
    )
    evaluator: Literal["local", "external"] = _setting(
        "local",
        help="async_eval: `local`, the training command starts the evaluator on this node and stops it at its end; "
        "`external`, you start `probdiff watch RUN_DIR` (another node, a SLURM job step)",
        group=BESIDE,
        read_by=_TRAINING,
    )
    evaluator_gpus: str | None = _setting(
        None,
        help="async_eval, local: the GPUs the evaluator sees (CUDA_VISIBLE_DEVICES, e.g. `7` or `6,7`); null: the CPU",
        group=BESIDE,
        read_by=_TRAINING,
    )
    evaluator_threads: int | None = _setting(
        None,
        help="async_eval, local: the evaluator's CPU threads; null: as many as each training process",
        group=BESIDE,
        read_by=_TRAINING,
    )
    end_wait_seconds: float | None = _setting(
        None,
        help="async_eval: how long the command waits at its end for evaluations still queued (null: until all are "
        "done); what is left is said, and `probdiff watch RUN_DIR` finishes it",
        group=BESIDE,
        read_by=_TRAINING,
    )

    def __post_init__(self) -> None:
        """The one check, however the settings came: types and choices by OmegaConf (an int where a float is expected
        becomes a float; the first wrong one stops), then the ranges, every problem in one error."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        try:
            values = typed(type(self), values, noun="ProbDiff setting ")
        except SettingError as err:
            raise ConfigError(str(err), key=err.key) from None
        for name, value in values.items():
            setattr(self, name, value)
        if problems := self._range_problems():
            raise ConfigError("Invalid ProbDiff config: " + "; ".join(problems))

    def _range_problems(self) -> list[str]:
        problems = []
        if isinstance(self.use_vllm, str) and self.use_vllm != "auto":
            problems.append(f"use_vllm={self.use_vllm!r}: use true, false or auto")
        if self.n_revisions < 1:
            problems.append(f"n_revisions={self.n_revisions}: needs at least 1 revision")
        if self.n_samples < 1:
            problems.append(f"n_samples={self.n_samples}: needs at least 1")
        for name in ("answer_top_p", "revision_top_p", "vllm_gpu_memory_utilization"):
            if not 0.0 < getattr(self, name) <= 1.0:
                problems.append(f"{name}={getattr(self, name)}: must be in (0, 1]")
        for name in ("max_new_tokens", "max_prompt_tokens", "batch_size", "score_chunk_tokens", "every"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)}: must be positive")
        if self.n_queries is not None and self.n_queries < 1:
            problems.append(f"n_queries={self.n_queries}: must be positive (or None for all)")
        for name in ("vllm_server_timeout", "vllm_stall_timeout"):
            if getattr(self, name) <= 0:
                problems.append(f"{name}={getattr(self, name)}: must be positive")
        if self.evaluator_threads is not None and self.evaluator_threads < 1:
            problems.append(f"evaluator_threads={self.evaluator_threads}: must be positive (or null)")
        if self.end_wait_seconds is not None and self.end_wait_seconds < 0:
            problems.append(f"end_wait_seconds={self.end_wait_seconds}: must be >= 0 (or null: until all are done)")
        if not 0.0 <= self.alarm_gain_share <= 1.0:
            problems.append(f"alarm_gain_share={self.alarm_gain_share}: a share of the gain, in [0, 1]")
        if self.wandb_table_rows < 0:
            problems.append(f"wandb_table_rows={self.wandb_table_rows}: must be >= 0")
        if self.refinement_prompt not in REFINEMENT_PROMPTS and not (
            "{instruction}" in self.refinement_prompt and "{response}" in self.refinement_prompt
        ):
            problems.append(
                f"refinement_prompt={self.refinement_prompt!r}: use one of {sorted(REFINEMENT_PROMPTS)} "
                "or a template containing {instruction} and {response}"
            )
        seen: dict[str, str] = {}
        for key in self.answer_temperature_by_category:
            canonical = canonical_category(key)
            if canonical in seen:  # e.g. Writing and 文本写作: one category, two temperatures
                problems.append(
                    f"answer_temperature_by_category: {seen[canonical]!r} and {key!r} name the same category"
                )
            seen[canonical] = key  # type: ignore[index]
        return problems

    @classmethod
    def from_values(
        cls,
        values: Mapping[str, Any],
        where: str | Callable[[str], str],
        valid: Sequence[str] | None = None,
        base: Mapping[str, Any] | None = None,
    ) -> ProbDiffConfig:
        """The settings `values` give over `base` (the defaults by default): the way in of both the CLI and the
        recipes. `where` names the source of the values, or of each key (a recipe's layers); `valid`: the keys that may
        be given (all by default)."""
        valid = list(valid) if valid is not None else cls.field_names()
        source = where if callable(where) else lambda key: where
        for key in values:
            if key not in valid:
                raise ConfigError(
                    f"{source(key)}: unknown key {key!r}{did_you_mean(key, valid)}. "
                    f"Valid ProbDiff settings: {', '.join(valid)}"
                )
        try:
            return cls(**merge([base or {}, values]))
        except ConfigError as err:
            if err.key is None:  # the ranges: the same message on every path
                raise
            raise ConfigError(f"{source(err.key)}: {err}", key=err.key) from None

    def with_overrides(
        self, overrides: Sequence[str], where: str = "command line", valid: Sequence[str] | None = None
    ) -> ProbDiffConfig:
        """These settings with `key=value` overrides applied (nested keys with dots), checked as `from_values` checks
        them."""
        return self.from_values(_items(overrides, where), where, valid, base=self.to_dict())

    def selection_problem(self, metric_for_best_model: str | None) -> str | None:
        """Why checkpoints cannot be selected by `metric_for_best_model` with these settings, or None: a ProbDiff or
        reference metric exists only at the evaluations ProbDiff runs at."""
        metric = metric_for_best_model or ""
        if metric.removeprefix("eval_").startswith(("probdiff_", "ref_")) and self.every != 1:
            return (
                f"metric_for_best_model={metric} needs ProbDiff at every evaluation, but every={self.every}: set "
                "every=1 and space evaluations with eval_steps instead"
            )
        return None

    def answer_temperature_for(self, category: str | None) -> float:
        """The answer temperature of a query's category, matched under any of the category's names."""
        by_canonical = {canonical_category(k): v for k, v in self.answer_temperature_by_category.items()}
        return by_canonical.get(canonical_category(category), self.answer_temperature)

    def check_categories(self, categories: Iterable[str | None]) -> None:
        """Stop when a key of `answer_temperature_by_category` names no category of the queries and no
        AlignBench category: an unmatched key would otherwise fall back to `answer_temperature` unseen."""
        categories = list(categories)
        unmatched = unmatched_keys(self.answer_temperature_by_category, categories)
        if unmatched:
            present = sorted({canonical_category(c) for c in categories if c is not None})  # type: ignore[type-var]
            raise ConfigError(
                f"answer_temperature_by_category: {', '.join(map(repr, unmatched))} matches no category. "
                f"The queries' categories: {describe(present) or '(none)'}; AlignBench's: {describe(ALIGNBENCH)}"
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def read_by(cls, reader: str) -> dict[str, list[str]]:
        """The settings `reader` (EVAL, SCORE or CALLBACK) reads, by group, in the order of the fields."""
        groups: dict[str, list[str]] = {}
        for f in dataclasses.fields(cls):
            if reader in f.metadata["read_by"]:
                groups.setdefault(f.metadata["group"], []).append(f.name)
        return groups

    @classmethod
    def keys_read_by(cls, reader: str) -> list[str]:
        return [name for names in cls.read_by(reader).values() for name in names]

    @classmethod
    def scope(cls, name: str) -> Mapping:
        """A field's metadata: help, group, read_by and cli."""
        return {f.name: f.metadata for f in dataclasses.fields(cls)}[name]


def _items(overrides: Sequence[str], where: str = "command line") -> dict[str, Any]:
    try:
        return parse_items(overrides, where)
    except SettingError as err:
        raise ConfigError(str(err)) from None


def config_for_command(command: str, overrides: list[str]) -> ProbDiffConfig:
    """The settings of a CLI command (EVAL or SCORE) with its `key=value` overrides applied, after refusing
    every key the command would not read: accepted, it would be silently ignored."""
    reads = ProbDiffConfig.keys_read_by(command)
    problems = []
    for key in _items(overrides):
        if key in ProbDiffConfig.field_names() and key not in reads:
            problems.append(_not_read(command, key))
    if problems:  # one per line: each names its key and what to do
        raise ConfigError("settings: " + (problems[0] if len(problems) == 1 else "\n  " + "\n  ".join(problems)))
    return ProbDiffConfig().with_overrides(overrides, valid=reads)


def _not_read(command: str, key: str) -> str:
    """Why `command` refuses `key`, and what to do instead."""
    scope = ProbDiffConfig.scope(key)
    if EVAL not in scope["read_by"]:  # the callback's schedule
        message = (
            f"{key} is a ProbDiffCallback setting ({scope['help']}); it applies during training only "
            f"(recipe `probdiff.{key}`)"
        )
        return message + (f"; for the CLI, {scope['cli']}" if scope["cli"] else "")
    # read by eval, not by score: sampling, revising, capping
    return (
        f"{key} is not read by `probdiff {command}`, which scores the texts in --pairs as they are and generates "
        "nothing; it applies to `probdiff eval` and during training"
    )
