"""The ProbDiff settings as one typed object (the metric, sampling, lengths and batching, and when the callback
runs it), each field scoped to what reads it, with `key=value` overrides that reject unknown keys and, for a CLI
command, the keys it would not read."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from probdiff_callback.core.categories import ALIGNBENCH, canonical_category, describe, unmatched_keys
from probdiff_callback.core.prompts import REFINEMENT_PROMPTS

# Who reads a setting: `probdiff eval`, `probdiff score`, and ProbDiffCallback, which runs eval's evaluation during
# training (so it reads everything eval reads) on its own schedule. The CLI refuses a key its command would not read
# rather than accept it and do nothing with it.
EVAL, SCORE, CALLBACK = "eval", "score", "callback"
_EVERYWHERE = frozenset({EVAL, SCORE, CALLBACK})
_GENERATING = frozenset({EVAL, CALLBACK})  # score is given its texts: nothing is sampled, revised or capped
_TRAINING = frozenset({CALLBACK})

METRIC, SAMPLING, LENGTHS, ENGINE, SCHEDULE = (
    "metric", "sampling", "lengths and batching", "generation engine", "training schedule"
)  # fmt: skip
VLLM_MODES = ("colocate", "server")
DEFAULT_SUBDIR = "probdiff"  # a run's ProbDiff files: <output_dir>/probdiff/
VLLM_WEIGHT_SYNCS = ("auto", "merged", "lora")


def _setting(default=dataclasses.MISSING, *, group: str, read_by: frozenset[str], about: str = "", cli: str = "", **kw):
    """A field with its scope: `group` (its section in the docs and in `--help`), `read_by` (the commands and the
    callback that read it), and for a training-only setting `about` (what it does) and `cli` (how the CLI gets the
    same, where it can), both for the CLI's refusal of the key."""
    metadata = {"group": group, "read_by": read_by, "about": about, "cli": cli}
    return field(default=default, metadata=metadata, **kw)


@dataclass
class ProbDiffConfig:
    # --- the metric (paper defaults: camera-ready version) ---
    delta: float = _setting(-0.05, group=METRIC, read_by=_EVERYWHERE)  # confident when d >= delta
    sweep: list[float] = _setting(group=METRIC, read_by=_EVERYWHERE, default_factory=lambda: [0.0, -0.02, -0.05, -0.1])
    n_revisions: int = _setting(1, group=METRIC, read_by=_GENERATING)  # K: revise the last revision K times
    # rewriter | rewriter-translation | simple | a template with {instruction} and {response}
    refinement_prompt: str = _setting("rewriter", group=METRIC, read_by=_GENERATING)
    # None: the chat template's own default (for Qwen, the paper's "You are a helpful assistant."). score reads it
    # too: both texts are scored under the chat prompt of the query.
    system_prompt: str | None = _setting(None, group=METRIC, read_by=_EVERYWHERE)
    # --- sampling (the reference code's: generation_task/vllm_inference.py and vllm_modify.py) ---
    # Temperature only: the reference code samples with top_p 1 and top_k -1 (off), and its runs
    # produced the published tables. The submission version of the paper states top_p 0.8 for
    # answers and 0.9 for revisions (the camera-ready states none): answer_top_p=0.8 revision_top_p=0.9.
    answer_temperature: float = _setting(0.7, group=SAMPLING, read_by=_GENERATING)
    answer_top_p: float = _setting(1.0, group=SAMPLING, read_by=_GENERATING)
    # AlignBench's official settings, keyed by any name of a category (see `canonical_category`)
    answer_temperature_by_category: dict[str, float] = _setting(
        group=SAMPLING, read_by=_GENERATING, default_factory=dict
    )
    revision_temperature: float = _setting(0.1, group=SAMPLING, read_by=_GENERATING)
    revision_top_p: float = _setting(1.0, group=SAMPLING, read_by=_GENERATING)
    # average d over this many independent answer -> revise chains
    n_samples: int = _setting(1, group=SAMPLING, read_by=_GENERATING)
    # the sampler's seed (texts depend only on seed, query id and sample); the callback also draws its subset with it
    seed: int = _setting(0, group=SAMPLING, read_by=_GENERATING)
    # --- lengths and batching ---
    # the reference code: 2,048 (AlignBench 1,024); answers cut here are flagged
    max_new_tokens: int = _setting(512, group=LENGTHS, read_by=_GENERATING)
    # longer queries (and refinement requests) are cut in the middle; score cuts its queries alike
    max_prompt_tokens: int = _setting(2048, group=LENGTHS, read_by=_EVERYWHERE)
    batch_size: int = _setting(16, group=LENGTHS, read_by=_EVERYWHERE)
    score_chunk_tokens: int = _setting(512, group=LENGTHS, read_by=_EVERYWHERE)  # positions per LM-head chunk
    # --- the generation engine (docs/vllm.md); scoring always stays with the model itself, in fp32 ---
    # answers and revisions from vLLM instead of HF generate (TRL's option names)
    use_vllm: bool = _setting(False, group=ENGINE, read_by=_GENERATING)
    # colocate: an engine in this process's job, started once; server: a `vllm serve` you started
    vllm_mode: str = _setting("colocate", group=ENGINE, read_by=_GENERATING)
    vllm_server_base_url: str = _setting("http://127.0.0.1:8000", group=ENGINE, read_by=_GENERATING)
    vllm_server_timeout: float = _setting(240.0, group=ENGINE, read_by=_GENERATING)  # seconds to wait for the server
    # colocate, on a GPU: vLLM's share of its memory. Not TRL's 0.3: Qwen-14B-Chat's bf16 weights alone are 0.35 of
    # an 80 GB GPU; 0.55 leaves them 16 GB of KV cache beside the model in training (docs/gpu.md)
    vllm_gpu_memory_utilization: float = _setting(0.55, group=ENGINE, read_by=_GENERATING)
    # how a colocated engine gets the evaluated weights: merged (written, then reloaded: fast on a CPU), lora (the
    # adapter by path: vLLM's LoRA kernels, the GPU's way), auto: merged on a CPU, lora on a GPU
    vllm_weight_sync: str = _setting("auto", group=ENGINE, read_by=_GENERATING)
    # --- the callback's schedule (ProbDiffCallback only: the CLI has its own flags or behaviour for these) ---
    n_queries: int | None = _setting(  # a fixed subset drawn with `seed`; None: all
        64, group=SCHEDULE, read_by=_TRAINING, about="the held-out queries evaluated at each step", cli="use --limit N"
    )
    every: int = _setting(
        1,
        group=SCHEDULE,
        read_by=_TRAINING,
        about="evaluate at every N-th evaluation, or checkpoint save when the run has no evaluation",
    )
    baseline: bool = _setting(  # a PEFT model with its adapters disabled
        True,
        group=SCHEDULE,
        read_by=_TRAINING,
        about="evaluate the base model before the first step",
        cli="run `probdiff eval` without --adapter",
    )
    at_end: bool = _setting(
        True, group=SCHEDULE, read_by=_TRAINING, about="evaluate the last step if it would not be evaluated otherwise"
    )
    gather_params: bool = _setting(  # False: keep it sharded
        True, group=SCHEDULE, read_by=_TRAINING, about="ZeRO-3: gather the whole model once per evaluation"
    )
    fail_on_error: bool = _setting(
        False,
        group=SCHEDULE,
        read_by=_TRAINING,
        about="re-raise a failed evaluation instead of recording it and training on",
        cli="an error always stops the command",
    )
    wandb_table_rows: int = _setting(
        8,
        group=SCHEDULE,
        read_by=_TRAINING,
        about="records per evaluated step added to the W&B table",
        cli="every record goes to records.jsonl",
    )
    output_subdir: str = _setting(
        DEFAULT_SUBDIR,
        group=SCHEDULE,
        read_by=_TRAINING,
        about="history and records under <output_dir>/<output_subdir>",
        cli="use --out DIR",
    )
    progress: bool = _setting(
        False,
        group=SCHEDULE,
        read_by=_TRAINING,
        about="a progress bar on the main process",
        cli="the progress bar is always shown",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        problems = []
        if self.n_revisions < 1:
            problems.append(f"n_revisions={self.n_revisions}: needs at least 1 revision")
        if self.n_samples < 1:
            problems.append(f"n_samples={self.n_samples}: needs at least 1")
        for name in ("answer_top_p", "revision_top_p"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                problems.append(f"{name}={value}: must be in (0, 1]")
        for name in ("max_new_tokens", "max_prompt_tokens", "batch_size", "score_chunk_tokens", "every"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)}: must be positive")
        if self.n_queries is not None and self.n_queries < 1:
            problems.append(f"n_queries={self.n_queries}: must be positive (or None for all)")
        if self.vllm_mode not in VLLM_MODES:
            problems.append(f"vllm_mode={self.vllm_mode!r}: use one of {', '.join(VLLM_MODES)}")
        if self.vllm_weight_sync not in VLLM_WEIGHT_SYNCS:
            problems.append(f"vllm_weight_sync={self.vllm_weight_sync!r}: use one of {', '.join(VLLM_WEIGHT_SYNCS)}")
        if not 0.0 < self.vllm_gpu_memory_utilization <= 1.0:
            problems.append(f"vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization}: must be in (0, 1]")
        if self.vllm_server_timeout <= 0:
            problems.append(f"vllm_server_timeout={self.vllm_server_timeout}: must be positive")
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
        raise_if_problems("Invalid ProbDiff config", problems)

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
            raise ValueError(
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
        """A field's scope: group, read_by, and for a training-only setting `about` and `cli`."""
        return {f.name: f.metadata for f in dataclasses.fields(cls)}[name]


def raise_if_problems(what: str, problems: list[str], error: type[Exception] = ValueError) -> None:
    """One error listing every problem found by a validator (a user fixes them in one go), or nothing."""
    if problems:
        raise error(f"{what}: " + "; ".join(problems))


def did_you_mean(key: str, candidates: list[str]) -> str:
    """` (did you mean 'x'?)` for the closest candidate to a mistyped key, else ``."""
    import difflib

    leaf = key.split(".")[-1]
    by_leaf = {c.split(".")[-1]: c for c in candidates}
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.7) or [
        by_leaf[m] for m in difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.7)
    ]
    return f" (did you mean {close[0]!r}?)" if close else ""


def wrong_type_message(key: str, value: object, expected: object) -> str:
    """`wrong type for 'key': got 'abc', expected float`, without OmegaConf's internals."""
    return f"wrong type for {key!r}: got {value!r}, expected {expected}"


def apply_overrides(base, overrides: list[str], where: str = "overrides"):
    """`base` (a dataclass instance) with `key=value` overrides applied through OmegaConf's typed merge.

    An unknown key or a value of the wrong type raises a ValueError that names the key, the expected
    type or the closest valid key, and lists the valid ones.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, ValidationError

    cls = type(base)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"{where}: {item!r} is not key=value")
    schema = OmegaConf.structured(base)
    layer = OmegaConf.from_dotlist(list(overrides))
    try:
        merged = OmegaConf.merge(schema, layer)
    except ConfigKeyError as err:
        key = str(getattr(err, "full_key", None) or err)
        valid = cls.field_names()
        raise ValueError(
            f"{where}: unknown key {key!r}{did_you_mean(key, valid)}. Valid keys: {', '.join(valid)}"
        ) from None
    except ValidationError as err:
        key = str(getattr(err, "full_key", "?"))
        expected = {f.name: f.type for f in dataclasses.fields(cls)}.get(key.split(".")[0], "value")
        raise ValueError(f"{where}: {wrong_type_message(key, OmegaConf.select(layer, key), expected)}") from None
    return OmegaConf.to_object(merged)


def config_for_command(command: str, overrides: list[str]) -> ProbDiffConfig:
    """The settings of a CLI command (EVAL or SCORE) with its `key=value` overrides applied, after refusing
    every key the command would not read: accepted, it would be silently ignored."""
    reads = ProbDiffConfig.keys_read_by(command)
    problems = []
    for item in overrides:
        key = item.split("=", 1)[0].split(".", 1)[0].strip()  # answer_temperature_by_category.Writing=0.3
        if key in reads or "=" not in item:
            continue  # apply_overrides names a malformed item
        if key not in ProbDiffConfig.field_names():
            problems.append(f"unknown key {key!r}{did_you_mean(key, reads)}. Valid keys: {', '.join(reads)}")
        else:
            problems.append(_not_read(command, key))
    if problems:  # one per line: each names its key and what to do
        raise ValueError("settings: " + (problems[0] if len(problems) == 1 else "\n  " + "\n  ".join(problems)))
    return apply_overrides(ProbDiffConfig(), overrides, where="settings")


def _not_read(command: str, key: str) -> str:
    """Why `command` refuses `key`, and what to do instead."""
    scope = ProbDiffConfig.scope(key)
    if EVAL not in scope["read_by"]:  # the callback's schedule
        message = (
            f"{key} is a ProbDiffCallback setting ({scope['about']}); it applies during training only "
            f"(recipe `probdiff.{key}`)"
        )
        return message + (f"; for the CLI, {scope['cli']}" if scope["cli"] else "")
    # read by eval, not by score: sampling, revising, capping
    return (
        f"{key} is not read by `probdiff {command}`, which scores the texts in --pairs as they are and generates "
        "nothing; it applies to `probdiff eval` and during training"
    )
