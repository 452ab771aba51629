"""The selection study of docs/agreement.md: how good is each way of picking a checkpoint?

On the `smollm2` preset and the paper's own data, three recipes (translation German -> English and XSum
summarization, with reference metrics; the Xiaohongshu blog posts, without), each trained as a clean run and as two
damaged ones (training references deranged across rows; a learning rate of 2e-2 that breaks the model), on two data
seeds: 18 runs of 30 steps, ProbDiff on 32 held-out queries at steps 0, 6, 12, 18, 24 and 30 (beside training, with
vLLM in the evaluator's process), the eval loss on the same 32 held-out conversations.

Each run's checkpoints (and the base model) are then measured on a test set of 64 queries that no selection saw:
greedy answers scored against the references (chrF for translation, ROUGE-L for summarization), and for the blog,
which has no reference metric, the loss on the test set's reference answers. For every run and every way of picking
(the last checkpoint, the lowest eval loss, the highest ProbDiff confidence, `probdiff_guarded`, and the oracle: the
checkpoint best on the test measure) the table gives the picked step's test measure and whether it is significantly
worse than the base model's there (a paired permutation test over the 64 queries, p < 0.05), then the regret against
the oracle (mean and worst) and the number of damaged picks per way.

Every stage skips what an earlier run of this script wrote (a finished run's `final/`, a step's test file), so the
study can be finished across sessions; one run at a time, one torch thread per process (training and its evaluator
on the two cores). Each measured run's numbers (no text of the paper's data) are added at once to the study's record,
tests/data/selection_study.json, which is committed: a run there is neither trained nor measured again, so a study
outlives the machine it ran on, and the tests check the docs' tables against it.

Run: python bench/selection_study.py [--work runs/selection-study] [--source ../shared/data/probdiff-reference]
     python bench/selection_study.py --report        (the tables from the record, nothing trained or measured)
     python bench/selection_study.py --report --docs (and the same tables into docs/agreement.md, between its markers)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from probdiff_callback.core.queries import read_jsonl
from probdiff_callback.runs.run_files import write_atomic, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SOURCE = ROOT.parent / "shared" / "data" / "probdiff-reference"
RECIPES = ("translation", "summarization", "blog")
CONDITIONS = ("clean", "deranged", "high-lr")
SEEDS = (0, 1)
HELD_OUT, TEST = 32, 64  # queries per evaluation while training; queries of the test set no selection sees
TRAIN_ROWS = 600  # training conversations per run (30 steps of 4 use 120 of them)
BROKEN_LEARNING_RATE = "2e-2"  # 67 times the preset's 3e-4: breaks SmolLM2 within 10 steps (docs/agreement.md)
# What the study changes from each recipe's smollm2 preset: six evaluations, all held-out conversations in the eval
# loss, the evaluation beside training with vLLM in the evaluator's own process (one thread each).
RUN_SETTINGS = ["max_steps=30", "eval_steps=6", "save_steps=6", "max_length=512", f"max_eval_samples={HELD_OUT}",
                f"probdiff.n_queries={HELD_OUT}", "probdiff.batch_size=16", "probdiff.max_prompt_tokens=512",
                "probdiff.async_eval=true", "probdiff.use_vllm=true", "probdiff.evaluator_threads=1", "threads=1",
                "report_to=none"]  # fmt: skip
MAX_NEW_TOKENS = {"translation": 64, "summarization": 64, "blog": 96}
# The test measure of each recipe: a sentence-level reference metric of greedy answers, or the loss on references.
STAGES = ("train", "test")  # what each run's times are kept of
TEST_MEASURE = {"translation": "chrf", "summarization": "rougeL", "blog": "reference_loss"}
TRANSLATION_PAIR = "de-en"  # SmolLM2 writes English: German into English is the direction it can do
RECORD = ROOT / "tests" / "data" / "selection_study.json"  # every measured run's numbers, committed
DOCS = ROOT / "docs" / "agreement.md"
MARKERS = {  # where in DOCS each table stands: (the line before it, the line after it)
    "picks": ("<!-- the selection study's tables: python bench/selection_study.py --report -->",
              "<!-- end of the selection study's tables -->"),
    "times": ("<!-- the selection study's times: python bench/selection_study.py --report -->",
              "<!-- end of the selection study's times -->"),
}  # fmt: skip


def say(text: str) -> None:
    print(text, flush=True)


def run(command: list[str], log: Path, timing: Path | None = None) -> None:
    """A project command, its output to `log`, one torch thread per process; the study stops on a failure. `timing`:
    a JSON file its seconds go to, added to those of earlier starts of the same stage (a resumed run's training is the
    sum of its starts), with the load average when the first one started."""
    say("$ " + " ".join(command))
    log.parent.mkdir(parents=True, exist_ok=True)
    started, load_before = time.time(), os.getloadavg()[0]
    with open(log, "w") as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}); see {log}")
    seconds, load_after = time.time() - started, os.getloadavg()[0]
    say(f"  {seconds:.0f} s, load average {load_before:.2f} before, {load_after:.2f} after")
    if timing is not None:
        total = json.loads(timing.read_text()) if timing.is_file() else {"seconds": 0, "load": load_before, "starts": 0}
        total["seconds"], total["starts"] = total["seconds"] + round(seconds), total["starts"] + 1
        timing.write_text(json.dumps(total) + "\n")


# ---- data ------------------------------------------------------------------------------------------------------------
def prepared(work: Path, source: Path, recipe: str, seed: int, deranged: bool) -> Path:
    """`data/prepare.py`'s output for the recipe (summarization: its own split of XSum's test documents per seed);
    `deranged`: the training references permuted across rows with the seed (`--shuffle-references`)."""
    per_seed = recipe == "summarization" or deranged  # the paper's other splits do not depend on the seed
    out = work / "data" / "prepared" / f"{'deranged' if deranged else 'clean'}{f'-s{seed}' if per_seed else ''}"
    if not (out / recipe / "heldout.jsonl").is_file():
        command = [sys.executable, "data/prepare.py", recipe, "--source", str(source), "--out", str(out), "--seed",
                   str(seed), *(["--split-test", "200"] if recipe == "summarization" else []),
                   *(["--shuffle-references"] if deranged else [])]  # fmt: skip
        run(command, work / "logs" / f"prepare-{out.name}-{recipe}.log")
    return out / recipe


def study_data(work: Path, source: Path, recipe: str, seed: int) -> Path:
    """The run data of one recipe and seed: train.jsonl and train-deranged.jsonl (the same rows, their references
    deranged), heldout.jsonl (32 queries, the selections' own) and test.jsonl (64 others)."""
    folder = work / "data" / f"{recipe}-s{seed}"
    if (folder / "test.jsonl").is_file():
        return folder
    keep = (lambda row: row["category"] == TRANSLATION_PAIR) if recipe == "translation" else (lambda row: True)
    clean, deranged = (prepared(work, source, recipe, seed, d) for d in (False, True))
    rng = random.Random(seed)
    heldout = [row for row in read_jsonl(clean / "heldout.jsonl") if keep(row)]
    rng.shuffle(heldout)
    train_ids = [row["id"] for row in read_jsonl(clean / "train.jsonl") if keep(row)]
    rng.shuffle(train_ids)
    chosen = set(train_ids[:TRAIN_ROWS])
    by_kind = {"train": clean / "train.jsonl", "train-deranged": deranged / "train.jsonl"}
    for name, path in by_kind.items():
        rows = [row for row in read_jsonl(path) if row["id"] in chosen]
        write_jsonl(folder / f"{name}.jsonl", sorted(rows, key=lambda row: train_ids.index(row["id"])))
    write_jsonl(folder / "heldout.jsonl", heldout[:HELD_OUT])
    write_jsonl(folder / "test.jsonl", heldout[HELD_OUT : HELD_OUT + TEST])
    return folder


# ---- training --------------------------------------------------------------------------------------------------------
def run_name(recipe: str, seed: int, condition: str) -> str:
    return f"{recipe}-s{seed}-{condition}"


def train(work: Path, data: Path, recipe: str, seed: int, condition: str) -> Path:
    run_dir = work / "runs" / run_name(recipe, seed, condition)
    if (run_dir / "final").is_dir():
        return run_dir
    train_file = data / ("train-deranged.jsonl" if condition == "deranged" else "train.jsonl")
    command = [sys.executable, "train/sft.py", f"recipe={recipe}", "model=smollm2", f"train_file={train_file}",
               f"heldout_file={data / 'heldout.jsonl'}", f"output_dir={run_dir}", f"seed={seed}",
               f"probdiff.max_new_tokens={MAX_NEW_TOKENS[recipe]}", *RUN_SETTINGS]  # fmt: skip
    if condition == "high-lr":
        command.append(f"learning_rate={BROKEN_LEARNING_RATE}")
    if run_dir.exists():
        command.append("resume=true")  # an interrupted run continues from its last checkpoint
    run(command, work / "logs" / f"train-{run_dir.name}.log", work / "logs" / f"train-{run_dir.name}.json")
    return run_dir


# ---- the test measure -----------------------------------------------------------------------------------------------
def evaluated_steps(run_dir: Path) -> list[int]:
    """The run's steps with a ProbDiff result and weights to measure: the baseline (the base model) and every
    evaluated checkpoint."""
    rows = read_jsonl(run_dir / "probdiff" / "history.jsonl")
    steps = [row["global_step"] for row in rows if row["summary"] is not None]
    return [s for s in steps if s == 0 or (run_dir / f"checkpoint-{s}").is_dir()]


def test_file(run_dir: Path, step: int) -> Path:
    return run_dir / "test" / f"step-{step}.json"


def measure(run_dir: Path, data: Path, recipe: str) -> None:
    """Each evaluated step's test measure, per test query, in `run_dir/test/step-<N>.json` (in a process of its own:
    vLLM's memory goes with it)."""
    if all(test_file(run_dir, step).is_file() for step in evaluated_steps(run_dir)):
        return
    command = [sys.executable, __file__, "--measure", str(run_dir), "--data", str(data), "--recipe", recipe]
    logs = run_dir.parents[1] / "logs"
    run(command, logs / f"test-{run_dir.name}.log", logs / f"test-{run_dir.name}.json")


def measure_here(run_dir: Path, data: Path, recipe: str) -> None:
    """`measure`'s work, in this process: the base model and each checkpoint's adapter on the test queries with the
    project's own functions (greedy answers through vLLM in this process, scored with the callback's sentence
    metrics; the blog's loss on the references with its scoring)."""
    import contextlib

    import torch

    from probdiff_callback.core.config import ProbDiffConfig
    from probdiff_callback.core.evaluator import generate_answers, make_chains
    from probdiff_callback.core.queries import load_queries
    from probdiff_callback.core.reference_metrics import metric_family, sentence_scores
    from probdiff_callback.core.scoring import score_texts
    from probdiff_callback.generation.vllm import VLLMGeneration
    from probdiff_callback.models import load_model_and_tokenizer

    torch.set_num_threads(len(os.sched_getaffinity(0)))  # alone on the machine: training is over
    queries = load_queries(data / "test.jsonl")
    config = ProbDiffConfig(
        max_new_tokens=MAX_NEW_TOKENS[recipe], max_prompt_tokens=512, batch_size=16, use_vllm=True,
        answer_temperature=0.0,
    )  # fmt: skip
    measure_name = TEST_MEASURE[recipe]
    base, tokenizer = load_model_and_tokenizer("smollm2", dtype="float32", device="cpu")
    vllm = None if measure_name == "reference_loss" else VLLMGeneration.start(config, base, tokenizer)
    with contextlib.ExitStack() as stack:
        if vllm is not None:
            stack.callback(vllm.close)
        for step in evaluated_steps(run_dir):
            out = test_file(run_dir, step)
            if out.is_file():
                continue
            started = time.time()
            model = base
            if step > 0:
                adapter = str(run_dir / f"checkpoint-{step}")
                model, _ = load_model_and_tokenizer("smollm2", adapter=adapter, dtype="float32", device="cpu")
            chains = make_chains(tokenizer, queries, config)
            if measure_name == "reference_loss":
                prompts = [chain.prepared.prompt_ids for chain in chains]
                scored = score_texts(model, tokenizer, prompts, [[q.reference] for q in queries], config)
                values = {q.id: -row[0][0] for q, row in zip(queries, scored)}
                texts = {}
            else:
                with vllm.holding(model, base_model=step == 0) as engine:
                    generate_answers(chains, engine, config)
                family = metric_family(queries[0].category)
                values = {
                    q.id: sentence_scores(family, q.category, chain.answer, q.reference)[measure_name]
                    for q, chain in zip(queries, chains)
                }
                texts = {q.id: chain.answer for q, chain in zip(queries, chains)}
            result = {"step": step, "measure": measure_name, "values": values, "answers": texts,
                      "seconds": round(time.time() - started, 1)}  # fmt: skip
            write_atomic(out, json.dumps(result, ensure_ascii=False, indent=1) + "\n")  # whole or not there
            say(f"step {step}: {measure_name} {sum(values.values()) / len(values):.3f} ({result['seconds']} s)")


# ---- the picks and the tables ----------------------------------------------------------------------------------------
WAYS = ("last", "lowest eval loss", "highest confidence", "probdiff_guarded", "oracle")
LOWER_IS_BETTER = {"chrf": False, "rougeL": False, "reference_loss": True}


def study_values(run_dir: Path) -> dict:
    """What the picks are decided from and measured on, numbers only (no text of the paper's data): the history rows
    (checkpoint paths as names), each step's records (id, d, sentence-level reference metrics), per-conversation eval
    losses, and each step's test measure per test query."""
    from probdiff_callback.runs.run_files import read_run

    run = read_run(run_dir)
    rows = [{**row.to_json(), "checkpoint": row.checkpoint and Path(row.checkpoint).name} for row in run.rows]
    tests = {
        str(step): json.loads(test_file(run_dir, step).read_text(encoding="utf-8"))["values"]
        for step in evaluated_steps(run_dir)
        if test_file(run_dir, step).is_file()
    }
    return {
        "rows": rows,
        "records": {
            str(step): [{"id": r.id, "d": r.d, "ref": r.ref} for r in records] for step, records in run.records.items()
        },
        "eval_losses": {str(step): losses for step, losses in run.eval_losses.items()},
        "test": tests,
    }


def picks_of(values: dict) -> dict[str, int | None]:
    """The step each way picks (0: the base model, where the guard passes no checkpoint; None: nothing to pick), with
    the project's own decision for the confidence and the guarded picks (`select.run_pick`)."""
    from probdiff_callback.analysis.pick import CONFIDENCE, GUARDED
    from probdiff_callback.analysis.select import run_pick
    from probdiff_callback.core.metric import is_finite
    from probdiff_callback.runs.run_files import HistoryRow

    rows = [HistoryRow.from_json(row) for row in values["rows"]]
    step_values = per_query_values(values)
    checkpoints = [row for row in rows if row.kind != "baseline" and not row.failed]
    with_loss = [row for row in checkpoints if is_finite(row.eval_loss)]
    test = {int(step): v for step, v in values["test"].items()}
    lower = LOWER_IS_BETTER[values["measure"]]
    means = {step: sum(v.values()) / len(v) for step, v in test.items() if step != 0}
    guarded = run_pick(rows, "", step_values, GUARDED, on_disk_only=False)
    return {
        "last": max(row.global_step for row in checkpoints),
        "lowest eval loss": min(with_loss, key=lambda r: (r.eval_loss, r.global_step)).global_step,
        "highest confidence": run_pick(rows, "", step_values, CONFIDENCE, on_disk_only=False).step,
        "probdiff_guarded": 0 if guarded.none_passes else guarded.step,
        "oracle": (min if lower else max)(sorted(means), key=lambda step: means[step]),
    }


def per_query_values(values: dict):
    """`values(step)`: the step's records and per-conversation eval losses, as the guard reads them."""
    records = {int(step): [record_numbers(r) for r in rs] for step, rs in values["records"].items()}
    losses = {int(step): ls for step, ls in values["eval_losses"].items()}
    return lambda step: (records.get(step), losses.get(step))


def record_numbers(numbers: dict):
    """A Record from the numbers the study keeps (its texts are not needed to pick)."""
    from probdiff_callback.core.metric import is_confident
    from probdiff_callback.core.records import Record

    d = numbers["d"] if numbers["d"] is not None else float("nan")
    return Record(id=numbers["id"], category=None, query="", response="", revisions=[""], logp_response=-1.0,
                  logp_revised=-1.0 + d, d=d, n_tokens_response=1, n_tokens_revised=1,
                  confident=is_confident(d, -0.05), truncated=False, ref=numbers.get("ref"))  # fmt: skip


def judged(values: dict, step: int) -> tuple[float, float, bool]:
    """(the step's test measure, its p against the base model's, whether it is significantly worse than the base
    model) over the test queries."""
    from probdiff_callback.core.significance import SIGNIFICANCE_LEVEL, paired_permutation_p

    base, here = values["test"]["0"], values["test"][str(step)]
    ids = sorted(base)
    mean, base_mean = sum(here[i] for i in ids) / len(ids), sum(base[i] for i in ids) / len(ids)
    if step == 0:
        return mean, 1.0, False
    p = paired_permutation_p([base[i] for i in ids], [here[i] for i in ids])
    worse = mean > base_mean if LOWER_IS_BETTER[values["measure"]] else mean < base_mean
    return mean, p, worse and p < SIGNIFICANCE_LEVEL


def all_picks(study: dict) -> dict[str, dict[str, int | None]]:
    """`picks_of` of every run, by run name (the guard's tests make it the costly part: compute it once)."""
    return {name: picks_of(values) for name, values in study.items()}


def damaged_picks(study: dict, picks: dict | None = None) -> dict[str, int]:
    """Per way of picking, the runs whose pick is damaged (significantly worse than the base model on the test set)."""
    picks = all_picks(study) if picks is None else picks
    return {way: sum(judged(values, picks[name][way])[2] for name, values in study.items()) for way in WAYS}


def study_table(study: dict, picks: dict | None = None) -> str:
    """Per run: each way's pick, its test measure and whether it is damaged; then per recipe and way the regret
    (mean and worst) against the oracle checkpoint and against the best the run has (its checkpoints or the base
    model, which the guarded pick can fall back to), and the damaged picks; the guard's rejections on the clean
    runs."""
    picks = all_picks(study) if picks is None else picks
    lines = [
        "| run | measure (base) | " + " | ".join(WAYS) + " |",
        "|---|---|" + "---|" * len(WAYS),
    ]
    regrets: dict[tuple[str, str, str], list[float]] = {}  # (recipe, way, against) -> each run's
    damaged: dict[str, int] = {way: 0 for way in WAYS}
    for name, values in study.items():
        recipe = name.split("-s")[0]
        run_picks = picks[name]
        lower = LOWER_IS_BETTER[values["measure"]]
        base = judged(values, 0)[0]
        oracle = judged(values, run_picks["oracle"])[0]
        best_of_run = (min if lower else max)(oracle, base)
        cells = []
        for way in WAYS:
            step = run_picks[way]
            mean, _, is_damaged = judged(values, step)
            for against, reference in (("oracle", oracle), ("run", best_of_run)):
                regret = (mean - reference) if lower else (reference - mean)
                regrets.setdefault((recipe, way, against), []).append(regret)
            damaged[way] += is_damaged
            where = "base" if step == 0 else f"{step}"
            cells.append(f"{where}: {mean:.2f}{' **damaged**' if is_damaged else ''}")
        lines.append(f"| {name} | {values['measure']} ({base:.2f}) | " + " | ".join(cells) + " |")
    summary = [
        "| recipe (runs) | regret against | " + " | ".join(WAYS[:-1]) + " |",
        "|---|---|" + "---|" * (len(WAYS) - 1),
    ]
    for recipe in RECIPES:
        runs = sum(name.split("-s")[0] == recipe for name in study)
        if not runs:
            continue
        for against, words in (("oracle", "the oracle checkpoint"), ("run", "the best of the run")):
            cells = [
                f"{sum(r) / len(r):.2f} / {max(r):.2f}" for way in WAYS[:-1] for r in [regrets[(recipe, way, against)]]
            ]
            summary.append(f"| {recipe} ({runs}) | {words}: mean / worst | " + " | ".join(cells) + " |")
    counts = " | ".join(str(damaged[way]) for way in WAYS[:-1])
    summary.append(f"| damaged picks (of {len(study)} runs) | | {counts} |")
    return "\n".join(lines) + "\n\n" + "\n".join(summary) + "\n\n" + guard_rejections(study)


def confirmed_on_test(values: dict, step: int, gain_share: float = 0.25) -> bool:
    """Whether the test set finds the step materially worse by the guard's own rule, on the test measure: significantly
    worse than the base model, or than the test's best checkpoint by more than `gain_share` of the test's gain."""
    from probdiff_callback.core.significance import SIGNIFICANCE_LEVEL, paired_permutation_p

    if judged(values, step)[2]:
        return True
    lower = LOWER_IS_BETTER[values["measure"]]
    test = {int(s): v for s, v in values["test"].items()}
    ids = sorted(test[0])
    mean = {s: sum(v[i] for i in ids) / len(ids) for s, v in test.items()}
    best = (min if lower else max)((s for s in mean if s != 0), key=lambda s: mean[s])
    gain = (mean[0] - mean[best]) if lower else (mean[best] - mean[0])
    given_up = (mean[step] - mean[best]) if lower else (mean[best] - mean[step])
    if gain <= 0 or given_up <= gain_share * gain:
        return False
    return paired_permutation_p([test[best][i] for i in ids], [test[step][i] for i in ids]) < SIGNIFICANCE_LEVEL


def guard_rejections(study: dict) -> str:
    """On the clean runs: the checkpoints the guard failed, and how many of them the test set finds materially worse by
    the same rule (the others are false rejections)."""
    from probdiff_callback.analysis.crosscheck import step_measures
    from probdiff_callback.analysis.guard import guard_checkpoints
    from probdiff_callback.runs.run_files import HistoryRow

    failed, truly, checkpoints = [], 0, 0
    for name, values in study.items():
        if not name.endswith("-clean"):
            continue
        rows = [HistoryRow.from_json(row) for row in values["rows"]]
        guard = guard_checkpoints(step_measures(rows), per_query_values(values), 0.25)
        checkpoints += len(guard.checkpoints)
        for step in guard.failed_steps:
            failed.append(f"{name} step {step} ({guard.why_failed(step)})")
            confirmed = confirmed_on_test(values, step)
            truly += confirmed
            failed[-1] += "" if confirmed else ": a false rejection, the test set finds it not materially worse"
    return (
        f"The guard on the clean runs: {len(failed)} of {checkpoints} checkpoints failed; the test set finds {truly} "
        f"of them materially worse by the same rule, {len(failed) - truly} false rejections"
        + "".join(f"\n- {f}" for f in failed)
    )


def collect(work: Path, record: Path) -> dict:
    """Every measured run's numbers (`study_values`) by run name, with its test measure and times: the record's, and
    those of the runs finished in `work` since."""
    study = json.loads(record.read_text(encoding="utf-8")) if record.is_file() else {}
    for seed, recipe, condition in itertools.product(SEEDS, RECIPES, CONDITIONS):
        run_dir = work / "runs" / run_name(recipe, seed, condition)
        if not (run_dir / "final").is_dir():
            continue
        values = study_values(run_dir)
        if set(values["test"]) != {str(step) for step in evaluated_steps(run_dir)}:
            continue  # its test measure is still under way
        values["measure"] = TEST_MEASURE[recipe]
        logs = work / "logs"
        values["times"] = {stage: json.loads((logs / f"{stage}-{run_dir.name}.json").read_text()) for stage in STAGES}
        study[run_name(recipe, seed, condition)] = values
    return study


def save(work: Path, record: Path) -> None:
    """The record with every run measured so far (written whole, then moved into place)."""
    write_atomic(record, json.dumps(collect(work, record), separators=(",", ":")) + "\n")


def seconds(timing: dict) -> str:
    """A stage's seconds, with its starts where it was resumed; `last_start_only`: an early run of the study, which
    kept the seconds of a resumed stage's last start only."""
    if timing.get("last_start_only"):
        return f"{timing['seconds']} (the last of {timing['starts']} starts only)"
    return f"{timing['seconds']}" + (f" (in {timing['starts']} starts)" if timing["starts"] > 1 else "")


def times_table(study: dict) -> str:
    """Each run's training and test-measure seconds (over all its starts, where it was resumed) and the load average
    when it first started."""
    lines = [
        "| run | training, beside its evaluator (s) | test measure (s) | load average at the start |",
        "|---|---|---|---|",
    ]
    for name, values in study.items():
        cells = [seconds(values["times"][stage]) for stage in STAGES]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {values['times']['train']['load']:.2f} |")
    return "\n".join(lines)


def write_into_docs(tables: dict[str, str]) -> None:
    """Each table between its markers in DOCS (the markers must be there, once each)."""
    text = DOCS.read_text(encoding="utf-8")
    for key, table in tables.items():
        start, end = MARKERS[key]
        if text.count(start) != 1 or text.count(end) != 1:
            sys.exit(f"{DOCS}: the markers of the {key} table must each be there once: {start!r} ... {end!r}")
        text = text[: text.index(start) + len(start)] + f"\n{table}\n" + text[text.index(end) :]
    DOCS.write_text(text, encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=str(ROOT / "runs" / "selection-study"), help="where everything goes")
    parser.add_argument("--source", default=str(DEFAULT_SOURCE), help="the paper's data (data/prepare.py's layout)")
    parser.add_argument("--only", nargs="*", default=None, help="run names to train and measure (default: all 18)")
    parser.add_argument("--report", action="store_true", help="the tables from the record; nothing trained")
    parser.add_argument("--docs", action="store_true", help="with --report: the tables into docs/agreement.md too")
    parser.add_argument("--record", default=str(RECORD), help="the measured runs' numbers (read, and added to)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # measure's own process: the run directory
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--recipe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        return measure_here(Path(args.measure), Path(args.data), args.recipe)
    work, source, record = Path(args.work).resolve(), Path(args.source).resolve(), Path(args.record).resolve()
    if args.report:
        study = collect(work, record)
        tables = {"picks": study_table(study), "times": times_table(study)}
        say(f"{len(study)} runs measured\n\n{tables['picks']}\n\n{tables['times']}")
        if args.docs:
            write_into_docs(tables)
            say(f"the tables are in {DOCS.relative_to(ROOT)}: its prose and its count of runs are yours to update")
        return None
    recorded = set(collect(work, record))
    say(f"load average {os.getloadavg()[0]:.2f}; everything goes to {work}")
    for seed, recipe, condition in itertools.product(SEEDS, RECIPES, CONDITIONS):
        name = run_name(recipe, seed, condition)
        if name in recorded or (args.only is not None and name not in args.only):
            continue
        if (work / "stop").exists():  # `touch WORK/stop`: the study ends between runs, nothing half done
            (work / "stop").unlink()
            return say("stopped: WORK/stop was there; run the same command to go on")
        data = study_data(work, source, recipe, seed)
        run_dir = train(work, data, recipe, seed, condition)
        measure(run_dir, data, recipe)
        save(work, record)
        say(f"{name}: measured, its numbers added to {record.relative_to(ROOT)}; commit it")


if __name__ == "__main__":
    main()
