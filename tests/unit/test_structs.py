"""JSON <-> Struct keeps numbers exact, refuses what cannot travel, and says where."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from google.protobuf import struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar_common.structs import (
    JSON,
    StructError,
    json_from_struct,
    json_from_value,
    struct_from_json,
    value_from_json,
)

LIMIT = 2**53


@pytest.mark.parametrize("number", [LIMIT, -LIMIT, 0, -1, 5600])
def test_integers_within_2_53_round_trip_as_integers(number: int) -> None:
    back = json_from_struct(struct_from_json({"n": number, "deep": [{"n": number}]}))
    assert back == {"n": number, "deep": [{"n": number}]}
    assert type(back["n"]) is int


@pytest.mark.parametrize("number", [LIMIT + 1, -(LIMIT + 1), 10**30])
@pytest.mark.parametrize(
    ("wrap", "path"),
    [
        (lambda n: {"n": n}, "n:"),
        (lambda n: {"a": {"b": [1, n]}}, "a.b[1]:"),
    ],
)
def test_integers_beyond_2_53_are_refused_with_their_path(number: int, wrap: Any, path: str) -> None:
    with pytest.raises(StructError) as info:
        struct_from_json(wrap(number))
    assert str(info.value).startswith(path)
    assert "2^53" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_an_integral_double_comes_back_as_an_integer() -> None:
    struct = struct_pb2.Struct()
    struct.update({"port": 5600.0, "ratio": 0.5, "big": 1e300})
    back = json_from_struct(struct)
    assert back == {"port": 5600, "ratio": 0.5, "big": 1e300}
    assert type(back["port"]) is int
    assert type(back["ratio"]) is float
    assert type(back["big"]) is float


def test_bools_stay_bools_and_null_stays_null() -> None:
    back = json_from_struct(struct_from_json({"t": True, "f": False, "z": None, "one": 1}))
    assert back == {"t": True, "f": False, "z": None, "one": 1}
    assert type(back["t"]) is bool
    assert type(back["one"]) is int


def test_empty_containers_stay_containers() -> None:
    assert json_from_struct(struct_from_json({"o": {}, "l": [], "s": ""})) == {"o": {}, "l": [], "s": ""}


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_infinity_are_refused_when_decoding_nested(bad: float) -> None:
    in_list = struct_pb2.Struct()
    in_list.update({"a": [1, {"b": [bad]}]})
    with pytest.raises(StructError) as info:
        json_from_struct(in_list)
    assert str(info.value).startswith("a[1].b[0]:")

    in_object = struct_pb2.Struct()
    in_object.update({"x": {"y": bad}})
    with pytest.raises(StructError) as info:
        json_from_struct(in_object)
    assert str(info.value).startswith("x.y:")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_infinity_are_refused_when_encoding(bad: float) -> None:
    with pytest.raises(StructError, match=r"^k\[0\]:"):
        struct_from_json({"k": [bad]})


@pytest.mark.parametrize("top", [[1, 2], "text", 3, None])
def test_the_top_level_must_be_an_object(top: Any) -> None:
    with pytest.raises(StructError, match="expected a JSON object"):
        struct_from_json(top)


@pytest.mark.parametrize(
    ("obj", "path"),
    [({"a": b"bytes"}, "a:"), ({"a": {1: "x"}}, "a:"), ({"a": [object()]}, "a[0]:")],
)
def test_values_that_are_not_json_are_refused_with_their_path(obj: Any, path: str) -> None:
    with pytest.raises(StructError) as info:
        struct_from_json(obj)
    assert str(info.value).startswith(path)


def test_a_value_with_no_kind_is_refused() -> None:
    struct = struct_pb2.Struct()
    struct.fields["empty"].Clear()
    with pytest.raises(StructError, match=r"^empty: the value has no kind set"):
        json_from_struct(struct)


def test_nesting_deeper_than_protobuf_can_carry_is_refused() -> None:
    deep: JSON = 1
    for _ in range(150):
        deep = [deep]
    with pytest.raises(StructError, match="nested deeper"):
        struct_from_json({"d": deep})


def test_single_values_use_the_same_rules() -> None:
    assert json_from_value(value_from_json(7.0)) == 7
    assert type(json_from_value(value_from_json(7.0))) is int
    assert json_from_value(value_from_json([True, None, "s"])) == [True, None, "s"]
    with pytest.raises(StructError, match=r"^engine_data\.x:"):
        value_from_json({"x": LIMIT + 1}, "engine_data")


exact_json: st.SearchStrategy[JSON] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-LIMIT, max_value=LIMIT)
    | st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not f.is_integer())
    | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4),
    max_leaves=20,
)


# No per-example deadline: a loaded 2-core CI machine must not turn slowness into a failure.
@settings(deadline=None)
@given(st.dictionaries(st.text(), exact_json, max_size=5))
def test_json_within_range_round_trips_exactly(obj: dict[str, JSON]) -> None:
    back = json_from_struct(struct_from_json(obj))
    assert back == obj
    # Same types too: JSON text tells 1 from 1.0 and true from 1.
    assert json.dumps(back, sort_keys=True) == json.dumps(obj, sort_keys=True)
