"""Reading query and pair files, writing results (JSON with NaN as null, atomically)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from probdiff_callback.categories import canonical_category

QUERY_FIELDS = ("query", "instruction", "question", "user")
TURN_FIELDS = ("conversations", "messages", "turns")


@dataclass(frozen=True)
class Query:
    id: str
    text: str
    category: str | None = None  # AlignBench's categories under their canonical name (categories.py)
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
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line)))
        except json.JSONDecodeError as err:
            raise DataFileError(f"{path}:{number}: not valid JSON ({err.msg}); expected one JSON object per line or a JSON list") from None
    return _check_objects(path, rows)


def _check_objects(path: Path, rows: list[tuple[int, object]]) -> list[tuple[int, dict]]:
    for number, row in rows:
        if not isinstance(row, dict):
            raise DataFileError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
    if not rows:
        raise DataFileError(f"{path}: the file holds no rows")
    return rows  # type: ignore[return-value]


def _first_user_turn(turns: object) -> str | None:
    if not isinstance(turns, list) or not turns:
        return None
    for turn in turns:
        if isinstance(turn, str):  # MT-Bench: a list of user turns
            return turn
        if isinstance(turn, dict):
            role = turn.get("role", turn.get("from"))
            if role in ("user", "human"):
                content = turn.get("content", turn.get("value"))
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
        role = turn.get("role", turn.get("from"))
        if role in ("user", "human"):
            if seen_user:
                return None
            seen_user = True
        elif role in ("assistant", "gpt") and seen_user:
            content = turn.get("content", turn.get("value"))
            return content if isinstance(content, str) and content.strip() else None
    return None


def reference_text(row: dict) -> str | None:
    """A row's reference answer: a string `reference`, else the assistant reply to the first user
    turn of `conversations`/`messages` (the prepared held-out rows keep it there)."""
    if isinstance(row.get("reference"), str) and row["reference"].strip():
        return row["reference"]
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
    """Queries from `query`, `instruction`, `question`, `user`, or the first user turn of
    `conversations`/`messages`/`turns`; `id`/`question_id` and `category` are optional; a reference
    answer from `reference` or the assistant's reply in `conversations`/`messages` (see `reference_text`)."""
    queries, seen = [], {}
    for index, (line, row) in enumerate(read_rows(path)):
        text = query_text(row)
        if text is None or not text.strip():
            raise DataFileError(
                f"{path}:{line}: no query found; give a non-empty string in one of "
                f"{', '.join(QUERY_FIELDS)}, or a user turn in {', '.join(TURN_FIELDS)} (keys here: {', '.join(row) or 'none'})"
            )
        query_id = row_id(row, index)
        if query_id in seen:
            raise DataFileError(f"{path}:{line}: id {query_id!r} repeats line {seen[query_id]}; ids must be unique")
        seen[query_id] = line
        category = row.get("category")
        queries.append(Query(query_id, text, None if category is None else str(category), reference_text(row)))
    return queries


def load_pairs(path: str | os.PathLike) -> list[tuple[Query, str, str]]:
    """Rows `{id, query, response, revised}` (texts generated elsewhere) for scoring only."""
    pairs, seen = [], {}
    for index, (line, row) in enumerate(read_rows(path)):
        missing = [k for k in ("query", "response", "revised") if not isinstance(row.get(k), str)]
        if missing:
            raise DataFileError(f"{path}:{line}: missing or non-string {', '.join(missing)}; each row needs query, response and revised")
        query_id = row_id(row, index)
        if query_id in seen:
            raise DataFileError(f"{path}:{line}: id {query_id!r} repeats line {seen[query_id]}; ids must be unique")
        seen[query_id] = line
        category = row.get("category")
        pairs.append((Query(query_id, row["query"], None if category is None else str(category)), row["response"], row["revised"]))
    return pairs


def _nan_to_none(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nan_to_none(v) for v in value]
    return value


def to_json(value, **kwargs) -> str:
    """JSON with NaN/inf written as null (strict JSON readers reject NaN)."""
    return json.dumps(_nan_to_none(value), ensure_ascii=False, allow_nan=False, **kwargs)


def write_atomic(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: str | os.PathLike, value) -> None:
    write_atomic(path, to_json(value, indent=2) + "\n")


def write_jsonl(path: str | os.PathLike, rows) -> None:
    write_atomic(path, "".join(to_json(row) + "\n" for row in rows))


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    return [row for _, row in read_rows(path)]
