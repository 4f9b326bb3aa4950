"""The checks vLLM makes outside its request models, each with vLLM's own message (pure).

Reading the body as vLLM's web framework does, the cache salt (checked before anything
else), the integers vLLM msgpack-encodes for its engine, and the engine's input checks the
frontend can make from what its workers report (vocabulary, context length, data-parallel
rank). Each raises :class:`Refused` (or :class:`Invalid`) with vLLM's answer.
"""

from __future__ import annotations

import email.message
import json
from collections.abc import Mapping
from http import HTTPStatus
from typing import Final

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.formats.vllm.errors import Invalid, Refused, ValidationIssue, VllmError, bad_request
from sidecar_frontend.formats.vllm.sampling import UINT32_MAX

__all__ = ["check_cache_salt", "check_msgpack", "check_prompt", "dp_rank", "header", "read_body"]

_CACHE_SALT_MAX: Final = 128
_CACHE_SALT_FORBIDDEN: Final = frozenset("@/\\\x00")
_MSGPACK_RANGE: Final = "can't serialize ints < -2**63 or > 2**64 - 1"


def check_cache_salt(salt: object) -> None:
    # vLLM checks the salt before anything else, and answers in its own error form.
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise Refused(
            bad_request("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
        )
    if len(salt) > _CACHE_SALT_MAX or any(char in _CACHE_SALT_FORBIDDEN for char in salt):
        raise Refused(
            bad_request(
                "Parameter 'cache_salt' must be at most 128 characters and must not contain "
                "'@', '/', '\\\\', or NUL.",
                "cache_salt",
            )
        )


def check_msgpack(values: list[object]) -> None:
    # vLLM msgpack-encodes the request for its engine; integers beyond 64 bits cannot travel.
    pending = list(values)
    while pending:
        value = pending.pop()
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value <= 2**64 - 1:
            raise Refused(bad_request(_MSGPACK_RANGE))
        if isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)


def check_prompt(token_ids: list[int], info: sidecar_pb2.ModelInfo) -> None:
    """vLLM's prompt checks, in its order: the length, then the vocabulary."""
    limit = info.max_context_length
    length = len(token_ids)
    if limit and length > limit:
        raise Refused(
            bad_request(
                f"The decoder prompt (length {length}) is longer than the maximum model length of {limit}. "
                "Make sure that `max_model_len` is no smaller than the number of text tokens."
            )
        )
    if limit and length == limit:
        raise Refused(
            bad_request(
                f"The decoder prompt (length {length}) plus the number of requested output tokens "
                f"(at least 1) is longer than the maximum model length of {limit}. Make sure that "
                "`max_model_len` is no smaller than the number of text tokens "
                "(prompt + requested output tokens)."
            )
        )
    if info.vocab_size:
        highest = max(token_ids)
        if highest >= info.vocab_size:
            raise Refused(bad_request(f"Token id {highest} is out of vocabulary"))
    elif max(token_ids) > UINT32_MAX:
        raise Refused(bad_request(f"Token id {max(token_ids)} is out of vocabulary"))


def dp_rank(text: str | None, dp_size: int) -> int | None:
    if text is None:
        return None
    try:
        rank = int(text)
    except ValueError:
        return None  # vLLM ignores a rank that is not an integer
    if rank < 0 or (dp_size and rank >= dp_size) or rank > UINT32_MAX:
        size = dp_size or 1
        raise Refused(bad_request(f"data_parallel_rank {rank} is out of range [0, {size})."))
    return rank


def header(headers: Mapping[str, str], name: str) -> str | None:
    """A header's value, whatever the case of its name (a plain dict in tests, a multidict live)."""
    value = headers.get(name)
    if value is not None:
        return value
    lowered = name.lower()
    for key, item in headers.items():
        if key.lower() == lowered:
            return item
    return None


def read_body(body: bytes, headers: Mapping[str, str]) -> dict[str, object]:
    """The body as vLLM's web framework reads it, then vLLM's content-type check.

    The framework parses the body as JSON first when the content type is missing or names
    JSON (``application/json``, ``application/*+json``), so a syntax error there wins over
    the content-type refusal; any other body is left unparsed and refused for its type.
    """
    content_type = header(headers, "content-type")
    data: object = None
    if body and (content_type is None or _names_json(content_type)):
        data = _parse_json(body)
    if (content_type or "").lower().split(";", 1)[0] != "application/json":
        raise Refused(
            VllmError(
                "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                HTTPStatus.BAD_REQUEST.phrase,
                HTTPStatus.BAD_REQUEST,
            )
        )
    if data is None:  # no body, or the JSON null
        raise Invalid(ValidationIssue("missing", "body", "Field required", None))
    if not isinstance(data, dict):
        raise Invalid(
            ValidationIssue(
                "model_attributes_type",
                "body",
                "Input should be a valid dictionary or object to extract fields from",
                data,
            )
        )
    return data


def _names_json(content_type: str) -> bool:
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def _parse_json(body: bytes) -> object:
    try:
        return json.loads(body)
    except json.JSONDecodeError as err:
        raise Invalid(
            ValidationIssue("json_invalid", f"body.{err.pos}", "JSON decode error", {}, {"error": err.msg})
        ) from None
    except (ValueError, RecursionError):  # not UTF-8 text, or nested beyond the parser
        raise Refused(
            VllmError(
                "There was an error parsing the body", HTTPStatus.BAD_REQUEST.phrase, HTTPStatus.BAD_REQUEST
            )
        ) from None
