"""Queries: reading them from files, strings, chats and datasets (with a reference answer where the rows carry one),
their categories under one canonical name (`categories`), and pair files for scoring."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from probdiff_callback.core.categories import canonical_category
from probdiff_callback.core.json_form import jsonl_lines

QUERY_FIELDS = ("query", "instruction", "question", "user", "prompt")
TURN_FIELDS = ("conversations", "messages", "turns", "prompt")  # trl's conversational `prompt` is a chat
# `messages` ({role, content}) and ShareGPT `conversations` ({from, value}) name the same roles differently
ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system"}
T = TypeVar("T")


@dataclass(frozen=True)
class Query:
    id: str
    text: str
    category: str | None = None  # AlignBench's categories under their canonical name (see `canonical_category`)
    reference: str | None = None  # a reference answer, for reference metrics (BLEU, chrF, ROUGE)

    def __post_init__(self) -> None:
        object.__setattr__(self, "category", canonical_category(self.category))


class DataFileError(ValueError):
    """A row of an input file that cannot be used; the message names the file and line."""


def read_rows(path: str | os.PathLike) -> list[tuple[int, dict]]:
    """(line number, row) for a JSON-lines file or a JSON list, told apart by content, not extension.

    For a JSON list the number is the item's line in the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    text = path.read_text(encoding="utf-8-sig")
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataFileError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
        rows = []
        decoder = json.JSONDecoder()
        # Recover each item's line for error messages without a second parser.
        position = text.index("[") + 1
        line, counted_to = 1, 0
        for item in items:
            while text[position] in " \t\r\n,":
                position += 1
            _, end = decoder.raw_decode(text, position)
            line += text.count("\n", counted_to, position)
            counted_to = position
            rows.append((line, item))
            position = end
        return _check_objects(path, rows)
    rows = []
    for number, line in enumerate(jsonl_lines(text), start=1):
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line)))
        except json.JSONDecodeError as err:
            raise DataFileError(
                f"{path}:{number}: not valid JSON ({err.msg}); expected one JSON object per line or a JSON list"
            ) from None
    return _check_objects(path, rows)


def _check_objects(path: Path, rows: list[tuple[int, object]]) -> list[tuple[int, dict]]:
    for number, row in rows:
        if not isinstance(row, dict):
            raise DataFileError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
    if not rows:
        raise DataFileError(f"{path}: the file holds no rows")
    return rows  # type: ignore[return-value]


def chat_turn(turn: object) -> tuple[str | None, object]:
    """(role as `user`/`assistant`/`system` or None when unknown, content) of one turn in either layout;
    a bare string is a user turn (MT-Bench's `turns`)."""
    if isinstance(turn, str):
        return "user", turn
    if not isinstance(turn, dict):
        return None, None
    return ROLES.get(turn.get("role", turn.get("from"))), turn.get("content", turn.get("value"))


def chat_messages(turns: object, where: str) -> list[dict]:
    """A conversation (`messages` or `conversations`) as `{role, content}` messages that end with the
    assistant; anything else stops with `where` (file and line) in the message."""
    if not isinstance(turns, list) or not turns:
        raise DataFileError(f"{where}: expected a non-empty list of turns")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise DataFileError(f"{where}: a turn is {type(turn).__name__}, expected an object")
        role, content = chat_turn(turn)
        if role is None:
            found = turn.get("role", turn.get("from"))
            raise DataFileError(f"{where}: unknown role {found!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(content, str) or not content.strip():
            raise DataFileError(f"{where}: a {role} turn has no text")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in messages) or messages[-1]["role"] != "assistant":
        raise DataFileError(f"{where}: a conversation needs a user turn and must end with an assistant turn")
    return messages


def _first_user_turn(turns: object) -> str | None:
    if not isinstance(turns, list):
        return None
    for turn in turns:
        role, content = chat_turn(turn)
        if role == "user":
            return content if isinstance(content, str) else None
    return None


def _first_assistant_reply(turns: object) -> str | None:
    """The assistant turn answering the first user turn of a conversation, if any."""
    if not isinstance(turns, list):
        return None
    seen_user = False
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        role, content = chat_turn(turn)
        if role == "user":
            if seen_user:
                return None
            seen_user = True
        elif role == "assistant" and seen_user:
            return content if isinstance(content, str) and content.strip() else None
    return None


def reference_text(row: dict) -> str | None:
    """A row's reference answer: a string `reference` or `completion` (trl's prompt-completion rows), else the
    assistant reply to the first user turn of `conversations`/`messages`/`completion`."""
    for key in ("reference", "completion"):
        if isinstance(row.get(key), str) and row[key].strip():
            return row[key]
    if isinstance(row.get("completion"), list):
        return next((c for r, c in map(chat_turn, row["completion"]) if r == "assistant" and isinstance(c, str)), None)
    for key in ("conversations", "messages"):
        if key in row:
            return _first_assistant_reply(row[key])
    return None


def query_text(row: dict) -> str | None:
    for key in QUERY_FIELDS:
        if isinstance(row.get(key), str):
            return row[key]
    for key in TURN_FIELDS:
        if key in row:
            return _first_user_turn(row[key])
    return None


def row_id(row: dict, index: int) -> str:
    for key in ("id", "question_id"):
        if row.get(key) is not None:
            return str(row[key])
    return str(index)


def load_queries(path: str | os.PathLike) -> list[Query]:
    """Queries from `query`, `instruction`, `question`, `user`, `prompt`, or the first user turn of
    `conversations`/`messages`/`turns`; `id`/`question_id` and `category` are optional; a reference
    answer from `reference` or the assistant's reply in `conversations`/`messages` (see `reference_text`)."""
    return queries_from_rows(read_rows(path), str(path), "line")


def queries_from_rows(rows: Iterable[tuple[int, dict]], where: str, unit: str = "row") -> list[Query]:
    """Queries of numbered rows (`where` names their source in errors, `unit` what the numbers count)."""
    queries, seen = [], {}
    for index, (number, row) in enumerate(rows):
        text = query_text(row)
        if text is None or not text.strip():
            raise DataFileError(
                f"{where}:{number}: no query found; give a non-empty string in one of {', '.join(QUERY_FIELDS)}, "
                f"or a user turn in {', '.join(TURN_FIELDS)} (keys here: {', '.join(row) or 'none'})"
            )
        query_id = row_id(row, index)
        if query_id in seen:
            raise DataFileError(
                f"{where}:{number}: id {query_id!r} repeats {unit} {seen[query_id]}; ids must be unique"
            )
        seen[query_id] = number
        category = row.get("category")
        queries.append(Query(query_id, text, None if category is None else str(category), reference_text(row)))
    return queries


def queries_from(source: Any) -> list[Query]:
    """Queries from a file path, a list of strings, a list of chats (each a list of `{role, content}`),
    a list of rows or `Query` objects, or a `datasets.Dataset` whose rows hold a prompt (`prompt`,
    `messages`, `query`, ...: see `load_queries`). Chats and rows may carry the reference answer."""
    if isinstance(source, (str, os.PathLike)):
        return load_queries(source)
    if hasattr(source, "column_names") and hasattr(source, "num_rows"):  # a datasets.Dataset, without importing it
        return queries_from_rows(enumerate(source), f"dataset with columns {source.column_names}")
    if not isinstance(source, Sequence) or isinstance(source, (bytes, dict)):
        raise TypeError(
            f"queries: got {type(source).__name__}; give a file path, a list of strings or chats, or a datasets.Dataset"
        )
    if all(isinstance(item, Query) for item in source):
        return list(source)
    rows = []
    for number, item in enumerate(source):
        if isinstance(item, str):
            item = {"query": item}
        elif isinstance(item, list):
            item = {"messages": item}
        elif not isinstance(item, dict):
            raise DataFileError(f"queries[{number}]: got {type(item).__name__}; expected a string, a chat or a row")
        rows.append((number, item))
    return queries_from_rows(rows, "queries")


def fixed_subset(items: Sequence[T], n: int | None, seed: int) -> list[T]:
    """`n` items drawn once with `seed`, kept in their order (without touching the global RNG, which drives
    training); all of them when `n` is None or at least their number."""
    if n is None or n >= len(items):
        return list(items)
    return [items[i] for i in sorted(random.Random(seed).sample(range(len(items)), n))]


def load_pairs(path: str | os.PathLike) -> list[tuple[Query, str, str]]:
    """Rows `{id, query, response, revised}` (texts generated elsewhere) for scoring only."""
    pairs, seen = [], {}
    for index, (line, row) in enumerate(read_rows(path)):
        missing = [k for k in ("query", "response", "revised") if not isinstance(row.get(k), str)]
        if missing:
            raise DataFileError(
                f"{path}:{line}: missing or non-string {', '.join(missing)}; each row needs query, response and revised"
            )
        query_id = row_id(row, index)
        if query_id in seen:
            raise DataFileError(f"{path}:{line}: id {query_id!r} repeats line {seen[query_id]}; ids must be unique")
        seen[query_id] = line
        category = row.get("category")
        pairs.append(
            (
                Query(query_id, row["query"], None if category is None else str(category)),
                row["response"],
                row["revised"],
            )
        )
    return pairs


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    return [row for _, row in read_rows(path)]
