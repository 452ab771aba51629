"""The `tiny` preset: a 2-layer Qwen2 model with the real Qwen-14B-Chat vocabulary, pretrained
briefly and deterministically on the project's own sample texts.

A random model's distribution is near uniform, so an answer and its revision score alike
(d ~ 0) and the metric reads it as confident. A short pretraining on chat-formatted
samples gives it real preferences, and teaches it the chatml turns and to stop with
<|im_end|>. Built once per machine (under the cache directory) and reused.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path

import torch

from probdiff_callback.cache import cache_dir, file_lock
from probdiff_callback.tokenizer import load_qwen_tokenizer

TINY_VERSION = "tiny-3"
SAMPLES_DIR = Path(__file__).resolve().parents[1] / "data" / "samples"
TINY_ARCHITECTURE = dict(
    vocab_size=152064,  # as Qwen-14B-Chat: 213 padded rows past the 151,851 ids with text
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
PRETRAIN = dict(block_size=256, batch_size=8, steps=200, learning_rate=4e-3, warmup_steps=20, seed=1234)


def sample_files(samples_dir: Path = SAMPLES_DIR) -> list[Path]:
    files = sorted(samples_dir.glob("*/*.jsonl"))
    if not files:
        raise FileNotFoundError(
            f"no sample texts under {samples_dir}: the `tiny` preset is pretrained on the project's "
            "data/samples/*/*.jsonl. Install the project from its source tree (pip install -e .)."
        )
    return files


def sample_conversations(files: list[Path]) -> list[list[dict]]:
    conversations = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                row = json.loads(line)
                if "messages" not in row:
                    raise ValueError(f"{path}:{number}: sample rows need a `messages` list")
                conversations.append(row["messages"])
    return conversations


def _fingerprint(files: list[Path]) -> str:
    digest = hashlib.sha256(json.dumps([TINY_VERSION, TINY_ARCHITECTURE, PRETRAIN]).encode())
    for path in files:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def tiny_model_dir(samples_dir: Path = SAMPLES_DIR) -> Path:
    """The cached `tiny` model directory, built on first use."""
    files = sample_files(samples_dir)
    target = cache_dir() / "models" / f"{TINY_VERSION}-{_fingerprint(files)}"
    with file_lock(target.with_suffix(".lock")):
        if not (target / "config.json").is_file():
            build_tiny_model(files, target)
    return target


def build_tiny_model(files: list[Path], target: Path) -> None:
    """Pretrain on the samples and save model + tokenizer to `target`.

    A full-vocabulary softmax makes each step ~20x dearer than the rest of this model,
    although the samples use only a few thousand distinct tokens. So we train over the
    tokens the samples use plus one class standing for all the others (its logit raised
    by log of their count, as if each had that logit), then expand: every unused token
    gets that class's LM-head row (plus small noise). The full model's distribution then
    equals the trained one's, and unused tokens share the small mass it learned for them.
    """
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = load_qwen_tokenizer()
    started = time.time()
    print(f"Building the `tiny` model (once per machine) into {target} ...", flush=True)
    torch.manual_seed(PRETRAIN["seed"])
    stream: list[int] = []
    for messages in sample_conversations(files):
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
    used = sorted(set(stream) | set(tokenizer.all_special_ids))
    compact = {token: i for i, token in enumerate(used)}
    n_used, n_unused = len(used), TINY_ARCHITECTURE["vocab_size"] - len(used)

    small = Qwen2ForCausalLM(Qwen2Config(**{**TINY_ARCHITECTURE, "vocab_size": n_used + 1}))
    block = PRETRAIN["block_size"]
    ids = torch.tensor([compact[t] for t in stream])
    blocks = ids[: len(ids) // block * block].view(-1, block)
    generator = torch.Generator().manual_seed(PRETRAIN["seed"])
    optimizer = torch.optim.AdamW(small.parameters(), lr=PRETRAIN["learning_rate"], weight_decay=0.0)
    steps = PRETRAIN["steps"]
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / PRETRAIN["warmup_steps"]) * 0.5 * (1 + math.cos(math.pi * step / steps))
    )
    other_bias = torch.zeros(n_used + 1)
    other_bias[-1] = math.log(n_unused)
    small.train()
    order, position = torch.randperm(len(blocks), generator=generator), 0
    for step in range(steps):
        if position + PRETRAIN["batch_size"] > len(order):
            order, position = torch.randperm(len(blocks), generator=generator), 0
        batch = blocks[order[position : position + PRETRAIN["batch_size"]]]
        position += PRETRAIN["batch_size"]
        logits = small(input_ids=batch).logits + other_bias
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, n_used + 1), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(small.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            print(f"  step {step + 1}/{steps}  loss {loss.item():.3f}", flush=True)

    config = Qwen2Config(
        **TINY_ARCHITECTURE,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    state = small.state_dict()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                trained = state[name]
                noise = torch.randn(tensor.shape, generator=generator) * 0.02 * trained[:-1].std()
                fill = trained[:-1].mean(0) if name == "model.embed_tokens.weight" else trained[-1]
                tensor.copy_(fill + noise)
                tensor[torch.tensor(used)] = trained[:-1]
            else:
                tensor.copy_(state[name])

    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|im_start|>")],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    seconds = round(time.time() - started, 1)
    (tmp / "probdiff_tiny.json").write_text(
        json.dumps(
            {"version": TINY_VERSION, "tokens": len(stream), "distinct_tokens": n_used, "final_loss": round(loss.item(), 3),
             "seconds": seconds, **PRETRAIN},
            indent=2,
        )
    )
    os.replace(tmp, target)
    print(f"Built the `tiny` model in {seconds:.0f}s ({len(stream):,} tokens of samples, {n_used:,} distinct).", flush=True)
