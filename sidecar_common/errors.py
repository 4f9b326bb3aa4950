"""The one failure vocabulary of the project, its table, and the one decoder of gRPC errors.

Every module of the sidecars raises :class:`SidecarError` (with a :class:`FailureReason`);
nothing invents its own exception or status code. The frontend carries the same reasons in
its ``WorkerFailure``, plus two of its own, and names the refusals it makes before any worker
(:class:`RefusalReason`). What lives here:

* :class:`FailureReason` and :data:`FAILURE_RULES`: for every reason, what is true of it
  whatever the HTTP format (its gRPC status from a sidecar, whether another worker may take
  the request before or after tokens were delivered, whether the worker answered busy);
  each format's HTTP answer to a reason lives in that format's plugin;
* engine gRPC status -> typed error (:data:`ENGINE_STATUS_TO_REASON`,
  :func:`from_engine_status`), docs/common.md;
* typed error -> a sidecar's gRPC status, with a ``google.rpc.ErrorInfo`` detail and the
  ``migratable`` flag (:func:`to_rpc_status`), docs/api.md;
* a failed call's status -> typed error, for an engine's status and a sidecar's alike
  (:func:`decode_rpc_error`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status as grpc_rpc_status

# The reasons themselves live in a module without grpc, so that what only names them (the
# frontend's pure admission and outlier modules, read by --help) loads no gRPC.
from sidecar_common.reasons import FailureReason, RefusalReason

__all__ = [
    "ENGINE_NOT_FOUND",
    "ENGINE_STATUS_TO_REASON",
    "ERROR_DOMAIN",
    "FAILURE_RULES",
    "FRONTEND_STATUS",
    "NOT_SENT",
    "ORIGIN_ENGINE",
    "SIDECAR_REASONS",
    "EngineOrigin",
    "FailureReason",
    "FailureRule",
    "FrontendStatus",
    "RefusalReason",
    "SidecarError",
    "decode_rpc_error",
    "engine_went_away",
    "engine_words",
    "from_engine_status",
    "from_rpc_error",
    "invalid_argument",
    "is_engine_fault",
    "never_started",
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
# gRPC's own words when a message is over a receiver's limit (RESOURCE_EXHAUSTED, bare): the
# request itself is the problem, not the server's backlog.
_MESSAGE_TOO_LARGE: Final = "larger than max"


@dataclass(frozen=True)
class FailureRule:
    """What a failure means, whatever the HTTP format answers for it."""

    # The gRPC status a sidecar ends a call with for it; None: the frontend's own reason.
    status: grpc.StatusCode | None
    # Tokens were delivered: the generation may continue on another worker (the sidecar
    # says so in its ErrorInfo ``migratable``).
    migratable: bool
    # Nothing was delivered yet: the request may run again on another worker (the worker or
    # its engine is gone or busy; a bad request would fail anywhere, a cancel is our own).
    retried: bool
    # The worker answered that it has no room, and is still there: the next attempt takes a
    # worker that serves now, never this one, and waits for none.
    busy: bool = False


_C = grpc.StatusCode
_R = FailureReason
FAILURE_RULES: Final[Mapping[FailureReason, FailureRule]] = {
    _R.INVALID_ARGUMENT: FailureRule(_C.INVALID_ARGUMENT, migratable=False, retried=False),
    _R.CANNOT_CONNECT: FailureRule(_C.UNAVAILABLE, migratable=True, retried=True),
    _R.CONNECTION_TIMEOUT: FailureRule(_C.DEADLINE_EXCEEDED, migratable=True, retried=True),
    _R.ENGINE_SHUTDOWN: FailureRule(_C.UNAVAILABLE, migratable=True, retried=True),
    _R.CANCELLED: FailureRule(_C.CANCELLED, migratable=False, retried=False),
    _R.OVERLOADED: FailureRule(_C.RESOURCE_EXHAUSTED, migratable=False, retried=True, busy=True),
    _R.PROTOCOL_ERROR: FailureRule(_C.INTERNAL, migratable=False, retried=False),
    _R.UNKNOWN: FailureRule(_C.UNKNOWN, migratable=False, retried=False),
    # Refused before any token: retried, and not busy (the engine goes on at continue, so a
    # later attempt may wait for it).
    _R.ENGINE_PAUSED: FailureRule(_C.UNAVAILABLE, migratable=False, retried=True),
    _R.NO_WORKER: FailureRule(None, migratable=False, retried=False),
    _R.DEADLINE: FailureRule(None, migratable=False, retried=False),
    _R.NOT_STARTED: FailureRule(None, migratable=False, retried=True),
}


@dataclass(frozen=True)
class FrontendStatus:
    """A sidecar's status for a reason (its row of :data:`FAILURE_RULES`)."""

    code: grpc.StatusCode
    migratable: bool


# The reasons a sidecar sends, with the status it sends them with (docs/api.md's table).
FRONTEND_STATUS: Final[Mapping[FailureReason, FrontendStatus]] = {
    reason: FrontendStatus(rule.status, rule.migratable)
    for reason, rule in FAILURE_RULES.items()
    if rule.status is not None
}
SIDECAR_REASONS: Final[frozenset[FailureReason]] = frozenset(FRONTEND_STATUS)

ENGINE_STATUS_TO_REASON: Final[Mapping[grpc.StatusCode, FailureReason]] = {
    _C.INVALID_ARGUMENT: _R.INVALID_ARGUMENT,
    _C.NOT_FOUND: _R.INVALID_ARGUMENT,
    _C.OUT_OF_RANGE: _R.INVALID_ARGUMENT,
    _C.FAILED_PRECONDITION: _R.INVALID_ARGUMENT,
    _C.ALREADY_EXISTS: _R.INVALID_ARGUMENT,
    _C.UNAVAILABLE: _R.CANNOT_CONNECT,
    _C.CANCELLED: _R.CANCELLED,
    _C.DEADLINE_EXCEEDED: _R.CONNECTION_TIMEOUT,
    _C.RESOURCE_EXHAUSTED: _R.OVERLOADED,
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
    ``migratable`` is the reason's (:data:`FAILURE_RULES`) unless the error was read from a
    status that said otherwise (:func:`decode_rpc_error`).
    """

    def __init__(
        self,
        reason: FailureReason,
        message: str,
        origin: EngineOrigin | None = None,
        *,
        migratable: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.origin = origin
        self._migratable = migratable

    def __str__(self) -> str:
        if self.origin is None:
            return self.message
        return f"{self.origin.call}: {self.message} ({self.origin.status})"

    @property
    def migratable(self) -> bool:
        if self._migratable is not None:
            return self._migratable
        return FAILURE_RULES[self.reason].migratable

    @property
    def code(self) -> grpc.StatusCode:
        """The status a sidecar ends a call with for this error."""
        status = FAILURE_RULES[self.reason].status
        if status is None:
            raise ValueError(f"{self.reason.value} is the frontend's own reason: no sidecar sends it")
        return status

    def __repr__(self) -> str:
        if self.origin is None:
            return f"SidecarError({self.reason.value}, {self.message!r})"
        return f"SidecarError({self.reason.value}, {self.message!r}, {self.origin!r})"


def engine_words(reason: FailureReason, words: str, call: str, status: str) -> SidecarError:
    """An error whose message is the engine's own text, unchanged (a refusal only the engine
    can make): the frontend shows ``words`` to the client as they are. Where they came from
    (``call``, ``status``) travels in the ErrorInfo metadata, not in the message."""
    return SidecarError(reason, words, EngineOrigin(call, status))


def invalid_argument(field: str, problem: str) -> SidecarError:
    """Bad input: the message always starts with the field's name."""
    return SidecarError(FailureReason.INVALID_ARGUMENT, f"{field}: {problem}")


def protocol_error(engine: str, what: str) -> SidecarError:
    """The engine sent something malformed."""
    return SidecarError(FailureReason.PROTOCOL_ERROR, f"invalid {engine} response: {what}")


def from_engine_status(rpc: str, code: grpc.StatusCode, details: str | None) -> SidecarError:
    """An engine call's non-OK status, as the typed error the spec's table assigns.

    A refusal (INVALID_ARGUMENT) with words keeps them as the message, unchanged, with its
    origin beside it: the client reads what the engine said. Any other status is described
    with the call's name and the code, for the operator.
    """
    reason = ENGINE_STATUS_TO_REASON.get(code, FailureReason.UNKNOWN)
    if details and reason is FailureReason.INVALID_ARGUMENT:
        return engine_words(reason, details, rpc, code.name)
    words = details if details else "engine error with no details"
    return SidecarError(reason, f"{rpc}: {words} ({code.name})")


def is_engine_fault(error: SidecarError) -> bool:
    """An engine failure with no type of its own (INTERNAL and the like): a bug of the request
    or the engine dying inside a live server, which only the engine's health can tell apart."""
    return error.reason is FailureReason.UNKNOWN


def engine_went_away(error: SidecarError, why: str) -> SidecarError:
    """An engine fault that came with the engine reporting itself unhealthy: the engine going
    away (ENGINE_SHUTDOWN, migratable), keeping the engine's own words."""
    return SidecarError(
        FailureReason.ENGINE_SHUTDOWN, f"{error}; the engine then reported itself unhealthy: {why}"
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
    """A failed engine call ``rpc``, typed by :func:`from_engine_status`."""
    return decode_rpc_error(error, engine_call=rpc)


def never_started(code: grpc.StatusCode, details: str, *, error_info: bool, started: bool) -> bool:
    """Whether a Generate call that failed with ``code`` was never taken by a sidecar that
    types every failure of the calls it takes (``ModelInfo.generate_failures_typed``): its
    status carries no sidecar ErrorInfo (``error_info``), no output came before it
    (``started``), and it is one of the two ways gRPC's server core ends
    a call the application has not picked up: RESOURCE_EXHAUSTED when too many calls wait
    (gRPC's pending-request limits, 1,000 soft and 3,000 hard by default), CANCELLED when one
    waited too long (30 s by default). Such a call reached no engine: it can run again
    anywhere, on the same worker too. A message over the server's size limit is also a bare
    RESOURCE_EXHAUSTED, but the request is the problem there: not this."""
    if error_info or started:
        return False
    if code is grpc.StatusCode.CANCELLED:
        return True
    return code is grpc.StatusCode.RESOURCE_EXHAUSTED and _MESSAGE_TOO_LARGE not in details


def decode_rpc_error(
    error: grpc.RpcError, *, engine_call: str | None = None, started: bool | None = None
) -> SidecarError:
    """A failed call as a typed error: the one place a gRPC status becomes a reason.

    ``engine_call`` names the engine call that failed: the status is an engine's, typed by
    :func:`from_engine_status`. Without it the status is a sidecar's. A sidecar types its own
    (the ErrorInfo of :func:`to_rpc_status`: reason, ``migratable``, and the origin of the
    engine's own words), taken as it is (a reason this version does not know is UNKNOWN). A
    status without one (the connection broke, a proxy answered) is typed by its code, as the
    sidecars type an engine's; except CANCELLED: a caller's own cancels never come back as a
    status, so a bare CANCELLED is the worker's server ending its calls as it stops.

    ``started`` says whether an output came before the status, for a sidecar that types every
    failure of the calls it takes (None: not such a sidecar, or a caller that did not look).
    A call with no output whose status is gRPC core's refusal (:func:`never_started`) is
    NOT_STARTED.
    """
    code, details = rpc_status(error)
    if engine_call is not None:
        return from_engine_status(engine_call, code, details)
    message = details if details else "worker error with no details"
    info = _error_info(error)
    if started is not None and never_started(
        code, details or "", error_info=info is not None, started=started
    ):
        return SidecarError(
            FailureReason.NOT_STARTED, f"{message} ({code.name}, before the sidecar took the call)"
        )
    if info is not None:
        origin = None
        if info.metadata.get("origin") == ORIGIN_ENGINE:
            origin = EngineOrigin(
                info.metadata.get("engine_call", ""), info.metadata.get("engine_status", "")
            )
        migratable = info.metadata.get("migratable") == "true"
        return SidecarError(_reason_named(info.reason), message, origin, migratable=migratable)
    if code is grpc.StatusCode.CANCELLED:
        return SidecarError(FailureReason.ENGINE_SHUTDOWN, f"{message} (CANCELLED by the worker)")
    reason = ENGINE_STATUS_TO_REASON.get(code, FailureReason.UNKNOWN)
    return SidecarError(reason, f"{message} ({code.name})")


def _reason_named(name: str) -> FailureReason:
    try:
        return FailureReason(name)
    except ValueError:
        return FailureReason.UNKNOWN


def _error_info(error: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The sidecar's ErrorInfo in a status's details, if it carries one."""
    try:
        status = grpc_rpc_status.from_call(error)  # type: ignore[arg-type]
    except (ValueError, AttributeError, TypeError):
        return None
    if status is None:
        return None
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Is(info.DESCRIPTOR) and detail.Unpack(info) and info.domain == ERROR_DOMAIN:
            return info
    return None
