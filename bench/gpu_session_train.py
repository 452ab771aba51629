"""bench/gpu_session.sh's training helpers: a random model of a given shape saved to a folder, and train/sft.py run
with the peak memory of its training steps and of each ProbDiff evaluation recorded, in the loop and beside it.

    python bench/gpu_session_train.py make-model DIR --shape qwen-14b --layers 8 [--device cuda] [--dtype bfloat16]
    python bench/gpu_session_train.py train --memory MEM.jsonl -- recipe=blog model=DIR key=value ...

`make-model` builds the model as bench/gpu.py does (random weights allocated and initialised on the device: the kit's
`build_model`), with `--layers` decoder layers instead of the shape's (every other dimension as the shape's), and saves
it with the Qwen v1 tokenizer and a generation config that stops at <|im_end|>, as the `tiny` preset's folder is laid
out: `model=DIR` then loads it like any checkpoint.

`train` runs train/sft.py's `main` in this process (as `python train/sft.py ARGS` does without launcher options), with
nothing of the package changed: a TrainerCallback added to the trainer the script builds, and the evaluations wrapped
where the package calls them. It appends one JSON line per measurement to MEM.jsonl as it happens:

- `train_step`: each optimizer step's peak (`torch.cuda.max_memory_allocated`, reset when the step begins);
- `evaluation`: each ProbDiff evaluation in the loop (`InLoop.evaluate_model`): its peak, and what was held before;
- with `probdiff.async_eval`: the evaluator process training starts (`probdiff watch`) runs through this file's
  `evaluator` command, which records each evaluation of a queued step (`beside.loop.evaluate_request`) the same way,
  and its process's peak at its exit.

On a CPU the numbers are the process's peak RSS so far (`ru_maxrss`, which cannot be reset), marked `"cpu": true`.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MEMORY_VARIABLE = "GPU_SESSION_EVALUATOR_MEMORY"  # where the evaluator process appends its lines


# ---- the memory records ----
class Memory:
    """Peak-memory readings appended to a JSON-lines file, on CUDA where torch has initialised it, else the CPU's."""

    def __init__(self, path: Path, process: str) -> None:
        self.path, self.process = path, process
        self.highest = 0  # the highest peak read so far: the process's own, across the resets

    @staticmethod
    def on_cuda() -> bool:
        import torch

        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def reset(self) -> None:
        """A new window for the peak; the old window's goes into the process's highest first."""
        if self.on_cuda():
            import torch

            self.highest = max(self.highest, torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

    def reading(self) -> dict:
        """The peak since the last reset and what is held now (CUDA), or the peak RSS so far (CPU)."""
        if self.on_cuda():
            import torch

            return {
                "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
                "allocated_bytes": torch.cuda.memory_allocated(),
                "cpu": False,
            }
        return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cpu": True}

    def held(self) -> int | None:
        """Bytes held by tensors now; None on a CPU, where the peak RSS counts everything."""
        if self.on_cuda():
            import torch

            return torch.cuda.memory_allocated()
        return None

    def write(self, kind: str, **fields) -> None:
        self.highest = max(self.highest, fields.get("peak_allocated_bytes", fields.get("peak_rss_bytes", 0)))
        line = {"process": self.process, "pid": os.getpid(), "kind": kind, "time": round(time.time(), 3), **fields}
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(line) + "\n")

    def process_end(self, kind: str, **fields) -> None:
        """The process's highest peak: the last window's and every one read before."""
        reading = self.reading()
        key = "peak_rss_bytes" if reading["cpu"] else "peak_allocated_bytes"
        reading[key] = max(reading[key], self.highest)
        self.write(kind, **fields, **reading)

    def around(self, kind: str, call, **fields):
        """`call()` between a reset of the peak and a reading of it."""
        before = self.held()
        self.reset()
        started = time.perf_counter()
        try:
            return call()
        finally:
            took = round(time.perf_counter() - started, 3)
            self.write(kind, seconds=took, held_before_bytes=before, **fields, **self.reading())
            self.reset()


def memory_callback(memory: Memory):
    """A TrainerCallback: each optimizer step's peak, from its beginning to its end (the evaluations come after)."""
    from transformers import TrainerCallback

    class StepMemory(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            memory.reset()
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            took = round(time.perf_counter() - self.started, 3)
            memory.write("train_step", step=state.global_step, seconds=took, **memory.reading())

    return StepMemory()


# ---- make-model ----
def make_model(args: argparse.Namespace) -> int:
    import torch
    from gpu_kit.workload import build_model, model_config
    from transformers import GenerationConfig

    from probdiff_callback.models.presets import ENDOFTEXT_ID, IM_END_ID, IM_START_ID
    from probdiff_callback.models.tokenizer import load_qwen_tokenizer

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    config = model_config(args.shape)
    layers = config.num_hidden_layers
    if args.layers is not None:
        config.num_hidden_layers = args.layers
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = config.layer_types[: args.layers]
    config.bos_token_id, config.eos_token_id, config.pad_token_id = None, IM_END_ID, ENDOFTEXT_ID
    started = time.perf_counter()
    model = build_model(config, device, dtype)
    built = time.perf_counter() - started
    target = Path(args.directory)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    load_qwen_tokenizer().save_pretrained(target)
    GenerationConfig(eos_token_id=[IM_END_ID, IM_START_ID], pad_token_id=ENDOFTEXT_ID).to_json_file(
        target / "generation_config.json"
    )
    saved = time.perf_counter() - started - built
    n_params = sum(p.numel() for p in model.parameters())
    size = sum(p.stat().st_size for p in target.iterdir() if p.is_file())
    print(
        f"make-model: --shape {args.shape} with {config.num_hidden_layers} of its {layers} layers, "
        f"{str(dtype).removeprefix('torch.')}, {n_params / 1e9:.3f} B parameters, random weights made on {device} in "
        f"{built:.1f} s, saved to {target} ({size / 1024**3:.2f} GiB) in {saved:.1f} s",
        flush=True,
    )
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    numbers = {"shape": args.shape, "layers": config.num_hidden_layers, "shape_layers": layers, "parameters": n_params,
               "weights_bytes": weights, "per_layer_bytes": per_layer, "bytes_on_disk": size,
               "build_s": round(built, 2), "save_s": round(saved, 2)}  # fmt: skip
    print("make-model: " + json.dumps(numbers), flush=True)
    return 0


# ---- train ----
def evaluator_command_through_this_file(original):
    """`probdiff watch ...` as training starts it, run through this file's `evaluator` command."""

    @functools.wraps(original)
    def command(*args, **kwargs) -> list[str]:
        python, *rest = original(*args, **kwargs)
        return [python, str(Path(__file__).resolve()), "evaluator", "--", *rest]

    return command


def train(args: argparse.Namespace) -> int:
    memory_path = Path(args.memory).resolve()
    os.environ[MEMORY_VARIABLE] = str(memory_path)  # the evaluator process training may start inherits it
    memory = Memory(memory_path, "training")

    from probdiff_callback.callback.beside import local
    from probdiff_callback.callback.in_loop import InLoop

    local.evaluator_command = evaluator_command_through_this_file(local.evaluator_command)
    evaluate_model = InLoop.evaluate_model

    def measured_evaluate_model(self, *, base_model: bool = False):
        step = self.trainer.state.global_step
        return memory.around("evaluation", lambda: evaluate_model(self, base_model=base_model), step=step,
                             base_model=base_model)  # fmt: skip

    InLoop.evaluate_model = measured_evaluate_model

    from probdiff_callback.training import sft

    build_trainer = sft.build_trainer

    def build_trainer_with_memory(*positional, **named):
        trainer, preemption = build_trainer(*positional, **named)
        trainer.add_callback(memory_callback(memory))
        return trainer, preemption

    sft.build_trainer = build_trainer_with_memory
    code = sft.main(list(args.sft_args))
    memory.process_end("training_process_end", exit_code=code)
    return code


# ---- evaluator (started by training, with async_eval) ----
def evaluator(args: argparse.Namespace) -> int:
    """`python -m MODULE ARGS` (probdiff watch), with each queued step's evaluation and the process's peak recorded."""
    import runpy

    rest = list(args.watch_command)
    if len(rest) < 2 or rest[0] != "-m":
        raise SystemExit(f"evaluator: expected -- -m MODULE ARGS, got {rest}")
    memory = Memory(Path(os.environ[MEMORY_VARIABLE]), "evaluator")

    from probdiff_callback.watch import loop

    evaluate_request = loop.evaluate_request

    def measured_evaluate_request(*positional, **named):
        step = positional[4] if len(positional) > 4 else named.get("step")
        return memory.around("evaluation", lambda: evaluate_request(*positional, **named), step=step)

    loop.evaluate_request = measured_evaluate_request
    atexit.register(lambda: memory.process_end("evaluator_process_end"))
    sys.argv = [rest[1], *rest[2:]]
    runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("make-model", help="a random model of a shape, saved to a folder")
    make.add_argument("directory")
    make.add_argument("--shape", default="qwen-14b", help="qwen-14b, qwen-7b or tiny (bench/gpu_kit/workload.py)")
    make.add_argument("--layers", type=int, default=None, help="decoder layers [the shape's]")
    make.add_argument("--device", default=None, help="where the weights are made [cuda when available]")
    make.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"], help="[bf16 on CUDA]")
    run = commands.add_parser("train", help="train/sft.py's main, with the peak memory recorded")
    run.add_argument("--memory", required=True, help="JSON lines appended here")
    run.add_argument("sft_args", nargs=argparse.REMAINDER, help="-- then train/sft.py's key=value arguments")
    watch = commands.add_parser("evaluator", help="(started by training) python -m MODULE ARGS, memory recorded")
    watch.add_argument("watch_command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    for name in ("sft_args", "watch_command"):
        if getattr(args, name, None) and getattr(args, name)[0] == "--":
            setattr(args, name, getattr(args, name)[1:])
    return {"make-model": make_model, "train": train, "evaluator": evaluator}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
