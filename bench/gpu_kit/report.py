"""The kit's one report: OUT/summary.json, written out as OUT/summary.md after every change (each session part as it
ends, the benchmark's rows as they come), with every traceback of OUT's logs in OUT/tracebacks.txt. Light on purpose:
it imports neither torch nor the package, so that a part that broke the environment is still recorded."""

from __future__ import annotations

import ast
import json
import time
from pathlib import Path

MEMORY = ("peak_memory_bytes", "memory_before_bytes", "peak_memory_before_bytes")  # the evaluator's, in its Cost
TITLES = {
    "0-env": "wheels installed, versions, the device",
    "1-bench": "bench/gpu.py bench: each decoding path against the floor",
    "2-train-tiny": "train/sft.py recipe=blog model=tiny",
    "2-train-shaped": "train/sft.py on a random model of the shape (fewer layers), evaluations in the loop",
    "3-async": "the same with probdiff.async_eval=true, the evaluator beside training on the same device",
}


def load(out: Path) -> dict:
    path = out / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {"started": time.strftime("%F %T %Z"), "parts": {}}


def update(out: Path, part: tuple[str, dict] | None = None, **changes) -> None:
    """The record with `changes` (top-level keys) and `part` (name, fields), saved as summary.json and summary.md."""
    out.mkdir(parents=True, exist_ok=True)
    record = load(out)
    if part is not None:
        record["parts"][part[0]] = part[1]
    record.update(changes, written=time.strftime("%F %T %Z"))
    for name, text in (("summary.json", json.dumps(record, indent=1) + "\n"), ("summary.md", markdown(record))):
        (out / f".{name}").write_text(text)
        (out / f".{name}").replace(out / name)
    found = [f"== {log.name}, line {line} ==\n" + "\n".join(block) for log in sorted(out.glob("*.log"))
             for line, block in tracebacks_in(log.read_text(errors="replace"))]  # fmt: skip
    (out / "tracebacks.txt").write_text("\n\n".join(found) + "\n" if found else "no traceback in any log\n")


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 1024**3:.2f} GiB"


def markdown_table(rows: list[dict]) -> str:
    lines = ["| figure | value | how it was measured |", "|---|---|---|"]
    return "\n".join(lines + ["| " + " | ".join(str(r[k]).replace("|", "/") for k in ("name", "value", "detail")) + " |"
                              for r in rows])  # fmt: skip


def run_outcome(run_dir: Path) -> dict:
    """What a training run left: its evaluated steps (confidence or error, the evaluator's memory readings), the best
    checkpoint, the final weights."""
    rows, history = [], run_dir / "probdiff" / "history.jsonl"
    for line in history.read_text().splitlines() if history.is_file() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        cost, error = row.get("cost") or {}, (row.get("error") or "").strip().splitlines()[-1:]
        rows.append({"step": row.get("global_step"), "kind": row.get("kind"), "seconds": row.get("seconds"),
                     "confidence": (row.get("summary") or {}).get("confidence"), "error": error[0] if error else None,
                     **{key: cost.get(key) for key in MEMORY}})  # fmt: skip
    best = (run_dir / "best").resolve().name if (run_dir / "best").exists() else None
    return {"evaluations": rows, "final": (run_dir / "final").is_dir(), "best": best}


def trainer_metrics(log: str) -> dict | None:
    """The metrics the Trainer logs at train()'s end (`{'train_runtime': ...}`); with `skip_memory_metrics=false` its
    memory ones too, and the peak they give (`train_peak_bytes`): memory before the Trainer + its init's + train()'s
    allocations + train()'s peak above its end, train() taken to begin where init ended."""
    for line in reversed(log.splitlines()):
        if "'train_runtime'" in line:
            metrics = ast.literal_eval(line[line.index("{") : line.rindex("}") + 1])
            kind = "gpu" if "train_mem_gpu_peaked_delta" in metrics else "cpu"
            keys = [f"before_init_mem_{kind}", *(f"{s}_mem_{kind}_{t}_delta" for s, t in
                    (("init", "alloc"), ("train", "alloc"), ("train", "peaked")))]  # fmt: skip
            if keys[-1] in metrics:
                metrics.update(train_peak_bytes=sum(int(metrics.get(k, 0)) for k in keys), memory_of=kind)
            return metrics
    return None


def memory_rows(run: dict, trainer: dict | None, beside: bool) -> list[dict]:
    """The peaks a training part measured: each evaluation's (its cost), the training steps' between evaluations in
    the loop (the next evaluation's `peak_memory_before_bytes`), training's whole (the Trainer's metrics)."""
    found, evaluations = [], [e for e in run["evaluations"] if e.get("peak_memory_bytes") is not None]
    if evaluations:
        top = max(evaluations, key=lambda e: e["peak_memory_bytes"])
        where = "the evaluator process, beside training" if beside else "in the training loop"
        found.append({"what": f"evaluation ({where})", "n": len(evaluations), "peak_bytes": top["peak_memory_bytes"],
                      "held_before_bytes": top["memory_before_bytes"]})  # fmt: skip
    between = [e["peak_memory_before_bytes"] for e in evaluations[1:]]
    if between and not beside:
        what = "training between two evaluations (steps, eval loss, saving)"
        found.append({"what": what, "n": len(between), "peak_bytes": max(between)})
    if trainer and "train_peak_bytes" in trainer:
        what = "allocated" if trainer["memory_of"] == "gpu" else "the process's RSS (CPU)"
        found.append({"what": f"training: train() as a whole, {what} (the Trainer's memory metrics)", "n": 1,
                      "peak_bytes": trainer["train_peak_bytes"]})  # fmt: skip
    return found


def markdown(record: dict) -> str:
    env, parts, bench = record.get("env") or {}, record["parts"], record.get("bench") or {}
    lines = [f"# GPU kit: bench/gpu.py {record.get('command', 'bench')} ({record.get('mode', 'one run')})", "",
             f"Started {record['started']}, written {record.get('written')}. {env.get('line', '')}"]  # fmt: skip
    if parts:
        lines += ["", "| part | what | status | seconds (limit) | result |", "|---|---|---|---|---|"]
        lines += [f"| {name} | {TITLES.get(name, '')} | {p['status']} | {p.get('seconds')} ({p.get('limit_s')}) | "
                  f"{p.get('result', '')} |" for name, p in parts.items()]  # fmt: skip
    memory = [f"| {name} | {r['what']} | {r['n']} | {gib(r['peak_bytes'])} | {gib(r.get('held_before_bytes'))} |"
              for name, p in parts.items() for r in p.get("memory", [])]  # fmt: skip
    if memory:
        header = "| part | what | n | highest peak | held before it |\n|---|---|---|---|---|"
        lines += ["", "## Peak memory", "", header, *memory]
    for name, p in parts.items():
        if m := p.get("model"):
            lines += ["", f"{name}'s model: --shape {m['shape']}, {m['layers']} of its {m['shape_layers']} layers, "
                      f"{m['dtype']}, {m['parameters'] / 1e9:.3f} B parameters, {gib(m['weights_bytes'])} of weights "
                      f"({gib(m['per_layer_bytes'])} a layer); made in {m['build_s']} s, saved in "
                      f"{m['save_s']} s."]  # fmt: skip
        if evaluations := (p.get("run") or {}).get("evaluations"):
            said = [f"{e['step']} {e['kind']}: " + ("failed" if e["error"] or e["confidence"] is None else
                    f"{100 * e['confidence']:.1f}% in {e['seconds']} s") for e in evaluations]  # fmt: skip
            lines += ["", f"{name}: ProbDiff by step: {', '.join(said)}; best {p['run']['best']}; the Trainer's "
                      f"{p.get('trainer')}."]  # fmt: skip
    if bench.get("figures"):
        state = "complete" if bench.get("complete") else "incomplete: the run went on or was stopped"
        lines += ["", f"## The benchmark ({state})", "", markdown_table(bench["figures"]), ""]
        lines += [f"- {note}" for note in bench["notes"]]
    packages = env.get("packages", {}).items()
    lines += ["", "## Environment", ""] if packages else []
    lines += [f"- {name}: {p.get('version')} ({p.get('from')})" if "error" not in p else
              f"- {name}: **cannot import**: {p['error']}" for name, p in packages]  # fmt: skip
    return "\n".join(lines) + "\n"


def tracebacks_in(text: str) -> list[tuple[int, list[str]]]:
    """(line number, lines) of each traceback: from its header to the exception line that ends it, with the ones
    chained to it ("During handling ...", "The above exception ...")."""
    header, chained = "Traceback (most recent call last):", ("During handling", "The above exception")
    lines, found, start = text.splitlines(), [], None
    for i, line in enumerate(lines):
        if start is None or line.startswith((" ", "\t", *chained)) or not line.strip() or header in line:
            start = i if start is None and header in line else start
        elif not next((later for later in lines[i + 1 :] if later.strip()), "").startswith(chained):
            found.append((start + 1, lines[start : i + 1]))  # its exception's line, and no other follows from it
            start = None
    return found + ([(start + 1, lines[start:])] if start is not None else [])
