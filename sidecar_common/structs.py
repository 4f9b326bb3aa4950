"""JSON <-> ``google.protobuf.Struct`` with exact numbers (docs/common.md).

Struct numbers are doubles. Encoding refuses integers that a double cannot hold exactly
(beyond ±2^53) rather than silently rounding them, and refuses NaN/±infinity, which JSON
cannot carry. Decoding refuses NaN/±infinity and gives integral values within ±2^53 back as
``int``, so a port 5600 does not come back as 5600.0. Pure: no I/O, no clock, no globals.

Errors are :class:`StructError` (a ``ValueError``) whose message starts with the key path
(``a.b[2]``); callers prefix the field name and map it to INVALID_ARGUMENT (from a request)
or PROTOCOL_ERROR (from an engine).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final, TypeAlias

from google.protobuf import struct_pb2

__all__ = [
    "JSON",
    "MAX_DEPTH",
    "MAX_EXACT_INT",
    "StructError",
    "json_from_struct",
    "json_from_value",
    "struct_from_json",
    "value_from_json",
]

JSON: TypeAlias = "bool | int | float | str | list[JSON] | dict[str, JSON] | None"

MAX_EXACT_INT: Final = 2**53
# protobuf's own parser refuses messages nested deeper than 100, so a deeper Struct could
# not travel anyway; refusing here also keeps the recursion far from Python's limit.
MAX_DEPTH: Final = 100


class StructError(ValueError):
    """A value that cannot cross the JSON/Struct boundary exactly; ``path`` says where."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path or '(top level)'}: {problem}")
        self.path = path
        self.problem = problem


def struct_from_json(obj: Mapping[str, JSON]) -> struct_pb2.Struct:
    """A JSON object as a Struct; refuses a non-object, and numbers that would not round-trip."""
    if not isinstance(obj, Mapping):
        raise StructError("", f"expected a JSON object, got {_kind(obj)}")
    struct = struct_pb2.Struct()
    _fill_struct(struct, obj, "", 0)
    return struct


def value_from_json(value: JSON, path: str = "") -> struct_pb2.Value:
    """One JSON value as a ``google.protobuf.Value``; ``path`` prefixes error messages."""
    message = struct_pb2.Value()
    _fill_value(message, value, path, 0)
    return message


def json_from_struct(struct: struct_pb2.Struct) -> dict[str, JSON]:
    """A Struct as a JSON object; refuses NaN/±infinity and unset values, with their path."""
    return _object(struct, "", 0)


def json_from_value(value: struct_pb2.Value, path: str = "") -> JSON:
    """One ``google.protobuf.Value`` as JSON; ``path`` prefixes error messages."""
    return _decode(value, path, 0)


def _key_path(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _kind(value: object) -> str:
    return type(value).__name__


def _fill_struct(struct: struct_pb2.Struct, obj: Mapping[Any, object], path: str, depth: int) -> None:
    if depth >= MAX_DEPTH:
        raise StructError(path, f"nested deeper than {MAX_DEPTH} levels")
    for key, item in obj.items():
        if not isinstance(key, str):
            raise StructError(path, f"object keys must be strings, got {_kind(key)} {key!r}")
        _fill_value(struct.fields[key], item, _key_path(path, key), depth + 1)


def _fill_value(message: struct_pb2.Value, value: object, path: str, depth: int) -> None:
    # bool before int: True is an int in Python but must stay a bool in the Struct.
    if value is None:
        message.null_value = struct_pb2.NULL_VALUE
    elif isinstance(value, bool):
        message.bool_value = value
    elif isinstance(value, int):
        if abs(value) > MAX_EXACT_INT:
            raise StructError(path, f"integer {value} is beyond ±2^53 and cannot be carried exactly")
        message.number_value = float(value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise StructError(path, f"{value} is not a JSON number")
        message.number_value = value
    elif isinstance(value, str):
        message.string_value = value
    elif isinstance(value, Mapping):
        message.struct_value.SetInParent()  # an empty object stays an object
        _fill_struct(message.struct_value, value, path, depth)
    elif isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        if depth >= MAX_DEPTH:
            raise StructError(path, f"nested deeper than {MAX_DEPTH} levels")
        items = message.list_value
        items.SetInParent()  # an empty list stays a list, not an unset value
        for index, item in enumerate(value):
            _fill_value(items.values.add(), item, f"{path}[{index}]", depth + 1)
    else:
        raise StructError(path, f"{_kind(value)} is not a JSON value")


def _object(struct: struct_pb2.Struct, path: str, depth: int) -> dict[str, JSON]:
    if depth >= MAX_DEPTH:
        raise StructError(path, f"nested deeper than {MAX_DEPTH} levels")
    return {key: _decode(item, _key_path(path, key), depth + 1) for key, item in struct.fields.items()}


def _decode(value: struct_pb2.Value, path: str, depth: int) -> JSON:
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        number = value.number_value
        if not math.isfinite(number):
            raise StructError(path, f"{number} is not a JSON number")
        if number.is_integer() and abs(number) <= MAX_EXACT_INT:
            return int(number)
        return number
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "null_value":
        return None
    if kind == "struct_value":
        return _object(value.struct_value, path, depth)
    if kind == "list_value":
        if depth >= MAX_DEPTH:
            raise StructError(path, f"nested deeper than {MAX_DEPTH} levels")
        return [
            _decode(item, f"{path}[{index}]", depth + 1) for index, item in enumerate(value.list_value.values)
        ]
    raise StructError(path, "the value has no kind set")
