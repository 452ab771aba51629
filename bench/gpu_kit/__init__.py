"""The GPU benchmark kit's modules; `bench/gpu.py` is its entry point (the command, the run, the table).

- `report`: a row of the table (`Figure`), the table itself, number formats, progress on stderr;
- `floor`: what a model of a given shape costs per token, and the floors of decoding, scoring and training;
- `device`: timing and memory on CUDA or CPU, the device's name and versions, its bandwidth and matmul rate;
- `workload`: the blog recipe's settings, prompts and training text, and the model of a given shape;
- `paths`: the decoding paths, each an engine for `evaluate(engine=...)`, and the wrapper that records their calls;
- `evaluation`: one evaluation through an engine, its stages as the evaluator timed them, against the floor;
- `vllm_path`: the same evaluation through vLLM in the process (colocate), a LoRA adapter loaded by path;
- `training`: the LoRA and QLoRA steps, and an evaluation's share of training time;
- `nominal`: the floor alone, from nominal bandwidth and FLOP/s (`--floor-only`).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
