"""Pretrain the `tiny` preset on data/samples and write its compact weights to the package.

    python -m probdiff_callback.training.build_tiny            # -> probdiff_callback/assets/tiny.safetensors

Users never run this: the weights ship with the package and are unpacked on first use
(probdiff_callback/models/presets.py). Run it only to change the tiny model on purpose, then update the
pinned hash in tests/test_presets.py and regenerate the README's example run.

With the full 152k-row LM head and softmax, the head would be nearly all of each training step's work
(its multiply-adds per token outnumber those of the two small layers many times over; docs/benchmarks.md),
although the samples use only a few thousand distinct ids. So it trains over the ids the samples use plus one class
standing for all the others (its logit raised by the log of their count, as if each had that logit).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from probdiff_callback.core.json_form import jsonl_lines
from probdiff_callback.models.presets import (
    ASSET,
    EMBED_FILL,
    EMBED_NOISE_STD,
    HEAD_NOISE_STD,
    TINY_ARCHITECTURE,
    USED_IDS,
)
from probdiff_callback.models.tokenizer import load_qwen_tokenizer
from probdiff_callback.training import PROJECT_ROOT

SAMPLES_DIR = PROJECT_ROOT / "data" / "samples"
PRETRAIN = dict(block_size=256, batch_size=8, steps=200, learning_rate=4e-3, warmup_steps=20, seed=1234)
NOISE_SCALE = 0.02  # unused ids' rows: the fill row plus this share of the trained rows' spread


def sample_conversations(samples_dir: Path) -> list[list[dict]]:
    conversations = []
    for path in sorted(samples_dir.glob("*/*.jsonl")):
        for number, line in enumerate(jsonl_lines(path.read_text(encoding="utf-8")), start=1):
            if line.strip():
                row = json.loads(line)
                if "messages" not in row:
                    raise ValueError(f"{path}:{number}: sample rows need a `messages` list")
                conversations.append(row["messages"])
    if not conversations:
        raise FileNotFoundError(f"no sample conversations under {samples_dir}/*/*.jsonl")
    return conversations


def token_stream(tokenizer, conversations: list[list[dict]]) -> list[int]:
    stream: list[int] = []
    for messages in conversations:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
    return stream


def pretrain_compact(stream: list[int], used: list[int]) -> tuple[torch.nn.Module, float]:
    """A Qwen2 model over `used` ids plus one "other" class, trained on `stream`; (model, final loss)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(PRETRAIN["seed"])
    compact = {token: i for i, token in enumerate(used)}
    n_used, n_unused = len(used), TINY_ARCHITECTURE["vocab_size"] - len(used)
    model = Qwen2ForCausalLM(Qwen2Config(**{**TINY_ARCHITECTURE, "vocab_size": n_used + 1}))
    block = PRETRAIN["block_size"]
    ids = torch.tensor([compact[t] for t in stream])
    blocks = ids[: len(ids) // block * block].view(-1, block)
    generator = torch.Generator().manual_seed(PRETRAIN["seed"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=PRETRAIN["learning_rate"], weight_decay=0.0)
    steps = PRETRAIN["steps"]

    def warmup_then_cosine(step: int) -> float:
        return min(1.0, (step + 1) / PRETRAIN["warmup_steps"]) * 0.5 * (1 + math.cos(math.pi * step / steps))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_cosine)
    other_bias = torch.zeros(n_used + 1)
    other_bias[-1] = math.log(n_unused)
    model.train()
    order, position = torch.randperm(len(blocks), generator=generator), 0
    for step in range(steps):
        if position + PRETRAIN["batch_size"] > len(order):
            order, position = torch.randperm(len(blocks), generator=generator), 0
        batch = blocks[order[position : position + PRETRAIN["batch_size"]]]
        position += PRETRAIN["batch_size"]
        logits = model(input_ids=batch).logits + other_bias
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, n_used + 1), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 20 == 0 or step == steps - 1:
            print(f"  step {step + 1}/{steps}  loss {loss.item():.3f}", flush=True)
    return model, loss.item()


def compact_tensors(model: torch.nn.Module, used: list[int]) -> dict[str, torch.Tensor]:
    """The asset's tensors: the compact weights in bf16 plus what the expansion needs."""
    state = {name: tensor.detach().to(torch.bfloat16).contiguous() for name, tensor in model.state_dict().items()}
    embed = state["model.embed_tokens.weight"]
    head = state["lm_head.weight"]
    state["model.embed_tokens.weight"] = embed[:-1].contiguous()  # the "other" class has no input embedding
    state[USED_IDS] = torch.tensor(used, dtype=torch.int64)
    state[EMBED_FILL] = embed[:-1].float().mean(0).to(torch.bfloat16)
    state[EMBED_NOISE_STD] = (NOISE_SCALE * embed[:-1].float().std()).to(torch.bfloat16).reshape(1)
    state[HEAD_NOISE_STD] = (NOISE_SCALE * head[:-1].float().std()).to(torch.bfloat16).reshape(1)
    return state


def main(argv: list[str] | None = None) -> int:
    from safetensors.torch import save_file

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ASSET)
    parser.add_argument("--samples", type=Path, default=SAMPLES_DIR)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one thread: the same build on any machine that runs this script
    started = time.time()
    tokenizer = load_qwen_tokenizer()
    stream = token_stream(tokenizer, sample_conversations(args.samples))
    used = sorted(set(stream) | set(tokenizer.all_special_ids))
    print(f"Pretraining the tiny model on {len(stream):,} tokens ({len(used):,} distinct ids) ...", flush=True)
    model, final_loss = pretrain_compact(stream, used)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    metadata = {
        "format": "pt",
        "tokens": str(len(stream)),
        "final_loss": f"{final_loss:.4f}",
        "pretrain": json.dumps(PRETRAIN),
    }
    save_file(compact_tensors(model, used), args.out, metadata=metadata)
    print(
        f"Wrote {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB) in {time.time() - started:.0f}s; "
        f"final loss {final_loss:.3f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
