"""How a failed vLLM ``Generate`` reads: a busy refusal or a transport failure (pure).

vLLM refuses a request it has no room for with an exception of its own (``QueueOverflowError``
past ``--max-num-queued-reqs``, ``MaxQueuedTokensError`` past ``--max-num-queued-tokens``),
which its HTTP server answers 503 and smg's servicer ends ``Generate`` with: gRPC UNAVAILABLE,
the exception's text as the details. gRPC itself also answers UNAVAILABLE when the call never
reached a live server (``failed to connect to all addresses; ...``, ``Socket closed``, a server
shutting down: ``Cancelling all calls``), and grpc.aio gives both the same shape: no initial
or trailing metadata, a debug string that only repeats the code and the details. So the text
is what tells them apart, and only vLLM's own refusal sentences are read as "busy": an
UNAVAILABLE with any other text stays a connection failure (CANNOT_CONNECT), as before.

A paused vLLM (``/pause`` in mode abort or wait) refuses each new request with a retryable
``RequestError`` (``vllm/v1/engine/core.py``, ``_reject_add_while_paused``), which the engine
client raises as ``RetryableRequestError`` and smg's servicer, not knowing it, ends INTERNAL
with its text. That exact text is ENGINE_PAUSED in vLLM's words: the engine is not failing.
"""

from __future__ import annotations

from typing import Final

import grpc

from sidecar_common.errors import FailureReason, SidecarError, engine_words, from_engine_status

__all__ = ["BUSY_REFUSALS", "PAUSED_REFUSAL", "generate_error"]

_CALL: Final = "Generate"

# The texts of vLLM 0.33's admission refusals (vllm/exceptions.py, both HTTP 503): the request
# queue is full, and the backlog of prompt tokens still in prefill is at its limit.
BUSY_REFUSALS: Final = frozenset(
    {
        "The engine is currently busy and cannot accept new requests. "
        "Please try again later or on a different instance.",
        "The engine has reached its prefill token backlog limit. "
        "Please try again later or on a different instance.",
    }
)

# vLLM 0.34's refusal of a new request while generation is paused.
PAUSED_REFUSAL: Final = "Generation is paused. Please retry after it resumes."


def generate_error(code: grpc.StatusCode, details: str | None) -> SidecarError:
    """The typed error of a failed ``Generate``: vLLM's busy refusal is OVERLOADED in vLLM's
    words (another worker may take the request); its paused refusal is ENGINE_PAUSED in its
    words; anything else as every engine status reads."""
    if details == PAUSED_REFUSAL and code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE):
        return engine_words(FailureReason.ENGINE_PAUSED, details, _CALL, code.name)
    if code is grpc.StatusCode.UNAVAILABLE and details in BUSY_REFUSALS:
        return engine_words(FailureReason.OVERLOADED, details, _CALL, code.name)
    return from_engine_status(_CALL, code, details)
