"""Reading W&B's local run files (`run-<id>.wandb`), as `wandb sync` uploads them.

wandb-core writes every run, online or offline, to a transaction log in its run directory
(`wandb/offline-run-<time>-<id>/run-<id>.wandb` offline, `wandb/run-<time>-<id>/` online): a 7-byte
header, then a LevelDB log of protobuf `Record`s (32 KiB blocks counted from the start of the
file, records split across blocks). wandb 0.31 ships the protobuf classes but no reader, so this
is one. A resumed segment's run record carries `branch_point` when it rewinds the run
(`resume_from="<id>?_step=N"`): W&B keeps the history up to `_step` N and the segment's rows follow.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

FILE_MAGIC = b":W&B"
FILE_HEADER = 7
BLOCK = 32768
RECORD_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
GLOBAL_STEP_KEY = "train/global_step"


def read_records(path: str | os.PathLike) -> list:
    """The protobuf records of a run file, in order; a record still being written at the end is left out."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if data[:4] != FILE_MAGIC:
        raise ValueError(f"{path}: not a W&B run file (it does not start with {FILE_MAGIC!r})")
    position, pending, records = FILE_HEADER, b"", []
    while position + RECORD_HEADER <= len(data):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < RECORD_HEADER:  # the block's tail is zero padding
            position += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position : position + RECORD_HEADER])
        payload = data[position + RECORD_HEADER : position + RECORD_HEADER + length]
        position += RECORD_HEADER + length
        if (kind == 0 and length == 0) or len(payload) < length:
            break  # zeroed tail of the last block, or a record still being written
        pending = payload if kind in (FULL, FIRST) else pending + payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def history_row(record) -> dict:
    """One history record as a dict; media fields arrive as one item per field under a nested key."""
    row: dict = {}
    for item in record.history.item:
        keys = [item.key] if item.key else list(item.nested_key)
        node = row
        for part in keys[:-1]:
            node = node.setdefault(part, {})
        node[keys[-1]] = json.loads(item.value_json)
    return row


@dataclass
class Segment:
    """One run file: which run it belongs to, where it rewinds that run to, and its history rows."""

    path: Path
    run_id: str
    branch_step: int | None  # the `_step` the segment rewinds to (rows after it are replaced), or None
    rows: list[dict] = field(default_factory=list)
    record_types: list[str] = field(default_factory=list)


def read_segment(path: str | os.PathLike) -> Segment:
    records = read_records(path)
    run = next((r.run for r in records if r.WhichOneof("record_type") == "run"), None)
    if run is None:
        raise ValueError(f"{path}: no run record (the file is empty or was cut before the run started)")
    branch = run.branch_point if run.HasField("branch_point") and run.branch_point.metric == "_step" else None
    return Segment(
        path=Path(path),
        run_id=run.run_id,
        branch_step=None if branch is None else int(branch.value),
        rows=[history_row(r) for r in records if r.WhichOneof("record_type") == "history"],
        record_types=[r.WhichOneof("record_type") for r in records],
    )


def effective_history(segments: list[Segment]) -> list[dict]:
    """The run's history once every segment is uploaded in order: a segment that rewinds to `_step` N
    keeps the earlier rows up to N and replaces the rest by its own."""
    rows: list[dict] = []
    for segment in segments:
        if segment.branch_step is not None:
            rows = [row for row in rows if row.get("_step", -1) <= segment.branch_step]
        rows.extend(segment.rows)
    return rows


def last_step_at_or_before(rows: list[dict], global_step: int) -> int | None:
    """The last W&B `_step` logged at a Trainer global step <= `global_step` (None if none was)."""
    steps = [
        row["_step"] for row in rows if "_step" in row and row.get(GLOBAL_STEP_KEY, global_step + 1) <= global_step
    ]
    return max(steps) if steps else None
