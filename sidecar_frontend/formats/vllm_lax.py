"""The lax value coercions vLLM's request models apply, with the problems they report (pure).

vLLM parses request bodies with pydantic in lax mode: ``"3"`` is an integer, ``"yes"`` is
true, ``3.0`` is the integer 3 but ``3.5`` is refused. Each coercion here either returns the
value vLLM would see or raises :class:`Invalid` with the problem(s) pydantic would list, so
that a refusal reads the same as the real server's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Final, TypeVar

from sidecar_frontend.formats.vllm_errors import ValidationIssue

__all__ = [
    "Fields",
    "Invalid",
    "as_bool",
    "as_dict",
    "as_float",
    "as_int",
    "as_int_list",
    "as_str",
    "as_str_list",
    "literal",
    "nullable",
]

T = TypeVar("T")

_INT_TEXT: Final = re.compile(r"[+-]?\d+")
_TRUE: Final = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE: Final = frozenset({"0", "off", "f", "false", "n", "no"})


class Invalid(Exception):
    """The value fails validation; ``issues`` are what pydantic would list for it."""

    def __init__(self, *issues: ValidationIssue) -> None:
        super().__init__(issues[0].msg if issues else "invalid")
        self.issues = issues


def as_int(value: object, loc: str) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise Invalid(ValidationIssue("finite_number", loc, "Input should be a finite number", value))
        if not value.is_integer():
            raise Invalid(
                ValidationIssue(
                    "int_from_float",
                    loc,
                    "Input should be a valid integer, got a number with a fractional part",
                    value,
                )
            )
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        if _INT_TEXT.fullmatch(text):
            return int(text)
        raise Invalid(
            ValidationIssue(
                "int_parsing",
                loc,
                "Input should be a valid integer, unable to parse string as an integer",
                value,
            )
        )
    raise Invalid(ValidationIssue("int_type", loc, "Input should be a valid integer", value))


def as_float(value: object, loc: str) -> float:
    if isinstance(value, bool | int | float):
        try:
            return float(value)
        except OverflowError:  # an integer beyond any double
            raise Invalid(
                ValidationIssue("finite_number", loc, "Input should be a finite number", value)
            ) from None
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
        raise Invalid(
            ValidationIssue(
                "float_parsing",
                loc,
                "Input should be a valid number, unable to parse string as a number",
                value,
            )
        )
    raise Invalid(ValidationIssue("float_type", loc, "Input should be a valid number", value))


def as_bool(value: object, loc: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise Invalid(
            ValidationIssue(
                "bool_parsing", loc, "Input should be a valid boolean, unable to interpret input", value
            )
        )
    if isinstance(value, int | float):
        raise Invalid(
            ValidationIssue(
                "bool_parsing", loc, "Input should be a valid boolean, unable to interpret input", value
            )
        )
    raise Invalid(ValidationIssue("bool_type", loc, "Input should be a valid boolean", value))


def as_str(value: object, loc: str) -> str:
    if isinstance(value, str):
        return value
    raise Invalid(ValidationIssue("string_type", loc, "Input should be a valid string", value))


def as_dict(value: object, loc: str) -> dict[str, object]:
    if isinstance(value, dict):
        return value
    raise Invalid(ValidationIssue("dict_type", loc, "Input should be a valid dictionary", value))


def literal(value: object, loc: str, allowed: tuple[str, ...]) -> str:
    if isinstance(value, str) and value in allowed:
        return value
    quoted = [f"'{a}'" for a in allowed]
    expected = ", ".join(quoted[:-1]) + f" or {quoted[-1]}" if len(quoted) > 1 else quoted[0]
    raise Invalid(
        ValidationIssue("literal_error", loc, f"Input should be {expected}", value, {"expected": expected})
    )


def _as_list(value: object, loc: str, item: Callable[[object, str], T]) -> list[T]:
    if not isinstance(value, list):
        raise Invalid(ValidationIssue("list_type", loc, "Input should be a valid list", value))
    result: list[T] = []
    issues: list[ValidationIssue] = []
    for index, element in enumerate(value):
        try:
            result.append(item(element, f"{loc}.{index}"))
        except Invalid as err:
            issues.extend(err.issues)
    if issues:
        raise Invalid(*issues)
    return result


def as_int_list(value: object, loc: str) -> list[int]:
    return _as_list(value, loc, as_int)


def as_str_list(value: object, loc: str) -> list[str]:
    return _as_list(value, loc, as_str)


class Fields:
    """The body's fields, coerced one by one; problems are collected, as pydantic does."""

    def __init__(self, data: dict[str, object], loc: str = "body") -> None:
        self.data = data
        self.loc = loc
        self.issues: list[ValidationIssue] = []

    def present(self, name: str) -> bool:
        return name in self.data

    def raw(self, name: str) -> object:
        return self.data.get(name)

    def get(self, name: str, coerce: Callable[[object, str], T]) -> T | None:
        if name not in self.data:
            return None
        try:
            return coerce(self.data[name], f"{self.loc}.{name}")
        except Invalid as err:
            self.issues.extend(err.issues)
            return None

    def required(self, name: str, coerce: Callable[[object, str], T]) -> T | None:
        if name not in self.data:
            self.issues.append(ValidationIssue("missing", f"{self.loc}.{name}", "Field required", self.data))
            return None
        return self.get(name, coerce)


def nullable(coerce: Callable[[object, str], T]) -> Callable[[object, str], T | None]:
    def check(value: object, loc: str) -> T | None:
        return None if value is None else coerce(value, loc)

    return check
