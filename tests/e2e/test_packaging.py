"""The package as a user installs it: a wheel in a fresh environment outside the checkout."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from _once import made_once

from probdiff_callback.cli import main

pytestmark = pytest.mark.slow  # every test here starts processes

ROOT = Path(__file__).resolve().parents[2]


def run(command: list[str], cwd: Path, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The package's wheel, built once per session whichever worker asks first (`_once.made_once`)."""

    def make(out: Path) -> None:
        # No build isolation: the installed setuptools builds it, so the test needs no network.
        run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(out),
             str(ROOT)], cwd=out)  # fmt: skip

    (path,) = made_once(tmp_path_factory, "wheel", make).glob("probdiff-*.whl")
    return path


def running_site_packages() -> list[str]:
    """The site-packages of the Python running the tests, a venv's or the system's, in the order it reads them."""
    dirs = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    dirs += [*site.getsitepackages(), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def venv_with(wheel: Path, venv: Path) -> Path:
    """A new venv with the wheel installed, seeing the running Python's packages (torch, transformers, ...) through a
    .pth file that lists its site-packages. The wheel goes in before that file, and without PYTHONPATH (which may hold
    the checkout and its probdiff.egg-info), so pip finds no install of this package to keep instead. Directories a
    .pth file lists are not searched for .pth files of their own: an editable install of this package there (one such
    file) stays out of sight."""
    run([sys.executable, "-m", "venv", str(venv)], cwd=venv.parent)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)]
    run(pip, cwd=venv.parent, env={**os.environ, "PYTHONPATH": ""})
    purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=venv.parent)
    (Path(purelib.stdout.strip()) / "_running_python.pth").write_text("\n".join(running_site_packages()) + "\n")
    return python


def test_wheel_carries_what_the_library_needs_at_run_time(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "probdiff_callback/assets/tiny.safetensors" in names
    assert "probdiff_callback/core/prompts.py" in names  # the prompts
    assert "probdiff_callback/models/tokenizer.py" in names  # the chat template
    assert "probdiff_callback/training/sft.py" in names and "probdiff_callback/data/prepare.py" in names  # the commands
    assert not any(name.startswith(("tests/", "data/", "train/", "bench/", "recipes/")) for name in names)


def test_installed_wheel_evaluates_and_trains_from_another_directory(wheel, tmp_path):
    """The wheel in a fresh environment that sees the test's own torch/transformers but takes this package only from
    the wheel, a fresh cache (`tiny` unpacked from the installed package data), outside the checkout: `probdiff eval`
    on the user's queries; then `python -m probdiff_callback.training` with a recipe file of the user's and data files
    of the user's, to its best checkpoint."""
    venv = tmp_path / "venv"
    python = venv_with(wheel, venv)
    work = tmp_path / "elsewhere"
    work.mkdir()
    queries = work / "queries.jsonl"
    queries.write_text(
        "\n".join(
            json.dumps({"id": f"q{i}", "query": q})
            for i, q in enumerate(["Write a haiku about tea.", "Translate the sentence into English:\nGuten Tag."])
        )
    )
    env = {**os.environ, "PROBDIFF_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": "",
           "WANDB_MODE": "offline"}  # fmt: skip
    which = "import probdiff_callback, transformers; print(probdiff_callback.__file__); print(transformers.__file__)"
    which += "; from probdiff_callback import ProbDiffCallback, ProbDiffConfig, evaluate, load_queries"  # the API
    ours, theirs = run([str(python), "-c", which], cwd=work, env=env).stdout.splitlines()[:2]  # then the API's lines
    assert ours.startswith(str(venv))  # the wheel's copy, not the checkout's (nor an editable install's)
    assert theirs.startswith(tuple(running_site_packages()))  # the dependencies the tests run with
    evaluation = ["eval", "--model", "tiny", "--queries", str(queries), "max_new_tokens=8"]
    done = run([str(venv / "bin" / "probdiff"), *evaluation, "--out", "out"], cwd=work, env=env)
    assert "Unpacking the `tiny` model" in done.stdout + done.stderr
    summary = json.loads((work / "out" / "summary.json").read_text())
    assert summary["n"] == 2
    records = [json.loads(line) for line in (work / "out" / "records.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["q0", "q1"] and all(r["response"] for r in records)
    # the console script's path (the collector paused while loading, the allocator tuned on a CPU: cli.entry_point)
    # gives what `main` gives in this process
    assert main([*evaluation, "--out", str(tmp_path / "in_process")]) == 0
    in_process = [json.loads(line) for line in (tmp_path / "in_process" / "records.jsonl").read_text().splitlines()]
    assert [r["response"] for r in records] == [r["response"] for r in in_process]

    for split in ("train", "heldout"):
        (work / f"{split}.jsonl").write_text((ROOT / "data" / "samples" / "blog" / f"{split}.jsonl").read_text())
    # the user's own recipe: the settings a CPU needs (recipes/models/tiny.yaml is the checkout's, not the wheel's)
    (work / "my-recipe.yaml").write_text(
        "task: blog\nmax_steps: 1\neval_steps: 1\nsave_steps: 1\nper_device_train_batch_size: 2\n"
        "max_eval_samples: 2\nmax_length: 64\ndtype: float32\nbf16: false\nactivation_checkpointing: false\n"
        "probdiff: {n_queries: 2, max_new_tokens: 4, max_prompt_tokens: 128}\n"
    )
    command = [str(python), "-m", "probdiff_callback.training", "recipe=my-recipe.yaml", "model=tiny",
               "train_file=train.jsonl", "heldout_file=heldout.jsonl", "output_dir=run", "report_to=none"]  # fmt: skip
    done = run(command, cwd=work, env=env)
    assert (work / "run" / "final").is_dir() and (work / "run" / "best").is_symlink()
    assert "python -m probdiff_callback.training" not in done.stdout  # no hint to go on: the run finished
    refused = subprocess.run([*command[:3], "recipe=blog"], cwd=work, env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and f"(files in {work / 'recipes'})" in refused.stderr
