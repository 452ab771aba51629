"""probdiff_callback/runtime/config_layers.py: layers merged by OmegaConf, typed once against a dataclass, refused with
the house's messages (OmegaConf's own texts never reach a user), and the layer that set a refused key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

from probdiff_callback.runtime.config_layers import SettingError, layer_of, merge, parse_items, typed


@dataclass
class Section:
    r: int = 16
    dropout: float = 0.05


@dataclass
class Schema:
    rate: float = 1.0
    steps: int = 1
    name: str | None = None
    flag: bool = False
    mode: Literal["fast", "slow"] = "fast"
    sweep: list[float] = field(default_factory=list)
    section: Section = field(default_factory=Section)
    loose: dict[str, Any] = field(default_factory=dict)
    count_or_share: int | float = field(default=1, metadata={"declared": float})


def refusal(values: dict) -> SettingError:
    with pytest.raises(SettingError) as err:
        typed(Schema, values, noun="setting ")
    return err.value


def test_values_keep_yamls_types_where_omegaconf_would_convert():
    values = typed(Schema, {"rate": 2, "name": 2024, "sweep": [0, -1], "section": {"dropout": 0}, "count_or_share": 10})
    assert values == {"rate": 2.0, "name": "2024", "sweep": [0.0, -1.0], "section": {"r": 16, "dropout": 0.0},
                      "count_or_share": 10}  # fmt: skip
    assert type(values["rate"]) is float and type(values["count_or_share"]) is int
    # OmegaConf reads '64' as 64 and 1 as True; YAML's typing does not
    assert str(refusal({"steps": "64"})) == "wrong type for setting 'steps': got '64', expected int"
    assert str(refusal({"rate": "1e-4"})) == "wrong type for setting 'rate': got '1e-4', expected float"
    assert str(refusal({"flag": 1})) == "wrong type for setting 'flag': got 1, expected bool"
    assert str(refusal({"steps": 2.5})) == "wrong type for setting 'steps': got 2.5, expected int"


def test_refusals_name_the_setting_its_value_and_what_is_valid():
    assert str(refusal({"sweep": [0, "x"]})) == "wrong type for setting 'sweep': got [0, 'x'], expected list[float]"
    assert str(refusal({"section": 5})) == "wrong type for setting 'section': got 5, expected dict"
    assert str(refusal({"section": {"r": "wide"}})) == "wrong type for setting 'section.r': got 'wide', expected int"
    assert str(refusal({"mode": "fsat"})) == "mode='fsat' (did you mean 'fast'?): use one of fast, slow"
    # a field may name the type its owner declares where the schema's differs
    assert str(refusal({"count_or_share": "x"})) == "wrong type for setting 'count_or_share': got 'x', expected float"
    unknown = refusal({"section": {"rank": 8}})
    assert unknown.unknown and unknown.key == "section.rank"
    assert refusal({"nope": 1}).key == "nope" and refusal({"nope": 1}).unknown
    for error in (refusal({"steps": "x"}), refusal({"mode": 3}), refusal({"section": 5})):
        assert "full_key" not in str(error) and "object_type" not in str(error)


def test_layers_merge_and_a_refusal_names_the_last_layer_that_set_the_key():
    layers = [("defaults", {"section": {"r": 8}, "sweep": [1]}), ("file", {"section": {"dropout": 0.1}}),
              ("command line", {"sweep": [0, "x"]})]  # fmt: skip
    assert merge([layer for _, layer in layers]) == {"section": {"r": 8, "dropout": 0.1}, "sweep": [0, "x"]}
    assert layer_of(layers, "section.r") == "defaults" and layer_of(layers, "section.dropout") == "file"
    assert layer_of(layers, "sweep[1]") == "command line"


def test_items_are_typed_as_yaml_reads_them():
    assert parse_items(["a.b=1", "c=-0.02", "d=abc", "e=null", "f=[0, -0.1]", "g='1'"], "here") == {
        "a": {"b": 1}, "c": -0.02, "d": "abc", "e": None, "f": [0, -0.1], "g": "1"
    }  # fmt: skip
    with pytest.raises(SettingError, match=r"^here: 'a' is not key=value$"):
        parse_items(["a"], "here")
