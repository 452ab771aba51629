"""Settings read in layers (YAML files, `key=value` items) and typed by OmegaConf structured configs, with the house's
messages.

OmegaConf merges the layers (a mapping in two layers gains keys, anything else is replaced) and checks each value
against the dataclass it belongs to: its type, the choices of a `Literal`, and unknown keys with their full path.
Its own error texts are not what a user sees: `typed` raises `SettingError`s that name the key, the value and what
is valid; the caller adds the layer the key came from (`layer_of`). Values keep the types YAML gave them where
OmegaConf would convert: text is neither a number nor a boolean (`'64'`, `'yes'`) and a number is not a boolean;
an int where a float is expected becomes a float, and a number or a boolean where text is expected becomes text
(`run_name=2024`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal


class SettingError(ValueError):
    """A key or value a schema refuses. `key` is its dotted path (`lora.r`, `sweep`); `unknown`: the schema has no
    such key, and the caller says which keys it has."""

    def __init__(self, message: str, key: str, unknown: bool = False):
        super().__init__(message)
        self.key, self.unknown = key, unknown


def parse_items(items: Sequence[str], where: str) -> dict[str, Any]:
    """`key=value` items as a nested mapping, each value typed as YAML reads it (`-0.02` a float, `abc` text, `null`
    None, `[0, -0.1]` a list); `a.b=1` nests."""
    from omegaconf import OmegaConf

    for item in items:
        if "=" not in item or not item.split("=", 1)[0]:
            raise SettingError(f"{where}: {item!r} is not key=value", key=item)
    return OmegaConf.to_container(OmegaConf.from_dotlist(list(items)))  # type: ignore[return-value]


def merge(layers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The layers merged in order, untyped: each value is typed once, as the run gets it (`typed`)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.merge(*(OmegaConf.create(dict(layer)) for layer in layers)))  # type: ignore[return-value]


def layer_of(layers: Sequence[tuple[str, Mapping[str, Any]]], key: str) -> str:
    """The name of the last layer that sets `key` (`lora.r`; `sweep[1]` is `sweep`): the one a refusal names."""
    parts = re.sub(r"\[\d+\]", "", key).split(".")
    for where, layer in reversed(layers):
        node: Any = layer
        for part in parts:
            if not isinstance(node, Mapping) or part not in node:
                break
            node = node[part]
        else:
            return where
    return layers[-1][0]


def typed(schema: type, values: Mapping[str, Any], noun: str = "") -> dict[str, Any]:
    """`values` as the dataclass `schema` types them (OmegaConf's check), the given keys only; the first problem
    raises a SettingError: `wrong type for <noun>'key': got 'abc', expected float`, `key='x' (did you mean 'y'?): use
    one of ...` for a Literal, or an unknown key."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    try:
        config = OmegaConf.merge(_structured(schema), dict(values))
        result = OmegaConf.to_container(config, resolve=True, throw_on_missing=True, enum_to_str=True)
    except (ConfigKeyError, ConfigAttributeError) as err:
        raise SettingError(f"unknown key {err.full_key!r}", key=err.full_key, unknown=True) from None
    except OmegaConfBaseException as err:
        raise _refusal(schema, values, err.full_key or _refused_key(schema, values), noun) from None
    result = {key: result[key] for key in values}  # type: ignore[index]
    for converted in _converted(values, result):
        raise _refusal(schema, values, converted, noun)
    return result


@functools.cache
def _structured(schema: type) -> Any:
    """The schema's defaults as an OmegaConf config, made once (a merge copies it)."""
    from omegaconf import OmegaConf

    return OmegaConf.structured(schema)


def _refused_key(schema: type, values: Mapping[str, Any]) -> str:
    """The key a merge refused where OmegaConf's error names none (a section given a number): merged one by one."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for key, value in values.items():
        try:
            OmegaConf.merge(_structured(schema), {key: value})
        except OmegaConfBaseException:
            return key
    return ""


def _converted(given: Any, typed: Any, path: str = "") -> Iterator[str]:
    """The paths where OmegaConf changed a value's type further than YAML's typing allows (see the docstring)."""
    if isinstance(given, Mapping) and isinstance(typed, Mapping):
        for key in given:
            if key in typed:
                yield from _converted(given[key], typed[key], f"{path}.{key}" if path else str(key))
    elif isinstance(given, list) and isinstance(typed, list):
        for index, (item, typed_item) in enumerate(zip(given, typed)):
            yield from _converted(item, typed_item, f"{path}[{index}]")
    elif not (
        type(given) is type(typed)
        or (type(given) is int and type(typed) is float)
        or (type(given) in (bool, int, float) and type(typed) is str)
    ):
        yield path


def _refusal(schema: type, values: Mapping[str, Any], key: str, noun: str) -> SettingError:
    """The message for a refused value: the setting it belongs to, named by its path from the schema's top."""
    name, hint, declared = _setting(schema, key)
    value: Any = values
    for part in name.split("."):
        value = value.get(part) if isinstance(value, Mapping) else value
    choices = [str(choice) for member in members(hint) if typing.get_origin(member) is Literal
               for choice in typing.get_args(member)]  # fmt: skip
    if choices and value is not None:
        close = did_you_mean(str(value), choices)
        return SettingError(f"{name}={value!r}{close}: use one of {', '.join(choices)}", name)
    return SettingError(f"wrong type for {noun}{name!r}: got {value!r}, expected {type_name(declared)}", name)


def _setting(schema: type, key: str) -> tuple[str, Any, Any]:
    """(the dotted path, the schema's type, the type to name) of the setting that holds `key`: `lora.r`; `sweep[1]`
    and `by_category.x` are parts of `sweep` and `by_category`. A field's metadata may declare the type to name
    (`declared`), where the schema types it otherwise than its owner does (a Literal for an Enum, say)."""
    path: list[str] = []
    cls: Any = schema
    for part in re.split(r"[.\[]", key):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            break
        path.append(part)
        hint = typing.get_type_hints(cls)[part]
        if not dataclasses.is_dataclass(hint):
            return ".".join(path), hint, fields[part].metadata.get("declared", hint)
        cls = hint
    return ".".join(path), dict, dict  # a section given something other than a mapping


def members(hint: Any) -> tuple:
    """The types of a union (`int | None` -> int, NoneType), or the hint itself."""
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    return typing.get_args(hint) if union else (hint,)


def type_name(hint: Any) -> str:
    if dataclasses.is_dataclass(hint):
        return "dict"
    return str(hint).replace("typing.", "") if typing.get_args(hint) else getattr(hint, "__name__", str(hint))


def did_you_mean(key: str, candidates: Sequence[str]) -> str:
    """` (did you mean 'x'?)` for the closest candidate to a mistyped key, else ``."""
    leaf = key.split(".")[-1]
    by_leaf = {c.split(".")[-1]: c for c in candidates}
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.7) or [
        by_leaf[m] for m in difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.7)
    ]
    return f" (did you mean {close[0]!r}?)" if close else ""
