"""Numbers as table cells: one rule for missing and non-finite values, percentages and aligned tables."""

from __future__ import annotations

import math
from collections.abc import Sequence


def is_finite(value: object) -> bool:
    """A real number that is neither NaN nor infinite (None, text and booleans are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def fmt(value: object, spec: str, missing: str = "n/a") -> str:
    """`value` formatted with `spec` (e.g. `.3g`, `+.2f`), or `missing` when it is not a finite number."""
    return format(value, spec) if is_finite(value) else missing


def pct(value: object, missing: str = "n/a") -> str:
    """A share in [0, 1] as a percentage with one decimal (`0.417` -> `41.7%`)."""
    return f"{100 * value:.1f}%" if is_finite(value) else missing  # type: ignore[operator]


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Right-aligned columns separated by two spaces."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    return "\n".join("  ".join(str(cell).rjust(width) for cell, width in zip(line, widths)) for line in [header, *rows])
