"""Every recipe under every model preset loads and validates; the accelerate configs load as accelerate
configs; SFTConfig fields pass through to SFTConfig; errors name the key and list what is valid; threads, W&B and
run-directory helpers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from probdiff_callback.models import PRESETS
from probdiff_callback.training.recipe import (
    RECIPES_DIR,
    SFT_DEFAULTS,
    TASKS,
    Recipe,
    RecipeError,
    RecipeKeys,
    as_installed,
    available_recipes,
    load_recipe,
    sft_config,
)

TASK_RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))
MODEL_FILES = sorted((RECIPES_DIR / "models").glob("*.yaml"))
ACCELERATE_CONFIGS = sorted((RECIPES_DIR / "accelerate").glob("*.yaml"))


def test_every_task_has_a_recipe():
    assert sorted(p.stem for p in TASK_RECIPES) == sorted(TASKS)
    assert available_recipes() == sorted(TASKS)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("path", TASK_RECIPES, ids=lambda p: p.stem)
def test_recipe_loads_for_every_preset(path: Path, preset: str):
    recipe = load_recipe([f"recipe={path.stem}", f"model={preset}"])
    assert recipe.recipe == path.stem and recipe.task == path.stem and recipe.model == preset
    assert recipe.probdiff.delta == -0.05 and -0.02 in recipe.probdiff.sweep and recipe.probdiff.n_revisions == 1
    training = recipe.training
    assert training["metric_for_best_model"] == "probdiff_guarded"
    assert training["save_steps"] % training["eval_steps"] == 0
    assert recipe.lora.enabled and recipe.lora.target_modules == ["all-linear"]
    if preset == "tiny":
        assert recipe.dtype == "float32" and training["bf16"] is False and training["max_steps"] > 0
        # enough evaluations for a curve: a baseline plus at least four checkpoints
        assert training["max_steps"] // training["eval_steps"] >= 4 and recipe.probdiff.baseline
    elif preset == "smollm2":  # sized for 2 CPU cores: fp32, short sequences, a baseline and two checkpoints
        assert recipe.dtype == "float32" and training["bf16"] is False and training["max_length"] <= 512
        assert training["max_steps"] // training["eval_steps"] >= 2 and recipe.probdiff.baseline
    else:
        assert recipe.dtype == "bfloat16" and training["bf16"] and training["activation_checkpointing"]
        assert training["max_length"] == 2048


@pytest.mark.parametrize("path", TASK_RECIPES, ids=lambda p: p.stem)
def test_recipe_opens_with_purpose_and_launch_commands(path: Path):
    head = path.read_text().split("\n\n")[0]
    assert head.startswith("# ")
    assert f"train/sft.py recipe={path.stem}" in head
    assert "python train/sft.py --config_file recipes/accelerate/" in head
    assert "model=tiny" in head


def test_alignbench_category_temperatures():
    recipe = load_recipe(["recipe=alignbench"])
    temps = recipe.probdiff.answer_temperature_by_category
    assert sorted(temps) == sorted(
        ["Professional", "Mathematics", "Fundamental", "Logical", "Writing", "Chinese", "Roleplay", "Open-ended"]
    )
    assert {k for k, v in temps.items() if v == 0.7} == {"Writing", "Roleplay", "Open-ended"}
    assert {v for k, v in temps.items() if k not in ("Writing", "Roleplay", "Open-ended")} == {0.1}
    assert recipe.probdiff.answer_temperature_for("Mathematics") == 0.1


def test_translation_uses_the_translation_refinement_prompt():
    assert load_recipe(["recipe=translation"]).probdiff.refinement_prompt == "rewriter-translation"


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.stem)
def test_accelerate_configs_load(path: Path):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    config = load_config_from_file(str(path))
    assert path.read_text().startswith("# ")
    assert "python train/sft.py --config_file recipes/accelerate/" in path.read_text()
    assert config.num_processes >= 1 and config.mixed_precision == "bf16"
    if config.distributed_type == DistributedType.DEEPSPEED:
        assert config.deepspeed_config["zero_stage"] in (2, 3)
        if config.deepspeed_config["zero_stage"] == 3:
            assert config.deepspeed_config["zero3_save_16bit_model"] is True
    if config.num_machines > 1:
        assert config.main_process_ip and config.main_process_port


def test_accelerate_configs_cover_the_setups():
    from accelerate.commands.config.config_args import load_config_from_file

    kinds = set()
    for path in ACCELERATE_CONFIGS:
        config = load_config_from_file(str(path))
        ds = config.deepspeed_config or {}
        kinds.add(
            (
                str(config.distributed_type),
                ds.get("zero_stage"),
                ds.get("offload_param_device"),
                config.num_machines > 1,
            )
        )
    assert ("DistributedType.NO", None, None, False) in kinds
    assert ("DistributedType.MULTI_GPU", None, None, False) in kinds
    assert ("DistributedType.DEEPSPEED", 2, "none", False) in kinds
    assert ("DistributedType.DEEPSPEED", 3, "none", False) in kinds
    assert ("DistributedType.DEEPSPEED", 3, "cpu", False) in kinds
    assert any(multi for *_, multi in kinds)


# --- overrides and errors ----------------------------------------------------------------------------
def test_sftconfig_fields_reach_sftconfig_from_the_file_and_the_command_line(tmp_path):
    """Keys outside the project's schema are SFTConfig fields: none is copied by hand."""
    (tmp_path / "mine.yaml").write_text("task: blog\noptim: adafactor\npresets:\n  tiny:\n    adam_beta1: 0.8\n")
    recipe = load_recipe(["recipe=mine", "model=tiny", "adam_epsilon=1e-6", "max_steps=3"], directory=tmp_path)
    assert recipe.training["optim"] == "adafactor" and recipe.training["adam_epsilon"] == 1e-6
    args = sft_config(recipe, tmp_path / "run", "mine/run", report_to=[])
    assert args.optim == "adafactor" and args.adam_epsilon == 1e-6 and args.adam_beta1 == 0.8 and args.max_steps == 3
    # the project's defaults, and what the script sets itself
    assert args.learning_rate == 1e-4 and args.gradient_accumulation_steps == 16 and args.max_length == 2048
    assert args.eval_strategy == "steps" and args.save_strategy == "steps" and args.greater_is_better is True
    assert args.assistant_only_loss and args.eval_on_start and activation_checkpointing(args)
    assert args.output_dir == str(tmp_path / "run") and args.run_name == "mine/run" and args.report_to == []


def test_a_preset_sets_sftconfig_fields_for_its_model():
    args = sft_config(load_recipe(["recipe=blog", "model=tiny"]), Path("run"), report_to=[])
    assert args.max_length == 512 and args.learning_rate == 2e-3 and args.bf16 is False
    assert activation_checkpointing(args) is False and args.eval_steps == 4 and args.per_device_train_batch_size == 4
    assert args.run_name == "blog/run"  # the recipe's name and the run directory's
    assert load_recipe(["recipe=blog"]).training["max_length"] == 2048


def activation_checkpointing(args) -> bool:
    """SFTConfig's activation-checkpointing switch under the installed transformers' name for it."""
    (name,) = as_installed({"activation_checkpointing": None})
    return getattr(args, name)


def _leaves(mapping: dict, prefix: tuple = ()) -> list[tuple]:
    """The key paths of a nested mapping's values (`presets.tiny.lora.r` as a tuple)."""
    return [
        leaf
        for key, value in mapping.items()
        for leaf in (_leaves(value, (*prefix, key)) if isinstance(value, dict) and value else [(*prefix, key)])
    ]


def _without(mapping: dict, path: tuple) -> dict:
    if len(path) == 1:
        return {k: v for k, v in mapping.items() if k != path[0]}
    return {**mapping, path[0]: _without(mapping[path[0]], path[1:])}


def _resolved(directory: Path, recipe: str, model: str | None) -> dict | str:
    """The recipe as the run gets it, or why it cannot run (a key its other keys need was left out)."""
    try:
        resolved = load_recipe([f"recipe={recipe}", *([f"model={model}"] if model else [])], directory=directory)
        return {key: value for key, value in resolved.to_dict().items() if key != "presets"}
    except RecipeError as err:
        return str(err)


@pytest.mark.parametrize("path", TASK_RECIPES + MODEL_FILES, ids=lambda p: str(p.relative_to(RECIPES_DIR)))
def test_every_key_of_a_recipe_or_model_file_changes_the_run(path: Path, tmp_path):
    """A default is stated once: every key a recipe file (its body and its `presets.<model>`) or a model file
    (`recipes/models/<model>.yaml`) states must change some resolved recipe. One that the layers under it already
    give (the project defaults, the model file under a recipe's preset) would hide which settings are its own."""
    import shutil

    from omegaconf import OmegaConf

    shutil.copytree(RECIPES_DIR, tmp_path / "recipes")
    directory, copy = tmp_path / "recipes", tmp_path / "recipes" / path.relative_to(RECIPES_DIR)
    body = OmegaConf.to_container(OmegaConf.load(path))
    is_model_file = path.parent.name == "models"
    contexts = (
        [(recipe.stem, path.stem) for recipe in TASK_RECIPES]
        if is_model_file
        else [(path.stem, None), *((path.stem, model) for model in body.get("presets", {}))]
    )
    before = {context: _resolved(directory, *context) for context in contexts}
    repeated = []
    for leaf in _leaves({k: v for k, v in body.items() if k not in ("description", "task")}):
        copy.write_text(OmegaConf.to_yaml(_without(body, leaf)))
        presets = leaf[1] if leaf[0] == "presets" else None
        mine = [c for c in contexts if presets is None or c[1] == presets]
        if all(_resolved(directory, *context) == before[context] for context in mine):
            repeated.append(".".join(leaf))
    assert not repeated, f"{path.relative_to(RECIPES_DIR)} states what the layers under it already give: {repeated}"


def test_a_model_file_is_a_layer_between_the_recipe_and_its_preset(tmp_path):
    import shutil

    shutil.copytree(RECIPES_DIR, tmp_path / "recipes")
    directory = tmp_path / "recipes"
    (directory / "models" / "smollm2.yaml").write_text("learning_rate: 0.5\nmax_steps: 3\neval_steps: 1\n")
    recipe = load_recipe(["recipe=summarization", "model=smollm2"], directory=directory)
    assert recipe.training["learning_rate"] == 0.5  # the model file over the recipe's body and the project defaults
    assert recipe.training["max_steps"] == 40  # the recipe's presets.smollm2 over the model file
    assert recipe.sources["learning_rate"].endswith("models/smollm2.yaml")
    (directory / "models" / "smollm2.yaml").write_text("model: tiny\n")
    with pytest.raises(RecipeError, match=r"smollm2.yaml: must be a mapping of keys other than `model` and `presets`"):
        load_recipe(["recipe=blog", "model=smollm2"], directory=directory)


@pytest.mark.parametrize("path", TASK_RECIPES + MODEL_FILES, ids=lambda p: str(p.relative_to(RECIPES_DIR)))
def test_the_paths_a_recipe_header_names_exist(path: Path):
    import re

    root = RECIPES_DIR.parent
    named = set(re.findall(r"(?:train|recipes|data|probdiff_callback)/[\w/.<>-]+\.(?:py|yaml)", path.read_text()))
    named = {n.replace("<model>", "tiny").replace("<name>", "blog") for n in named}
    assert named, f"{path.name} names no file"
    missing = sorted(n for n in named if not (root / n).is_file())
    assert not missing, f"{path.name} names files that do not exist: {missing}"


def test_the_resolved_recipe_lists_the_defaults_it_applied():
    resolved = load_recipe(["recipe=blog"]).to_dict()
    blog = {"logging_steps": 5, "eval_steps": 10, "save_steps": 10}
    assert {key: resolved[key] for key in SFT_DEFAULTS} == {**SFT_DEFAULTS, **blog}
    assert resolved["lora"] == dataclasses.asdict(RecipeKeys().lora) and resolved["lora"]["r"] == 16
    assert resolved["probdiff"]["delta"] == -0.05 and resolved["probdiff"]["max_new_tokens"] == 768
    assert resolved["train_file"] == "data/processed/blog/train.jsonl" and resolved["wandb_project"] == "probdiff-blog"


def test_a_mapping_gains_keys_from_a_later_layer():
    recipe = load_recipe(["recipe=blog", "activation_checkpointing_kwargs.preserve_rng_state=false"])
    assert recipe.training["activation_checkpointing_kwargs"] == {"use_reentrant": False, "preserve_rng_state": False}


def test_sftconfig_rejections_name_the_keys_and_their_layers(tmp_path):
    recipe = load_recipe(["recipe=blog", "model=tiny", "fp16=true", "bf16=true"])
    with pytest.raises(
        RecipeError, match=r"SFTConfig rejects bf16=True \(command line\), fp16=True \(command line\): At most one"
    ):
        sft_config(recipe, tmp_path / "run")
    recipe = load_recipe(["recipe=blog", "warmup_steps=-1"])
    # SFTConfig's own words, which differ between transformers releases, follow the key and its layer
    with pytest.raises(RecipeError, match=r"SFTConfig rejects warmup_steps=-1 \(command line\): .*warmup_steps"):
        sft_config(recipe, tmp_path / "run")


def test_renamed_and_fixed_sftconfig_keys_stop_with_the_name_to_use():
    with pytest.raises(RecipeError, match=r"'max_seq_length' is SFTConfig's 'max_length': write max_length"):
        load_recipe(["recipe=blog", "max_seq_length=512"])
    with pytest.raises(RecipeError, match=r"'gradient_checkpointing' is SFTConfig's 'activation_checkpointing'"):
        load_recipe(["recipe=blog", "gradient_checkpointing=false"])
    with pytest.raises(RecipeError, match=r"presets.tiny: 'warmup_ratio' is SFTConfig's 'warmup_steps'"):
        load_recipe(["recipe=blog", "model=tiny", "presets.tiny.warmup_ratio=0.1"])
    with pytest.raises(RecipeError, match=r"eval_strategy='epoch': train/sft.py sets eval_strategy=steps"):
        load_recipe(["recipe=blog", "eval_strategy=epoch"])
    with pytest.raises(RecipeError, match=r"lr_scheduler_type='cosin' \(did you mean 'cosine'\?\): use one of"):
        load_recipe(["recipe=blog", "lr_scheduler_type=cosin"])


def test_overrides_nested_and_precedence():
    recipe = load_recipe(
        ["recipe=blog", "model=tiny", "lora.r=8", "probdiff.delta=-0.02", "probdiff.n_queries=3", "max_steps=7"]
    )
    assert recipe.lora.r == 8 and recipe.probdiff.delta == -0.02 and recipe.probdiff.n_queries == 3
    assert recipe.training["max_steps"] == 7  # the command line beats presets.tiny
    assert recipe.lora.alpha == 128  # presets.tiny beats the YAML body


def test_unknown_key_names_it_and_lists_valid_keys():
    top_level = r"unknown key 'learning_rat'.*Valid keys: .*lora, .*any field of trl.SFTConfig"
    with pytest.raises(RecipeError, match=top_level):
        load_recipe(["recipe=blog", "learning_rat=1e-4"])
    with pytest.raises(
        RecipeError,
        match=r"unknown key 'lora.rank' \(did you mean 'lora.r'\?\). "
        r"Valid keys in lora: enabled, r, alpha, dropout, target_modules",
    ):
        load_recipe(["recipe=blog", "lora.rank=8"])
    with pytest.raises(RecipeError, match=r"unknown key 'dleta'.*Valid ProbDiff settings: delta"):
        load_recipe(["recipe=blog", "probdiff.dleta=0"])


def test_unknown_key_suggests_the_closest_valid_one():
    with pytest.raises(RecipeError, match=r"unknown key 'lerning_rate' \(did you mean 'learning_rate'\?\)"):
        load_recipe(["recipe=blog", "lerning_rate=1e-4"])
    with pytest.raises(RecipeError, match=r"unknown key 'delta' \(did you mean 'probdiff.delta'\?\)"):
        load_recipe(["recipe=blog", "delta=-0.02"])
    with pytest.raises(RecipeError, match="the `callback` section is now part of `probdiff`"):
        load_recipe(["recipe=blog", "callback.n_queries=5"])
    with pytest.raises(RecipeError, match=r"unknown key 'n_querys' \(did you mean 'n_queries'\?\)"):
        load_recipe(["recipe=blog", "probdiff.n_querys=3"])
    with pytest.raises(RecipeError) as info:
        load_recipe(["recipe=blog", "zzzz=1"])
    assert "did you mean" not in str(info.value)


def test_wrong_type_names_key_and_expected_type():
    with pytest.raises(RecipeError, match=r"wrong type for 'learning_rate'.*'fast'.*expected float"):
        load_recipe(["recipe=blog", "learning_rate=fast"])
    with pytest.raises(RecipeError, match=r"wrong type for ProbDiff setting 'n_queries'"):
        load_recipe(["recipe=blog", "probdiff.n_queries=many"])
    with pytest.raises(RecipeError) as info:
        load_recipe(["recipe=blog", "probdiff.delta=abc"])
    message = str(info.value)
    assert message == "command line: wrong type for ProbDiff setting 'delta': got 'abc', expected float"
    assert "full_key" not in message and "object_type" not in message
    with pytest.raises(RecipeError, match=r"wrong type for 'adam_epsilon': got 'tiny', expected float"):
        load_recipe(["recipe=blog", "adam_epsilon=tiny"])
    with pytest.raises(RecipeError, match=r"^command line: wrong type for 'bf16': got 'maybe', expected bool \| None$"):
        load_recipe(["recipe=blog", "bf16=maybe"])
    with pytest.raises(RecipeError, match=r"wrong type for 'max_steps': got 2.5, expected int$"):
        load_recipe(["recipe=blog", "max_steps=2.5"])
    with pytest.raises(RecipeError, match=r"wrong type for 'learning_rate': got None, expected float$"):
        load_recipe(["recipe=blog", "learning_rate=null"])
    with pytest.raises(RecipeError, match=r"wrong type for 'lora': got 5, expected dict$"):
        load_recipe(["recipe=blog", "lora=5"])
    with pytest.raises(RecipeError, match=r"ProbDiff setting 'sweep': got \[0, 'x'\], expected list\[float\]"):
        load_recipe(["recipe=blog", "probdiff.sweep=[0,x]"])


def test_values_keep_the_types_the_run_had():
    """SFTConfig's float fields keep an int as given (so `num_train_epochs: 3` stays 3); the project's own float
    keys take a float; a number or a boolean where text is expected becomes text (`resume=true`)."""
    recipe = load_recipe(["recipe=blog", "learning_rate=1", "eval_steps=10", "adam_epsilon=1e-6", "run_name=2024"])
    assert [type(recipe.training[key]) for key in ("learning_rate", "eval_steps", "adam_epsilon")] == [int, int, float]
    assert recipe.training["run_name"] == "2024" and recipe.training["num_train_epochs"] == 3
    recipe = load_recipe(["recipe=blog", "probdiff.delta=0", "probdiff.sweep=[0,-1]", "lora.dropout=0", "resume=true"])
    assert type(recipe.probdiff.delta) is float and [type(d) for d in recipe.probdiff.sweep] == [float, float]
    assert type(recipe.lora.dropout) is float and recipe.resume == "True"


def test_the_probdiff_sections_own_checks_stop_the_recipe():
    with pytest.raises(RecipeError, match=r"^Invalid ProbDiff config: n_revisions=0: needs at least 1"):
        load_recipe(["recipe=blog", "probdiff.n_revisions=0"])
    with pytest.raises(RecipeError, match=r"presets.tiny: must be a mapping of keys other than `model` and `presets`"):
        load_recipe(["recipe=blog", "model=tiny", "presets.tiny.model=smollm2"])


def test_wrong_types_name_the_layer_they_came_from(tmp_path):
    (tmp_path / "mine.yaml").write_text("task: blog\nlearning_rate: fast\n")
    with pytest.raises(RecipeError, match=r"mine.yaml: wrong type for 'learning_rate': got 'fast', expected float"):
        load_recipe(["recipe=mine"], directory=tmp_path)
    (tmp_path / "mine.yaml").write_text("task: blog\npresets:\n  tiny:\n    eval_on_start: often\n")
    with pytest.raises(RecipeError, match=r"mine.yaml presets.tiny: wrong type for 'eval_on_start': got 'often'"):
        load_recipe(["recipe=mine", "model=tiny"], directory=tmp_path)
    (tmp_path / "mine.yaml").write_text("task: blog\nlora: {r: wide}\n")
    with pytest.raises(RecipeError, match=r"mine.yaml: wrong type for 'lora.r': got 'wide', expected int"):
        load_recipe(["recipe=mine"], directory=tmp_path)
    with pytest.raises(
        RecipeError, match=r"^command line: optim='adamw_troch' \(did you mean 'adamw_torch'\?\): use one of"
    ):
        load_recipe(["recipe=blog", "optim=adamw_troch"])


def test_missing_and_misspelled_recipe_list_the_recipes(tmp_path):
    for args in (["model=tiny"], ["recipe=blgo"]):
        with pytest.raises(RecipeError) as info:
            load_recipe(args)
        assert all(name in str(info.value) for name in TASKS)
    with pytest.raises(RecipeError, match=r"recipe='blgo' is not a recipe \(did you mean 'blog'\?\)"):
        load_recipe(["recipe=blgo"])
    missing = tmp_path / "mine.yaml"  # a file that is not there is said to be missing, not "not a recipe"
    with pytest.raises(RecipeError, match=rf"^recipe={missing}: no such file\. Recipes: alignbench, blog"):
        load_recipe([f"recipe={missing}"])


def test_bad_values_in_a_recipe_file_name_the_file(tmp_path):
    (tmp_path / "broken.yaml").write_text("task: blog\nlora:\n  rank: 8\n")
    with pytest.raises(RecipeError, match=r"broken.yaml: unknown key 'lora.rank'"):
        load_recipe(["recipe=broken"], directory=tmp_path)
    (tmp_path / "badpreset.yaml").write_text("task: blog\npresets:\n  tiny:\n    lerning_rate: 1\n")
    with pytest.raises(RecipeError, match=r"presets.tiny: unknown key 'lerning_rate'"):
        load_recipe(["recipe=badpreset", "model=tiny"], directory=tmp_path)


def test_cross_field_validation():
    with pytest.raises(RecipeError, match="save_steps=30 must be a multiple of eval_steps=20"):
        load_recipe(["recipe=blog", "eval_steps=20", "save_steps=30"])
    with pytest.raises(RecipeError, match="quantization='8bit'"):
        load_recipe(["recipe=blog", "quantization=8bit"])
    with pytest.raises(RecipeError, match="needs lora.enabled=true"):
        load_recipe(["recipe=blog", "quantization=4bit", "lora.enabled=false"])
    with pytest.raises(RecipeError, match="not key=value"):
        load_recipe(["recipe=blog", "model"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("quantization=8bit", "quantization='8bit' (did you mean '4bit'?): use one of none, 4bit"),
        ("task=blgo", "task='blgo' (did you mean 'blog'?): use one of translation, summarization, blog, alignbench"),
        ("dtype=fp16", "dtype='fp16': use one of auto, float32, bfloat16, float16"),
    ],
)
def test_the_projects_enumerations_stop_as_sftconfigs_do(override, message, tmp_path):
    """`task`, `dtype` and `quantization` are Literals, checked with SFTConfig's enumerations, where the layer is
    known: the command line, or the file that set the value."""
    with pytest.raises(RecipeError) as err:
        load_recipe(["recipe=blog", override])
    assert str(err.value) == f"command line: {message}"
    key, value = override.split("=")
    (tmp_path / "mine.yaml").write_text(("" if key == "task" else "task: blog\n") + f"{key}: {value}\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(["recipe=mine"], directory=tmp_path)
    assert str(err.value) == f"{tmp_path / 'mine.yaml'}: {message}"


def test_a_recipe_names_its_task(tmp_path):
    (tmp_path / "mine.yaml").write_text("description: no task\n")
    with pytest.raises(RecipeError, match=r"^recipe 'mine': task: not set; a recipe names its task \(translation, "):
        load_recipe(["recipe=mine"], directory=tmp_path)


def test_the_values_the_run_gets_are_checked_once_the_layers_are_merged(tmp_path):
    """OmegaConf merges the layers, then types the result: a value a later layer replaces is not the run's, and is
    not refused; the one the run gets is, naming the layer that set it."""
    (tmp_path / "mine.yaml").write_text("task: blog\nlearning_rate: fast\nprobdiff: {delta: high}\n")
    recipe = load_recipe(["recipe=mine", "learning_rate=1e-4", "probdiff.delta=-0.02"], directory=tmp_path)
    assert recipe.training["learning_rate"] == 1e-4 and recipe.probdiff.delta == -0.02
    assert recipe.sources["learning_rate"] == "command line"
    with pytest.raises(RecipeError, match=r"mine.yaml: wrong type for ProbDiff setting 'delta': got 'high'"):
        load_recipe(["recipe=mine", "learning_rate=1e-4"], directory=tmp_path)


# --- data ----------------------------------------------------------------------------------------


# --- W&B and runs ----------------------------------------------------------------------------------


def test_schema_defaults_validate():
    assert Recipe().model == "qwen-14b-chat" and Recipe().probdiff.delta == -0.05


def test_selecting_by_a_reference_metric_needs_every_evaluation():
    recipe = load_recipe(["recipe=translation", "model=tiny", "metric_for_best_model=ref_chrf"])
    assert recipe.setting("metric_for_best_model") == "ref_chrf"
    with pytest.raises(RecipeError, match="metric_for_best_model=ref_bleu needs ProbDiff at every evaluation"):
        load_recipe(["recipe=translation", "model=tiny", "metric_for_best_model=ref_bleu", "probdiff.every=2"])


def test_activation_checkpointing_goes_to_a_transformers_before_5_23_under_its_old_names():
    """transformers 5.17 to 5.22 (in the range vLLM pins) name the same settings gradient_checkpointing*: recipes keep
    the new names, and SFTConfig gets them under the installed release's."""
    from probdiff_callback.training.recipe import installed_fields

    before_5_23 = {"learning_rate", "gradient_checkpointing", "gradient_checkpointing_kwargs"}
    assert installed_fields(before_5_23) == {
        "learning_rate": "learning_rate",
        "activation_checkpointing": "gradient_checkpointing",
        "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs",
    }
    since_5_23 = {"learning_rate", "activation_checkpointing", "activation_checkpointing_kwargs"}
    assert installed_fields(since_5_23) == {name: name for name in since_5_23}
