"""docs/async.md's SLURM script for training across nodes, run as written: stand-ins for `srun` and `scontrol`
(tests/slurm/) start each job step's tasks on this machine with SLURM's variables set, so two training nodes and an
evaluator node run on one host, `tiny` on a CPU. The wiring is what is tested: each node's command gets its machine
rank, the nodes meet at the first node's address, the evaluator starts once training wrote its spec, and a finished
run is not requeued."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _launch import CHEAP, ROOT, free_port, history_rows, sft_env

pytestmark = pytest.mark.slow  # the script starts processes

STANDINS = Path(__file__).resolve().parents[1] / "slurm"


def script(heading: str) -> str:
    """The first bash block under `heading` in docs/async.md, as a user copies it."""
    text = (ROOT / "docs" / "async.md").read_text()
    section = text[text.index(heading) :]
    start = section.index("```bash\n") + len("```bash\n")
    return section[start : section.index("\n```", start)] + "\n"


def test_the_across_nodes_script_trains_on_two_nodes_and_evaluates_on_a_third(tmp_path):
    (tmp_path / "job.sh").write_text(script("### SLURM: training across nodes"))
    (tmp_path / "train").symlink_to(ROOT / "train")  # the script runs from the checkout: `python train/sft.py`
    training = ["recipe=blog", *[a for a in CHEAP if not a.startswith("max_steps")], "max_steps=3"]
    env = sft_env(
        PATH=os.pathsep.join([str(STANDINS), str(Path(sys.executable).parent), os.environ["PATH"]]),
        SLURM_NNODES="3", SLURM_JOB_NODELIST="node[0-2]", SLURM_JOB_ID="42", SCONTROL_LOG=str(tmp_path / "scontrol"),
        GPUS_PER_NODE="1", TRAINING_ARGS=" ".join(training), RUN="run", MAIN_PORT=str(free_port()),
    )  # fmt: skip
    job = subprocess.run(["bash", "job.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-4000:]
    assert "2 training processes" in output and "Traceback" not in output, output[-4000:]
    assert not (tmp_path / "scontrol").exists(), "a finished run is not requeued"
    run = tmp_path / "run"
    assert (run / "final").is_dir() and (run / "best").is_symlink()
    assert [row["global_step"] for row in history_rows(run)] == [0, 1, 2, 3]
    assert output.count("probdiff watch: step 3: ") == 1, "the evaluator on its own node evaluated the last step once"
