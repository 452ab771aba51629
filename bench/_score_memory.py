"""Peak memory of scoring 8 sequences x 1,024 tokens with the 152k vocabulary, in this process.

Usage: python bench/_score_memory.py {chunked|plain}
Prints one JSON line: the rise of peak RSS (VmHWM, reset after loading) during scoring.
"""

import json
import sys

import torch

from probdiff_callback.models import load_model_and_tokenizer
from probdiff_callback.scoring import score_batch


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
    else:
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)
        scores = logp[:, 511:-1].gather(2, ids[:, 512:, None]).squeeze(-1).mean(-1).tolist()
peak = (status_kib("VmHWM") - before) * 1024
print(json.dumps({"mode": mode, "peak_bytes": peak, "scores": scores}))
