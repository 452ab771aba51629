"""trl's `SFTConfig` without importing trl: its fields, their types and defaults, written once per set of installed
versions into the cache and read back as a dataclass of the same names, types and defaults (`stand_in`).

Importing trl imports transformers and torch: seconds, tens of them on a loaded machine. The recipe's keys and types
are SFTConfig's, so the settings check that runs before those imports (`precheck.py`) needs its fields, and
`train.recipe` types a recipe against the stand-in exactly as against SFTConfig. The file is made from the class
itself, by a process that imports trl, rather than from trl's and transformers' source read with `ast`: the types
are enumerations defined across transformers' modules, unions written two ways and defaults that are expressions,
and a parser of that source would have to follow each refactoring upstream; the class says what Python makes of it.
The file is named by what could change the fields (`fingerprint`): the versions of trl, transformers (whose
TrainingArguments SFTConfig extends) and accelerate (whose ParallelismConfig it names), and the files that define
them, for an editable install whose version stays put while its source changes.

A type it cannot write down (a class such as ParallelismConfig) stands in as `Any`: that key is checked after the
imports only (`UNCHECKED`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import operator
import os
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

FORMAT = 1  # the layout of the file below: a new one is written when it changes
UNCHECKED = "__unchecked__"  # the stand-in's attribute: the fields it types as Any (see the docstring)
BUILTINS = {t.__name__: t for t in (int, float, str, bool, dict, list)}
# What defines SFTConfig's fields: each distribution, and the file of it that declares them
SOURCES = {"trl": "trainer/sft_config.py", "transformers": "training_args.py", "accelerate": "parallelism_config.py"}
WRITE_TIMEOUT_S = 600  # the first import of trl on a loaded machine


def fingerprint() -> str:
    """What the fields depend on, as one name: the versions and the defining files' size and time, found without
    importing the packages."""
    parts = [f"format {FORMAT}", f"python {sys.version_info.major}.{sys.version_info.minor}"]
    for package, source in SOURCES.items():
        spec = importlib.util.find_spec(package)
        where = Path(spec.submodule_search_locations[0]) / source if spec and spec.submodule_search_locations else None
        stat = where.stat() if where is not None and where.is_file() else None
        parts.append(f"{package} {importlib.metadata.version(package)} {stat and (stat.st_size, stat.st_mtime_ns)}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def cache_path() -> Path:
    from probdiff_callback.models.cache import cache_dir

    return cache_dir() / "sft-config" / f"{fingerprint()}.json"


def stand_in() -> type | None:
    """SFTConfig's stand-in for the installed versions; written first where the cache has none (by a process of its
    own: this one stays without trl), None where it cannot be (the check after the imports then does it all)."""
    try:
        path = cache_path()
        if not path.is_file():
            write_once(path)
        return rebuild(json.loads(path.read_text(encoding="utf-8"))["fields"])
    except (OSError, ImportError, ValueError, KeyError, TypeError, subprocess.SubprocessError):
        return None


def write_once(path: Path) -> None:
    """`write_cache` by one process where several start on one cache at once (the machines of a run sharing it, as
    the model cache's files, models/cache.py): the others wait for its file rather than import trl to write it too."""
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(path.with_name(f"{path.name}.lock"), timeout=WRITE_TIMEOUT_S):
        if not path.is_file():  # else another process wrote it while this one waited
            write_cache(path)


def write_cache(path: Path) -> None:
    """Write SFTConfig's description to `path`: here where trl is imported already (a test, a notebook), else in a
    process that imports it."""
    if "trl" in sys.modules:
        save(path)
        return
    subprocess.run([sys.executable, "-m", "probdiff_callback.training.sft_config_cache", str(path)], check=True,
                   capture_output=True, timeout=WRITE_TIMEOUT_S)  # fmt: skip


def save(path: Path) -> None:
    """SFTConfig's description, written whole or not at all (ranks of one launch may write it at once)."""
    from trl import SFTConfig

    path.parent.mkdir(parents=True, exist_ok=True)
    versions = {package: importlib.metadata.version(package) for package in SOURCES}
    body = json.dumps({"versions": versions, "fields": describe(SFTConfig)}, indent=1)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(body, encoding="utf-8")
    os.replace(partial, path)


# --- a dataclass's fields as JSON, and back ------------------------------------------------------------------------
class Unwritable(TypeError):
    """A type that has no written form here (a class other than an enumeration or a builtin)."""


def describe(cls: type) -> list[dict[str, Any]]:
    """The init fields of the dataclass `cls`: name, type, and the default or the default factory's value."""
    hints = typing.get_type_hints(cls)
    described = []
    for spec in dataclasses.fields(cls):
        if not spec.init:
            continue
        try:
            entry: dict[str, Any] = {"name": spec.name, "type": type_form(hints[spec.name])}
            if spec.default_factory is not dataclasses.MISSING:
                entry["factory"] = _value_form(spec.default_factory())
            else:
                entry["default"] = _value_form(spec.default)
        except Unwritable:
            entry = {"name": spec.name, "type": "Any", "default": None, "unchecked": True}
        described.append(entry)
    return described


def rebuild(described: list[dict[str, Any]]) -> type:
    """The dataclass `describe` described: the same field names, types (enumerations rebuilt under their own names,
    so that a message names them as before) and defaults."""
    enums: dict[str, type] = {}
    fields = []
    for entry in described:
        if "factory" in entry:
            spec = dataclasses.field(default_factory=functools.partial(json.loads, json.dumps(entry["factory"])))
        else:
            spec = dataclasses.field(default=entry["default"])
        fields.append((entry["name"], hint_of(entry["type"], enums), spec))
    stand = dataclasses.make_dataclass("SFTConfig", fields)
    setattr(stand, UNCHECKED, frozenset(entry["name"] for entry in described if entry.get("unchecked")))
    return stand


def type_form(hint: Any) -> Any:
    """A type hint as JSON: a builtin's name, null for None, or {kind: parts}; raises Unwritable."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return None
    if hint is Any:
        return "Any"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        members = {member.name: member.value for member in hint}
        return {"enum": f"{hint.__module__}:{hint.__qualname__}", "members": members, "str": issubclass(hint, str)}
    if isinstance(hint, type) and BUILTINS.get(hint.__name__) is hint:
        return hint.__name__
    if isinstance(hint, types.UnionType):  # `a | b`, which prints otherwise than typing.Union (before 3.14)
        return {"|": [type_form(arg) for arg in args]}
    if origin is typing.Union:
        return {"Union": [type_form(arg) for arg in args]}
    if origin is Literal:
        return {"Literal": [_value_form(arg) for arg in args]}
    if isinstance(hint, types.GenericAlias) and origin in (list, dict):
        return {origin.__name__: [type_form(arg) for arg in args]}
    raise Unwritable(repr(hint))


def hint_of(form: Any, enums: dict[str, type]) -> Any:
    """The type hint `type_form` wrote; `enums` keeps one class per enumeration."""
    if form is None:
        return type(None)
    if form == "Any":
        return Any
    if isinstance(form, str):
        return BUILTINS[form]
    (kind, parts), *_ = form.items()
    if kind == "enum":
        if parts not in enums:
            module, qualname = parts.split(":")
            enums[parts] = enum.Enum(qualname.rsplit(".", 1)[-1], form["members"], module=module, qualname=qualname,
                                     type=str if form["str"] else None)  # fmt: skip
        return enums[parts]
    if kind == "Literal":
        return Literal[tuple(parts)]
    hints = [hint_of(part, enums) for part in parts]
    if kind == "|":
        return functools.reduce(operator.or_, hints)
    if kind == "Union":
        return typing.Union[tuple(hints)]  # noqa: UP007 (it prints as typing.Union does)
    return BUILTINS[kind][tuple(hints)] if len(hints) > 1 else BUILTINS[kind][hints[0]]


def _value_form(value: Any) -> Any:
    """A default or a Literal's value as JSON (an enumeration's member by its value); raises Unwritable."""
    value = value.value if isinstance(value, enum.Enum) else value
    try:
        if json.loads(json.dumps(value)) == value:
            return value
    except (TypeError, ValueError):
        pass
    raise Unwritable(repr(value))


if __name__ == "__main__":  # write_cache's own process: python -m probdiff_callback.training.sft_config_cache PATH
    save(Path(sys.argv[1]))
