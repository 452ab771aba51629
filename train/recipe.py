"""Training recipes: `recipes/<name>.yaml` read in layers, each overriding the one before,

    project defaults  <  recipes/<name>.yaml  <  presets.<model> in that YAML  <  command-line key=value

and validated. `model=...` picks the preset layer: a recipe's `presets:` mapping holds per-model settings (e.g. fp32,
short generations and a small batch for `model=tiny`).

A recipe holds two kinds of keys. The project's own (`model`, `lora.*`, `probdiff.*`, the data files, `presets`, ...)
are the fields of `RecipeKeys` below. Every other key is a field of trl's `SFTConfig` and goes to it unchanged,
typed by SFTConfig's own field types (training_arguments.py). Unknown keys and wrong types stop with a message that
names the key, the layer it came from and what is valid.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training_arguments import (
    RENAMED,
    SFT_DEFAULTS,
    SFTCONFIG_DOCS,
    report_to_values,
    setting,
    sft_schema,
    sft_type_hints,
    sft_type_name,
    training_problems,
)

from probdiff_callback.config import ProbDiffConfig, did_you_mean, raise_if_problems, wrong_type_message
from probdiff_callback.models import PRESETS

PROJECT_ROOT = Path(__file__).resolve().parents[1]
RECIPES_DIR = PROJECT_ROOT / "recipes"
TASKS = ("translation", "summarization", "blog", "alignbench")
QUANTIZATIONS = ("none", "4bit")
DTYPES = ("auto", "float32", "bfloat16", "float16")


class RecipeError(ValueError):
    """A recipe or override that cannot be used; the message says which key and what is valid."""


@dataclass
class LoraArgs:
    enabled: bool = True  # false: train all weights (no adapters)
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # or module names of the model


@dataclass
class RecipeKeys:
    """The project's own keys; any other key of a recipe is an SFTConfig field."""

    # --- what ---
    recipe: str = ""  # set from recipe=NAME
    description: str = ""
    task: str = ""  # translation | summarization | blog | alignbench: data/processed/<task>, data/samples/<task>
    # --- model ---
    model: str = "qwen-14b-chat"  # a preset (tiny, qwen-14b-chat, qwen1.5-14b-chat), a directory or a hub id
    dtype: str = "bfloat16"  # weights as loaded: auto | float32 | bfloat16 | float16
    attn_implementation: str = "sdpa"  # sdpa | eager | flash_attention_2
    quantization: str = "none"  # none | 4bit (QLoRA: bitsandbytes NF4, CUDA only)
    lora: LoraArgs = field(default_factory=LoraArgs)
    # --- data ---
    train_file: str | None = None  # default data/processed/<task>/train.jsonl
    heldout_file: str | None = None  # default data/processed/<task>/heldout.jsonl (eval loss and ProbDiff queries)
    samples_fallback: bool = True  # prepared data missing: use data/samples/<task>/ (and say so)
    max_eval_samples: int | None = 200  # held-out conversations for the eval loss (a fixed subset); null: all
    # --- ProbDiff: the metric, when and on how many queries ---
    probdiff: ProbDiffConfig = field(default_factory=ProbDiffConfig)
    # --- run ---
    threads: int | None = None  # torch CPU threads per process; null: the cores divided among local processes
    resume: str | None = None  # true: the run's latest checkpoint; a path: that checkpoint
    overwrite: bool = False  # start afresh in a run directory that already has checkpoints
    wandb_project: str | None = None  # default probdiff-<recipe>
    wandb_entity: str | None = None
    presets: dict[str, Any] = field(default_factory=dict)  # model preset -> settings applied when model=<preset>


@dataclass
class Recipe(RecipeKeys):
    training: dict[str, Any] = field(default_factory=dict)  # the SFTConfig keys: project defaults, then the layers

    def setting(self, key: str) -> Any:
        """An SFTConfig key as the run will have it: the recipe's value, else SFTConfig's default."""
        return setting(self.training, key)

    def project_dict(self) -> dict:
        values = dataclasses.asdict(self)
        return {f.name: values[f.name] for f in dataclasses.fields(RecipeKeys)}

    def to_dict(self) -> dict:
        """Both kinds of keys in one mapping, as a recipe file writes them."""
        return {**self.project_dict(), **self.training}


# --- loading ------------------------------------------------------------------------------------
def available_recipes(directory: Path = RECIPES_DIR) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.yaml"))


def recipe_path(name: str, directory: Path = RECIPES_DIR) -> Path:
    if name.endswith((".yaml", ".yml")):
        path = Path(name)
        if not path.is_file():
            raise RecipeError(f"recipe={name}: no such file")
        return path
    path = directory / f"{name}.yaml"
    if not path.is_file():
        raise RecipeError(
            f"recipe={name!r} is not a recipe. Recipes: {', '.join(available_recipes(directory)) or '(none)'} "
            f"(files in {directory}), or a path to a .yaml file"
        )
    return path


def _section_class(parts: list[str]) -> type | None:
    """The dataclass of the project's keys at a dotted path, or None past a free-form mapping."""
    cls: type = RecipeKeys
    for part in parts:
        spec = {f.name: f for f in dataclasses.fields(cls)}.get(part)
        section = spec.default_factory if spec is not None else None
        if not (isinstance(section, type) and dataclasses.is_dataclass(section)):
            return None
        cls = section
    return cls


def _project_keys(cls: type = RecipeKeys, prefix: str = "") -> list[str]:
    """Every dotted key of the project's schema, nested sections included (`probdiff.delta`)."""
    keys = []
    for f in dataclasses.fields(cls):
        keys.append(prefix + f.name)
        if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            keys.extend(_project_keys(f.default_factory, f"{prefix}{f.name}."))
    return keys


def _key_error(full_key: str, where: str) -> RecipeError:
    parts = full_key.split(".")
    prefix = ""
    if parts[0] == "presets" and len(parts) > 2:  # presets.<model>.<key>
        parts, prefix = parts[2:], ".".join(parts[:2]) + "."
    if parts[-1] == "callback":
        return RecipeError(
            f"{where}: the `callback` section is now part of `probdiff`: write probdiff.<key> (e.g. probdiff.n_queries)"
        )
    if len(parts) == 1 and parts[0] in RENAMED:
        return RecipeError(
            f"{where}: {full_key!r} is SFTConfig's {RENAMED[parts[0]]!r}: write {prefix}{RENAMED[parts[0]]}"
        )
    hint = did_you_mean(".".join(parts), _project_keys() + list(sft_type_hints()))
    scope = ".".join(parts[:-1])
    if not scope:
        valid = ", ".join(f.name for f in dataclasses.fields(RecipeKeys))
        return RecipeError(
            f"{where}: unknown key {full_key!r}{hint}. Valid keys: {valid}, and any field of trl.SFTConfig "
            f"({SFTCONFIG_DOCS})"
        )
    section = _section_class(parts[:-1])
    valid = ", ".join(f.name for f in dataclasses.fields(section)) if section is not None else ""
    return RecipeError(f"{where}: unknown key {full_key!r}{hint}. Valid keys in {prefix}{scope}: {valid}")


def _expected_type(key: str) -> str:
    parts = key.split(".")
    if parts[0] in sft_type_hints():
        return sft_type_name(parts[0])
    section = _section_class(parts[:-1]) or RecipeKeys
    return str({f.name: f.type for f in dataclasses.fields(section)}.get(parts[-1], "value"))


def _merge(layers: list[tuple[str, Any]]):
    """(project keys, SFTConfig keys): each layer's keys merged onto their typed schema, with errors that name the
    key and the layer."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

    own_keys = {f.name for f in dataclasses.fields(RecipeKeys)}
    project, training = OmegaConf.structured(RecipeKeys), OmegaConf.structured(sft_schema())
    for where, layer in layers:
        unknown = [key for key in layer if key not in own_keys and key not in sft_type_hints()]
        if unknown:
            raise _key_error(str(unknown[0]), where)
        try:
            project = OmegaConf.merge(project, OmegaConf.masked_copy(layer, [k for k in layer if k in own_keys]))
            training = OmegaConf.merge(training, OmegaConf.masked_copy(layer, [k for k in layer if k not in own_keys]))
        except ConfigKeyError as err:
            raise _key_error(str(getattr(err, "full_key", "") or err), where) from None
        except ValidationError as err:
            key = str(getattr(err, "full_key", "?"))
            message = wrong_type_message(key, OmegaConf.select(layer, key), _expected_type(key))
            raise RecipeError(f"{where}: {message}") from None
        except OmegaConfBaseException as err:
            raise RecipeError(f"{where}: {str(err).splitlines()[0]}") from None
    return project, training


def parse_overrides(args: list[str]) -> tuple[str | None, list[str]]:
    """(recipe name, the other key=value overrides) from command-line arguments."""
    name, overrides = None, []
    for arg in args:
        if "=" not in arg or arg.startswith("="):
            raise RecipeError(f"{arg!r} is not key=value (e.g. recipe=blog model=tiny learning_rate=1e-4)")
        key, value = arg.split("=", 1)
        if key.lstrip("+") == "recipe":
            name = value
        else:
            overrides.append(arg)
    return name, overrides


def load_recipe(args: list[str], directory: Path = RECIPES_DIR) -> Recipe:
    """The validated recipe for `recipe=NAME key=value ...`."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    name, overrides = parse_overrides(args)
    if not name:
        raise RecipeError(
            f"give recipe=NAME. Recipes: {', '.join(available_recipes(directory)) or '(none)'}; "
            "e.g. python train/sft.py recipe=blog model=tiny"
        )
    path = recipe_path(name, directory)
    try:
        body = OmegaConf.load(path)
    except (yaml.YAMLError, ValueError, OmegaConfBaseException) as err:
        raise RecipeError(f"{path}: not a valid YAML mapping ({str(err).splitlines()[0]})") from None
    if not OmegaConf.is_dict(body):
        raise RecipeError(f"{path}: expected a mapping of keys, got {type(body).__name__}")
    layers = [
        ("project defaults", OmegaConf.create(SFT_DEFAULTS)),
        (str(path), body),
        ("command line", OmegaConf.from_dotlist(overrides)),
    ]
    # Which model? Then its preset goes between the YAML and the command line.
    project, _ = _merge(layers)
    preset = OmegaConf.to_container(project.presets).get(project.model)  # type: ignore[union-attr]
    if preset is not None:
        if not isinstance(preset, dict):
            raise RecipeError(f"{path}: presets.{project.model} must be a mapping of keys")
        if "model" in preset or "presets" in preset:
            raise RecipeError(f"{path}: presets.{project.model} cannot set `model` or `presets`")
        layers.insert(2, (f"{path} presets.{project.model}", OmegaConf.create(preset)))
    project, training = _merge(layers)
    keys: RecipeKeys = OmegaConf.to_object(project)  # type: ignore[assignment]
    given = OmegaConf.to_container(training, throw_on_missing=False)
    recipe = Recipe(
        **{f.name: getattr(keys, f.name) for f in dataclasses.fields(RecipeKeys)},
        training={key: value for key, value in given.items() if not OmegaConf.is_missing(training, key)},
    )
    recipe.recipe = Path(name).stem
    validate(recipe)
    return recipe


# --- validation -----------------------------------------------------------------------------------
def report_to_list(recipe: Recipe) -> list[str]:
    """The integrations to report to; none for `none`."""
    reports = report_to_values(recipe.setting("report_to"))
    return [] if reports == ["none"] else reports


def validate(recipe: Recipe) -> None:
    """Cross-field checks the types cannot express; raises RecipeError listing every problem."""
    problems = []
    if recipe.task not in TASKS:
        problems.append(f"task={recipe.task!r}: use one of {', '.join(TASKS)}")
    if recipe.quantization not in QUANTIZATIONS:
        problems.append(f"quantization={recipe.quantization!r}: use one of {', '.join(QUANTIZATIONS)}")
    if recipe.dtype not in DTYPES:
        problems.append(f"dtype={recipe.dtype!r}: use one of {', '.join(DTYPES)}")
    if recipe.quantization == "4bit" and not recipe.lora.enabled:
        problems.append("quantization=4bit trains adapters on frozen 4-bit weights: it needs lora.enabled=true")
    if recipe.quantization == "4bit" and recipe.model in ("tiny", "smollm2"):
        problems.append(f"quantization=4bit is for the GPU presets; model={recipe.model} runs in fp32 on the CPU")
    if recipe.lora.enabled and (recipe.lora.r < 1 or not recipe.lora.target_modules):
        problems.append("lora: r must be positive and target_modules non-empty")
    if recipe.threads is not None and recipe.threads < 1:
        problems.append(f"threads={recipe.threads}: must be positive (or null)")
    unknown_presets = sorted(set(recipe.presets) - set(PRESETS))
    if unknown_presets:
        problems.append(f"presets: {', '.join(unknown_presets)} are not model presets ({', '.join(PRESETS)})")
    problems += training_problems(recipe.training, recipe.probdiff.every)
    raise_if_problems(f"recipe {recipe.recipe!r}", problems, RecipeError)
