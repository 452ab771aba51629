"""The JSON form of the package's typed files, one codec for all: `JsonRecord`, the base of every dataclass written as
a JSON object (the records, summaries, comparisons and costs of `records.py`, a run's history rows, the evaluation
queue's messages).

The rule:
- keys in the order of the fields; then the keys this version does not know, which reading keeps in the field `extra`
  (a dict) as they were, so rewriting a file loses nothing;
- NaN (and infinity) written as null, since JSON has none, and read back the other way: null is NaN where the field
  holds a number and not None (`float`), None where its type admits None, so the rest of the package sees NaN, never
  None, where a number belongs. Other values are read as they are (an int in a `float` field stays an int, so a file
  rewrites byte for byte); nested `JsonRecord`s, also in lists and dicts, as their types;
- a key the file lacks reads as the field's default (a required one: a ValueError naming it), and the object remembers
  it (`absent`): it is left out again while it still holds its default, so rewriting an older file invents nothing. A
  class that sets `remember_absent = False` writes those fields instead (a history row gains `"vs_base": null`);
- a field made with `json_field(omit_default=True)` is left out while it holds its default: keys only some objects
  have (a record's `reference`, a row's `cost` or `eval_loss`).

A field holds its default when its JSON form is the default's: any NaN or infinity holds a NaN default. `dumps` writes
any value holding these objects; `JsonRecord.from_file` reads one from a file.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

T = TypeVar("T", bound="JsonRecord")
EXTRA = "extra"  # the field that keeps the keys a class does not know


def json_field(
    default: Any = dataclasses.MISSING, *, omit_default: bool = False, help: str | None = None, **kwargs: Any
) -> Any:
    """A dataclass field (`kwargs` go to `dataclasses.field`); `omit_default`: left out of the JSON form while it
    holds its default; `help`: its documentation, in its metadata (`records.markdown_table`)."""
    metadata = {"omit_default": omit_default, **({} if help is None else {"help": help})}
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def nan_to_none(value: Any) -> Any:
    """`value` with every NaN and infinity, however deeply nested, as None; tuples become lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: nan_to_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [nan_to_none(v) for v in value]
    return value


def jsonl_lines(text: str) -> list[str]:
    """The lines of a JSON Lines text, split at "\\n" only (a "\\r" before it is whitespace to JSON). `str.splitlines`
    would also split at U+2028, U+2029, U+0085 and others, which JSON strings may hold unescaped and `dumps` writes as
    they are: a model's answer, or a Xiaohongshu post, can hold them."""
    return text.split("\n")


def dumps(value: Any, **kwargs: Any) -> str:
    """`value` as JSON text: the `JsonRecord`s in their JSON form, wherever they sit in it, and every NaN and infinity
    as null (strict JSON readers reject NaN); `kwargs` go to `json.dumps` (`indent`)."""
    return json.dumps(nan_to_none(_to_json(value)), ensure_ascii=False, allow_nan=False, **kwargs)


class JsonRecord:
    """The JSON form of a dataclass (see the module's docstring): subclass it and declare an `extra` dict field."""

    # The fields the file it was read from lacked (written by an older version); none for an object made here.
    absent: ClassVar[frozenset[str]] = frozenset()
    # False: every field is written, even where the file it was read from lacked it (`omit_default` ones aside).
    remember_absent: ClassVar[bool] = True

    @classmethod
    def from_json(cls: type[T], value: Mapping[str, Any]) -> T:
        """The object a file's mapping describes; a ValueError names a required key it lacks."""
        if not isinstance(value, Mapping):
            raise ValueError(f"not a {cls.__name__.lower()}: a JSON object is expected, not {type(value).__name__}")
        hints, known = _hints(cls), _known(cls)
        missing = [f.name for f in known if f.name not in value and _default(f) is dataclasses.MISSING]
        if missing:
            raise ValueError(f"not a {cls.__name__.lower()}: no {', '.join(map(repr, missing))}")
        names = {f.name for f in known}
        fields = {name: _from_json(value[name], hints[name]) for name in names if name in value}
        if _has_extra(cls):
            fields[EXTRA] = {k: v for k, v in value.items() if k not in names}
        made = cls(**fields)
        absent = frozenset(names - set(value))
        if absent and cls.remember_absent:
            made.absent = absent  # type: ignore[misc]
        return made

    def to_json(self) -> dict[str, Any]:
        """The mapping written to the files: the fields in their order, NaN as null, then the unknown keys kept; the
        `omit_default` fields, and those its file lacked (`absent`), left out while they hold their defaults."""
        value: dict[str, Any] = {}
        for f in _known(type(self)):
            item = getattr(self, f.name)
            if (f.metadata.get("omit_default") or f.name in self.absent) and _holds_default(f, item):
                continue
            value[f.name] = _to_json(item)
        return nan_to_none({**value, **getattr(self, EXTRA, {})})

    @classmethod
    def from_file(cls: type[T], path: str | os.PathLike) -> T:
        """The object a JSON file holds; a ValueError names the file and what is wrong (not JSON, not an object, a
        required key missing); an OSError as reading the file raises it."""
        path = Path(path)
        try:
            return cls.from_json(json.loads(path.read_text(encoding="utf-8")))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err.msg})") from None
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None


# --- the rule's parts -------------------------------------------------------------------------------------
@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _known(cls: type) -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in dataclasses.fields(cls) if f.name != EXTRA)


@functools.cache
def _has_extra(cls: type) -> bool:
    return any(f.name == EXTRA for f in dataclasses.fields(cls))


def _default(f: dataclasses.Field) -> Any:
    """The field's default (made afresh from its factory), or MISSING for a required field."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _holds_default(f: dataclasses.Field, item: Any) -> bool:
    """Whether `item` is written as the field's default is: NaN and infinity hold a NaN default."""
    default = _default(f)
    if default is dataclasses.MISSING:
        return False
    return item is default or nan_to_none(_to_json(item)) == nan_to_none(_to_json(default))


def _is_record(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, JsonRecord)


def _members(hint: Any) -> tuple:
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    return typing.get_args(hint) if union else (hint,)


def _from_json(value: Any, hint: Any) -> Any:
    """A JSON value as a field of type `hint` holds it: null as NaN where a number belongs and None does not, nested
    records as their types (a ValueError where one is not an object); anything else as it is (the reader checks what
    it needs)."""
    members = _members(hint)
    if value is None:
        return None if type(None) in members or float not in members else math.nan
    if type(value) in members:  # a number, text or flag the field takes as it is
        return value
    for member in members:
        origin, args = typing.get_origin(member) or member, typing.get_args(member)
        if _is_record(origin) and isinstance(value, Mapping):
            return origin.from_json(value)
        if origin is list and isinstance(value, list):
            return [_from_json(v, args[0]) if args else v for v in value]
        if origin is dict and isinstance(value, Mapping):
            return {k: _from_json(v, args[1]) if args else v for k, v in value.items()}
    record = next((member for member in members if _is_record(member)), None)
    return value if record is None else record.from_json(value)  # not an object: its ValueError says so


def _to_json(item: Any) -> Any:
    if isinstance(item, JsonRecord):
        return item.to_json()
    if isinstance(item, dict):
        return {k: _to_json(v) for k, v in item.items()}
    if isinstance(item, (list, tuple)):
        return [_to_json(v) for v in item]
    return item
