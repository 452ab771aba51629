"""train/sft.py end to end with model=tiny for every recipe (a few steps, offline, in a temporary directory): the run's
files, truncation accounting, Ctrl-C. The blog run and Ctrl-C as a user starts them (processes); the other recipes
through the script's `main` in the test's process. A resume past the run's end: e2e/test_checkpoints.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from _launch import CHEAP, ROOT, history_rows, refused_here, run_sft, sft_command, sft_env, sft_here

from probdiff_callback.runtime.threads import choose_threads
from probdiff_callback.training.recipe import TASKS

pytestmark = pytest.mark.slow  # every test here trains (most start the training script)


def assert_self_contained(directory: Path) -> None:
    assert (directory / "adapter_config.json").is_file() and (directory / "adapter_model.safetensors").is_file()
    assert (directory / "tokenizer_config.json").is_file() and (directory / "tokenizer.json").is_file()
    template = directory / "chat_template.jinja"
    has_template = template.is_file() or "chat_template" in json.loads(
        (directory / "tokenizer_config.json").read_text()
    )
    assert has_template
    stops = json.loads((directory / "generation_config.json").read_text())["eos_token_id"]
    assert 151645 in (stops if isinstance(stops, list) else [stops])  # <|im_end|>


def test_blog_end_to_end_through_accelerate_launch(blog_run):
    """conftest's `blog_run`: `accelerate launch train/sft.py recipe=blog` with CHEAP's 2 steps (W&B offline: its
    lines are test_wandb_run.py's)."""
    run_dir, out = blog_run.run_dir, blog_run.stdout
    # asked for 2 processes without --multi_gpu: accelerate started one, and the run says so with the flag
    assert "1 training process; 2 were asked for (--num_processes 2), but accelerate started 1: add --multi_gpu" in out
    rows = history_rows(run_dir)
    assert [(r["global_step"], r["kind"]) for r in rows] == [(0, "baseline"), (1, "evaluate"), (2, "evaluate")]
    assert all(r["summary"] is not None and r["summary"]["n"] == 3 and r["error"] is None for r in rows)
    for step in (1, 2):
        assert_self_contained(run_dir / f"checkpoint-{step}")
        assert rows[step]["checkpoint"] is not None
    assert_self_contained(run_dir / "final")
    assert (run_dir / "best").is_symlink() and (run_dir / "best").resolve().name in ("checkpoint-1", "checkpoint-2")
    assert (run_dir / "probdiff" / "probdiff.png").is_file()
    # the resolved config is saved and loads back
    from omegaconf import OmegaConf

    saved = OmegaConf.load(run_dir / "recipe.yaml")
    assert saved.model == "tiny" and saved.max_steps == 2 and saved.lora.r == 64
    # threads: accelerate's injected OMP_NUM_THREADS=1 is replaced by the machine's free cores
    cores = len(os.sched_getaffinity(0))
    chosen = re.search(
        r"(\d+) CPU threads per process \((\d+) cores(?:, (\d+) busy with other processes,)? / 1 local", out
    )
    assert chosen is not None, out
    count, seen_cores, busy = int(chosen[1]), int(chosen[2]), int(chosen[3] or 0)
    assert seen_cores == cores and count == choose_threads(cores, 1, busy)
    # the summary table: step, loss, confidence with interval, mean d, and where everything is
    assert "step" in out and "eval loss" in out and "95% CI" in out and "mean d" in out
    table = out[out.index("ProbDiff over training") :]
    assert len([line for line in table.splitlines() if line.strip().startswith(("0 ", "1 ", "2 "))]) >= 3
    # how many answers/revisions hit the cap (8 new tokens cut most of the tiny model's answers)
    assert "capped: answers/revisions that hit max_new_tokens=8" in table
    for row in rows:
        line = next(line for line in table.splitlines() if line.strip().startswith(f"{row['global_step']} "))
        assert f"{row['summary']['n_capped']}/{row['summary']['n_revision_capped']}" in line.split()  # its own cell
    assert any(row["summary"]["n_capped"] > 0 for row in rows)
    assert "offline samples" in out and "Best checkpoint: step" in out and f"{run_dir.name}/best" in out
    # one pick everywhere: the end-of-run table, RUN_DIR/best, the Trainer's record, probdiff select
    from probdiff_callback.analysis.select import select_checkpoints

    picked = int(re.search(r"Best checkpoint: step (\d+)", out)[1])
    assert (run_dir / "best").resolve().name == f"checkpoint-{picked}"
    state = json.loads((run_dir / "checkpoint-2" / "trainer_state.json").read_text())
    assert Path(state["best_model_checkpoint"]).name == f"checkpoint-{picked}"
    selection = select_checkpoints(run_dir)
    assert (
        selection.pick.metric
        == json.loads((run_dir / "probdiff" / "selection.json").read_text())["metric_for_best_model"]
    )
    assert selection.best_checkpoint.global_step == picked
    card = (run_dir / "README.md").read_text()
    assert "[None]" not in card and "`probdiff tiny`" in card and 'model="None"' not in card


def test_checkpoint_loads_for_probdiff_eval(blog_run):
    from probdiff_callback.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(
        "tiny", adapter=str(blog_run.run_dir / "checkpoint-2"), dtype="float32", device="cpu"
    )
    assert type(model).__name__ == "PeftModelForCausalLM" and tokenizer.chat_template


def summarization_prompts_reaching(qwen_tokenizer, length: int) -> tuple[int, int]:
    """(conversations whose prompt alone fills `length` tokens, all conversations) of the summarization samples,
    counted from prompt lengths, independently of sft.py's assistant-mask count."""
    train = [json.loads(line) for line in (ROOT / "data/samples/summarization/train.jsonl").read_text().splitlines()]
    reaching = sum(
        len(
            qwen_tokenizer.apply_chat_template(
                r["messages"][:-1], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        >= length
        for r in train
    )
    return reaching, len(train)


# translation and AlignBench with max_length=128, where their sample prompts (up to 83 and 80 tokens) leave answer
# tokens; summarization with 300: some sample articles fill it before the summary starts
EXTRA = {"translation": ["max_length=128"], "summarization": ["max_length=300"], "alignbench": ["max_length=128"]}


@pytest.mark.parametrize("task", [t for t in TASKS if t != "blog"])
def test_other_recipes_end_to_end(task, tmp_path, tiny_model_path, qwen_tokenizer, monkeypatch, capsys,
                                  sft_in_this_process):  # fmt: skip
    """Each recipe's data, reference metrics and report, through train/sft.py's `main` in this process (the command
    as a process: the blog run above, the resume and Ctrl-C here, and e2e/test_launcher_signals.py)."""
    code, stdout, stderr = sft_here(
        [f"recipe={task}", *CHEAP, "max_steps=1", "output_dir=run", *EXTRA[task]], tmp_path, monkeypatch, capsys
    )
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    rows = history_rows(tmp_path / "run")
    assert [r["global_step"] for r in rows] == [0, 1] and all(r["summary"] is not None for r in rows)
    assert_self_contained(tmp_path / "run" / "checkpoint-1")
    if task == "alignbench":
        assert "data/samples/alignbench/train.jsonl" in stdout  # the tiny fallback says so
        assert "ProbDiff: no reference metric for" in stdout
        assert all("reference" not in r["summary"] for r in rows)
    else:  # reference metrics in the history and the summary table, and the cross-check line
        names = {"translation": ["BLEU", "chrF"], "summarization": ["ROUGE-1", "ROUGE-2", "ROUGE-L"]}[task]
        table = stdout[stdout.index("ProbDiff over training") :]
        assert all(name in table.splitlines()[1] for name in names) and "vs base" in table
        assert all(r["summary"]["reference"]["overall"] for r in rows)
        assert rows[1]["vs_base"] is not None and rows[1]["eval_loss"] is not None
    assert "Cross-check over 2 steps" in stdout
    if task == "summarization":
        # conversations that truncation leaves with no assistant token are counted and named, not dropped silently
        reaching, total = summarization_prompts_reaching(qwen_tokenizer, 300)
        assert 0 < reaching < total
        assert f"warning: {reaching} of {total} training conversations keep no assistant token" in stdout
    else:
        assert "training conversations: all" in stdout


def test_ctrl_c_says_how_to_continue(tmp_path, tiny_model_path, monkeypatch, capsys, sft_in_this_process):
    """SIGINT after the first checkpoint (Ctrl-C at the terminal): no traceback, exit 130, one line naming the
    checkpoint and the command that continues the run. Before it, while the job trains, a second job on its run
    directory stops at once naming the first's host and pid: by train/sft.py's `main` in this process (fresh and
    resume=true: the lock is checked before the checkpoints) and as a process launching two. (A lock left by a job
    killed with -9 does not block the resume: e2e/test_faults.py's step 2.)"""
    import signal
    import socket
    import time

    args = ["recipe=blog", *CHEAP, "max_steps=50", "output_dir=runs/blog/ctrl-c"]
    with open(tmp_path / "stdout.txt", "w") as stdout, open(tmp_path / "stderr.txt", "w") as stderr:
        process = subprocess.Popen(
            [*sft_command(), *args], cwd=tmp_path, env=sft_env(), stdout=stdout, stderr=stderr, text=True,
            # a shell's background job ignores SIGINT, and the child would inherit that: give it a terminal's default
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
    try:
        first = tmp_path / "runs/blog/ctrl-c/checkpoint-1"
        deadline = time.time() + 300
        while not (first / "trainer_state.json").is_file():
            assert process.poll() is None and time.time() < deadline, (tmp_path / "stderr.txt").read_text()[-3000:]
            time.sleep(0.2)
        in_use = f"is in use by another training job: host {socket.gethostname()}, pid {process.pid}"
        for extra in ([], ["resume=true"]):
            second = refused_here([*args, *extra], tmp_path, monkeypatch, capsys)
            assert in_use in second and "already has checkpoints" not in second
        two = run_sft([*args, "resume=true"], tmp_path, launcher="accelerate", processes=2, timeout=300)
        assert two.returncode != 0 and two.stderr.count(in_use) == 1, two.stderr[-3000:]
        process.send_signal(signal.SIGINT)
        process.wait(timeout=300)
    finally:
        process.kill()  # where an assertion above failed: the job ends with the test
        process.wait()
    out, err = (tmp_path / "stdout.txt").read_text(), (tmp_path / "stderr.txt").read_text()
    assert process.returncode == 130, out[-2000:] + err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    hint = next(line for line in out.splitlines() if line.startswith("interrupted: "))
    assert "the last checkpoint is runs/blog/ctrl-c/checkpoint-" in hint
    assert hint.endswith("train/sft.py " + " ".join(args) + " resume=true")
