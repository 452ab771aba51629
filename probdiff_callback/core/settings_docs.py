"""The settings as Markdown tables for docs/configuration.md (tests/test_config.py checks that they are current):
a job of its own beside the settings themselves (config.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from probdiff_callback.core.config import CALLBACK, EVAL, SCORE


def settings_table(cls: type, prefix: str = "") -> str:
    """A Markdown table of a settings dataclass's fields: key, default, and help (with who reads it, where fields
    say). docs/configuration.md holds these tables; tests/test_config.py checks that they are current."""
    readers = {EVAL: "eval", SCORE: "score", CALLBACK: "training"}
    with_scope = any("read_by" in f.metadata for f in dataclasses.fields(cls))
    lines = ["| key | default | " + ("read by | " if with_scope else "") + "what it does |"]
    lines.append("| --- | --- | " + ("--- | " if with_scope else "") + "--- |")
    defaults = cls()
    for f in dataclasses.fields(cls):
        if not f.init or "help" not in f.metadata:
            continue
        default = getattr(defaults, f.name)
        shown = "–" if dataclasses.is_dataclass(default) else f"`{_yaml_value(default)}`"
        scope = ", ".join(readers[r] for r in (EVAL, SCORE, CALLBACK) if r in f.metadata.get("read_by", ()))
        help_text = f.metadata["help"].replace("|", "\\|")
        lines.append(f"| `{prefix}{f.name}` | {shown} | " + (f"{scope} | " if with_scope else "") + f"{help_text} |")
    return "\n".join(lines)


def _yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)
