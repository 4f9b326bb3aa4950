"""What to run after a worker failed a sub-request, and how a worker's failure reads.

Pure: :func:`next_attempt` is the one place that decides whether a failed sub-request runs
again and where. Today: once more on another worker when nothing was delivered yet (the
client has seen nothing, so nothing can be duplicated). Migration of a generation that had
already delivered tokens plugs in here: :class:`Progress` keeps what it needs (the tokens
each choice delivered, which choices finished).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import ENGINE_STATUS_TO_REASON, ERROR_DOMAIN, FRONTEND_STATUS, ErrorReason
from sidecar_frontend.formats.base import WorkerFailure

__all__ = ["MAX_ATTEMPTS", "Attempt", "Progress", "failure_from_rpc_error", "next_attempt"]

# The first try and one retry on another worker.
MAX_ATTEMPTS: Final = 2
# Failures another worker may not repeat: the worker or its engine is gone or busy. A bad
# request (INVALID_ARGUMENT) would fail anywhere; CANCELLED is the frontend's own doing.
_RETRYABLE: Final = frozenset(
    {
        ErrorReason.CANNOT_CONNECT.value,
        ErrorReason.CONNECTION_TIMEOUT.value,
        ErrorReason.ENGINE_SHUTDOWN.value,
        ErrorReason.OVERLOADED.value,
    }
)


@dataclass
class Progress:
    """What one sub-request has delivered to the encoder so far, over every attempt."""

    outputs: int = 0
    tokens: dict[int, list[int]] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)

    def observe(self, output: sidecar_pb2.LLMEngineOutput) -> None:
        self.outputs += 1
        index = output.index
        if output.token_ids:
            self.tokens.setdefault(index, []).extend(output.token_ids)
        if output.finish_reason != sidecar_pb2.UNSPECIFIED:
            self.finished.add(index)

    @property
    def delivered(self) -> bool:
        return self.outputs > 0

    def completion_tokens(self) -> int:
        return sum(len(t) for t in self.tokens.values())


@dataclass(frozen=True)
class Attempt:
    request: sidecar_pb2.PreprocessedRequest
    exclude: frozenset[str] = frozenset()  # worker addresses not to use


def next_attempt(
    request: sidecar_pb2.PreprocessedRequest,
    progress: Progress,
    failure: WorkerFailure,
    tried: Sequence[str],
) -> Attempt | None:
    """The attempt to run after ``failure`` on the workers ``tried`` (in order), or None:
    report the failure through the encoder."""
    if progress.delivered or len(tried) >= MAX_ATTEMPTS:
        return None
    if failure.reason not in _RETRYABLE and not failure.migratable:
        return None
    return Attempt(request, frozenset(tried))


def failure_from_rpc_error(error: grpc.RpcError) -> WorkerFailure:
    """A failed Generate call as the sidecar typed it (its ``google.rpc.ErrorInfo``: reason
    and ``migratable``); a status without one (the connection broke, a proxy answered) is
    typed by its code, as the sidecars type an engine's."""
    code_fn = getattr(error, "code", None)
    details_fn = getattr(error, "details", None)
    code = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    details = details_fn() if callable(details_fn) else None
    message = details if isinstance(details, str) and details else "worker error with no details"
    info = _error_info(error)
    if info is not None:
        return WorkerFailure(info.reason, message, info.metadata.get("migratable") == "true")
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    reason = ENGINE_STATUS_TO_REASON.get(code, ErrorReason.UNKNOWN)
    name = code.name
    return WorkerFailure(reason.value, f"{message} ({name})", FRONTEND_STATUS[reason].migratable)


def _error_info(error: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
    except (ValueError, AttributeError, TypeError):
        return None
    if status is None:
        return None
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Is(info.DESCRIPTOR) and detail.Unpack(info) and info.domain == ERROR_DOMAIN:
            return info
    return None
