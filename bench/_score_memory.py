"""Peak memory of scoring 8 sequences x 1,024 tokens with the 152k vocabulary, in this process.

Usage: python bench/_score_memory.py {chunked|plain|fp64}
Prints one JSON line: the rise of peak RSS (VmHWM, reset after loading) during scoring.
`fp64` is the accuracy reference (one sequence at a time, log-softmax in float64).
"""

import json
import sys

import torch

from probdiff_callback.core.scoring import score_batch
from probdiff_callback.models import load_model_and_tokenizer


def status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


mode = sys.argv[1]
model, tokenizer = load_model_and_tokenizer("tiny", dtype="float32", device="cpu")
generator = torch.Generator().manual_seed(0)
ids = torch.randint(0, 150_000, (8, 1024), generator=generator)
prompts, responses = [row[:512].tolist() for row in ids], [row[512:].tolist() for row in ids]
with open("/proc/self/clear_refs", "w") as handle:
    handle.write("5")  # reset VmHWM to the current RSS
before = status_kib("VmHWM")
with torch.no_grad():
    if mode == "chunked":
        scores = [s for s, _ in score_batch(model, prompts, responses, tokenizer.pad_token_id, chunk_size=512)]
    elif mode == "plain":
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)
        scores = logp[:, 511:-1].gather(2, ids[:, 512:, None]).squeeze(-1).mean(-1).tolist()
    else:
        scores = []
        for row in ids:
            logp = torch.log_softmax(model(row[None]).logits[0].double(), dim=-1)
            scores.append(logp[511:-1].gather(1, row[512:, None]).mean().item())
peak = (status_kib("VmHWM") - before) * 1024
print(json.dumps({"mode": mode, "peak_bytes": peak, "scores": scores}))
