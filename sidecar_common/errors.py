"""The one error vocabulary of the sidecars, and its two mappings.

Every module raises :class:`SidecarError` (with an :class:`ErrorReason`); nothing invents its
own exception or status code. Two tables live here and nowhere else:

* engine gRPC status -> typed error (:func:`from_engine_status`), docs/common.md;
* typed error -> frontend gRPC status, with a ``google.rpc.ErrorInfo`` detail and the
  ``migratable`` flag (:data:`FRONTEND_STATUS`, :func:`to_rpc_status`), docs/api.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

__all__ = [
    "ENGINE_NOT_FOUND",
    "ENGINE_STATUS_TO_REASON",
    "ERROR_DOMAIN",
    "FRONTEND_STATUS",
    "NOT_SENT",
    "ORIGIN_ENGINE",
    "EngineOrigin",
    "ErrorReason",
    "FrontendStatus",
    "SidecarError",
    "engine_went_away",
    "engine_words",
    "from_engine_status",
    "from_rpc_error",
    "invalid_argument",
    "is_engine_fault",
    "protocol_error",
    "rpc_status",
    "to_rpc_status",
]

ERROR_DOMAIN: Final = "sidecar"
# ErrorInfo metadata ``origin`` of an error whose message is the engine's own text.
ORIGIN_ENGINE: Final = "engine"
# ``engine_status`` of an engine's refusal the sidecar makes itself, in the engine's words,
# before any call (it knows the engine would refuse: its fixed rule, or what discovery told).
NOT_SENT: Final = "not sent"
# ``engine_status`` values of a refusal because the engine does not have what the request
# names (vLLM's NotFoundError, e.g. a LoRA adapter it cannot find): gRPC NOT_FOUND, HTTP 404.
# The reason stays INVALID_ARGUMENT (the request is the problem, on any worker); a frontend
# whose server answers such a refusal with its own status (vLLM: 404) reads it from here.
ENGINE_NOT_FOUND: Final = frozenset({grpc.StatusCode.NOT_FOUND.name, "404"})


class ErrorReason(enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    CANNOT_CONNECT = "CANNOT_CONNECT"
    CONNECTION_TIMEOUT = "CONNECTION_TIMEOUT"
    ENGINE_SHUTDOWN = "ENGINE_SHUTDOWN"
    CANCELLED = "CANCELLED"
    OVERLOADED = "OVERLOADED"
    PROTOCOL_ERROR = "PROTOCOL_ERROR"
    UNKNOWN = "UNKNOWN"


@dataclass(frozen=True)
class FrontendStatus:
    code: grpc.StatusCode
    migratable: bool


FRONTEND_STATUS: Final[dict[ErrorReason, FrontendStatus]] = {
    ErrorReason.INVALID_ARGUMENT: FrontendStatus(grpc.StatusCode.INVALID_ARGUMENT, False),
    ErrorReason.CANNOT_CONNECT: FrontendStatus(grpc.StatusCode.UNAVAILABLE, True),
    ErrorReason.CONNECTION_TIMEOUT: FrontendStatus(grpc.StatusCode.DEADLINE_EXCEEDED, True),
    ErrorReason.ENGINE_SHUTDOWN: FrontendStatus(grpc.StatusCode.UNAVAILABLE, True),
    ErrorReason.CANCELLED: FrontendStatus(grpc.StatusCode.CANCELLED, False),
    ErrorReason.OVERLOADED: FrontendStatus(grpc.StatusCode.RESOURCE_EXHAUSTED, False),
    ErrorReason.PROTOCOL_ERROR: FrontendStatus(grpc.StatusCode.INTERNAL, False),
    ErrorReason.UNKNOWN: FrontendStatus(grpc.StatusCode.UNKNOWN, False),
}

ENGINE_STATUS_TO_REASON: Final[dict[grpc.StatusCode, ErrorReason]] = {
    grpc.StatusCode.INVALID_ARGUMENT: ErrorReason.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND: ErrorReason.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE: ErrorReason.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION: ErrorReason.INVALID_ARGUMENT,
    grpc.StatusCode.ALREADY_EXISTS: ErrorReason.INVALID_ARGUMENT,
    grpc.StatusCode.UNAVAILABLE: ErrorReason.CANNOT_CONNECT,
    grpc.StatusCode.CANCELLED: ErrorReason.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorReason.CONNECTION_TIMEOUT,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorReason.OVERLOADED,
}


@dataclass(frozen=True)
class EngineOrigin:
    """Where an error in the engine's own words came from.

    ``call`` names the engine call (``Generate``, ``POST /generate``); ``status`` is what the
    engine answered it with (a gRPC code name such as ``INVALID_ARGUMENT``, or an HTTP status
    such as ``400``).
    """

    call: str
    status: str


class SidecarError(Exception):
    """A failure with a reason the frontend can act on, and a message for a human.

    ``origin`` is set when ``message`` is the engine's own text, unchanged (see
    :func:`engine_words`); ``str()`` of the error then names the call and status too, for logs.
    """

    def __init__(self, reason: ErrorReason, message: str, origin: EngineOrigin | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.origin = origin

    def __str__(self) -> str:
        if self.origin is None:
            return self.message
        return f"{self.origin.call}: {self.message} ({self.origin.status})"

    @property
    def migratable(self) -> bool:
        return FRONTEND_STATUS[self.reason].migratable

    @property
    def code(self) -> grpc.StatusCode:
        return FRONTEND_STATUS[self.reason].code

    def __repr__(self) -> str:
        if self.origin is None:
            return f"SidecarError({self.reason.value}, {self.message!r})"
        return f"SidecarError({self.reason.value}, {self.message!r}, {self.origin!r})"


def engine_words(reason: ErrorReason, words: str, call: str, status: str) -> SidecarError:
    """An error whose message is the engine's own text, unchanged (a refusal only the engine
    can make): the frontend shows ``words`` to the client as they are. Where they came from
    (``call``, ``status``) travels in the ErrorInfo metadata, not in the message."""
    return SidecarError(reason, words, EngineOrigin(call, status))


def invalid_argument(field: str, problem: str) -> SidecarError:
    """Bad input: the message always starts with the field's name."""
    return SidecarError(ErrorReason.INVALID_ARGUMENT, f"{field}: {problem}")


def protocol_error(engine: str, what: str) -> SidecarError:
    """The engine sent something malformed."""
    return SidecarError(ErrorReason.PROTOCOL_ERROR, f"invalid {engine} response: {what}")


def from_engine_status(rpc: str, code: grpc.StatusCode, details: str | None) -> SidecarError:
    """An engine call's non-OK status, as the typed error the spec's table assigns.

    A refusal (INVALID_ARGUMENT) with words keeps them as the message, unchanged, with its
    origin beside it: the client reads what the engine said. Any other status is described
    with the call's name and the code, for the operator.
    """
    reason = ENGINE_STATUS_TO_REASON.get(code, ErrorReason.UNKNOWN)
    if details and reason is ErrorReason.INVALID_ARGUMENT:
        return engine_words(reason, details, rpc, code.name)
    words = details if details else "engine error with no details"
    return SidecarError(reason, f"{rpc}: {words} ({code.name})")


def is_engine_fault(error: SidecarError) -> bool:
    """An engine failure with no type of its own (INTERNAL and the like): a bug of the request
    or the engine dying inside a live server, which only the engine's health can tell apart."""
    return error.reason is ErrorReason.UNKNOWN


def engine_went_away(error: SidecarError, why: str) -> SidecarError:
    """An engine fault that came with the engine reporting itself unhealthy: the engine going
    away (ENGINE_SHUTDOWN, migratable), keeping the engine's own words."""
    return SidecarError(
        ErrorReason.ENGINE_SHUTDOWN, f"{error}; the engine then reported itself unhealthy: {why}"
    )


def to_rpc_status(error: SidecarError) -> status_pb2.Status:
    """The frontend status for a typed error: code, message, ErrorInfo{reason, migratable},
    plus, for the engine's own words, ``origin: engine``, ``engine_call`` and
    ``engine_status``."""
    metadata = {"migratable": "true" if error.migratable else "false"}
    if error.origin is not None:
        metadata.update(
            origin=ORIGIN_ENGINE, engine_call=error.origin.call, engine_status=error.origin.status
        )
    info = error_details_pb2.ErrorInfo(reason=error.reason.value, domain=ERROR_DOMAIN, metadata=metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    code_value: int = error.code.value[0]
    assert code_value in code_pb2.Code.values()
    return status_pb2.Status(code=code_value, message=error.message, details=[detail])


def rpc_status(error: grpc.RpcError) -> tuple[grpc.StatusCode, str | None]:
    """A failed call's code and details (grpc.aio.AioRpcError or any RpcError with them)."""
    code_fn = getattr(error, "code", None)
    details_fn = getattr(error, "details", None)
    code = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    details = details_fn() if callable(details_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    return code, details if isinstance(details, str) else None


def from_rpc_error(rpc: str, error: grpc.RpcError) -> SidecarError:
    """A failed engine call, typed by :func:`from_engine_status`."""
    return from_engine_status(rpc, *rpc_status(error))
