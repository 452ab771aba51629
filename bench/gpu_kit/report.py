"""The kit's output: a row of the table (`Figure`), the markdown table, number formats, progress on stderr."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

GIB = 1024**3


@dataclass
class Figure:
    """One row of the table: a headline value, how it was measured, and its numbers for --json."""

    name: str
    value: str
    detail: str = ""
    numbers: dict[str, float] = field(default_factory=dict)


def say(message: str) -> None:
    """Progress on stderr, so that stdout holds only the table."""
    print(f"[gpu.py {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def markdown_table(figures: Sequence[Figure]) -> str:
    lines = ["| figure | value | how it was measured |", "|---|---|---|"]
    for figure in figures:
        lines.append("| " + " | ".join(c.replace("|", "/") for c in (figure.name, figure.value, figure.detail)) + " |")
    return "\n".join(lines)


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.2f} GiB"


def plural(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


def seconds(value: float) -> str:
    return f"{value:.3g} s" if value < 100 else f"{value:.0f} s"
