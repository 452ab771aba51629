"""bench/gpu_session.sh, the one command a session with a device runs, kept working without one: its CPU mode end to
end (every part writes its result, the summary says each part is ok, at most 8 files come back), what its runs
import against the device image's packages and the carried wheels (bench/gpu_wheels.py), and its helpers' pieces."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_session.sh"

import gpu_session_report as report  # noqa: E402
import gpu_wheels  # noqa: E402

# What comes back from a device's $OUT: at most 8 files, named in letters, digits, '.', '_' and '-'
OUT_FILES = {"summary.md", "summary.json", "0-env.log", "1-bench.md", "1-bench.log", "2-train.log", "3-async.log",
             "tracebacks.txt"}  # fmt: skip
PARTS = ["0-env", "1-bench", "2-train-tiny", "2-train-qwen14b-shape", "3-async"]
# Distributions this environment needs that the device does not: huggingface_hub 2's HTTP client (the device has
# huggingface_hub 1.33, on httpx, which it has)
HERE_ONLY = {"httpx2", "httpcore2", "truststore", "sniffio"}
# In every process of the session (the runs and the processes they start): the modules of what neither the device's
# image has nor the wheels carry are hidden from the import system, as on the device (importlib.util.find_spec says
# None, as transformers' and trl's availability checks ask), and each process's imported modules are listed at its exit
AUDIT = textwrap.dedent(
    """
    import atexit, importlib.machinery, os, sys

    _hidden = frozenset(filter(None, os.environ.get("GPU_SESSION_HIDE", "").split(",")))

    class _Hiding(importlib.machinery.PathFinder):
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name.partition(".")[0] in _hidden:
                return None
            return super().find_spec(name, path, target)

    sys.meta_path[:] = [_Hiding if f is importlib.machinery.PathFinder else f for f in sys.meta_path]

    def _dump():
        with open(os.path.join(os.environ["GPU_SESSION_AUDIT"], f"{os.getpid()}.txt"), "w") as handle:
            handle.write("\\n".join(sorted({name.split(".")[0] for name in list(sys.modules)})))

    if os.environ.get("GPU_SESSION_AUDIT"):
        atexit.register(_dump)
    """
)


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def allowed() -> set[str]:
    """The distributions a session may import: the device image's, the carried ones, this project, and HERE_ONLY."""
    image = {normalized(name) for name in gpu_wheels.IMAGE_PACKAGES}
    return image | {normalized(name) for name, _, _ in gpu_wheels.WHEELS} | {"probdiff"} | HERE_ONLY


def hidden_modules() -> list[str]:
    """The top-level modules installed here whose every distribution is outside `allowed` (wandb, deepspeed, gguf,
    rouge_score, ...): on the device they do not exist."""
    ok = allowed()
    owners = importlib.metadata.packages_distributions()
    return sorted(m for m, dists in owners.items() if not any(normalized(d) in ok for d in dists) and m.isidentifier())


@pytest.mark.slow
def test_the_cpu_mode_runs_every_part_with_what_the_device_has(tmp_path):
    """One run of `bash bench/gpu_session.sh --cpu` (about a minute on 2 cores), as on a device: what it lacks hidden.
    Both checks read the same run, so that side by side (pytest-xdist) the session runs once."""
    out, result, audit = run_session(tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + tracebacks(out)
    check_every_part_recorded(out)
    check_imports(audit)


def tracebacks(out: Path) -> str:
    path = out / "tracebacks.txt"
    return "\n" + path.read_text()[-6000:] if path.is_file() else ""


def run_session(base: Path) -> tuple[Path, subprocess.CompletedProcess, Path]:
    """(OUT, the completed `bash bench/gpu_session.sh --cpu`, the folder of its processes' import lists)."""
    out, work, audit, site = base / "out", base / "work", base / "audit", base / "audit_site"
    audit.mkdir()
    site.mkdir()
    (site / "sitecustomize.py").write_text(AUDIT)
    env = {**os.environ, "OUT": str(out), "GPU_SESSION_WORK": str(work), "PYTHON": sys.executable,
           "GPU_SESSION_AUDIT": str(audit), "GPU_SESSION_HIDE": ",".join(hidden_modules()),
           "PYTHONPATH": str(site)}  # fmt: skip
    result = subprocess.run(["bash", str(SCRIPT), "--cpu"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=1800)  # fmt: skip
    return out, result, audit


def check_every_part_recorded(out: Path) -> None:
    """Every part wrote its result, the summary says each is ok, and at most 8 files are there to come back."""
    files = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert files == OUT_FILES, files  # exactly the 8 files a run call brings back
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", name) for name in files)
    assert all((out / name).stat().st_size < 16 * 1024**2 for name in files)

    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["parts"]) == PARTS
    not_ok = {name: part for name, part in summary["parts"].items() if part["status"] != "ok"}
    assert not not_ok, json.dumps(not_ok, indent=1)[-4000:]
    text = (out / "summary.md").read_text()
    assert all(f"| {name} |" in text for name in PARTS)
    assert "transformers " in text and "cannot import" not in text
    assert (out / "tracebacks.txt").read_text() == "no traceback in any log\n", (out / "tracebacks.txt").read_text()

    bench = summary["parts"]["1-bench"]["bench"]
    assert bench["complete"] and not bench["skipped_for_time"]
    rows = {figure["name"]: figure["value"] for figure in bench["figures"]}
    assert {"memory bandwidth", "model build", "decode batch 2"} <= set(rows)
    assert any(name.startswith("LoRA step") for name in rows), rows
    assert not [name for name, value in rows.items() if value in ("failed", "out of memory")], rows
    table = (out / "1-bench.md").read_text()
    assert all(f"| {name} |" in table for name in rows)

    tiny = summary["parts"]["2-train-tiny"]["run"]
    assert [row["step"] for row in tiny["evaluations"]] == [0, 1, 2] and tiny["best"] and tiny["final"]
    for name in ("2-train-qwen14b-shape", "3-async"):
        part = summary["parts"][name]
        assert [row["step"] for row in part["run"]["evaluations"]] == [0, 2, 4], part["run"]
        assert part["run"]["best"] and part["run"]["final"]
        assert part["model"]["layers"] == 2 and part["model"]["per_layer_bytes"] > 0
    memory = summary["parts"]["2-train-qwen14b-shape"]["memory"]
    assert memory["training: train_step"]["n"] == 4 and memory["training: evaluation"]["n"] == 3
    beside = summary["parts"]["3-async"]["memory"]
    assert beside["training: train_step"]["n"] == 4 and "training: evaluation" not in beside
    assert beside["evaluator: evaluation"]["n"] == 3 and beside["evaluator: evaluation"]["peak_bytes"] > 0
    assert "evaluator: evaluator_process_end" in beside
    assert "== the evaluator's log:" in (out / "3-async.log").read_text()


def check_imports(audit: Path) -> None:
    """The distributions of every module the session's processes imported (the bench, training, the evaluator, the
    reports) are the device image's or carried (bench/gpu_wheels.py); each wheel that fills a gap is used."""
    lists = list(audit.glob("*.txt"))
    assert len(lists) >= 5, "the bench, two training runs, an evaluator and the reports each write one"
    owners = importlib.metadata.packages_distributions()
    modules = {module for path in lists for module in path.read_text().split() if module in owners}
    ok = allowed()
    missing = {m: owners[m] for m in modules if not any(normalized(d) in ok for d in owners[m])}
    assert not missing, f"imported, but neither on the device nor carried: {missing}"
    seen = {normalized(d) for m in modules for d in owners[m]}
    image = {normalized(name) for name in gpu_wheels.IMAGE_PACKAGES}
    gaps = {normalized(name) for name, _, _ in gpu_wheels.WHEELS} - image
    assert gaps <= set(seen), f"carried but never imported: {sorted(gaps - set(seen))}"


def test_the_script_parses_and_names_its_parts():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    for name in PARTS[1:]:
        assert f"--name {name}" in text
    assert all(name in text for name in OUT_FILES - {"summary.md", "summary.json", "tracebacks.txt", "1-bench.md"})


def test_the_wheels_pinned_fit_the_project_and_are_checked(tmp_path):
    """Each pin satisfies pyproject.toml's bound for it; `--check` lists what a wheel folder lacks."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    bounds = {normalized(Requirement(d).name): Requirement(d).specifier
              for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}  # fmt: skip
    for name, version, _ in gpu_wheels.WHEELS:
        if normalized(name) in bounds:
            assert version in bounds[normalized(name)], f"{name}=={version}: pyproject asks {bounds[normalized(name)]}"
    assert gpu_wheels.IMAGE_TRANSFORMERS in bounds["transformers"]  # the image's own serves: none is carried
    assert "transformers" not in {normalized(name) for name, _, _ in gpu_wheels.WHEELS}
    (tmp_path / "stale-1.0-py3-none-any.whl").write_bytes(b"")
    problems = gpu_wheels.check(tmp_path)
    assert any(p.startswith("trl==") for p in problems)
    assert any("stale-1.0" in p for p in problems)


def test_tracebacks_are_cut_at_their_exception_line():
    log = textwrap.dedent(
        """\
        progress
        Traceback (most recent call last):
          File "a.py", line 1, in <module>
            f()
        ValueError: bad

        During handling of the above exception, another exception occurred:

        Traceback (most recent call last):
          File "b.py", line 2, in <module>
        RuntimeError: worse
        more progress
        """
    )
    found = report.tracebacks_in(log)
    assert [line for line, _ in found] == [2]
    assert found[0][1][-1] == "RuntimeError: worse" and "more progress" not in found[0][1]


def test_the_evaluator_command_runs_through_the_memory_wrapper():
    import gpu_session_train as train_helper

    def original(run_dir, subdir, helpers=0):
        return [sys.executable, "-m", "probdiff_callback.cli", "watch", str(run_dir), "--started-by-training"]

    command = train_helper.evaluator_command_through_this_file(original)("RUN", "probdiff")
    assert command[:4] == [sys.executable, str(ROOT / "bench" / "gpu_session_train.py"), "evaluator", "--"]
    assert command[4:] == ["-m", "probdiff_callback.cli", "watch", "RUN", "--started-by-training"]
