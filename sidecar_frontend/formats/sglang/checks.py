"""SGLang's checks of a ``/generate`` body that are not pydantic's (pure), with its own text.

``input_ids_error`` is the validator SGLang's request dataclass runs on ``input_ids`` (the
dataclass itself is ``model``, validated by pydantic); ``check_contract`` is the JSON
contract gate that follows it. Only the fields this frontend reads or refuses are checked by
the contract; an unknown top-level key is ignored, as SGLang does, while an unknown
``sampling_params`` key is refused.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping
from typing import Final

from sidecar_common import sampling_schema
from sidecar_frontend.formats.sglang.wire import ContractError

__all__ = ["SAMPLING_FIELDS", "check_contract", "input_ids_error"]

# SGLang's sampling_params schema, in its order: the kernel's one list, shared with the sidecar.
SAMPLING_FIELDS: Final = sampling_schema.SAMPLING_FIELDS


# ------------------------------------------------ the input_ids validator of the request model


def _type_name(value: object) -> str:
    return type(value).__name__


def _row(value: object) -> str | None:
    """SGLang's input_ids row check; the error text, or None."""
    if not isinstance(value, list):
        return f"must be list; got {_type_name(value)}"
    if not value:
        return None
    if not isinstance(value[0], int):
        return f"elements must be int; got {_type_name(value[0])}"
    try:
        array("q", value)
    except (TypeError, OverflowError) as err:
        return f"contains non-int64 element: {err}"
    return None


def input_ids_error(value: object) -> str | None:
    """SGLang's own validator of ``input_ids`` (the request model's one non-pydantic check)."""
    if value is None:
        return None
    if not isinstance(value, list):
        return f"must be list or null; got {_type_name(value)}"
    if not value:
        return None
    if isinstance(value[0], int):
        return _row(value)
    if isinstance(value[0], list):
        for i, row in enumerate(value):
            error = _row(row)
            if error is not None:
                return f"row {i}: {error}"
        return None
    return f"elements must be int or list; got {_type_name(value[0])}"


# ------------------------------------------------------------------ gate 2: JSON contract


def _unexpected(value: object) -> str:
    """serde's description of a JSON value, as SGLang's contract writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    if isinstance(value, list):
        return "sequence"
    if isinstance(value, dict):
        return "map"
    return _type_name(value)


def _invalid(value: object, expected: str) -> ContractError:
    return ContractError(f"invalid type: {_unexpected(value)}, expected {expected}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _int(value: object, expected: str = "i64") -> None:
    if not _is_int(value):
        raise _invalid(value, expected)


def _uint(value: object) -> None:
    _int(value, "u64")
    assert isinstance(value, int)
    if value < 0:
        raise ContractError(f"invalid value: integer `{value}`, expected u64")


def _float(value: object) -> None:
    if not _is_number(value):
        raise _invalid(value, "f64")


def _bool(value: object) -> None:
    if not isinstance(value, bool):
        raise _invalid(value, "a boolean")


def _str(value: object) -> None:
    if not isinstance(value, str):
        raise _invalid(value, "a string")


def _seq(value: object) -> list[object]:
    if not isinstance(value, list):
        raise _invalid(value, "a sequence")
    return value


def _map(value: object, expected: str = "a map") -> dict[str, object]:
    if not isinstance(value, dict):
        raise _invalid(value, expected)
    return value


def _or_list(item: Callable[[object], None], name: str) -> Callable[[object], None]:
    """One value or an array of them (SGLang's ``XOrList`` shapes)."""

    def check(value: object) -> None:
        if isinstance(value, list):
            for element in value:
                item(element)
            return
        if name.startswith("Optional") and value is None:
            return
        try:
            item(value)
        except ContractError:
            raise _invalid(value, f"a value or an array of values for {name}") from None

    return check


def _optional(check: Callable[[object], None]) -> Callable[[object], None]:
    def inner(value: object) -> None:
        if value is not None:
            check(value)

    return inner


def _token_ids(value: object) -> None:
    for element in _seq(value):
        _int(element)


def _token_ids_or_list(value: object) -> None:
    if not isinstance(value, list):
        raise _invalid(value, "a value or an array of values for TokenIdsOrList")
    if not value or _is_number(value[0]):
        _token_ids(value)
        return
    for row in value:
        _token_ids(row)


def _string_or_list(value: object) -> None:
    if isinstance(value, list):
        for element in value:
            _str(element)
        return
    if not isinstance(value, str):
        raise _invalid(value, "a value or an array of values for StringOrList")


def _sampling_one(value: object) -> None:
    params = _map(value, "struct SamplingParams")
    for key, item in params.items():
        check = _SAMPLING_CHECKS.get(key)
        if check is None:
            listed = ", ".join(f"`{name}`" for name in SAMPLING_FIELDS)
            raise ContractError(f"unknown field `{key}`, expected one of {listed}")
        if item is not None:
            check(item)


def _sampling(value: object) -> None:
    if isinstance(value, list):
        for element in value:
            _sampling_one(element)
        return
    _sampling_one(value)


def _logit_bias(value: object) -> None:
    for item in _map(value).values():
        _float(item)


def _watermark(value: object) -> None:
    config = _map(value, "struct WatermarkRequestConfig")
    fields = ("enabled", "key", "context_window")
    checks: dict[str, Callable[[object], None]] = {"enabled": _bool, "key": _str, "context_window": _int}
    for key, item in config.items():
        if key not in checks:
            listed = ", ".join(f"`{name}`" for name in fields)
            raise ContractError(f"unknown field `{key}`, expected one of {listed}")
        if item is not None:
            checks[key](item)


def _choice(value: object) -> None:
    for element in _seq(value):
        _str(element)


def _stop_ids(value: object) -> None:
    for element in _seq(value):
        _int(element)


# The contract gate's type check of each key; every key of the kernel's list has one (a key
# missing here fails at import).
_CHECK_OF: Final[Mapping[str, Callable[[object], None]]] = {
    "max_new_tokens": _int,
    "stop": _string_or_list,
    "stop_token_ids": _stop_ids,
    "stop_regex": _string_or_list,
    "temperature": _float,
    "top_p": _float,
    "top_k": _int,
    "min_p": _float,
    "frequency_penalty": _float,
    "presence_penalty": _float,
    "repetition_penalty": _float,
    "min_new_tokens": _int,
    "n": _int,
    "json_schema": _str,
    "regex": _str,
    "ebnf": _str,
    "structural_tag": _str,
    "ignore_eos": _bool,
    "skip_special_tokens": _bool,
    "spaces_between_special_tokens": _bool,
    "no_stop_trim": _bool,
    "stream_interval": _int,
    "logit_bias": _logit_bias,
    "sampling_seed": _int,
    "custom_params": lambda _value: None,
    "beam_width": _int,
    "watermark": _watermark,
    "choice": _choice,
}
_SAMPLING_CHECKS: Final[Mapping[str, Callable[[object], None]]] = {
    name: _CHECK_OF[name] for name in SAMPLING_FIELDS
}


def _labels(value: object) -> None:
    for item in _map(value).values():
        _str(item)


_TOP_CHECKS: Final[Mapping[str, Callable[[object], None]]] = {
    "rid": _optional(_string_or_list),
    "text": _optional(_string_or_list),
    "input_ids": _optional(_token_ids_or_list),
    "stream": _optional(_bool),
    "sampling_params": _optional(_sampling),
    "return_logprob": _optional(_or_list(_bool, "BoolOrList")),
    "logprob_start_len": _optional(_or_list(_int, "Int64OrList")),
    "top_logprobs_num": _optional(_or_list(_int, "Int64OrList")),
    "token_ids_logprob": _optional(_token_ids_or_list),
    "return_hidden_states": _optional(_or_list(_bool, "BoolOrList")),
    "return_text_in_logprobs": _optional(_bool),
    "bootstrap_host": _optional(_or_list(_optional(_str), "OptionalStringOrList")),
    "bootstrap_port": _optional(_or_list(_optional(_int), "OptionalInt64OrList")),
    "bootstrap_room": _optional(_or_list(_optional(_int), "OptionalInt64OrList")),
    "bootstrap_pair_key": _optional(_or_list(_optional(_str), "OptionalStringOrList")),
    "decode_tp_size": _optional(_or_list(_optional(_int), "OptionalInt64OrList")),
    "routed_dp_rank": _optional(_int),
    "disagg_prefill_dp_rank": _optional(_int),
    "extra_key": _optional(_string_or_list),
    "priority": _optional(_int),
    "cache_salt": _optional(_string_or_list),
    "require_reasoning": _optional(_bool),
    "lora_path": _optional(_or_list(_optional(_str), "OptionalStringOrList")),
    "routing_key": _optional(_str),
    "max_thinking_tokens": _optional(_uint),
    "session_id": _optional(_str),
    "custom_logit_processor": _optional(_or_list(_optional(_str), "OptionalStringOrList")),
    "custom_labels": _optional(_labels),
    "return_prompt_token_ids": _bool,
    "routed_experts_start_len": _int,
    "return_sampling_mask": _optional(_or_list(_bool, "BoolOrList")),
}


def check_contract(body: Mapping[str, object]) -> None:
    """Gate 2 (SGLang's JSON schema): strict JSON types, in the body's key order."""
    for key, value in body.items():
        check = _TOP_CHECKS.get(key)
        if check is not None:
            check(value)
