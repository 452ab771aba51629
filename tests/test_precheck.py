"""A mistake in the settings is said before torch, transformers and trl are imported: by `python train/sft.py`
(training/precheck.py, with SFTConfig's stand-in from training/sft_config_cache.py) and by each `probdiff` command; the
same `error:` line and exit status 2 as the checks after the imports, which stay as they were.

What is asserted is the mechanism (which modules a refused command imported), not seconds, which no test holds."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import typing

import pytest
from _launch import ROOT, SFT

from probdiff_callback.training import precheck, sft, sft_config_cache
from probdiff_callback.training.recipe import RecipeError, sft_config_class

HEAVY = ("torch", "transformers", "trl")
HEAVY_IMPORT = re.compile(rf"\|\s+({'|'.join(HEAVY)})(\.|$)")  # a `-X importtime` line of one of them
BLOG_QUERIES = str(ROOT / "data" / "samples" / "blog" / "heldout.jsonl")


@pytest.fixture
def stand_in_cache(tmp_path, monkeypatch) -> dict[str, str]:
    """A cache of its own holding SFTConfig's stand-in for the installed versions; the environment that names it."""
    monkeypatch.setenv("PROBDIFF_CACHE", str(tmp_path / "cache"))
    sft_config_cache.write_cache(sft_config_cache.cache_path())  # trl is imported here: written in this process
    return {**os.environ, "PROBDIFF_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}


def test_the_stand_in_has_sftconfigs_fields_types_and_defaults():
    from trl import SFTConfig

    stand_in = sft_config_cache.rebuild(json.loads(json.dumps(sft_config_cache.describe(SFTConfig))))
    real_hints, stand_in_hints = typing.get_type_hints(SFTConfig), typing.get_type_hints(stand_in)
    real = {spec.name: spec for spec in dataclasses.fields(SFTConfig) if spec.init}
    unchecked = getattr(stand_in, sft_config_cache.UNCHECKED)
    assert unchecked <= {"parallelism_config"}  # a class of accelerate's: a new one here is a key checked late
    assert [spec.name for spec in dataclasses.fields(stand_in)] == list(real)
    for spec in dataclasses.fields(stand_in):
        if spec.name not in unchecked:  # printed as before: a refusal names the type as SFTConfig declares it
            assert str(stand_in_hints[spec.name]) == str(real_hints[spec.name]), spec.name
            assert default_of(spec) == default_of(real[spec.name]), spec.name


def default_of(spec: dataclasses.Field):
    return spec.default_factory() if spec.default is dataclasses.MISSING else spec.default  # type: ignore[misc]


REFUSED = [
    ["recipe=nope"],
    ["recipe=blog", "lerning_rate=1e-4"],  # SFTConfig's names, with the closest one
    ["recipe=blog", "max_steps=ten"],
    ["recipe=blog", "warmup_steps=abc"],
    ["recipe=blog", "lr_scheduler_type=cosin"],  # an enumeration of transformers'
    ["recipe=blog", "lr_scheduler_type=null"],  # ... named as SFTConfig declares it
    ["recipe=blog", "debug=[nope]"],  # a list of one
    ["recipe=blog", "trackio_static_space_id=[1]"],  # typing.Union, printed as such
    ["recipe=blog", "gradient_checkpointing=true"],  # renamed
    ["recipe=blog", "eval_steps=30", "save_steps=50"],  # the project's checks of SFTConfig's values and defaults
    ["recipe=blog", "num_train_epochs=0"],
    ["recipe=blog", "model=tiny", "probdiff.delta=abc"],
    ["recipe=blog", "probdiff.n_querys=3"],
    ["recipe=blog", "lora.r=0"],
    ["recipe=blog", "model=tiny", "train_file=/nope.jsonl"],
    ["recipe=blog", "model=tiny", "resume=/nope/checkpoint-1"],
    ["recipe=blog", "model=tyni"],
]


@pytest.mark.parametrize("args", REFUSED, ids=" ".join)
def test_the_check_before_the_imports_says_what_the_run_says(args, stand_in_cache, tmp_path, monkeypatch, capsys,
                                                             sft_in_this_process):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError) as early:
        precheck.check_settings(args)
    assert sft_config_class().__module__.startswith("trl")  # the stand-in is gone with the check
    assert sft.main(args) == 2  # the checks after the imports, with trl's SFTConfig
    assert capsys.readouterr().err.strip() == f"error: {early.value}"


def test_settings_without_a_mistake_pass_the_check(stand_in_cache, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert precheck.refused([], ["recipe=blog", "model=tiny", "report_to=none", "lr_scheduler_type=linear"]) is None
    assert precheck.refused(["--help"], []) is None  # the launcher's help asks for no settings
    assert capsys.readouterr() == ("", "")
    assert not (tmp_path / "runs").exists()


def test_without_a_stand_in_the_checks_after_the_imports_do_it_all(monkeypatch):
    monkeypatch.setattr(precheck, "stand_in", lambda: None)
    assert precheck.refused([], ["recipe=nope"]) is None


@pytest.mark.parametrize(
    "mistake, said",
    [
        ("probdiff.delta=abc", "error: command line: wrong type for ProbDiff setting 'delta': got 'abc'"),
        ("recipe=nope", "error: recipe='nope' is not a recipe"),
        ("train_file=/nope.jsonl", "error: train_file=/nope.jsonl: no such file"),
    ],
)
def test_the_training_command_refuses_before_importing_torch(mistake, said, stand_in_cache, tmp_path):
    """The README's command with one mistake: one line, exit status 2, and none of torch, transformers, trl imported."""
    command = [sys.executable, "-X", "importtime", str(SFT), "recipe=blog", "model=tiny", mistake]
    result = subprocess.run(command, cwd=tmp_path, env=stand_in_cache, capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(said), result.stderr[-2000:]
    assert not [line for line in result.stderr.splitlines() if HEAVY_IMPORT.search(line)]


@pytest.mark.slow  # imports trl once, in the process that writes the stand-in
def test_a_missing_stand_in_is_written_by_a_process_of_its_own(tmp_path):
    env = {**os.environ, "PROBDIFF_CACHE": str(tmp_path / "cache")}
    code = "from probdiff_callback.training import precheck, sft_config_cache as c; import sys; "
    code += "print(precheck.refused([], ['recipe=blog', 'lerning_rate=1']), c.cache_path().is_file(), "
    code += f"[m for m in {HEAVY!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.stdout.strip() == "2 True []", result.stderr[-2000:]
    assert "unknown key 'lerning_rate'" in result.stderr


def test_processes_that_start_on_one_cache_at_once_write_the_stand_in_once(tmp_path, monkeypatch):
    """The machines of a run share one cache: one process writes the stand-in, the others wait and read its file.
    (Threads stand in for the processes: each takes the lock through a file of its own, as a process does.)"""
    import threading

    path, writes = tmp_path / "cache" / "sft-config" / "stand-in.json", []

    def slow_write(target):  # a process that imports trl takes seconds: the others start meanwhile
        writes.append(threading.get_ident())
        time.sleep(0.5)
        target.write_text("{}")

    monkeypatch.setattr(sft_config_cache, "write_cache", slow_write)
    starts = [threading.Thread(target=sft_config_cache.write_once, args=(path,)) for _ in range(3)]
    for start in starts:
        start.start()
    for start in starts:
        start.join(30)
    assert not any(start.is_alive() for start in starts)
    assert len(writes) == 1 and path.read_text() == "{}"


# `probdiff COMMAND ...` with one mistake -> the start of its error line
CLI_REFUSED = {
    ("eval", "--queries", BLOG_QUERIES, "delta=abc"): "wrong type for ProbDiff setting 'delta'",
    ("eval", "--queries", "/nope.jsonl"): "/nope.jsonl: no such file",
    ("eval", "--queries", BLOG_QUERIES, "n_queries=3"): "settings: n_queries is a ProbDiffCallback setting",
    ("eval", "--queries", BLOG_QUERIES, "--model", "tyni"): "model='tyni' is neither a preset",
    ("eval", "--queries", BLOG_QUERIES, "--dtype", "fp8"): "dtype='fp8': use one of auto",
    ("eval", "--queries", BLOG_QUERIES, "--adapter", "/nope"): "--adapter /nope: no adapter_config.json there",
    ("eval", "--queries", BLOG_QUERIES, "--limit", "0"): "argument --limit: 0 is not a positive count",
    ("score", "--pairs", "/nope.jsonl"): "/nope.jsonl: no such file",
    ("score", "--pairs", BLOG_QUERIES, "max_new_tokens=3"): "settings: max_new_tokens is not read by `probdiff score`",
    ("compare", "/nope", "/nope2"): "/nope/records.jsonl: not found",
    ("select", "/nope"): "/nope: no such run directory",
    ("plot", "/nope"): "/nope: no such run directory",
    ("crosscheck", "/nope"): "/nope: no such run directory",
    ("watch", "/nope"): "/nope: no such run directory",
    ("watch", "/nope", "--started-by-training", "--no-follow"): "--started-by-training follows the run",
    ("convert-qwen", "/nope", "/nope-out"): "/nope/config.json not found",
}
CLI_RUNNER = """
import contextlib, io, json, sys
from probdiff_callback.cli import main
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit:  # argparse's refusals
            code = exit.code
    heavy = [name for name in %r if name in sys.modules]
    print(json.dumps([code, err.getvalue().strip().splitlines()[-1:], heavy]))
"""


def test_each_probdiff_command_refuses_its_arguments_before_importing_torch(tmp_path):
    """All in one process, in turn: a command that imported torch would show in every one after it."""
    commands = [[*argv[:1], *(["--out", str(tmp_path / "out")] if argv[0] in ("eval", "score") else []), *argv[1:]]
                for argv in CLI_REFUSED]  # fmt: skip
    runner = CLI_RUNNER % (HEAVY,)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's package, wherever it is installed from
    result = subprocess.run([sys.executable, "-c", runner, json.dumps(commands)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    outcomes = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(outcomes) == len(CLI_REFUSED), result.stderr[-2000:]
    for (argv, said), (code, lines, heavy) in zip(CLI_REFUSED.items(), outcomes):
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f"probdiff {argv[0]}: error: "), (argv, lines)
        assert said in lines[0], (argv, lines)
        assert heavy == [], (argv, heavy)
    assert not (tmp_path / "out").exists()  # eval removes the folders it made for results it never wrote
