"""The one way tests start the training script as a process, as a user does: `python train/sft.py [--num_processes N
--multi_gpu]` or `accelerate launch [--num_processes N --multi_gpu] train/sft.py`, offline, with W&B off, and what
they read back from a run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from _faults import FAULT_ENV, fault_env
from _once import made_once

ROOT = Path(__file__).resolve().parents[1]
SFT = ROOT / "train" / "sft.py"
# A few cheap steps: 2 optimizer steps, evaluated at 1 and 2, 3 queries of 8 new tokens; conversations cut at 64
# tokens (the blog samples' prompts, 30-40 tokens in the chat format, fit with room for 24 answer tokens; the other
# recipes' runs say their own): on `tiny`, whose vocabulary is Qwen's 152k tokens, the logits are nearly all of a
# step's cost, in proportion to the length (a 4-step run on 2 busy cores: 62 s at 128, 50 s at 64; `tiny`'s 512 doubles
# a step again)
CHEAP = [
    "model=tiny",
    "max_length=64",
    "report_to=none",
    "max_steps=2",
    "eval_steps=1",
    "save_steps=1",
    "logging_steps=1",
    "probdiff.n_queries=3",
    "probdiff.max_new_tokens=8",
    "max_eval_samples=2",
    "per_device_train_batch_size=2",
    "per_device_eval_batch_size=2",
]


def sft_command(launcher: str = "python", processes: int = 1, launcher_args: tuple[str, ...] = ()) -> list[str]:
    """The command line that starts train/sft.py: the script itself (for several processes with `accelerate launch`'s
    options, and it launches them), or through `accelerate launch` (on a CPU, `--multi_gpu` is what starts several
    DDP processes; `launcher_args` replace it, e.g. DeepSpeed's flags)."""
    several = list(launcher_args) or (["--multi_gpu"] if processes > 1 else [])
    if launcher == "accelerate":
        accelerate = shutil.which("accelerate") or "accelerate"
        # a free port for the processes' rendezvous: other tests' launches may run beside this one
        return [accelerate, "launch", "--num_processes", str(processes), "--main_process_port", "0", *several, str(SFT)]
    return [sys.executable, str(SFT), *(["--num_processes", str(processes), *several] if several else [])]


def sft_env(**extra: str | None) -> dict[str, str]:
    """The environment of a started process (its threads: conftest's `pytest_configure`); `PROBDIFF_FAULT=<plan>`
    among `extra` arms the fault seam in it; a variable given as None is unset."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", **extra}
    if extra.get(FAULT_ENV):
        env.update(fault_env(extra[FAULT_ENV]))
    return {name: value for name, value in env.items() if value is not None}


def run_sft(
    args: list[str],
    cwd: Path,
    launcher: str = "python",
    timeout: int = 600,
    processes: int = 1,
    launcher_args: tuple[str, ...] = (),
    **env: str | None,
) -> subprocess.CompletedProcess:
    """train/sft.py run to its end in `cwd`; its output captured; `env` added to the environment."""
    command = sft_command(launcher, processes, launcher_args) + args
    return subprocess.run(command, cwd=cwd, env=sft_env(**env), capture_output=True, text=True, timeout=timeout)


def history_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "probdiff" / "history.jsonl").read_text().splitlines()]


def one_error(result: subprocess.CompletedProcess) -> str:
    """A setup error as it must end: exit 2, exactly one `error:` line on stderr, no traceback; that line."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "exitcode" not in result.stderr, result.stderr[-3000:]
    assert "were not passed to `accelerate launch`" not in result.stderr, "accelerate's defaults warning"
    return lines[0]


def sft_here(args: list[str], cwd: Path, monkeypatch, capsys) -> tuple[int, str, str]:
    """train/sft.py's `main(args)` in this process, in `cwd`, as `python train/sft.py args` would run there without a
    launcher: (exit status, stdout, stderr). The test asks for the `sft_in_this_process` fixture, which undoes what
    `main` sets in the process. For what does not need a process of its own; the command as a process is the e2e
    tests'."""
    from probdiff_callback.training import sft

    capsys.readouterr()
    with monkeypatch.context() as here:
        here.chdir(cwd)
        code = sft.main(args)
    out, err = capsys.readouterr()
    return code, out, err


def refused_here(args: list[str], cwd: Path, monkeypatch, capsys) -> str:
    """`sft_here` for a run train/sft.py must refuse before it trains (a setup error, a run directory in use, a
    checkpoint it cannot resume from): exit status 2, one `error:` line on stderr, nothing else said there; that line.
    Such an error ends the same way in a process of its own, through this same `main` (`one_error`:
    e2e/test_launcher_signals.py's)."""
    code, _, err = sft_here(args, cwd, monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# ---- one cheap run that several modules read: e2e/test_sft_runs.py, e2e/test_checkpoints.py, test_wandb_run.py ----
BLOG_RUN = "runs/blog/test"  # its output_dir, relative to its working directory
BLOG_ARGS = ["recipe=blog", *[a for a in CHEAP if a != "report_to=none"], f"output_dir={BLOG_RUN}"]


@dataclass(frozen=True)
class BlogRun:
    """`accelerate launch --num_processes 2 train/sft.py` with `BLOG_ARGS` (CHEAP's 2 steps, evaluated and saved at
    each) and W&B offline, run to its end in `cwd`: one process on a CPU without `--multi_gpu`. Read it in place; a
    test that changes the run works on `copy_to(its folder)`."""

    cwd: Path
    stdout: str
    stderr: str

    @property
    def run_dir(self) -> Path:
        return self.cwd / BLOG_RUN

    def copy_to(self, cwd: Path) -> Path:
        """The run copied into `cwd` at the same relative place (its files name their checkpoints relative to the
        working directory); its run directory there."""
        shutil.copytree(self.cwd / "runs", cwd / "runs", symlinks=True)
        return cwd / BLOG_RUN


def blog_run_once(tmp_path_factory) -> BlogRun:
    """The session's one `BlogRun`, made by the first worker that asks (`_once.made_once`)."""

    def make(cwd: Path) -> None:
        # `--num_processes 2` without `--multi_gpu`, as a newcomer types it: on a CPU accelerate starts one process,
        # and the run says so with the flag that gives two (`--num_machines 1` only stands in for `--multi_gpu`)
        # (its threads chosen as on a user's machine: test_sft_runs.py checks the line)
        result = run_sft(BLOG_ARGS, cwd, launcher="accelerate", processes=2, launcher_args=("--num_machines", "1"),
                         WANDB_MODE="offline", OMP_NUM_THREADS=None)  # fmt: skip
        (cwd / "stdout.txt").write_text(result.stdout)
        (cwd / "stderr.txt").write_text(result.stderr)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    cwd = made_once(tmp_path_factory, "blog-run", make)
    return BlogRun(cwd, (cwd / "stdout.txt").read_text(), (cwd / "stderr.txt").read_text())


# ---- comparing a run that was stopped and continued with one that was not ----
STEPS = 4  # the runs compared: 4 steps, evaluated and saved at each
# threads=1: the runs compared train on one thread each whatever the load (pytest-xdist's workers set it anyway; under
# `-n 0` each process would choose by the load it sees, and weights trained on different thread counts drift apart by
# more than the 1e-4 the comparisons allow the scores)
SETTINGS = ["recipe=blog", *[a for a in CHEAP if not a.startswith("max_steps")], f"max_steps={STEPS}", "threads=1"]


def table(stdout: str) -> list[str]:
    """The end-of-run table: ProbDiff over training, its header and one row per evaluated step (no timings)."""
    lines = stdout[stdout.index("ProbDiff over training") :].splitlines()
    rows = [line for line in lines[2:] if line[:1] == " " and line.split()[0].isdigit()]
    return lines[:2] + rows


def tokens(cost: dict | None) -> dict:
    return {key: value for key, value in (cost or {}).items() if not key.endswith("_seconds")}


def assert_same_run(reference: Path, run: Path) -> None:
    """The history, every step's records and the Trainer's log equal the uninterrupted run's."""
    expected, got = history_rows(reference), history_rows(run)
    assert [r["global_step"] for r in got] == [r["global_step"] for r in expected]
    for want, have in zip(expected, got):
        assert have.get("abandoned") is None, have
        for key in want.keys() | have.keys():
            if key == "seconds" or (key == "error" and want[key]):
                continue
            if key == "checkpoint":
                assert (want[key] and Path(want[key]).name) == (have[key] and Path(have[key]).name)
            elif key == "cost":  # its seconds are the clock's; the tokens generated are the run's
                assert tokens(want[key]) == tokens(have[key]), (want["global_step"], key)
            else:
                assert want.get(key) == have.get(key), (want["global_step"], key)
        if want["records"]:
            assert (run / "probdiff" / have["records"]).read_text() == (
                reference / "probdiff" / want["records"]
            ).read_text()

    def state(directory: Path) -> dict:
        return json.loads((directory / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())

    def log(directory: Path) -> list[dict]:
        return [
            {k: v for k, v in e.items() if "runtime" not in k and "per_second" not in k}
            for e in state(directory)["log_history"]
        ]

    def best(directory: Path) -> tuple:
        kept = state(directory)
        return kept["best_metric"], kept["best_global_step"], Path(kept["best_model_checkpoint"] or "").name

    assert log(run) == log(reference), "each step logged once, with the uninterrupted run's numbers"
    assert best(run) == best(reference), "the Trainer's best model is the uninterrupted run's"


def assert_same_records(run: Path, reference: Path) -> None:
    """Every step of `run` evaluated, with `reference`'s records: the same texts, scores within float noise (a run
    that scores in other shares, or trains with another engine, as ZeRO-3 against DDP)."""
    from probdiff_callback.core.queries import read_jsonl

    rows, expected = history_rows(run), history_rows(reference)
    assert [row["global_step"] for row in rows] == [row["global_step"] for row in expected]
    for row, want in zip(rows, expected):
        got, wanted = (read_jsonl(folder / "probdiff" / r["records"]) for folder, r in ((run, row), (reference, want)))
        assert [(r["id"], r["response"], r["revisions"]) for r in got] == [
            (r["id"], r["response"], r["revisions"]) for r in wanted
        ], row["global_step"]
        for key in ("logp_response", "logp_revised"):
            assert all(abs(a[key] - b[key]) < 1e-4 for a, b in zip(got, wanted)), (row["global_step"], key)


# ---- two machines on one host: one launcher each, one run directory ----
def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def machine_command(machine: int, machines: int, port: int, launcher_args: tuple[str, ...] = ()) -> list[str]:
    """train/sft.py as machine `machine` of `machines` starts it, one training process each (`--multi_gpu` is what
    starts DDP on a CPU; `launcher_args` replace it, e.g. DeepSpeed's flags), machine 0 at 127.0.0.1:`port`."""
    return [sys.executable, str(SFT), "--num_machines", str(machines), "--machine_rank", str(machine),
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--num_processes", str(machines),
            *(launcher_args or ["--multi_gpu"])]  # fmt: skip


@dataclass
class Machines:
    """Launchers started as machines 0..n-1 (`start_machines`), each writing `cwd/machine-N.txt`."""

    launchers: list[subprocess.Popen]
    logs: list[Path]

    def wait(self, timeout: float = 600) -> list[int]:
        return [launcher.wait(timeout) for launcher in self.launchers]

    def output(self, machine: int) -> str:
        return self.logs[machine].read_text()

    def kill(self, machine: int) -> None:
        """kill -9 of everything on `machine`: its training processes, then its launcher (a machine lost)."""
        import psutil

        launcher = psutil.Process(self.launchers[machine].pid)
        for process in [*launcher.children(recursive=True), launcher]:
            process.kill()


def start_machines(
    args: list[str],
    cwd: Path,
    machines: int = 2,
    launcher_args: tuple[str, ...] = (),
    env_of: dict[int, dict[str, str]] | None = None,
    cwd_of: dict[int, Path] | None = None,
) -> Machines:
    """train/sft.py started as `machines` machines on this host (their launchers in sessions of their own), with
    `env_of[machine]` added to a machine's environment and `cwd_of[machine]` its working directory (`cwd` otherwise)."""
    port, launchers, logs = free_port(), [], []
    for machine in range(machines):
        log = cwd / f"machine-{machine}.txt"
        with log.open("w") as out:
            launchers.append(subprocess.Popen(
                [*machine_command(machine, machines, port, launcher_args), *args], cwd=(cwd_of or {}).get(machine, cwd),
                env=sft_env(**(env_of or {}).get(machine, {})), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, text=True,
            ))  # fmt: skip
        logs.append(log)
    return Machines(launchers, logs)


def still_running(processes) -> list[str]:
    """The command lines of those of `processes` (psutil.Process) that still run (a zombie has ended)."""
    import psutil

    left = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                left.append(" ".join(process.cmdline()))
        except psutil.NoSuchProcess:
            pass
    return left
