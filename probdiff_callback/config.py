"""The ProbDiff settings as one typed object (the metric, and when the callback runs it), with `key=value`
overrides that reject unknown keys."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

from probdiff_callback.history import DEFAULT_SUBDIR
from probdiff_callback.prompts import REFINEMENT_PROMPTS
from probdiff_callback.queries import (
    ALIGNBENCH,
    canonical_category,
    describe,
    unmatched_keys,
)


@dataclass
class ProbDiffConfig:
    # --- the metric (paper defaults: camera-ready version) ---
    delta: float = -0.05  # confident when d >= delta
    sweep: list[float] = field(default_factory=lambda: [0.0, -0.02, -0.05, -0.1])
    n_revisions: int = 1  # K: revise the last revision K times
    refinement_prompt: str = (
        "rewriter"  # rewriter | rewriter-translation | simple | a template with {instruction} and {response}
    )
    # None: the chat template's own default (for Qwen, the paper's "You are a helpful assistant.")
    system_prompt: str | None = None
    # --- sampling (the reference code's: generation_task/vllm_inference.py and vllm_modify.py) ---
    # Temperature only: the reference code samples with top_p 1 and top_k -1 (off), and its runs
    # produced the published tables. The submission version of the paper states top_p 0.8 for
    # answers and 0.9 for revisions (the camera-ready states none): answer_top_p=0.8 revision_top_p=0.9.
    answer_temperature: float = 0.7
    answer_top_p: float = 1.0
    # AlignBench's official settings, keyed by any name of a category (categories.py)
    answer_temperature_by_category: dict[str, float] = field(default_factory=dict)
    revision_temperature: float = 0.1
    revision_top_p: float = 1.0
    n_samples: int = 1  # average d over this many independent answer -> revise chains
    seed: int = 0
    # --- lengths and batching ---
    max_new_tokens: int = 512  # the reference code: 2,048 (AlignBench 1,024); answers cut here are flagged
    max_prompt_tokens: int = 2048  # longer queries are cut in the middle
    batch_size: int = 16
    score_chunk_tokens: int = 512  # positions per LM-head chunk when scoring
    # --- during training (ProbDiffCallback) ---
    n_queries: int | None = 64  # held-out queries evaluated each time (a fixed subset drawn with `seed`); None: all
    every: int = 1  # evaluate at every N-th evaluation (or checkpoint save when the run has no evaluation)
    baseline: bool = True  # evaluate before the first step (a PEFT model with its adapters disabled)
    at_end: bool = True  # evaluate the last step if it would not be evaluated otherwise
    gather_params: bool = True  # ZeRO-3: gather the whole model once per evaluation (False: keep it sharded)
    fail_on_error: bool = False  # re-raise an evaluation failure instead of recording it and training on
    wandb_table_rows: int = 8  # records per evaluated step added to the W&B table
    output_subdir: str = DEFAULT_SUBDIR  # history and records under <output_dir>/<output_subdir>
    progress: bool = False  # a progress bar on the main process

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
