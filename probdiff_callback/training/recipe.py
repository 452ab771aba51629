"""Training recipes: `recipes/<name>.yaml` and `key=value` overrides, read in layers, each overriding the one before,

    project defaults < recipes/<name>.yaml < recipes/models/<model>.yaml < presets.<model> in the recipe < key=value

The project's own keys (`model`, `lora.*`, `probdiff.*`, the data files, ...) are the fields of `RecipeKeys`; every
other key is a field of trl's `SFTConfig` and goes to `SFTConfig(**fields)` unchanged. Defaults are stated once:
`RecipeKeys` and `ProbDiffConfig` for the project's keys, `SFT_DEFAULTS` for SFTConfig's, `recipes/models/<model>.yaml`
for what a model preset needs in every recipe; a recipe states what differs. OmegaConf merges the layers and types
the result once against `RecipeKeys` and SFTConfig's own fields (`probdiff_callback.runtime.config_layers`); the
`probdiff` section goes to `ProbDiffConfig.from_values`, the CLI's way in, so a bad value gets the same message on both
paths. A refusal names the layer that set the key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import re
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from probdiff_callback.core.config import ConfigError, ProbDiffConfig
from probdiff_callback.generation.vllm_common import vllm_problem
from probdiff_callback.models import PRESETS
from probdiff_callback.runtime.config_layers import (
    SettingError,
    did_you_mean,
    layer_of,
    members,
    merge,
    parse_items,
    typed,
)
from probdiff_callback.training import PROJECT_ROOT

RECIPES_DIR = PROJECT_ROOT / "recipes"
MODELS_DIR = "models"  # recipes/models/<preset>.yaml: what a model preset needs in every recipe
Task = Literal["translation", "summarization", "blog", "alignbench"]
TASKS: tuple[str, ...] = typing.get_args(Task)

# The project's SFTConfig settings, the layer under every recipe. `logging_steps` and `seed` equal trl's defaults:
# stated so that a change of trl's cannot move a run, and so that RUN_DIR/recipe.yaml names them.
SFT_DEFAULTS: dict[str, Any] = {
    "learning_rate": 1e-4,
    "per_device_train_batch_size": 1,
    "per_device_eval_batch_size": 1,
    "gradient_accumulation_steps": 16,  # with N GPUs the effective batch is 16 * N: divide by N to keep 16
    "weight_decay": 0.1,
    "adam_beta2": 0.95,
    "warmup_steps": 0.01,  # a float below 1 is a share of the steps
    "lr_scheduler_type": "cosine",
    "bf16": True,
    "activation_checkpointing": True,  # trl's default, under transformers 5's name (the old one warns)
    "activation_checkpointing_kwargs": {"use_reentrant": False},
    "max_length": 2048,  # Qwen-14B-Chat's trained context
    "assistant_only_loss": True,  # loss on the assistant turns: the chat template's {% generation %} markers
    "logging_steps": 10,
    "eval_steps": 100,  # eval loss + ProbDiff every N optimizer steps
    "save_steps": 100,  # a multiple of eval_steps: every checkpoint has a ProbDiff score to be selected by
    "eval_on_start": True,  # the eval loss of the base model, beside the ProbDiff baseline
    "logging_first_step": True,
    "seed": 42,  # also draws the eval-loss subset (max_eval_samples)
    # The Trainer tracks (and keeps) the best checkpoint by it: the confidence of the checkpoints the run's own
    # measures do not call damaged (the selection study, docs/agreement.md: fewer damaged picks than any other way)
    "metric_for_best_model": "probdiff_guarded",
    "report_to": "wandb",  # offline by itself when not logged in; wandb, tensorboard or none, a list or a,b
    "ddp_find_unused_parameters": False,  # every trainable weight (adapters or all) gets a gradient each step
}
# Set by sft_config: ProbDiff runs at the evaluations, and checkpoints are saved at evaluated steps.
FIXED = {"eval_strategy": "steps", "save_strategy": "steps"}
# Names that SFTConfig no longer has, or keeps only as deprecated aliases that the new name silently overrides.
RENAMED = {
    "max_seq_length": "max_length",
    "gradient_checkpointing": "activation_checkpointing",
    "gradient_checkpointing_kwargs": "activation_checkpointing_kwargs",
    "warmup_ratio": "warmup_steps",
}
SFTCONFIG_DOCS = "https://huggingface.co/docs/trl/sft_trainer#trl.SFTConfig"
# transformers 5.23 named gradient_checkpointing* activation_checkpointing*; the project takes >= 5.17, the range
# vLLM's newer releases and the GPU device's image (5.17) sit in. Recipes, docs and RUN_DIR/recipe.yaml write the new
# names; under an older transformers they go to SFTConfig under the old ones (the same settings: the flag, its
# kwargs). `installed_fields` and `as_installed` are the one place that maps them.
CHECKPOINTING_BEFORE_5_23 = {
    "activation_checkpointing": "gradient_checkpointing",
    "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs",
}


class RecipeError(ConfigError):
    """A recipe or override that cannot be used; the message says which key and what is valid."""


def _key(default=dataclasses.MISSING, *, help: str, **kw):
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class LoraArgs:
    enabled: bool = _key(True, help="false: train all weights (full fine-tuning; set learning_rate too)")
    r: int = _key(16, help="the adapters' rank")
    alpha: int = _key(32, help="LoRA's scaling numerator (scale = alpha / r)")
    dropout: float = _key(0.05, help="dropout on the adapters' input")
    target_modules: list[str] = _key(
        help="module names or `all-linear` (every linear layer but the LM head)",
        default_factory=lambda: ["all-linear"],
    )


@dataclass
class RecipeKeys:
    """The project's own keys; any other key of a recipe is an SFTConfig field."""

    recipe: str = _key("", help="set from recipe=NAME (a file in recipes/, or a path to a .yaml file)")
    description: str = _key("", help="one line on the task and its data")
    task: Task | None = _key(
        None,
        help="translation, summarization, blog or alignbench: data from data/processed/<task>, data/samples/<task>",
    )
    model: str = _key(
        "qwen-14b-chat", help="a preset (tiny, smollm2, qwen-14b-chat, qwen1.5-14b-chat), a directory or a hub id"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _key(
        "bfloat16", help="weights as loaded: auto, float32, bfloat16, float16"
    )
    attn_implementation: str = _key("sdpa", help="sdpa, eager, flash_attention_2 (where flash-attn is installed)")
    quantization: Literal["none", "4bit"] = _key("none", help="none, 4bit (QLoRA: bitsandbytes NF4, CUDA only)")
    lora: LoraArgs = _key(help="the adapters: `lora.r`, `lora.alpha`, ... (below)", default_factory=LoraArgs)
    train_file: str | None = _key(None, help="null: data/processed/<task>/train.jsonl")
    heldout_file: str | None = _key(
        None, help="null: data/processed/<task>/heldout.jsonl (the eval loss and the ProbDiff queries)"
    )
    samples_fallback: bool = _key(True, help="the recipe's prepared data missing: train on data/samples/<task>/")
    max_eval_samples: int | None = _key(
        200, help="held-out conversations for the eval loss (a fixed subset); null: all"
    )
    probdiff: ProbDiffConfig = _key(
        help="the metric, and when and on how many queries it runs: `probdiff.<key>` (the ProbDiff settings, below)",
        default_factory=ProbDiffConfig,
    )
    threads: int | None = _key(None, help="torch CPU threads per process; null: the free cores divided among processes")
    resume: str | None = _key(None, help="true: the run's latest complete checkpoint; a path: that checkpoint")
    overwrite: bool = _key(False, help="start afresh in a run directory that already has checkpoints")
    wandb_project: str | None = _key(None, help="null: probdiff-<recipe>")
    wandb_entity: str | None = _key(None, help="null: your default entity")
    presets: dict[str, Any] = _key(
        help="model preset -> keys applied when model=<preset>, over recipes/models/<preset>.yaml", default_factory=dict
    )


@dataclass
class Recipe(RecipeKeys):
    training: dict[str, Any] = field(default_factory=dict)  # the SFTConfig keys: project defaults, then the layers
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)  # SFTConfig key -> its layer

    def setting(self, key: str) -> Any:
        """An SFTConfig key as the run will have it: the recipe's value, else SFTConfig's default."""
        SFTConfig = sft_config_class()
        if key in self.training:
            return self.training[key]
        spec = {f.name: f for f in dataclasses.fields(SFTConfig)}[next(iter(as_installed({key: None})))]
        return spec.default_factory() if spec.default is dataclasses.MISSING else spec.default  # type: ignore[misc]

    def project_dict(self) -> dict:
        values = dataclasses.asdict(self)
        return {name: values[name] for name in _fields(RecipeKeys)}

    def to_dict(self) -> dict:
        """Both kinds of keys in one mapping, as a recipe file writes them."""
        return {**self.project_dict(), **self.training}


# --- keys and types -------------------------------------------------------------------------------
@functools.cache
def _fields(cls: type) -> dict[str, Any]:
    """The fields a recipe may set on `cls` (RecipeKeys, a section such as LoraArgs, SFTConfig) and their types, under
    the names a recipe writes (`installed_fields`)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}
    return {written: fields[name] for written, name in installed_fields(fields).items() if written not in RENAMED}


def installed_fields(fields) -> dict[str, str]:
    """The names a recipe writes -> the installed SFTConfig's (identical but for activation checkpointing before
    transformers 5.23), for the names `fields` has."""
    names = {name: name for name in fields}
    for written, old in CHECKPOINTING_BEFORE_5_23.items():
        if written not in names and old in names:
            names[written] = old
            del names[old]
    return names


def as_installed(settings: Mapping[str, Any]) -> dict[str, Any]:
    """SFTConfig keyword arguments under the installed SFTConfig's names (see `installed_fields`)."""
    names = installed_fields({f.name for f in dataclasses.fields(sft_config_class())})
    return {names.get(key, key): value for key, value in settings.items()}


def sft_fields() -> dict[str, Any]:
    return _fields(sft_config_class())


def sft_config_class() -> type:
    """trl's SFTConfig; inside `sft_config_stand_in`, its stand-in (sft_config_cache.py: the same fields, types
    and defaults, without importing trl, transformers and torch)."""
    if _STAND_INS:
        return _STAND_INS[-1]
    from trl import SFTConfig

    return SFTConfig


_STAND_INS: list[type] = []  # while the settings are checked before the imports (precheck.py)


@contextlib.contextmanager
def sft_config_stand_in(stand_in: type) -> Iterator[None]:
    """Recipes loaded meanwhile are typed against `stand_in` for SFTConfig; the schema made of it goes with it."""
    _STAND_INS.append(stand_in)
    _schema.cache_clear()
    try:
        yield
    finally:
        _STAND_INS.pop()
        _schema.cache_clear()


@functools.cache
def _schema() -> type:
    """The dataclass OmegaConf types a recipe by: SFTConfig's fields as a recipe writes them (`_as_written`), and the
    project's own keys, whose `probdiff` section is a mapping here: ProbDiffConfig checks it itself."""
    SFTConfig = sft_config_class()
    own, sft = _fields(RecipeKeys), _fields(SFTConfig)
    specs = {f.name: f for f in (*dataclasses.fields(SFTConfig), *dataclasses.fields(RecipeKeys))}
    specs |= {written: specs[name] for written, name in installed_fields(specs).items()}
    fields = [
        (name, _as_written(hint), _schema_field(specs[name], hint)) for name, hint in sft.items() if name not in own
    ]
    fields += [(name, dict[str, Any] if hint is ProbDiffConfig else hint, _schema_field(specs[name], hint))
               for name, hint in own.items()]  # fmt: skip
    return dataclasses.make_dataclass("RecipeSchema", fields)


def _as_written(hint: Any) -> Any:
    """An SFTConfig field's type for OmegaConf: an enumeration (`SchedulerType | str`) as a Literal of its values, so
    that a misspelt one stops; a float as int or float, so that `eval_steps: 10` stays a count (a float below 1 is a
    share of the steps)."""
    types = members(hint)
    choices = tuple(choice.value for member in types if isinstance(member, enum.EnumMeta) for choice in member)
    if choices:
        types = (Literal[choices], *(t for t in types if t is type(None)))  # type: ignore[valid-type]
    elif float in types:
        types = (int, *types)
    return typing.Union[types] if len(types) > 1 else types[0]  # noqa: UP007 (a tuple of types)


def _schema_field(spec: dataclasses.Field, declared: Any) -> Any:
    """A schema field with `spec`'s default, and the type its owner declares, for messages."""
    metadata = {"declared": declared}
    if declared is ProbDiffConfig:
        return field(default_factory=dict, metadata=metadata)
    if spec.default_factory is not dataclasses.MISSING:
        return field(default_factory=spec.default_factory, metadata=metadata)
    default = spec.default.value if isinstance(spec.default, enum.Enum) else spec.default  # a Literal's value
    return field(default=default, metadata=metadata)


def _resolved(layers: list[tuple[str, dict]]) -> dict[str, Any]:
    """The layers merged and typed; a refusal names the key and the layer that set it."""
    try:
        values = typed(_schema(), merge([layer for _, layer in layers]))
    except SettingError as err:
        where = layer_of(layers, err.key)
        raise (_key_error(err.key, where) if err.unknown else RecipeError(f"{where}: {err}")) from None
    if "probdiff" in values:
        try:
            values["probdiff"] = ProbDiffConfig.from_values(
                values["probdiff"], where=lambda key: layer_of(layers, f"probdiff.{key}")
            )
        except ConfigError as err:
            raise RecipeError(str(err)) from None
    if "lora" in values:
        values["lora"] = LoraArgs(**values["lora"])
    return values


def _key_error(key: str, where: str) -> RecipeError:
    parts, own = key.split("."), _fields(RecipeKeys)
    if parts[0] == "callback":
        return RecipeError(
            f"{where}: the `callback` section is now part of `probdiff`: write probdiff.<key> (e.g. probdiff.n_queries)"
        )
    if key in RENAMED:
        return RecipeError(f"{where}: {key!r} is SFTConfig's {RENAMED[key]!r}: write {RENAMED[key]}")
    nested = [f"{name}.{k}" for name, hint in own.items() if dataclasses.is_dataclass(hint) for k in _fields(hint)]
    unknown = f"{where}: unknown key {key!r}{did_you_mean(key, [*own, *nested, *sft_fields()])}"
    if len(parts) == 1:
        return RecipeError(
            f"{unknown}. Valid keys: {', '.join(own)}, and any field of trl.SFTConfig ({SFTCONFIG_DOCS})"
        )
    return RecipeError(f"{unknown}. Valid keys in {parts[0]}: {', '.join(_fields(own[parts[0]]))}")


# --- loading ------------------------------------------------------------------------------------
def available_recipes(directory: Path = RECIPES_DIR) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.yaml"))


def _recipe_path(name: str | None, directory: Path) -> Path:
    """The file `recipe=NAME` names: recipes/NAME.yaml, or a path to a .yaml file."""
    recipes = f"Recipes: {', '.join(available_recipes(directory)) or '(none)'} (files in {directory})"
    if not name:
        raise RecipeError(f"give recipe=NAME. {recipes}, or a path to a .yaml file; e.g. recipe=blog model=tiny")
    if name.endswith((".yaml", ".yml")):
        if not Path(name).is_file():
            raise RecipeError(f"recipe={name}: no such file. {recipes}")
        return Path(name)
    path = directory / f"{name}.yaml"
    if not path.is_file():
        raise RecipeError(f"recipe={name!r} is not a recipe{did_you_mean(name, available_recipes(directory))}. "
                          f"{recipes}, or a path to a .yaml file")  # fmt: skip
    return path


def _read_yaml(path: Path) -> dict:
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:  # OmegaConf's YAML reads 1e-4 as a number, where PyYAML's reads text
        body = OmegaConf.to_container(OmegaConf.load(path))
    except (yaml.YAMLError, ValueError, OmegaConfBaseException) as err:
        raise RecipeError(f"{path}: not a valid YAML mapping ({str(err).splitlines()[0]})") from None
    if not isinstance(body, dict):
        raise RecipeError(f"{path}: expected a mapping of keys, got {type(body).__name__}")
    return body


def parse_overrides(args: list[str]) -> tuple[str | None, list[str]]:
    """(recipe name, the other key=value overrides) from command-line arguments."""
    name, overrides = None, []
    for arg in args:
        key, equals, value = arg.partition("=")
        if not (key and equals):
            raise RecipeError(f"{arg!r} is not key=value (e.g. recipe=blog model=tiny learning_rate=1e-4)")
        if key.lstrip("+") == "recipe":
            name = value
        else:
            overrides.append(arg)
    return name, overrides


def load_recipe(args: list[str], directory: Path = RECIPES_DIR) -> Recipe:
    """The validated recipe for `recipe=NAME key=value ...`."""
    name, overrides = parse_overrides(args)
    path = _recipe_path(name, directory)
    try:
        command_line = parse_items(overrides, "command line")
    except SettingError as err:
        raise RecipeError(str(err)) from None
    layers = [("project defaults", SFT_DEFAULTS), (str(path), _read_yaml(path)), ("command line", command_line)]
    chosen = merge([layer for _, layer in layers])
    model, presets = str(chosen.get("model", RecipeKeys.model)), chosen.get("presets")
    model_file = directory / MODELS_DIR / f"{model}.yaml"
    preset = presets.get(model) if isinstance(presets, Mapping) else None  # presets of another type: refused below
    for where, layer in ((str(model_file), _read_yaml(model_file) if model_file.is_file() else None),
                         (f"{path} presets.{model}", preset)):  # fmt: skip
        if layer is not None:  # between the YAML and the command line, in this order
            if not isinstance(layer, dict) or {"model", "presets"} & set(layer):
                raise RecipeError(f"{where}: must be a mapping of keys other than `model` and `presets`")
            layers.insert(-1, (where, layer))
    values = _resolved(layers)
    own = {key: values.pop(key) for key in list(values) if key in _fields(RecipeKeys)}
    sources = {key: where for where, layer in layers for key in layer}  # the last layer that set each key
    recipe = Recipe(**own, training=values, sources={key: sources[key] for key in values})
    recipe.recipe = Path(name).stem
    # Defaults that follow from the task and the name, written out so that RUN_DIR/recipe.yaml names them
    recipe.train_file = recipe.train_file or default_data_file(recipe.task, "train")
    recipe.heldout_file = recipe.heldout_file or default_data_file(recipe.task, "heldout")
    recipe.wandb_project = recipe.wandb_project or f"probdiff-{recipe.recipe}"
    validate(recipe)
    return recipe


def default_data_file(task: str, split: str) -> str:
    """The recipe's own data (`python data/prepare.py <task>` writes it): the only file `samples_fallback` stands in
    for; a file the user names must exist."""
    return f"data/processed/{task}/{split}.jsonl"


# --- validation -----------------------------------------------------------------------------------
def report_to_values(value: Any) -> list[str]:
    """`report_to` as a list of names: it may be a comma-separated string or a list."""
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else []
    return [str(item).strip() for item in items if str(item).strip()]


def report_to_list(recipe: Recipe) -> list[str]:
    """The integrations to report to; none for `none`."""
    reports = report_to_values(recipe.setting("report_to"))
    return [] if reports == ["none"] else reports


def validate(recipe: Recipe) -> None:
    """What the project needs beyond the types and SFTConfig's own checks; raises RecipeError listing every
    problem."""
    problems, value, lora, four_bit = [], recipe.setting, recipe.lora, recipe.quantization == "4bit"
    if recipe.task is None:
        problems.append(f"task: not set; a recipe names its task ({', '.join(TASKS)})")
    if four_bit and not lora.enabled:
        problems.append("quantization=4bit trains adapters on frozen 4-bit weights: it needs lora.enabled=true")
    if four_bit and recipe.model in ("tiny", "smollm2"):
        problems.append(f"quantization=4bit is for the GPU presets; model={recipe.model} runs in fp32 on the CPU")
    if lora.enabled and (lora.r < 1 or not lora.target_modules):
        problems.append("lora: r must be positive and target_modules non-empty")
    if recipe.threads is not None and recipe.threads < 1:
        problems.append(f"threads={recipe.threads}: must be positive (or null)")
    if unknown_presets := sorted(set(recipe.presets) - set(PRESETS)):
        problems.append(f"presets: {', '.join(unknown_presets)} are not model presets ({', '.join(PRESETS)})")
    for key, fixed in FIXED.items():
        if recipe.training.get(key, fixed) != fixed:
            problems.append(f"{key}={value(key)!r}: train/sft.py sets {key}={fixed} (ProbDiff runs at evaluations)")
    counts = ("eval_steps", "save_steps", "logging_steps", "per_device_train_batch_size", "per_device_eval_batch_size",
              "gradient_accumulation_steps", "max_length")  # fmt: skip
    problems += [f"{key}={value(key)}: must be positive" for key in counts
                 if (value(key) < 1 if value(key) is not None else key != "max_length")]  # fmt: skip
    if value("learning_rate") <= 0:
        problems.append(f"learning_rate={value('learning_rate')}: must be positive")
    if value("max_steps") <= 0 and value("num_train_epochs") <= 0:
        problems.append("set num_train_epochs > 0 or max_steps > 0")
    evals, saves = value("eval_steps"), value("save_steps")
    if evals is not None and saves is not None and min(evals, saves) >= 1 and saves % evals:
        problems.append(
            f"save_steps={saves} must be a multiple of eval_steps={evals}, "
            "so every checkpoint has a ProbDiff score to be selected by"
        )
    if engine := vllm_problem(recipe.probdiff):
        problems.append(f"probdiff.{engine}")
    if selection := recipe.probdiff.selection_problem(value("metric_for_best_model")):
        problems.append(selection)
    reports = report_to_values(value("report_to"))
    if not reports or ("none" in reports and len(reports) > 1):
        problems.append(f"report_to={value('report_to')!r}: give `none` or integrations such as wandb, tensorboard")
    if problems:
        raise RecipeError(f"recipe {recipe.recipe!r}: " + "; ".join(problems))


def sft_config(
    recipe: Recipe,
    run_dir: Path,
    run_name: str | None = None,
    report_to: list[str] | None = None,
    resuming: bool = False,
):
    """The run's `trl.SFTConfig`: the recipe's SFTConfig keys, with the run directory, W&B run name and integrations.
    Build it before the model loads, so that DeepSpeed ZeRO-3 can partition the weights while they load, and after
    the model files are made: it starts the distributed state. SFTConfig's own checks stop like the recipe's."""
    import torch
    from trl import SFTConfig

    metric, settings = recipe.training.get("metric_for_best_model"), recipe.training
    derived = {
        "use_cpu": not torch.cuda.is_available(),
        "greater_is_better": None if metric is None else not metric.endswith("loss"),
    }
    reports = report_to_list(recipe) if report_to is None else report_to
    run = {"output_dir": str(run_dir), "run_name": run_name or f"{recipe.recipe}/{run_dir.name}"}
    if resuming:  # the checkpoint's step was evaluated before it was saved: evaluating it again logs it twice
        run["eval_on_start"] = False
    try:
        return SFTConfig(**as_installed({**derived, **settings, **FIXED, **run, "report_to": reports or "none"}))
    except ValueError as err:
        named = [
            f"{k}={v!r} ({recipe.sources.get(k)})" for k, v in settings.items() if re.search(rf"\b{k}\b", str(err))
        ]
        raise RecipeError(f"SFTConfig rejects {', '.join(named) or 'the recipe'}: {err}") from None
