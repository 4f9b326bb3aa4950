"""The failure and refusal reasons, by name: the vocabulary of ``errors.py`` without its gRPC
side (the status table, the decoder), so a module that only names a reason loads no gRPC.
``sidecar_common.errors`` re-exports both enums; import them from either."""

from __future__ import annotations

import enum

__all__ = ["FailureReason", "RefusalReason"]


class FailureReason(enum.Enum):
    """Why a generation failed. The sidecars' reasons travel as the ErrorInfo ``reason`` of
    their status (docs/api.md); ``NO_WORKER``, ``DEADLINE`` and ``NOT_STARTED`` are the
    frontend's own and never travel."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    CANNOT_CONNECT = "CANNOT_CONNECT"
    CONNECTION_TIMEOUT = "CONNECTION_TIMEOUT"
    ENGINE_SHUTDOWN = "ENGINE_SHUTDOWN"
    CANCELLED = "CANCELLED"
    OVERLOADED = "OVERLOADED"
    PROTOCOL_ERROR = "PROTOCOL_ERROR"
    UNKNOWN = "UNKNOWN"
    # The engine refused a new request because its trainer paused generation (vLLM's
    # retryable "Generation is paused. Please retry after it resumes."): nothing was
    # delivered, the engine is not down, and the request may run once it (or another
    # worker) generates again.
    ENGINE_PAUSED = "ENGINE_PAUSED"
    # The frontend's own: no worker serves the request's model.
    NO_WORKER = "NO_WORKER"
    # The frontend's own: its --request-timeout-secs ran out.
    DEADLINE = "DEADLINE"
    # The frontend's own: the worker's gRPC server refused or dropped the call before its
    # sidecar took it (too many calls waiting to be picked up, or one waited too long), so no
    # engine saw the request. Retried, on the same worker too (errors.py, never_started).
    NOT_STARTED = "NOT_STARTED"


class RefusalReason(enum.Enum):
    """Why the frontend answered a generate request before any worker saw it (beside
    ``FailureReason.NO_WORKER``): the ``reason`` of its request metric and log line. Never
    travels on gRPC."""

    # The format refused the request (its body, a header, a parameter).
    INVALID_REQUEST = "INVALID_REQUEST"
    # No worker serves the model the request names.
    MODEL_NOT_FOUND = "MODEL_NOT_FOUND"
    # The body is over --max-body-bytes.
    BODY_TOO_LARGE = "BODY_TOO_LARGE"
    # No worker can serve because workers were refused for their role (the fleet's roles do
    # not fit together).
    MISCONFIGURED = "MISCONFIGURED"
    # Admission (sidecar_frontend/admission/): the request's priority band already holds
    # --max-queue-depth waiting requests (429).
    QUEUE_FULL = "QUEUE_FULL"
    # It waited --max-queue-wait-secs in the admission queue without a worker having room (429).
    QUEUE_TIMEOUT = "QUEUE_TIMEOUT"
    # It waited in a full band and was refused to make room for another tenant's request: its
    # tenant queued the most there (429).
    QUEUE_PUSHED_OUT = "QUEUE_PUSHED_OUT"
    # No worker of the model can take a request at all (503).
    NO_CAPACITY = "NO_CAPACITY"
    # Its tenant is over its requests or tokens per minute (--rate-limits file) (429).
    RATE_LIMITED = "RATE_LIMITED"
