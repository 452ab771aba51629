"""core/json_form.py: the one JSON form of the package's typed files: keys in the fields' order, unknown keys kept in
`extra` and written back after the known ones, absent keys defaulted and left out again on rewrite (or written, for a
class that does not remember them), NaN <-> null, `omit_default` fields left out while they hold their defaults,
nested records, and a file read with its name in the error. The types that use it: tests/test_records.py,
tests/test_run_files.py."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest

from probdiff_callback.core.json_form import JsonRecord, dumps, json_field


@dataclass(kw_only=True)
class Part(JsonRecord):
    size: int
    weight: float = math.nan
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class Thing(JsonRecord):
    name: str
    score: float
    temperature: float | None = None
    tags: list[str] = field(default_factory=list)
    samples: list[float] = field(default_factory=lambda: [math.nan, math.nan])
    parts: dict[str, Part] = field(default_factory=dict)
    main: Part | None = None
    loss: float = json_field(math.nan, omit_default=True)
    note: str | None = json_field(None, omit_default=True)
    stopped: bool = json_field(False, omit_default=True)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Message(JsonRecord):
    """Written whole, as a queue message or a history row: the keys a file lacked are written back."""

    remember_absent: ClassVar[bool] = False

    step: int
    seconds: float = math.nan
    error: str | None = None
    extra: dict = field(default_factory=dict)


def round_trip(cls: type[JsonRecord], value: dict) -> tuple[JsonRecord, dict]:
    """The object `value` reads as, and what it is written back as, through JSON text."""
    read = cls.from_json(json.loads(json.dumps(value)))
    return read, json.loads(dumps(read))


def test_unknown_keys_are_kept_in_extra_and_written_back_after_the_known_ones():
    value = {"judge": "GPT-4", "name": "a", "score": 1.5, "rating": [7, None]}
    read, written = round_trip(Thing, value)
    assert read.extra == {"judge": "GPT-4", "rating": [7, None]}
    assert list(written) == ["name", "score", "judge", "rating"] and written == value
    # in nested records too
    read, written = round_trip(Thing, {"name": "a", "score": 1.0, "main": {"size": 2, "colour": "red"}})
    assert read.main.extra == {"colour": "red"} and written["main"] == {"size": 2, "colour": "red"}


def test_absent_keys_read_as_their_defaults_and_are_left_out_again_on_rewrite():
    read, written = round_trip(Thing, {"name": "a", "score": 0.5})
    assert read.temperature is None and read.tags == [] and all(map(math.isnan, read.samples))
    assert read.absent == {"temperature", "tags", "samples", "parts", "main", "loss", "note", "stopped"}
    assert written == {"name": "a", "score": 0.5}  # rewriting an older file invents nothing
    read.tags = ["new"]  # a value given since is written, in its field's place
    assert list(read.to_json()) == ["name", "score", "tags"]
    assert Thing.absent == frozenset() and Thing(name="a", score=0.5).absent == frozenset()
    made = Thing(name="a", score=0.5).to_json()  # an object made here writes every field but the omitted ones
    assert list(made) == ["name", "score", "temperature", "tags", "samples", "parts", "main"]


def test_a_class_that_does_not_remember_absent_keys_writes_them():
    read, written = round_trip(Message, {"step": 3, "future": True})
    assert read.absent == frozenset() and math.isnan(read.seconds)
    assert written == {"step": 3, "seconds": None, "error": None, "future": True}
    assert Message(4) == Message.from_json({"step": 4})  # not kw_only: the codec takes any dataclass


def test_a_missing_required_key_or_a_value_that_is_not_an_object_is_named():
    with pytest.raises(ValueError, match=r"^not a thing: no 'name', 'score'$"):
        Thing.from_json({"tags": []})
    with pytest.raises(ValueError, match=r"^not a thing: a JSON object is expected, not list$"):
        Thing.from_json([])
    with pytest.raises(ValueError, match=r"^not a part: no 'size'$"):
        Thing.from_json({"name": "a", "score": 1.0, "parts": {"x": {"weight": 1.0}}})
    with pytest.raises(ValueError, match=r"^not a part: a JSON object is expected, not str$"):
        Thing.from_json({"name": "a", "score": 1.0, "main": "wheel"})


def test_nan_and_infinity_are_written_as_null_and_null_reads_as_nan_where_a_number_belongs():
    thing = Thing(name="a", score=math.inf, samples=[0.5, math.nan], parts={"x": Part(size=1)}, extra={"e": math.nan})
    written = json.loads(dumps(thing))
    assert written["score"] is None and written["samples"] == [0.5, None] and written["e"] is None
    assert written["parts"] == {"x": {"size": 1, "weight": None}}
    read = Thing.from_json(written)
    assert math.isnan(read.score) and math.isnan(read.samples[1]) and math.isnan(read.parts["x"].weight)
    assert isinstance(read.parts["x"], Part) and read.extra == {"e": None}  # unknown keys: as they are
    read, _ = round_trip(Thing, {"name": "a", "score": 1.0, "temperature": None})
    assert read.temperature is None  # a field that admits None keeps it
    read, written = round_trip(Thing, {"name": "a", "score": 2, "samples": [1, None]})
    assert read.score == 2 and type(read.score) is int and written["samples"] == [1, None]  # numbers as they are
    assert dumps({"things": [thing], "n": math.nan}).startswith('{"things": [{"name": "a", "score": null')


def test_an_omit_default_field_is_left_out_while_it_holds_its_default():
    assert list(Thing(name="a", score=1.0).to_json())[-1] == "main"
    for default in ({"loss": float("nan")}, {"loss": math.inf}, {"note": None}, {"stopped": False}):
        assert set(default).isdisjoint(Thing(name="a", score=1.0, **default).to_json())  # any NaN holds a NaN default
    written = Thing(name="a", score=1.0, loss=2.5, note="n", stopped=True, extra={"k": 1}).to_json()
    assert list(written)[-4:] == ["loss", "note", "stopped", "k"]  # in their fields' places, before the unknown keys
    read, again = round_trip(Thing, written)
    assert read.loss == 2.5 and read.stopped is True and again == written


def test_a_file_is_read_with_its_name_in_every_error(tmp_path):
    path = tmp_path / "thing.json"
    path.write_text(dumps(Thing(name="a", score=0.5, main=Part(size=3))), encoding="utf-8")
    assert Thing.from_file(path) == Thing(name="a", score=0.5, main=Part(size=3))
    path.write_text('{"name": "a",', encoding="utf-8")
    with pytest.raises(ValueError, match=r"thing\.json: not valid JSON \("):
        Thing.from_file(path)
    path.write_text('{"name": "a"}', encoding="utf-8")
    with pytest.raises(ValueError, match=r"thing\.json: not a thing: no 'score'$"):
        Thing.from_file(path)
    with pytest.raises(FileNotFoundError):
        Thing.from_file(tmp_path / "missing.json")
