"""Training recipes: the typed schema of `recipes/<name>.yaml`, loading with `key=value` overrides,
validation, and the small helpers `train/sft.py` calls (threads, W&B, run directory, resume, data).

A recipe is read in four layers, each overriding the one before:

    schema defaults  <  recipes/<name>.yaml  <  presets.<model> in that YAML  <  command-line key=value

`model=...` picks the preset layer: a recipe's `presets:` mapping holds per-model settings (e.g. fp32,
short generations and a small batch for `model=tiny`). Unknown keys and wrong types stop with a message
that names the key and lists the valid ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from probdiff_callback.config import (
    ProbDiffConfig,
    did_you_mean,
    raise_if_problems,
    wrong_type_message,
)
from probdiff_callback.io import DataFileError, Query, load_queries, read_rows
from probdiff_callback.models import PRESETS
from probdiff_callback.qwen_v1 import QWEN2_LORA_TARGET_MODULES

PROJECT_ROOT = Path(__file__).resolve().parents[1]
RECIPES_DIR = PROJECT_ROOT / "recipes"
PROCESSED_DIR = PROJECT_ROOT / "data" / "processed"
SAMPLES_DIR = PROJECT_ROOT / "data" / "samples"
RUNS_DIR = Path("runs")
TASKS = ("translation", "summarization", "blog", "alignbench")
QUANTIZATIONS = ("none", "4bit")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Settings that name or steer a run rather than define what is trained: left out of the run name's hash,
# so `resume=true` or `report_to=none` finds the same run directory.
RUN_LEVEL_KEYS = (
    "recipe", "output_dir", "run_name", "resume", "overwrite", "report_to", "wandb_project", "wandb_entity",
    "push_to_hub", "hub_model_id", "threads", "presets", "description",
)


class RecipeError(ValueError):
    """A recipe or override that cannot be used; the message says which key and what is valid."""


@dataclass
class LoraArgs:
    enabled: bool = True  # false: train all weights (no adapters)
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: list(QWEN2_LORA_TARGET_MODULES))


@dataclass
class Recipe:
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
    max_seq_length: int = 2048
    max_eval_samples: int | None = 200  # held-out conversations for the eval loss (a fixed subset); null: all
    # --- training (trl.SFTConfig) ---
    learning_rate: float = 1e-4
    num_train_epochs: float = 3.0
    max_steps: int = -1  # > 0 overrides num_train_epochs
    per_device_train_batch_size: int = 1
    per_device_eval_batch_size: int = 1
    gradient_accumulation_steps: int = 16
    weight_decay: float = 0.1
    adam_beta2: float = 0.95
    warmup_ratio: float = 0.01
    lr_scheduler_type: str = "cosine"
    max_grad_norm: float = 1.0
    bf16: bool = True
    gradient_checkpointing: bool = True
    eval_steps: int = 100  # eval loss + ProbDiff every N optimizer steps
    save_steps: int = 100  # a checkpoint every N steps (a multiple of eval_steps: every checkpoint has a score)
    save_total_limit: int | None = None  # keep the N newest checkpoints (the best one is always kept)
    logging_steps: int = 10
    seed: int = 42
    dataloader_num_workers: int = 0
    threads: int | None = None  # torch CPU threads per process; null: the cores divided among local processes
    # --- ProbDiff ---
    probdiff: ProbDiffConfig = field(default_factory=ProbDiffConfig)  # the metric, when and on how many queries
    metric_for_best_model: str = "probdiff_confidence"
    # --- run ---
    output_dir: str | None = None  # default runs/<recipe>/<run_name>
    run_name: str | None = None  # default <model>-<hash of the training settings>
    resume: str | None = None  # true: the run's latest checkpoint; a path: that checkpoint
    overwrite: bool = False  # start afresh in a run directory that already has checkpoints
    report_to: str = "wandb"  # wandb | tensorboard | none | a comma-separated list
    wandb_project: str | None = None  # default probdiff-<recipe>
    wandb_entity: str | None = None
    push_to_hub: bool = False
    hub_model_id: str | None = None
    presets: dict[str, Any] = field(default_factory=dict)  # model preset -> settings applied when model=<preset>

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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


def _section_class(cls: type, parts: list[str]) -> type | None:
    """The dataclass at a dotted path of the schema, or None past a free-form mapping."""
    for part in parts:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields or not isinstance(fields[part].default_factory, type):  # type: ignore[arg-type]
            return None
        cls = fields[part].default_factory  # type: ignore[assignment]
        if not dataclasses.is_dataclass(cls):
            return None
    return cls


def _schema_keys(cls: type = Recipe, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, nested sections included (`probdiff.delta`)."""
    keys = []
    for f in dataclasses.fields(cls):
        keys.append(prefix + f.name)
        section = f.default_factory if isinstance(f.default_factory, type) else None  # type: ignore[arg-type]
        if section is not None and dataclasses.is_dataclass(section):
            keys.extend(_schema_keys(section, f"{prefix}{f.name}."))
    return keys


def _key_error(full_key: str, where: str) -> RecipeError:
    parts = full_key.split(".")
    if parts[-1] == "callback":  # the section before the callback's options joined ProbDiffConfig
        return RecipeError(f"{where}: the `callback` section is now part of `probdiff`: write probdiff.<key> (e.g. probdiff.n_queries)")
    if parts and parts[0] == "presets" and len(parts) > 2:  # presets.<model>.<key>
        parts, prefix = parts[2:], ".".join(parts[:2]) + "."
    else:
        prefix = ""
    section = _section_class(Recipe, parts[:-1])
    valid = [f.name for f in dataclasses.fields(section)] if section is not None else []
    scope = ".".join(parts[:-1])
    hint = did_you_mean(".".join(parts), _schema_keys())
    return RecipeError(
        f"{where}: unknown key {full_key!r}{hint}. Valid keys{' in ' + prefix + scope if scope else ''}: "
        f"{', '.join(valid)}"
    )


def _merge(layers: list[tuple[str, Any]]):
    """Typed merge of OmegaConf layers onto the schema, with errors that name the key and the layer."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

    merged = OmegaConf.structured(Recipe)
    for where, layer in layers:
        try:
            merged = OmegaConf.merge(merged, layer)
        except ConfigKeyError as err:
            raise _key_error(str(getattr(err, "full_key", "") or err), where) from None
        except ValidationError as err:
            key = str(getattr(err, "full_key", "?"))
            section = _section_class(Recipe, key.split(".")[:-1]) or Recipe
            expected = {f.name: f.type for f in dataclasses.fields(section)}.get(key.split(".")[-1], "value")
            raise RecipeError(f"{where}: {wrong_type_message(key, OmegaConf.select(layer, key), expected)}") from None
        except OmegaConfBaseException as err:
            raise RecipeError(f"{where}: {str(err).splitlines()[0]}") from None
    return merged


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
    from omegaconf import OmegaConf

    name, overrides = parse_overrides(args)
    if not name:
        raise RecipeError(
            f"give recipe=NAME. Recipes: {', '.join(available_recipes(directory)) or '(none)'}; "
            "e.g. python train/sft.py recipe=blog model=tiny"
        )
    path = recipe_path(name, directory)
    try:
        body = OmegaConf.load(path)
    except Exception as err:
        raise RecipeError(f"{path}: not a valid YAML mapping ({str(err).splitlines()[0]})") from None
    if not OmegaConf.is_dict(body):
        raise RecipeError(f"{path}: expected a mapping of keys, got {type(body).__name__}")
    cli = OmegaConf.from_dotlist(overrides)
    layers: list[tuple[str, Any]] = [(str(path), body), ("command line", cli)]
    # Which model? Then its preset goes between the YAML and the command line.
    model = _merge(layers).model
    presets = OmegaConf.to_container(_merge(layers).presets)
    preset = presets.get(model) if isinstance(presets, dict) else None
    if preset is not None:
        if not isinstance(preset, dict):
            raise RecipeError(f"{path}: presets.{model} must be a mapping of keys")
        if "model" in preset or "presets" in preset:
            raise RecipeError(f"{path}: presets.{model} cannot set `model` or `presets`")
        layers.insert(1, (f"{path} presets.{model}", OmegaConf.create(preset)))
    recipe_obj: Recipe = OmegaConf.to_object(_merge(layers))  # type: ignore[assignment]
    recipe_obj.recipe = Path(name).stem
    validate(recipe_obj)
    return recipe_obj


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
    if recipe.quantization == "4bit" and recipe.model == "tiny":
        problems.append("quantization=4bit is for the GPU presets; model=tiny runs in fp32 on the CPU")
    if recipe.lora.enabled and (recipe.lora.r < 1 or not recipe.lora.target_modules):
        problems.append("lora: r must be positive and target_modules non-empty")
    for key in ("max_seq_length", "eval_steps", "save_steps", "logging_steps", "per_device_train_batch_size",
                "per_device_eval_batch_size", "gradient_accumulation_steps"):
        if getattr(recipe, key) < 1:
            problems.append(f"{key}={getattr(recipe, key)}: must be positive")
    if recipe.learning_rate <= 0:
        problems.append(f"learning_rate={recipe.learning_rate}: must be positive")
    if recipe.max_steps <= 0 and recipe.num_train_epochs <= 0:
        problems.append("set num_train_epochs > 0 or max_steps > 0")
    if recipe.save_steps % recipe.eval_steps:
        problems.append(
            f"save_steps={recipe.save_steps} must be a multiple of eval_steps={recipe.eval_steps}, "
            "so every checkpoint has a ProbDiff score to be selected by"
        )
    if recipe.threads is not None and recipe.threads < 1:
        problems.append(f"threads={recipe.threads}: must be positive (or null)")
    if not 0.0 <= recipe.warmup_ratio < 1.0:
        problems.append(f"warmup_ratio={recipe.warmup_ratio}: a share of the steps, in [0, 1)")
    metric = recipe.metric_for_best_model.removeprefix("eval_")
    if metric.startswith(("probdiff_", "ref_")) and recipe.probdiff.every != 1:
        problems.append(f"metric_for_best_model={recipe.metric_for_best_model} needs probdiff.every=1 (space evaluations with eval_steps)")
    reports = [r.strip() for r in recipe.report_to.split(",") if r.strip()]
    if not reports or ("none" in reports and len(reports) > 1):
        problems.append(f"report_to={recipe.report_to!r}: give `none` or integrations such as wandb, tensorboard")
    unknown_presets = sorted(set(recipe.presets) - set(PRESETS))
    if unknown_presets:
        problems.append(f"presets: {', '.join(unknown_presets)} are not model presets ({', '.join(PRESETS)})")
    raise_if_problems(f"recipe {recipe.recipe!r}", problems, RecipeError)


def report_to_list(recipe: Recipe) -> list[str]:
    reports = [r.strip() for r in recipe.report_to.split(",") if r.strip()]
    return [] if reports == ["none"] else reports


# --- environment ----------------------------------------------------------------------------------
LAUNCHERS = ("accelerate", "torchrun", "torch.distributed.run", "torch.distributed.launch")


def _launcher_environment() -> dict[str, str] | None:
    """The environment the launcher (`accelerate launch`, `torchrun`) itself was started with (the user's),
    read from /proc: the value a launcher hands its workers cannot tell a user's OMP_NUM_THREADS=1 from the
    launcher's own default."""
    pid = os.getppid()
    for _ in range(4):  # worker <- (torch elastic agent, same process as) accelerate launch / torchrun
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if any(name in cmdline for name in LAUNCHERS):
                raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)
            status = Path(f"/proc/{pid}/status").read_text()
            pid = int(re.search(r"^PPid:\s*(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
        except (OSError, AttributeError, ValueError):
            return None
        if pid <= 1:
            return None
    return None


def configure_threads(threads: int | None = None, environ: dict[str, str] | None = None, launcher_environ: dict[str, str] | None = None) -> tuple[int, str]:
    """Set torch's CPU thread count; returns (threads, why).

    `accelerate launch` (and `torchrun`) set OMP_NUM_THREADS=1 in their workers when the user did not set
    it, which halves CPU training speed. Unless the recipe (`threads=N`) or the user's own OMP_NUM_THREADS
    says otherwise, the process gets the cores it may run on divided among the local processes.
    """
    import torch

    environ = os.environ if environ is None else environ
    if threads is not None:
        torch.set_num_threads(threads)
        return threads, "threads= in the recipe"
    # set by every `accelerate launch` launcher / by torchrun's elastic agent
    under_launcher = "ACCELERATE_DYNAMO_BACKEND" in environ or "TORCHELASTIC_RUN_ID" in environ
    user_value = environ.get("OMP_NUM_THREADS")
    if user_value is not None:
        if under_launcher:
            launcher = _launcher_environment() if launcher_environ is None else launcher_environ
            # Unknown launcher environment: accelerate's own default is "1", anything else came from the user.
            injected = ("OMP_NUM_THREADS" not in launcher) if launcher is not None else user_value == "1"
        else:
            injected = False
        if not injected:
            return torch.get_num_threads(), f"OMP_NUM_THREADS={user_value} set by the user"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = int(environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    count = max(1, cores // max(local, 1))
    torch.set_num_threads(count)
    return count, f"{cores} cores / {local} local process{'es' if local > 1 else ''}"


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def wandb_logged_in(environ: dict[str, str] | None = None) -> bool:
    """An API key in WANDB_API_KEY or in the netrc file `wandb login` writes."""
    import netrc

    environ = os.environ if environ is None else environ
    if environ.get("WANDB_API_KEY"):
        return True
    host = environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].rstrip("/")
    try:
        path = environ.get("NETRC") or str(Path.home() / ".netrc")
        return Path(path).is_file() and netrc.netrc(path).authenticators(host) is not None
    except (netrc.NetrcParseError, OSError):
        return False


def setup_wandb(recipe: Recipe, run_dir: Path) -> str | None:
    """Environment for the Trainer's W&B integration: project per recipe, files in the run directory,
    offline when not logged in. Returns the `wandb sync` command for an offline run, else None."""
    if "wandb" not in report_to_list(recipe):
        return None
    if importlib.util.find_spec("wandb") is None:
        raise RecipeError("report_to includes wandb but wandb is not installed: pip install wandb, or report_to=none")
    os.environ.setdefault("WANDB_PROJECT", recipe.wandb_project or f"probdiff-{recipe.recipe}")
    if recipe.wandb_entity:
        os.environ["WANDB_ENTITY"] = recipe.wandb_entity
    os.environ.setdefault("WANDB_DIR", str(run_dir))
    os.environ.setdefault("WANDB_LOG_MODEL", "false")
    if os.environ.get("WANDB_MODE") is None and not wandb_logged_in():
        os.environ["WANDB_MODE"] = "offline"
    if os.environ.get("WANDB_MODE") in ("offline", "dryrun"):
        return f"wandb sync {Path(os.environ['WANDB_DIR']) / 'wandb' / 'offline-run-*'}"
    return None


# --- run directory and resume ---------------------------------------------------------------------
def model_tag(model: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model.rstrip("/")).name) or "model"


def default_run_name(recipe: Recipe) -> str:
    """`<model>-<hash>`: the same settings give the same name (and directory) on every rank and rerun."""
    settings = {k: v for k, v in recipe.to_dict().items() if k not in RUN_LEVEL_KEYS}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{model_tag(recipe.model)}-{digest}"


def checkpoints(run_dir: Path) -> list[Path]:
    found = [p for p in run_dir.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))


def resolve_run(recipe: Recipe) -> tuple[Path, str | None]:
    """(run directory, checkpoint to resume from or None), checking the directory can be used."""
    resume = recipe.resume
    resume_flag = None if resume is None else resume.strip().lower()
    checkpoint = None
    if resume_flag not in (None, "", "false", "true"):
        checkpoint = Path(resume)
        if not (checkpoint / "trainer_state.json").is_file():
            raise RecipeError(f"resume={resume}: not a training checkpoint (no trainer_state.json there)")
    if recipe.output_dir:
        run_dir = Path(recipe.output_dir)
    elif checkpoint is not None:
        run_dir = checkpoint.parent  # the checkpoint's own run goes on
    else:
        run_dir = RUNS_DIR / recipe.recipe / (recipe.run_name or default_run_name(recipe))
    existing = checkpoints(run_dir)
    if resume_flag == "true":
        if existing:
            checkpoint = existing[-1]
        else:
            print(f"resume=true: {run_dir} has no checkpoint yet; starting from step 0", flush=True)
    elif checkpoint is None and existing and not recipe.overwrite:
        raise RecipeError(
            f"{run_dir} already has checkpoints ({existing[-1].name} the latest). "
            "Continue it with resume=true, start afresh with overwrite=true, or choose another run_name="
        )
    return run_dir, None if checkpoint is None else str(checkpoint)


# --- data -------------------------------------------------------------------------------------------
def _resolve_path(path: str) -> Path:
    """A relative path is taken from the working directory, else from the project root."""
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists():
        return candidate
    return PROJECT_ROOT / candidate if (PROJECT_ROOT / candidate).exists() else candidate


def data_files(recipe: Recipe) -> tuple[Path, Path, list[str]]:
    """(train file, held-out file, notices): the prepared files, or the samples when they are missing
    and `samples_fallback` allows it."""
    notices = []
    chosen = []
    for split, configured in (("train", recipe.train_file), ("heldout", recipe.heldout_file)):
        path = _resolve_path(configured) if configured else PROCESSED_DIR / recipe.task / f"{split}.jsonl"
        if not path.is_file():
            sample = SAMPLES_DIR / recipe.task / f"{split}.jsonl"
            if recipe.samples_fallback and sample.is_file():
                notices.append(
                    f"{split} data: {path} not found; using the offline samples {sample} instead "
                    f"(prepare the real data with: python data/prepare.py {recipe.task})"
                )
                path = sample
            elif recipe.task == "alignbench" and split == "train":
                raise RecipeError(
                    f"AlignBench training data not found at {path}: run `python data/prepare.py alignbench`, which "
                    "downloads the paper's GPT-4-generated training set (alignbench/data/gpt_generate_train.json in "
                    "its repository) to data/processed/alignbench/train.jsonl; `--train FILE` takes your own "
                    "conversations instead; or set train_file=PATH. With model=tiny the recipe trains on "
                    f"{SAMPLES_DIR / 'alignbench' / 'train.jsonl'}."
                )
            else:
                raise RecipeError(
                    f"{split} data not found at {path}: run `python data/prepare.py {recipe.task}` "
                    f"or set {'train_file' if split == 'train' else 'heldout_file'}=PATH"
                )
        chosen.append(path)
    return chosen[0], chosen[1], notices


def read_conversations(path: Path) -> list[dict]:
    """Rows `{"id", "messages"}` of a prepared file; a row that is not a chat ending with the assistant
    stops with its file and line."""
    rows = []
    for index, (line, row) in enumerate(read_rows(path)):
        messages = row.get("messages")
        ok = (
            isinstance(messages, list)
            and len(messages) >= 2
            and all(isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), str) for m in messages)
            and messages[-1]["role"] == "assistant"
        )
        if not ok:
            raise DataFileError(
                f"{path}:{line}: expected `messages`: a list of {{role, content}} (roles system/user/assistant) "
                "ending with an assistant turn (see data/prepare.py)"
            )
        rows.append({"id": str(row.get("id", index)), "messages": [{"role": m["role"], "content": m["content"]} for m in messages]})
    return rows


def heldout_queries(path: Path) -> list[Query]:
    return load_queries(path)


def count_without_assistant_tokens(tokenizer, rows: list[dict], max_length: int) -> list[str]:
    """Ids of the rows that keep no assistant token after truncation to `max_length` (trl keeps the start
    and then drops such rows silently, so they are counted here before training)."""
    lost = []
    for row in rows:
        encoded = tokenizer.apply_chat_template(row["messages"], return_dict=True, return_assistant_tokens_mask=True, tokenize=True)
        if 1 not in encoded["assistant_masks"][:max_length]:
            lost.append(row["id"])
    return lost


def subset(rows: list, n: int | None, seed: int) -> list:
    """A fixed subset of `n` rows (in file order), or all."""
    import random

    if n is None or n >= len(rows):
        return rows
    keep = sorted(random.Random(seed).sample(range(len(rows)), n))
    return [rows[i] for i in keep]


# --- quantization ---------------------------------------------------------------------------------
def quantization_config(recipe: Recipe):
    """The bitsandbytes NF4 config for quantization=4bit, or None; a clear error where it cannot run."""
    if recipe.quantization == "none":
        return None
    import torch

    if not torch.cuda.is_available():
        raise RecipeError(
            "quantization=4bit (QLoRA) needs an NVIDIA GPU with CUDA and the bitsandbytes package "
            "(pip install 'probdiff[qlora]'); this machine has no CUDA device. Use quantization=none."
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise RecipeError("quantization=4bit (QLoRA) needs bitsandbytes: pip install 'probdiff[qlora]' (bitsandbytes>=0.45)")
    from transformers import BitsAndBytesConfig

    compute = torch.bfloat16 if recipe.bf16 else torch.float16
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute)


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(cell).rjust(width) for cell, width in zip(line, widths)) for line in [header, *rows]]
    return "\n".join(lines)


def pct(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{100 * value:.1f}%"


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
