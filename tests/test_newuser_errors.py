"""What a new user hit (issue 28): a data file that is not there, --out over a file or earlier results, a hub id
without network, resume= of a checkpoint that is not there, and the W&B lines of an offline run. Each mistake stops
at once with one `error:` line naming the key or flag and what to do, exit status 2."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import train.data
from probdiff_callback.cli import main as probdiff
from probdiff_callback.models import ModelUnavailable, load_model_and_tokenizer, resolve_model_path
from probdiff_callback.models.loading import hub_model_source
from train import sft
from train.data import data_files
from train.recipe import RecipeError, load_recipe
from train.run_dir import resolve_run

ROOT = Path(__file__).resolve().parents[1]
QUERIES = str(ROOT / "data" / "samples" / "blog" / "heldout.jsonl")
HUB_ID = "Qwen/Qwen2-0.5B-Instruct"


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]


def reason_left_out(line: str) -> str:
    """The line with why the hub could not be reached (the OS's words) replaced by REASON."""
    return re.sub(r"cannot be reached \((.+?)\)(:| and)", r"cannot be reached (REASON)\2", line)


# --- 1. a data file the user named ------------------------------------------------------------------
@pytest.mark.parametrize("key", ["train_file", "heldout_file"])
def test_a_named_data_file_that_is_missing_stops_instead_of_training_on_the_samples(key, tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(RecipeError) as raised:
        data_files(load_recipe(["recipe=blog", "model=tiny", f"{key}={missing}"]))
    assert str(raised.value) == (
        f"{key}={missing}: no such file. Give an existing JSON-lines file of conversations (docs/configuration.md, "
        f'"Your own files"), or leave {key} out to use the recipe\'s data '
        f"(data/processed/blog/{key.split('_')[0]}.jsonl)"
    )
    args = ["recipe=blog", "model=tiny", f"{key}={missing}", "report_to=none", f"output_dir={tmp_path}/r"]
    assert sft.main(args) == 2
    assert error_lines(capsys.readouterr().err) == [f"error: {raised.value}"]
    assert not (tmp_path / "r").exists()


def test_a_relative_data_path_says_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    looked = rf"heldout_file=mine/h.jsonl: no such file \(looked in {re.escape(str(tmp_path))} and "
    with pytest.raises(RecipeError, match=looked):
        data_files(load_recipe(["recipe=blog", "heldout_file=mine/h.jsonl"]))
    (tmp_path / "mine").mkdir()
    with pytest.raises(RecipeError, match=r"train_file=mine: is a directory, not a file\. Give an existing"):
        data_files(load_recipe(["recipe=blog", "train_file=mine"]))


def test_the_recipes_own_data_still_falls_back_to_the_samples(tmp_path, monkeypatch):
    """Where data/processed/<task>/ is not prepared (no such folder in the working directory or the project root)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train.data, "PROJECT_ROOT", tmp_path)
    train_file, heldout_file, notices = data_files(load_recipe(["recipe=blog"]))
    assert train_file == train.data.SAMPLES_DIR / "blog" / "train.jsonl"
    assert heldout_file == train.data.SAMPLES_DIR / "blog" / "heldout.jsonl"
    assert [n.split(":")[0] for n in notices] == ["train data", "heldout data"]
    # the same file named explicitly is the recipe's own data too
    assert data_files(load_recipe(["recipe=blog", "train_file=data/processed/blog/train.jsonl"]))[0] == train_file


# --- 2. --out ---------------------------------------------------------------------------------------
@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if the model would load: the --out checks come first."""
    import probdiff_callback.cli

    def load(args):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(probdiff_callback.cli, "_load", load)


def pairs_file(tmp_path: Path) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"id": "1", "query": "q", "response": "a", "revised": "b"}) + "\n")
    return str(path)


@pytest.mark.parametrize("command", ["eval", "score"])
def test_out_that_is_a_file_stops_before_the_model_loads(command, tmp_path, capsys, no_model):
    source = ["--queries", QUERIES] if command == "eval" else ["--pairs", pairs_file(tmp_path)]
    a_file = tmp_path / "results"
    a_file.write_text("")
    assert probdiff([command, *source, "--out", str(a_file)]) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"probdiff {command}: error: --out {a_file} is a file: give a directory (it gets records.jsonl and "
        "summary.json)"
    ]
    assert probdiff([command, *source, "--out", str(a_file / "sub")]) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"probdiff {command}: error: --out {a_file / 'sub'} is under {a_file}, a file: give a directory (it gets "
        "records.jsonl and summary.json)"
    ]


@pytest.mark.parametrize("command", ["eval", "score"])
def test_out_with_earlier_results_is_refused_without_overwrite(command, tmp_path, capsys, no_model):
    source = ["--queries", QUERIES] if command == "eval" else ["--pairs", pairs_file(tmp_path)]
    out = tmp_path / "earlier"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    assert probdiff([command, *source, "--out", str(out)]) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"probdiff {command}: error: --out {out} already holds summary.json of an earlier run: choose another "
        "--out, or add --overwrite to replace them"
    ]
    assert (out / "summary.json").read_text() == "{}"


def test_overwrite_replaces_earlier_results_and_says_so(tmp_path, capsys, tiny_model_path):
    out = tmp_path / "earlier"
    out.mkdir()
    for name in ("records.jsonl", "summary.json"):
        (out / name).write_text("old\n")
    args = ["eval", "--queries", QUERIES, "--limit", "1", "--out", str(out), "max_new_tokens=4", "--overwrite"]
    assert probdiff(args) == 0
    assert f"--overwrite: replacing records.jsonl and summary.json in {out}" in capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["n"] == 1


# --- 3. a hub id without network ----------------------------------------------------------------------
def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """An empty Hugging Face cache and a hub endpoint that refuses connections (as without network, but at once
    and on any machine); HF_HUB_OFFLINE off. Returns the cache directory."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub_model_source.cache_clear()
    yield cache
    hub_model_source.cache_clear()


def test_hub_id_not_cached_with_hf_hub_offline_stops_at_once(hub, monkeypatch, tmp_path, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    started = time.time()
    assert probdiff(["eval", "--model", HUB_ID, "--queries", QUERIES, "--out", str(tmp_path / "o")]) == 2
    assert time.time() - started < 10
    assert error_lines(capsys.readouterr().err) == [
        f"probdiff eval: error: --model {HUB_ID}: a hub id with no copy in the Hugging Face cache ({hub}), and "
        f"HF_HUB_OFFLINE=1 allows no download: give a local model directory, or download it first "
        f"(`hf download {HUB_ID}` where there is network)"
    ]
    with pytest.raises(ModelUnavailable, match=r"hf download Qwen/Qwen1.5-14B-Chat"):  # the presets' hub ids too
        resolve_model_path("qwen1.5-14b-chat")


def test_hub_id_with_the_hub_unreachable_stops_at_once(hub, tmp_path, capsys):
    from huggingface_hub import constants

    started = time.time()
    assert probdiff(["eval", "--model", HUB_ID, "--queries", QUERIES, "--out", str(tmp_path / "o")]) == 2
    assert sft.main(["recipe=blog", f"model={HUB_ID}", "report_to=none", f"output_dir={tmp_path}/r"]) == 2
    assert time.time() - started < 30
    expected = (
        f"a hub id, but the Hugging Face Hub ({constants.ENDPOINT}) cannot be reached (REASON) and the cache ({hub}) "
        "has no copy of it: give a local model directory, or download it first "
        f"(`hf download {HUB_ID}` where there is network) and run with HF_HUB_OFFLINE=1"
    )
    assert [reason_left_out(line) for line in error_lines(capsys.readouterr().err)] == [
        f"probdiff eval: error: --model {HUB_ID}: {expected}",
        f"error: model={HUB_ID}: {expected}",
    ]


def test_hub_id_with_the_hub_unreachable_loads_its_cached_copy(hub, tiny_model_path, capsys):
    snapshot = hub / "models--probdiff--tiny-copy" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_model_path, snapshot)
    (hub / "models--probdiff--tiny-copy" / "refs").mkdir()
    (hub / "models--probdiff--tiny-copy" / "refs" / "main").write_text("0" * 40)
    assert resolve_model_path("probdiff/tiny-copy") == str(snapshot)
    model, _ = load_model_and_tokenizer("probdiff/tiny-copy", dtype="float32")
    assert model.config.num_hidden_layers == 2
    notes = [reason_left_out(line) for line in capsys.readouterr().err.splitlines() if "cannot be reached" in line]
    assert notes == [  # once per process
        f"note: the Hugging Face Hub cannot be reached (REASON): loading probdiff/tiny-copy "
        f"from the cache ({snapshot}); HF_HUB_OFFLINE=1 skips this check"
    ]


def test_a_directory_without_weights_is_one_line(tmp_path, capsys, tiny_model_path):
    (tmp_path / "m").mkdir()
    shutil.copy(tiny_model_path / "config.json", tmp_path / "m" / "config.json")
    with pytest.raises(ModelUnavailable, match=r"^cannot be loaded: Error no file named model.safetensors"):
        load_model_and_tokenizer(str(tmp_path / "m"))
    assert probdiff(["eval", "--model", str(tmp_path / "m"), "--queries", QUERIES, "--out", str(tmp_path / "o")]) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert line.startswith(f"probdiff eval: error: --model {tmp_path / 'm'}: cannot be loaded: Error no file named")


@pytest.mark.slow
def test_probdiff_eval_without_network_says_so_in_one_line(tmp_path):
    """As the user ran it: a process with HF_HUB_OFFLINE unset and the hub unreachable; once about 50 s of retry
    lines and a 30-line traceback."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}"}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    started = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "probdiff_callback.cli", "eval", "--model", HUB_ID, "--queries", QUERIES, "--out",
         str(tmp_path / "o")],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and time.time() - started < 60
    assert "Traceback" not in done.stderr and "Retrying" not in done.stderr
    [line] = error_lines(done.stderr)
    assert line.startswith(f"probdiff eval: error: --model {HUB_ID}: a hub id, but the Hugging Face Hub")


# --- 4. resume= of a checkpoint that is not there ---------------------------------------------------
def test_resume_of_a_missing_checkpoint_lists_the_runs_checkpoints(tmp_path, capsys):
    run = tmp_path / "run"
    for step in (10, 20):
        (run / f"checkpoint-{step}").mkdir(parents=True)
    recipe = load_recipe(["recipe=blog", f"resume={run}/checkpoint-30", f"output_dir={run}"])
    with pytest.raises(RecipeError) as raised:
        resolve_run(recipe)
    assert str(raised.value) == (
        f"resume={run}/checkpoint-30: no such directory. {run} has checkpoint-10, checkpoint-20: give one of them "
        f"(e.g. resume={run}/checkpoint-20), or resume=true for the latest complete one"
    )
    args = ["recipe=blog", "model=tiny", f"resume={run}/checkpoint-30", f"output_dir={run}", "report_to=none"]
    assert sft.main(args) == 2
    assert error_lines(capsys.readouterr().err) == [f"error: {raised.value}"]
    # a folder that is there but is no checkpoint; a run of another recipe's directory gets no resume=true
    with pytest.raises(RecipeError, match=rf"resume={re.escape(str(run))}: not a training checkpoint \(a checkpoint-N"):
        resolve_run(load_recipe(["recipe=blog", f"resume={run}"]))
    with pytest.raises(RecipeError, match=rf"give one of them \(e.g. resume={re.escape(str(run))}/checkpoint-20\)$"):
        resolve_run(load_recipe(["recipe=blog", f"resume={run}/checkpoint-5"]))


def test_resume_of_a_missing_checkpoint_in_a_run_without_checkpoints(tmp_path):
    recipe = load_recipe(["recipe=blog", f"resume={tmp_path}/gone/checkpoint-3", f"output_dir={tmp_path}/run"])
    with pytest.raises(RecipeError) as raised:
        resolve_run(recipe)
    assert str(raised.value) == (
        f"resume={tmp_path}/gone/checkpoint-3: no such directory; {tmp_path}/run, this recipe's run directory, has no "
        "checkpoint yet. Leave resume out to start the run, or give resume=RUN_DIR/checkpoint-N of another run"
    )


# --- 4. the W&B lines of an offline run -------------------------------------------------------------
@pytest.mark.slow
def test_offline_wandb_run_no_url_warning_and_one_sync_line(tmp_path, tiny_model_path):
    """A few steps of model=tiny, W&B offline: trl's model card asked the offline run for its URL at each
    checkpoint, and W&B's own closing lines offered `wandb sync` for one segment beside the run's command."""
    cheap = ["model=tiny", "max_steps=2", "eval_steps=1", "save_steps=1", "probdiff.n_queries=2",
             "probdiff.max_new_tokens=4", "max_eval_samples=2", "per_device_train_batch_size=2"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    for key in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_QUIET", "WANDB_SILENT"):
        env.pop(key, None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "train" / "sft.py"), "recipe=blog", *cheap, "output_dir=runs/w"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "URL not available" not in output
    [sync] = [line for line in output.splitlines() if "wandb sync" in line]
    run_id = (tmp_path / "runs" / "w" / "wandb_run_id").read_text().strip()
    assert sync.endswith(f"upload it with: wandb sync --id {run_id} runs/w/wandb/offline-run-*-{run_id}")
    assert len(list((tmp_path / "runs" / "w" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))) == 1
