"""A plain batched `model.generate` pipeline doing ProbDiff's work, as a whole process: answers at temperature 0.7,
revisions at 0.1 (top_p 1, no top_k, HF's own sampling from the global generator), both in batches of BATCH with
left padding, then each text scored after its chat-formatted query with one batched forward and a full-vocabulary
fp32 log-softmax. What a user would write with transformers alone.

Usage: python bench/_plain_generate.py MODEL QUERIES LIMIT MAX_NEW_TOKENS BATCH OUT_JSON
"""

import json
import sys
import time

import torch

started = time.time()
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from probdiff_callback.core.prompts import REWRITER, refinement_request  # noqa: E402
from probdiff_callback.core.queries import load_queries  # noqa: E402
from probdiff_callback.models import resolve_model_path  # noqa: E402
from probdiff_callback.runtime.threads import configure_threads  # noqa: E402

model_name, queries_path, limit, max_new_tokens, batch, out_path = sys.argv[1:7]
limit, max_new_tokens, batch = int(limit), int(max_new_tokens), int(batch)
configure_threads()  # the same rule as `probdiff eval`, so both get the same threads
path = resolve_model_path(model_name)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
tokenizer = AutoTokenizer.from_pretrained(path)
tokenizer.padding_side = "left"
queries = [q.text for q in load_queries(queries_path)[:limit]]
torch.manual_seed(0)


def chat(text: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def generate(texts: list[str], temperature: float) -> list[str]:
    inputs = tokenizer([chat(t) for t in texts], return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **inputs, do_sample=True, temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens
        )
    return [t.strip() for t in tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)]


def score(texts: list[str], responses: list[str]) -> list[float]:
    prompts = [tokenizer(chat(t), add_special_tokens=False)["input_ids"] for t in texts]
    answers = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in responses]
    width = max(len(p) + len(a) for p, a in zip(prompts, answers))
    ids = torch.full((len(texts), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(texts), width), dtype=torch.long)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        mask[i, : len(p) + len(a)] = 1
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
    means = []
    for i, (p, a) in enumerate(zip(prompts, answers)):
        if not a:
            means.append(float("nan"))
            continue
        positions = torch.arange(len(p) - 1, len(p) + len(a) - 1)
        means.append(logp[i, positions, torch.tensor(a)].mean().item())
    return means


d, lengths = [], []
for start in range(0, len(queries), batch):
    chunk = queries[start : start + batch]
    answers = generate(chunk, 0.7)
    revisions = generate([refinement_request(REWRITER, q, a) for q, a in zip(chunk, answers)], 0.1)
    d += [r - a for a, r in zip(score(chunk, answers), score(chunk, revisions))]
    lengths += [len(tokenizer(a)["input_ids"]) for a in answers + revisions]
json.dump({"n": len(d), "seconds": time.time() - started, "d": d, "mean_length": sum(lengths) / len(lengths)},
          open(out_path, "w"))  # fmt: skip
