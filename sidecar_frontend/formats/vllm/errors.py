"""vLLM's error bodies, as the vLLM 0.33 HTTP server writes them (pure).

Three shapes reach a vLLM client:

* ``{"error":{"message","type","param","code"}}``, compact, as a whole JSON response; ``type``
  is ``"BadRequestError"``-style for vLLM's own checks and the HTTP phrase (``"Bad Request"``)
  for body-validation failures, which also list every problem in the message;
* the same object written with ``json.dumps`` defaults (spaces after ``:`` and ``,``) as one
  SSE event inside a stream that already answered 200;
* ``{"detail": ...}`` for the web framework's own 404 and 405.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Final

from sidecar_common.errors import FailureReason
from sidecar_frontend.formats.base import HttpReply
from sidecar_frontend.formats.vllm.wire import compact_json

__all__ = [
    "DEAD_ENGINE_MESSAGE",
    "FAILURE_ANSWERS",
    "OVERLOADED_MESSAGE",
    "REFUSED_BEFORE_STREAM",
    "FailureAnswer",
    "Invalid",
    "Refused",
    "ValidationIssue",
    "VllmError",
    "bad_request",
    "detail_reply",
    "error_reply",
    "uncarried",
    "validation_reply",
]

# What vLLM tells a client when its engine process is gone (EngineDeadError.CLIENT_MESSAGE).
DEAD_ENGINE_MESSAGE: Final = "The server had an error while processing your request."
# vLLM's admission-control refusal (QueueOverflowError), answered 503 so callers retry elsewhere.
OVERLOADED_MESSAGE: Final = (
    "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance."
)


class FailureAnswer(enum.Enum):
    """How vLLM answers a failure (``response.failure_error`` writes each)."""

    # As an abort: the open choices finish with finish_reason "abort", the tokens so far stand.
    ABORT = "abort"
    # 400 BadRequestError in the failure's words (404 NotFoundError for what the engine lacks).
    REFUSED = "refused"
    # 503 Service Unavailable (vLLM's admission refusal), before any stream starts.
    BUSY = "busy"
    # 500 InternalServerError with vLLM's sentence for a failed engine.
    ENGINE_FAILED = "engine_failed"


# What vLLM answers for each reason: the cause in vLLM that matches it.
FAILURE_ANSWERS: Final[Mapping[FailureReason, FailureAnswer]] = {
    FailureReason.INVALID_ARGUMENT: FailureAnswer.REFUSED,
    FailureReason.CANNOT_CONNECT: FailureAnswer.ENGINE_FAILED,
    FailureReason.CONNECTION_TIMEOUT: FailureAnswer.ENGINE_FAILED,
    FailureReason.ENGINE_SHUTDOWN: FailureAnswer.ENGINE_FAILED,
    FailureReason.CANCELLED: FailureAnswer.ABORT,
    FailureReason.OVERLOADED: FailureAnswer.BUSY,
    FailureReason.PROTOCOL_ERROR: FailureAnswer.ENGINE_FAILED,
    FailureReason.UNKNOWN: FailureAnswer.ENGINE_FAILED,
    # vLLM's paused refusal is a RetryableRequestError: 503 in the engine's words.
    FailureReason.ENGINE_PAUSED: FailureAnswer.BUSY,
    FailureReason.NO_WORKER: FailureAnswer.ENGINE_FAILED,
    # Our request deadline ends the request as vLLM's abort does.
    FailureReason.DEADLINE: FailureAnswer.ABORT,
    # Its worker's server had no room to take the call (no engine saw it): vLLM's admission
    # refusal, before any stream starts.
    FailureReason.NOT_STARTED: FailureAnswer.BUSY,
}

# vLLM checks admission before it starts a stream (serving's check_admission): a streamed
# request it has no room for gets the same 503 JSON as a unary one, never a 200.
REFUSED_BEFORE_STREAM: Final = frozenset(
    reason for reason, answer in FAILURE_ANSWERS.items() if answer is FailureAnswer.BUSY
)

_MAX_REPORTED: Final = 10
_MAX_INPUT_CHARS: Final = 200
_MAX_ERROR_CHARS: Final = 1000


@dataclass(frozen=True)
class VllmError:
    """One error as vLLM reports it; ``code`` is also the HTTP status."""

    message: str
    type: str
    code: int
    param: str | None = None

    def body(self) -> dict[str, object]:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": int(self.code)}
        }

    def reply(self) -> HttpReply:
        return HttpReply(int(self.code), compact_json(self.body()))

    def sse_event(self) -> bytes:
        # vLLM writes this one event with json.dumps defaults: spaces, ASCII escapes.
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


def bad_request(message: str, param: str | None = None, value: object = None) -> VllmError:
    """A vLLM validation error: the message gets `` (parameter=…, value=…)`` when they are known."""
    extras = []
    if param is not None:
        extras.append(f"parameter={param}")
    if value is not None:
        extras.append(f"value={value}")
    text = f"{message} ({', '.join(extras)})" if extras else message
    return VllmError(text, "BadRequestError", HTTPStatus.BAD_REQUEST, param)


class Invalid(Exception):
    """The body fails validation; ``issues`` are the problems, as vLLM lists them."""

    def __init__(self, *issues: ValidationIssue) -> None:
        super().__init__(issues[0].msg if issues else "invalid")
        self.issues = issues


class Refused(Exception):
    """Raised while parsing: the request is refused with ``reply``; nothing reaches a worker."""

    def __init__(self, error: VllmError | HttpReply) -> None:
        self.reply = error.reply() if isinstance(error, VllmError) else error
        super().__init__(self.reply.status)


def uncarried(name: str, why: str) -> Refused:
    """A field vLLM accepts but this frontend cannot carry to a vLLM sidecar, refused by name."""
    return Refused(bad_request(f"{name} is not supported by this server: {why}.", name))


def error_reply(status: int, message: str) -> HttpReply:
    """A refusal the handler decides (no worker, overload, bad method) in vLLM's shapes."""
    if status in (HTTPStatus.NOT_FOUND, HTTPStatus.METHOD_NOT_ALLOWED):
        # The web framework's own answer: the status phrase, whatever the handler's words.
        return detail_reply(status, HTTPStatus(status).phrase)
    return VllmError(message, _error_type(status), status).reply()


def detail_reply(status: int, detail: str) -> HttpReply:
    return HttpReply(status, compact_json({"detail": detail}))


def _error_type(status: int) -> str:
    named = {
        HTTPStatus.BAD_REQUEST: "BadRequestError",
        HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
        HTTPStatus.NOT_IMPLEMENTED: "NotImplementedError",
    }
    if status in named:
        return named[HTTPStatus(status)]
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


@dataclass(frozen=True)
class ValidationIssue:
    """One body-validation problem, in the fields pydantic reports (``loc`` already dotted)."""

    type: str
    loc: str
    msg: str
    input: object
    ctx: dict[str, object] | None = field(default=None)

    def text(self) -> str:
        entry: dict[str, object] = {
            "type": self.type,
            "loc": self.loc,
            "msg": self.msg,
            "input": _summarise(self.input),
        }
        if self.ctx is not None:
            entry["ctx"] = self.ctx
        text = str(entry)
        return text[:_MAX_ERROR_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_CHARS else text


def validation_reply(issues: Sequence[ValidationIssue]) -> HttpReply:
    """vLLM's answer to a body that fails validation: every problem listed, the first one's place."""
    count = len(issues)
    label = "error" if count == 1 else "errors"
    lines = "".join(f"  {issue.text()}\n" for issue in issues[:_MAX_REPORTED])
    if count > _MAX_REPORTED:
        lines += f"  ...and {count - _MAX_REPORTED} more {label}\n"
    message = f"{count} validation {label}:\n{lines}".rstrip()
    param = issues[0].loc if issues else None
    return VllmError(message, HTTPStatus.BAD_REQUEST.phrase, HTTPStatus.BAD_REQUEST, param).reply()


def _summarise(value: object) -> object:
    """The bounded stand-in vLLM reports for an offending value (containers are only counted)."""
    if isinstance(value, str):
        return value[:_MAX_INPUT_CHARS] + "...[truncated]" if len(value) > _MAX_INPUT_CHARS else value
    if isinstance(value, list | tuple | dict | set | frozenset):
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = str(value)
    except ValueError:  # an int past the interpreter's digit limit
        return f"<{type(value).__name__}>"
    return text[:_MAX_INPUT_CHARS] + "...[truncated]" if len(text) > _MAX_INPUT_CHARS else text
