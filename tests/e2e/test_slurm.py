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
from _launch import ROOT, SETTINGS, STEPS, free_port, history_rows, sft_env

from probdiff_callback.core.queries import read_jsonl

pytestmark = pytest.mark.slow  # the script starts processes

STANDINS = Path(__file__).resolve().parents[1] / "slurm"


def script(heading: str) -> str:
    """The first bash block under `heading` in docs/async.md, as a user copies it."""
    text = (ROOT / "docs" / "async.md").read_text()
    section = text[text.index(heading) :]
    start = section.index("```bash\n") + len("```bash\n")
    return section[start : section.index("\n```", start)] + "\n"


def test_the_across_nodes_script_trains_on_two_nodes_and_evaluates_on_a_third(tmp_path, uninterrupted):
    (tmp_path / "job.sh").write_text(script("### SLURM: training across nodes"))
    (tmp_path / "train").symlink_to(ROOT / "train")  # the script runs from the checkout: `python train/sft.py`
    training = [*SETTINGS, "output_dir=run"]
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
    reference = uninterrupted(2)[0]  # the loop, two processes on one machine
    rows, expected = history_rows(run), history_rows(reference)
    assert [row["global_step"] for row in rows] == list(range(STEPS + 1))
    assert output.count(f"probdiff watch: step {STEPS}: ") == 1, "the evaluator's node evaluated the last step once"
    # the evaluator's records equal those of the loop's two ranks on one machine: same texts, scores within float
    # noise (one process scores what two scored in shares)
    for row, want in zip(rows, expected):
        got, wanted = (read_jsonl(folder / "probdiff" / r["records"]) for folder, r in ((run, row), (reference, want)))
        assert [(r["id"], r["response"], r["revisions"]) for r in got] == [
            (r["id"], r["response"], r["revisions"]) for r in wanted
        ], row["global_step"]
        for key in ("logp_response", "logp_revised"):
            assert all(abs(a[key] - b[key]) < 1e-4 for a, b in zip(got, wanted)), (row["global_step"], key)
