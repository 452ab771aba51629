"""What W&B gets beside the scalars (which go through `trainer.log`): the distribution of d at each evaluated step as
a histogram, and the first records of each step in one table that grows across steps. Main process only."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from probdiff_callback.core.records import Record

WANDB_HISTOGRAM_KEY = "eval/probdiff_d"
WANDB_TABLE_KEY = "eval/probdiff_records"
WANDB_TABLE_COLUMNS = ["step", "id", "category", "query", "response", "revision", "logp_response", "logp_revised", "d"]


class WandbRecords:
    """The distribution of d at each evaluated step as a histogram, and the first records of each step in one
    table that grows across steps."""

    def __init__(self, table_rows: int) -> None:
        self.table_rows = table_rows
        self._table = None

    def log(self, step: int, records: Sequence[Record]) -> None:
        import wandb

        if wandb.run is None:
            return
        payload: dict[str, Any] = {"train/global_step": step}
        ds = [r.d for r in records if math.isfinite(r.d)]
        if ds:  # wandb.Histogram raises on NaN; the invalid ones are counted in eval/probdiff_n_invalid
            payload[WANDB_HISTOGRAM_KEY] = wandb.Histogram(ds)
        if self.table_rows and records:
            if self._table is None:
                self._table = wandb.Table(columns=WANDB_TABLE_COLUMNS, log_mode="INCREMENTAL")
            for r in records[: self.table_rows]:
                revision = r.revisions[-1] if r.revisions else ""
                self._table.add_data(
                    step, r.id, r.category, r.query, r.response, revision, r.logp_response, r.logp_revised, r.d
                )
            payload[WANDB_TABLE_KEY] = self._table
        if len(payload) > 1:
            wandb.log(payload)
