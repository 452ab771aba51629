"""The README's callback snippet, run as written on the `tiny` model (1 step, answers capped at 16 new tokens)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _distributed_eval import chat_dataset, load_tiny

from probdiff_callback.runs import run_files

README = Path(__file__).resolve().parents[1] / "README.md"


def callback_snippet() -> str:
    section = README.read_text(encoding="utf-8").split("## The callback in your own Trainer", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


# trl's SFTConfig sets gradient_checkpointing=True, which transformers 5 reads under its deprecated name
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
# what the snippet's DataLoader says on a machine without a GPU, where SFTConfig's pin_memory=True does nothing
@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator is found:UserWarning")
def test_the_readme_callback_snippet_trains_and_evaluates(tmp_path, tiny_model_path, monkeypatch):
    import trl

    import probdiff_callback

    monkeypatch.chdir(tmp_path)
    # The snippet's 256 new tokens, capped: `tiny` writes no language and stops at no end of turn, so each text would
    # be 256 steps of its 152k-token head (minutes); what the test checks is that the snippet trains and evaluates.
    written = probdiff_callback.ProbDiffConfig
    monkeypatch.setattr(probdiff_callback, "ProbDiffConfig", lambda **kw: written(**{**kw, "max_new_tokens": 16}))
    # and its 3 epochs (a full fine-tune of a 152k-token head) cut to one step of a batch of 2: the base model's
    # evaluation, then the last step's
    sft_config = trl.SFTConfig
    monkeypatch.setattr(trl, "SFTConfig", lambda **kw: sft_config(**{**kw, "max_steps": 1}))
    model, tokenizer = load_tiny(tiny_model_path)
    data = chat_dataset(10)
    names = {"model": model, "tokenizer": tokenizer, "train_dataset": data.select(range(2)),
             "eval_dataset": data.select(range(8, 10))}  # fmt: skip
    exec(compile(callback_snippet(), str(README), "exec"), names)

    trainer = names["trainer"]
    rows = [r.to_json() for r in run_files.read_history(run_files.history_path(tmp_path / "out"))]
    assert rows[0]["kind"] == "baseline" and rows[-1]["global_step"] == trainer.state.global_step > 0
    assert all(r["error"] is None for r in rows)
    assert all(r["summary"]["n"] == 2 for r in rows)  # the two held-out chats
    assert all(r["cost"]["answer_tokens"] <= 2 * 16 for r in rows)  # the cap reached the callback
    assert any("eval_probdiff_confidence" in entry for entry in trainer.state.log_history)


def test_the_readme_is_short_and_its_quick_start_is_two_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) < 200, "the README reads in one sitting: move detail to docs/"
    quick_start = text.split("## Quick start", 1)[1]
    commands = re.search(r"```bash\n(.*?)```", quick_start, re.S).group(1).strip().splitlines()
    assert commands == ["python train/sft.py recipe=blog model=tiny", "python -m pytest -q"]
