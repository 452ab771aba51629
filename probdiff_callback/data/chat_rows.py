"""The chat rows every task builds and reads: a chat row `{"category", "messages", ...}` from a prompt and its answer
(`row`), the conversations of the paper's training files in any of their shapes (`conversation_rows`), a required text
field with an error that names file and line (`text_field`), and the deliberate corruption `--shuffle-references`
applies to finished training rows (`shuffle_references`). Shared by the four task modules, so that they read their
files and write their rows the same way.
"""

from __future__ import annotations

import random
from pathlib import Path

from probdiff_callback.core.queries import DataFileError, chat_messages, read_rows

CONVERSATIONS = "a JSON list of `conversations` [{from, value}]"


def conversation_rows(path: Path, rows: list[tuple[int, dict]] | None = None) -> list[tuple[str, list[dict], dict]]:
    """(where, messages, row) for each row of a conversation file (`rows`: its rows, if already read)."""
    out = []
    for line, row in read_rows(path) if rows is None else rows:
        turns = row.get("messages", row.get("conversations"))
        if turns is None and isinstance(row.get("user"), str) and isinstance(row.get("assistant"), str):
            turns = [{"role": "user", "content": row["user"]}, {"role": "assistant", "content": row["assistant"]}]
        if turns is None:
            raise DataFileError(
                f"{path}:{line}: expected `messages`, `conversations` or `user` + `assistant` "
                f"(keys here: {', '.join(row) or 'none'})"
            )
        out.append((f"{path}:{line}", chat_messages(turns, f"{path}:{line}"), row))
    return out


def text_field(row: dict, key: str, where: str) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        raise DataFileError(f"{where}: missing or empty `{key}` (keys here: {', '.join(row) or 'none'})")
    return value.strip()


def row(category: str, user: str, assistant: str, **extra) -> dict:
    return {
        "category": category,
        "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}],
        **extra,
    }


def shuffle_references(rows: list[dict], seed: int) -> list[dict]:
    """The rows with their reference answers (last assistant turns) permuted across rows of the same category by a
    seeded derangement (a random cycle: no row keeps its own), each row naming whose answer it now holds."""
    by_category: dict[str, list[int]] = {}
    for index, item in enumerate(rows):
        by_category.setdefault(item["category"], []).append(index)
    out = [dict(item) for item in rows]
    for category, indices in sorted(by_category.items()):
        if len(indices) < 2:
            raise SystemExit(
                f"error: --shuffle-references: category {category!r} has one training row, nothing to swap"
            )
        order = indices[:]
        random.Random(f"{seed}-{category}-shuffle").shuffle(order)
        for position, target in enumerate(order):  # each row takes the answer of the next one in a random cycle
            donor = rows[order[(position + 1) % len(order)]]
            messages = [dict(m) for m in rows[target]["messages"]]
            messages[-1] = {**messages[-1], "content": donor["messages"][-1]["content"]}
            out[target] = {**rows[target], "messages": messages, "reference_of": donor["id"]}
    return out
