"""SGLang's bytes on the wire (pure): compact JSON, SSE events and its error bodies.

SGLang answers a bad ``/generate`` with a different body depending on which of its gates
refused it (see docs/frontend-sglang.md, "Errors"); each gate has one constructor here:

* ``model.ModelErrors.reply`` - the request-model parse (pydantic's list, always 400);
* :func:`contract_error` - the JSON schema gate (``{"error": "<serde text>"}``, always 400);
* :func:`value_error` - a value check (unary 400 ``{"error": {"message"}}``; a stream gets
  HTTP 200, one SSE error event and ``data: [DONE]``);
* :func:`status_error` - any other status (``{"object": "error", "type": "<code>", ...}``).

A worker's failure is answered with the status SGLang uses for the same cause
(:data:`FAILURE_STATUS`).
"""

from __future__ import annotations

import json
import math
import reprlib
from collections.abc import Mapping
from typing import Final

import orjson

from sidecar_common.errors import FailureReason
from sidecar_frontend.formats.base import JSON_CONTENT_TYPE, SSE_CONTENT_TYPE, HttpReply

__all__ = [
    "DONE_EVENT",
    "FAILURE_STATUS",
    "ContractError",
    "ValueRefusal",
    "bounded_repr",
    "contract_error",
    "dumps",
    "event",
    "status_error",
    "stream_error_event",
    "value_error",
]

DONE_EVENT: Final = b"data: [DONE]\n\n"

# A worker failure's HTTP status, as SGLang answers the same cause: a refused value 400;
# capacity, reachability and time 503; anything else 500. None: an abort (SGLang ends the
# request with the abort finish reason and the output so far, on 200).
FAILURE_STATUS: Final[Mapping[FailureReason, int | None]] = {
    FailureReason.INVALID_ARGUMENT: 400,
    FailureReason.CANNOT_CONNECT: 503,
    FailureReason.CONNECTION_TIMEOUT: 503,
    FailureReason.ENGINE_SHUTDOWN: 503,
    FailureReason.CANCELLED: None,
    FailureReason.OVERLOADED: 503,
    FailureReason.PROTOCOL_ERROR: 500,
    FailureReason.UNKNOWN: 500,
    # A paused engine's refusal: unavailable for now, as SGLang's /ready says while paused.
    FailureReason.ENGINE_PAUSED: 503,
    FailureReason.NO_WORKER: 503,
    FailureReason.DEADLINE: 503,
    # No engine saw it, and its worker's server had no room to take it: SGLang's busy answer.
    FailureReason.NOT_STARTED: 503,
}


def _bounded_repr() -> reprlib.Repr:
    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother, short.maxlist, short.maxdict = 3, 100, 100, 10, 10
    return short


_REPR: Final = _bounded_repr()


def bounded_repr(value: object) -> str:
    """``repr`` bounded in size and depth: an echoed input may be anything the client sent."""
    return _REPR.repr(value)


class ContractError(Exception):
    """Gate 2: the JSON schema's serde-style text."""


class ValueRefusal(Exception):
    """Gate 3: a value the server refuses (SGLang's ValueError text, or ours naming the field)."""


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    return value


def dumps(value: object) -> bytes:
    """Compact UTF-8 JSON written by orjson, as SGLang writes it (non-finite floats are null)."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        # Only an echo of a client's malformed input can get here (a lone surrogate, an
        # integer past 64 bits): escape what UTF-8 cannot hold.
        return json.dumps(_finite(value), separators=(",", ":"), allow_nan=False).encode()


def event(value: object) -> bytes:
    return b"data: " + dumps(value) + b"\n\n"


def contract_error(err: ContractError) -> HttpReply:
    return HttpReply(400, dumps({"error": str(err)}))


def stream_error_event(message: str, code: int = 400) -> bytes:
    return event(
        {"error": {"message": message, "type": "invalid_request_error", "code": code, "retryable": False}}
    )


def value_error(message: str, *, stream: bool) -> HttpReply:
    if stream:
        return HttpReply(200, stream_error_event(message) + DONE_EVENT, SSE_CONTENT_TYPE)
    return HttpReply(400, dumps({"error": {"message": message}}))


def status_error(status: int, message: str) -> HttpReply:
    """A non-400 refusal: SGLang's ErrorResponse with the status code as the type."""
    if status == 400:
        return HttpReply(400, dumps({"error": {"message": message}}))
    body = {"object": "error", "message": message, "type": str(status), "param": None, "code": status}
    return HttpReply(status, dumps(body), JSON_CONTENT_TYPE)
