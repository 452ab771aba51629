"""The reference pipeline's way, as a whole process: one query at a time with HF `generate`
(global-RNG sampling over the full vocabulary), then scoring one text at a time with a full
forward and a full-vocabulary fp32 log-softmax, prompt and response tokenized jointly.

Usage: python bench/_plain_loop.py QUERIES MAX_NEW_TOKENS OUT_JSON
"""

import json
import sys
import time

import torch

started = time.time()
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from probdiff_callback.core.prompts import REWRITER, refinement_request  # noqa: E402
from probdiff_callback.core.queries import load_queries  # noqa: E402
from probdiff_callback.models.presets import tiny_model_dir  # noqa: E402

queries_path, max_new_tokens, out_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
limit = int(sys.argv[4]) if len(sys.argv) > 4 else None
path = tiny_model_dir()
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
tokenizer = AutoTokenizer.from_pretrained(path)
queries = load_queries(queries_path)[:limit]
torch.manual_seed(0)
stop = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|im_start|>", "<|endoftext|>")]


def chat(text):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def generate(text, temperature, top_p):
    ids = tokenizer(chat(text), return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **ids,
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            top_k=0,
            max_new_tokens=max_new_tokens,
            eos_token_id=stop,
            pad_token_id=tokenizer.pad_token_id,
            repetition_penalty=1.0,
        )
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def score(prompt_text, response):
    full = tokenizer(prompt_text + response, return_tensors="pt", add_special_tokens=False)["input_ids"]
    n_prompt = len(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
    if full.shape[1] <= n_prompt:
        return float("nan")
    with torch.no_grad():
        logp = torch.log_softmax(model(full).logits.float(), dim=-1)[0]
    targets = full[0, n_prompt:]
    return logp[n_prompt - 1 : -1].gather(1, targets[:, None]).mean().item()


ds = []
for q in queries:
    # temperature only, top_p 1: the reference code's vLLM settings (and our defaults)
    answer = generate(q.text, 0.7, 1.0)
    revised = generate(refinement_request(REWRITER, q.text, answer), 0.1, 1.0)
    prompt = chat(q.text)
    ds.append(score(prompt, revised) - score(prompt, answer))
json.dump({"n": len(ds), "seconds": time.time() - started, "d": ds}, open(out_path, "w"))
