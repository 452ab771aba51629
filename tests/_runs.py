"""Run directories laid out as ProbDiffCallback writes them (history rows, step records, checkpoint folders), built by
hand for the tests of `select`, `plot` and the disagreement alarm."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from probdiff_callback.core.metric import compare_to_base, is_confident, summary_of
from probdiff_callback.core.records import Record
from probdiff_callback.runs.run_files import (
    HistoryRow,
    history_path,
    read_history,
    read_records,
    step_records_path,
    write_jsonl,
)

DELTA = -0.05


def records_for(ds: list[float], categories: tuple[str, ...] = ("writing", "math")) -> list[Record]:
    return [
        Record(
            id=f"q{i}",
            category=categories[i % len(categories)],
            query=f"query {i}",
            response="a",
            revisions=["b"],
            logp_response=-2.0,
            logp_revised=-2.0 + d,
            d=d,
            n_tokens_response=10,
            n_tokens_revised=10,
            confident=is_confident(d, DELTA),
            truncated=False,
        )
        for i, d in enumerate(ds)
    ]


def write_run(
    run: Path, steps: dict[int, list[float] | None], *, checkpoints: tuple[int, ...] = (), baseline: bool = True
) -> None:
    """A run directory: history rows (step 0 the baseline), step records, checkpoint dirs, added to the rows
    already there. A step given None is a failed evaluation. `vs_base` is stored as the callback stores it."""
    rows = {row.global_step: row for row in read_history(history_path(run))}
    for step, ds in steps.items():
        kind = "baseline" if step == 0 and baseline else "evaluate"
        checkpoint = None
        if step in checkpoints:
            checkpoint = str(run / f"checkpoint-{step}")
            Path(checkpoint).mkdir(parents=True)
            (Path(checkpoint) / "adapter_config.json").write_text("{}")
            save_file(
                {"lora_A": np.zeros((4, 8), dtype=np.float32)}, str(Path(checkpoint) / "adapter_model.safetensors")
            )
        row = {
            "global_step": step,
            "epoch": step / 10,
            "kind": kind,
            "base_model": kind == "baseline",
            "checkpoint": checkpoint,
            "records": None,
            "summary": None,
            "error": "RuntimeError: boom" if ds is None else None,
            "seconds": 1.0,
        }
        if ds is not None:
            records = records_for(ds)
            write_jsonl(step_records_path(run, step), records)
            row["records"] = f"step-{step}/records.jsonl"
            row["summary"] = summary_of(records, DELTA, [0.0, -0.1]).to_json()
            base = rows.get(0)
            if kind != "baseline" and base is not None and base.records:
                base_records = read_records(run / "probdiff" / base.records)
                row["vs_base"] = compare_to_base(records, base_records, DELTA).to_json()
        rows[step] = HistoryRow.from_json(row)
    write_jsonl(history_path(run), [rows[step].to_json() for step in sorted(rows)])


GOOD = [0.2, 0.1, 0.3, 0.05, 0.4, 0.2, 0.1, -0.01]  # all confident
MIXED = [0.2, -0.3, 0.3, -0.2, 0.4, 0.2, -0.5, -0.01]  # 5 of 8
MIXED_HIGHER_D = [0.9, -0.3, 0.9, -0.2, 0.9, 0.9, -0.5, -0.01]  # 5 of 8, larger mean d
POOR = [-0.2, -0.3, -0.1, -0.2, 0.4, -0.6, -0.5, -0.4]  # 1 of 8
