"""The trust study of docs/agreement.md, on a model that can answer: does ProbDiff follow quality?

On the `smollm2` preset and the paper's 1,000 XSum test documents (split into training and held-out documents):

  a. a clean summarization run: confidence and mean d over its evaluations against ROUGE and the eval loss;
  b. a broken run: the same recipe trained on references shuffled across documents (summaries of other articles);
  c. four models on the paper's MT-Bench and AlpacaEval queries (`tiny`, SmolLM2 as shipped, after a and after b),
     ranked by ProbDiff next to measures that do not come from the model's own judgement: ROUGE on held-out XSum
     documents, and each model's loss on their reference summaries (`probdiff score` with the reference as the
     answer), with `probdiff compare` between them; SmolLM2 as shipped again with a 1,024-token cap, to see what the
     256-token cap did to its figures.

Every step runs the project's own commands (printed as they run) and skips what a previous run of this script already
wrote, so an interrupted study continues. Answers and revisions that hit the cap are counted beside every figure, and
each confidence is also given over the queries where neither hit it. It takes about two hours on two CPU cores (two
commands at a time).

Run: python bench/trust_study.py [--work runs/trust-study] [--source ../shared/data/probdiff-reference]
     python bench/trust_study.py --work DIR --alarm-fixture tests/data/trust_study_alarm.json   (after the runs)

`--alarm-fixture` writes what the disagreement alarm of the two runs reads, numbers only (the history rows without
checkpoint paths; each record's id, d, log-probs, lengths and sentence-level ROUGE, no text; each step's eval losses),
for tests/test_disagreement.py, which checks the graded and sized lines docs/agreement.md quotes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from probdiff_callback.core.metric import compare
from probdiff_callback.core.queries import read_jsonl
from probdiff_callback.runs.run_files import read_records

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SOURCE = ROOT.parent / "shared" / "data" / "probdiff-reference"
HELD_OUT = 200  # of the 1,000 XSum test documents; the other 800 are training documents
# What the study changes from the recipe's smollm2 preset: more evaluations for a curve, more queries per evaluation
# and a cap that most of the base model's answers fit in.
RUN_SETTINGS = [
    "max_steps=30",
    "eval_steps=6",
    "save_steps=6",
    "probdiff.n_queries=16",
    "probdiff.batch_size=16",
    "probdiff.max_new_tokens=256",
    "max_eval_samples=32",
    "report_to=none",
]
CROSS_MODEL_QUERIES = 16  # per query set
CROSS_MODEL_SETTINGS = ["max_new_tokens=256", "batch_size=16", "max_prompt_tokens=512"]
# SmolLM2 as shipped writes long answers: the same queries again with a cap four times higher show what the 256-token
# cap did to its figures.
CAP_CHECK = 1024
# Two commands at a time, one thread each: on two cores a second torch thread gains little (docs/benchmarks.md)
# while a second process doubles the work done.
PARALLEL = 2


def run(command: list[str], log: Path) -> None:
    """Run a project command, its output to `log`; stop the study on failure."""
    run_all([(command, log)])


def run_all(jobs: list[tuple[list[str], Path]]) -> None:
    """Run project commands PARALLEL at a time with one torch thread each, outputs to their logs; stop on a failure."""
    pending = list(jobs)
    running: list[tuple[subprocess.Popen, Path]] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    while pending or running:
        while pending and len(running) < PARALLEL:
            command, log = pending.pop(0)
            print("$ " + " ".join(command), flush=True)
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "w") as out:
                process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
            running.append((process, log))
        process, log = running.pop(0)
        if process.wait() != 0:
            for other, _ in running:
                other.terminate()
            sys.exit(f"failed ({process.returncode}); see {log}")


def prepare_data(work: Path, source: Path) -> dict[str, Path]:
    """XSum's test documents split into training and held-out ones, and a copy with shuffled references."""
    folders = {"clean": work / "data" / "clean", "broken": work / "data" / "broken"}
    for kind, extra in (("clean", []), ("broken", ["--shuffle-references"])):
        if not (folders[kind] / "summarization" / "train.jsonl").is_file():
            command = [sys.executable, "data/prepare.py", "summarization", "--source", str(source), "--split-test",
                       str(HELD_OUT), *extra, "--out", str(folders[kind])]  # fmt: skip
            run(command, work / f"{kind}-data.log")
    return {kind: folder / "summarization" for kind, folder in folders.items()}


def train(work: Path, data: dict[str, Path], heldout: Path) -> dict[str, Path]:
    """The clean and the broken run side by side, both evaluated on the same held-out documents."""
    runs, jobs = {}, []
    for kind in ("clean", "broken"):
        runs[kind] = work / kind
        if not (runs[kind] / "final").is_dir():
            command = [sys.executable, "train/sft.py", "recipe=summarization", "model=smollm2",
                       f"train_file={data[kind] / 'train.jsonl'}", f"heldout_file={heldout}",
                       f"output_dir={runs[kind]}", *RUN_SETTINGS]  # fmt: skip
            jobs.append((command, work / f"{kind}-train.log"))
    run_all(jobs)
    return runs


def history(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "probdiff" / "history.jsonl")


def uncapped_confidence(rows: list[dict], delta: float) -> tuple[float, int]:
    """Confidence over the queries whose answer and revision both ended before the cap, and how many those are."""
    kept = [r for r in rows if not r.get("response_capped") and not r.get("revision_capped")]
    confident = [r["d"] is not None and math.isfinite(r["d"]) and r["d"] >= delta for r in kept]
    return (sum(confident) / len(kept) if kept else math.nan), len(kept)


def pct(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{100 * value:.1f}%"


def number(value: float | None, spec: str) -> str:
    return "n/a" if value is None or not math.isfinite(value) else format(value, spec)


def run_table(run_dir: Path) -> str:
    lines = [
        "| step | confidence | mean d | capped answers / revisions | confidence, uncapped queries | revision = answer "
        "| answer tokens | ROUGE-1 | ROUGE-2 | ROUGE-L | eval loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in history(run_dir):
        s = row["summary"]
        if s is None:
            lines.append(f"| {row['global_step']} | failed |" + " |" * 9)
            continue
        overall = (s.get("reference") or {}).get("overall", {})
        step_records = read_jsonl(run_dir / "probdiff" / row["records"])
        kept, n_kept = uncapped_confidence(step_records, s["delta"])
        # A revision that repeats the answer word for word has d = 0, which counts as confident at any delta <= 0.
        unchanged = sum(r["revisions"][0].strip() == r["response"].strip() for r in step_records if r["revisions"])
        lines.append(
            f"| {row['global_step']} | {pct(s['confidence'])} | {number(s['d_mean'], '+.3f')} | "
            f"{s['n_capped']} / {s['n_revision_capped']} of {s['n']} | {pct(kept)} (n {n_kept}) | {unchanged} | "
            f"{number(s['len_response_mean'], '.0f')} | {number(overall.get('rouge1'), '.1f')} | "
            f"{number(overall.get('rouge2'), '.2f')} | {number(overall.get('rougeL'), '.1f')} | "
            f"{number(row.get('eval_loss'), '.3f')} |"
        )
    return "\n".join(lines)


def query_files(work: Path, source: Path, heldout: Path) -> dict[str, Path]:
    """The cross-model query sets: MT-Bench and AlpacaEval as the paper ships them, and held-out XSum documents."""
    return {
        "MT-Bench": source / "mtbench" / "question.jsonl",
        "AlpacaEval": source / "alpaca_eval" / "test.json",
        "XSum": heldout,
    }


def reference_pairs(heldout: Path, out: Path) -> Path:
    """Held-out XSum documents with their reference summary as both answer and revision: `probdiff score` then
    gives each model's mean log-probability of the references, the negative of its loss on them."""
    if not out.is_file():
        rows = []
        for line in heldout.read_text().splitlines()[:CROSS_MODEL_QUERIES]:
            row = json.loads(line)
            user = next(m["content"] for m in row["messages"] if m["role"] == "user")
            reference = next(m["content"] for m in row["messages"] if m["role"] == "assistant")
            rows.append({"id": row["id"], "query": user, "response": reference, "revised": reference})
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return out


def slug_of(label: str) -> str:
    """The folder of a model's results: "tiny", "as-shipped", "clean-run", "broken-run"."""
    return label if label == "tiny" else "-".join(label.split()[-2:]).lower()


def cross_model(work: Path, source: Path, heldout: Path, clean: Path, broken: Path) -> str:
    models = {
        "tiny": ["--model", "tiny"],
        "SmolLM2 as shipped": ["--model", "smollm2"],
        "after the clean run": ["--model", "smollm2", "--adapter", str(clean / "final")],
        "after the broken run": ["--model", "smollm2", "--adapter", str(broken / "final")],
    }
    sets = query_files(work, source, heldout)
    pairs = reference_pairs(heldout, work / "models" / "xsum-reference-pairs.jsonl")
    jobs = []
    for label, model in models.items():
        slug = slug_of(label)
        for name, path in sets.items():
            out = work / "models" / slug / name
            if not (out / "summary.json").is_file():
                command = ["probdiff", "eval", *model, "--queries", str(path), "--limit", str(CROSS_MODEL_QUERIES),
                           "--out", str(out), *CROSS_MODEL_SETTINGS]  # fmt: skip
                jobs.append((command, out.with_suffix(".log")))
        out = work / "models" / slug / "reference-loss"
        if not (out / "summary.json").is_file():
            command = ["probdiff", "score", *model, "--pairs", str(pairs), "--out", str(out)]
            jobs.append((command, out.with_suffix(".log")))
    run_all(jobs)
    results: dict[str, dict[str, dict]] = {}
    for label in models:
        slug = slug_of(label)
        results[label] = {name: json.loads((work / "models" / slug / name / "summary.json").read_text())
                          for name in [*sets, "reference-loss"]}  # fmt: skip
        results[label]["reference"] = results[label].pop("reference-loss")

    lines = [
        "| model | MT-Bench confidence | mean d | capped | AlpacaEval confidence | mean d | capped | XSum confidence "
        "| XSum ROUGE-L | loss on reference summaries |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, by_set in results.items():
        cells = []
        for name in ("MT-Bench", "AlpacaEval"):
            s = by_set[name]
            cells += [pct(s["confidence"]), number(s["d_mean"], "+.3f"), f"{s['n_capped']} / {s['n_revision_capped']}"]
        xsum = by_set["XSum"]
        rouge = (xsum.get("reference") or {}).get("overall", {}).get("rougeL")
        loss = -by_set["reference"]["logp_response_mean"]
        lines.append(f"| {label} | {' | '.join(cells)} | {pct(xsum['confidence'])} | {number(rouge, '.1f')} | "
                     f"{number(loss, '.3f')} |")  # fmt: skip
    return "\n".join(lines) + "\n\n" + comparison_table(work, list(models))


def comparison_table(work: Path, labels: list[str]) -> str:
    """The figures of `probdiff compare A B` on each query set, one line per pair of models."""
    table = [
        "| queries | A vs B | confidence A | confidence B | win / tie / lose | sign p | Wilcoxon p |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("MT-Bench", "AlpacaEval", "XSum"):
        for a, b in ((labels[2], labels[1]), (labels[3], labels[1]), (labels[2], labels[3]), (labels[1], labels[0])):
            folders = [work / "models" / slug_of(label) / name for label in (a, b)]
            delta = json.loads((folders[0] / "summary.json").read_text())["delta"]
            result = compare(*(read_records(folder / "records.jsonl") for folder in folders), delta)
            table.append(
                f"| {name} | {a} vs {b} | {pct(result.confidence_a)} | {pct(result.confidence_b)} | "
                f"{result.win} / {result.tie} / {result.lose} | {number(result.sign_p, '.3g')} | "
                f"{number(result.wilcoxon_p, '.3g')} |"
            )
    return "\n".join(table)


def cap_check(work: Path, source: Path, heldout: Path) -> str:
    """SmolLM2 as shipped on the cross-model queries at a cap of CAP_CHECK tokens beside its figures at 256."""
    sets = query_files(work, source, heldout)
    jobs = []
    for name, path in sets.items():
        out = work / "models" / f"as-shipped-cap{CAP_CHECK}" / name
        if not (out / "summary.json").is_file():
            settings = [f"max_new_tokens={CAP_CHECK}", *CROSS_MODEL_SETTINGS[1:]]
            command = ["probdiff", "eval", "--model", "smollm2", "--queries", str(path), "--limit",
                       str(CROSS_MODEL_QUERIES), "--out", str(out), *settings]  # fmt: skip
            jobs.append((command, out.with_suffix(".log")))
    run_all(jobs)
    lines = [
        "| queries | cap | confidence | mean d | capped answers / revisions | confidence, uncapped queries | "
        "answer length (tokens, mean) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in sets:
        for cap, folder in ((256, "as-shipped"), (CAP_CHECK, f"as-shipped-cap{CAP_CHECK}")):
            out = work / "models" / folder / name
            s = json.loads((out / "summary.json").read_text())
            kept, n_kept = uncapped_confidence(read_jsonl(out / "records.jsonl"), s["delta"])
            lines.append(
                f"| {name} | {cap} | {pct(s['confidence'])} | {number(s['d_mean'], '+.3f')} | "
                f"{s['n_capped']} / {s['n_revision_capped']} of {s['n']} | {pct(kept)} (n {n_kept}) | "
                f"{number(s['len_response_mean'], '.0f')} |"
            )
    return "\n".join(lines)


RECORD_NUMBERS = (
    "id",
    "category",
    "d",
    "logp_response",
    "logp_revised",
    "n_tokens_response",
    "n_tokens_revised",
    "ref",
)


def alarm_values(run_dir: Path) -> dict:
    """What `probdiff select` grades the run's disagreements from, without a word of the documents or answers."""
    rows = [dict(row, checkpoint=None) for row in history(run_dir)]
    return {
        "rows": rows,
        "records": {
            str(row["global_step"]): [
                {k: r[k] for k in RECORD_NUMBERS if k in r} for r in read_jsonl(run_dir / "probdiff" / row["records"])
            ]
            for row in rows
            if row["records"]
        },  # fmt: skip
        "eval_losses": {
            str(row["global_step"]): json.loads((run_dir / "probdiff" / row["eval_losses"]).read_text())["losses"]
            for row in rows
            if row.get("eval_losses")
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", default=str(ROOT / "runs" / "trust-study"), help="where everything goes")
    parser.add_argument(
        "--source", default=str(DEFAULT_SOURCE), help="the paper's data (the layout of data/prepare.py)"
    )
    parser.add_argument("--alarm-fixture", help="write the two runs' alarm values to this JSON file and stop")
    args = parser.parse_args()
    work, source = Path(args.work).resolve(), Path(args.source).resolve()
    if args.alarm_fixture:
        fixture = {kind: alarm_values(work / kind) for kind in ("clean", "broken")}
        Path(args.alarm_fixture).write_text(json.dumps(fixture, indent=1) + "\n")
        return
    if not (source / "xsum" / "test.json").is_file():
        sys.exit(f"{source}/xsum/test.json not found: give --source, the folder with the paper's data")
    print(f"load average {os.getloadavg()[0]:.2f}; everything goes to {work}")
    data = prepare_data(work, source)
    heldout = data["clean"] / "heldout.jsonl"
    runs = train(work, data, heldout)
    for kind, run_dir in runs.items():
        print(f"\n## {kind} run ({run_dir})\n\n{run_table(run_dir)}\n")
        done = subprocess.run(["probdiff", "crosscheck", str(run_dir)], cwd=ROOT, capture_output=True, text=True)
        print(done.stdout.strip())
        done = subprocess.run(["probdiff", "select", str(run_dir)], cwd=ROOT, capture_output=True, text=True)
        print(done.stdout.strip())
    print("\n## across models\n\n" + cross_model(work, source, heldout, runs["clean"], runs["broken"]))
    print(f"\n## SmolLM2 as shipped, cap 256 and {CAP_CHECK}\n\n" + cap_check(work, source, heldout))


if __name__ == "__main__":
    main()
