"""vLLM as the engine that writes answers and revisions (`use_vllm=true`), with what it needs beyond the method: an
engine started in this process and handed the weights of each evaluation, or a connection to a server you started, and
the watch on a slow server (TRL keeps the same apart, in `trl/generation/`). The engine protocol and the evaluator's
default engine are the method's own (`core/engine.py`, `core/decoding.py`'s `HFEngine`).

- `vllm`: `VLLMGeneration`, the one owner of "start vLLM for this model and hand it the weights being evaluated";
- `vllm_colocate`: vLLM in the evaluating process (`vllm.LLM`), `vllm_server`: a `vllm serve` you started, over HTTP,
  with `liveness`, whether it is alive and making progress;
- `vllm_common`: what both share (sampling stated whole, texts from token ids, whether vLLM can run here).
"""
