"""The plain pipelines `probdiff eval` is measured against (bench_eval.py): ProbDiff's work done with transformers
alone, as a whole process. Answers at temperature 0.7, revisions at 0.1 with the Response Refinement Prompt, both at
top_p 1 with no top_k (the reference code's settings) and HF's own sampling from the global generator; each text is
scored after its chat-formatted query with a full-vocabulary fp32 log-softmax.

  loop     the reference pipeline's way: one query at a time with `generate`, then one text at a time scored, prompt
           and response tokenized jointly (BATCH is not used);
  batched  what a user would write with transformers: BATCH queries at a time with left padding, then each batch's
           texts scored in one forward.

Usage: python bench/_plain.py {loop|batched} MODEL QUERIES LIMIT MAX_NEW_TOKENS BATCH OUT_JSON
Writes {"n", "seconds", "d", "mean_length"} (d of each query; answers' and revisions' mean length in tokens).
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

mode, model_name, queries_path, limit, max_new_tokens, batch, out_path = sys.argv[1:8]
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


# --- loop: one query, one text at a time --------------------------------------------------------------------------
STOPS = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|im_start|>", "<|endoftext|>")]


def generate_one(text: str, temperature: float) -> str:
    ids = tokenizer(chat(text), return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
                             max_new_tokens=max_new_tokens, eos_token_id=STOPS, pad_token_id=tokenizer.pad_token_id,
                             repetition_penalty=1.0)  # fmt: skip
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def score_one(prompt_text: str, response: str) -> float:
    full = tokenizer(prompt_text + response, return_tensors="pt", add_special_tokens=False)["input_ids"]
    n_prompt = len(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
    if full.shape[1] <= n_prompt:
        return float("nan")
    with torch.no_grad():
        logp = torch.log_softmax(model(full).logits.float(), dim=-1)[0]
    return logp[n_prompt - 1 : -1].gather(1, full[0, n_prompt:, None]).mean().item()


def loop() -> tuple[list[float], list[str]]:
    d, texts = [], []
    for query in queries:
        answer = generate_one(query, 0.7)
        revised = generate_one(refinement_request(REWRITER, query, answer), 0.1)
        d.append(score_one(chat(query), revised) - score_one(chat(query), answer))
        texts += [answer, revised]
    return d, texts


# --- batched: BATCH queries at a time, left padding -------------------------------------------------------------
def generate_batch(texts: list[str], temperature: float) -> list[str]:
    inputs = tokenizer([chat(t) for t in texts], return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **inputs, do_sample=True, temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens
        )
    return [t.strip() for t in tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)]


def score_batch(texts: list[str], responses: list[str]) -> list[float]:
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
        positions = torch.arange(len(p) - 1, len(p) + len(a) - 1)
        means.append(logp[i, positions, torch.tensor(a)].mean().item() if a else float("nan"))
    return means


def batched() -> tuple[list[float], list[str]]:
    d, texts = [], []
    for start in range(0, len(queries), batch):
        chunk = queries[start : start + batch]
        answers = generate_batch(chunk, 0.7)
        revisions = generate_batch([refinement_request(REWRITER, q, a) for q, a in zip(chunk, answers)], 0.1)
        d += [r - a for a, r in zip(score_batch(chunk, answers), score_batch(chunk, revisions))]
        texts += answers + revisions
    return d, texts


d, texts = {"loop": loop, "batched": batched}[mode]()
lengths = [len(tokenizer(t)["input_ids"]) for t in texts]
result = {"n": len(d), "seconds": time.time() - started, "d": d, "mean_length": sum(lengths) / len(lengths)}
with open(out_path, "w") as out:
    json.dump(result, out)
