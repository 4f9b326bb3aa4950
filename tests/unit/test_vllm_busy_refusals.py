"""A failed vLLM Generate: vLLM's busy refusals are OVERLOADED in vLLM's words; every other
UNAVAILABLE (gRPC's own texts for a call that never reached a live server) stays CANNOT_CONNECT.

The servicer ends Generate UNAVAILABLE with ``str(exc)`` of vLLM's QueueOverflowError and
MaxQueuedTokensError; gRPC's own UNAVAILABLE texts below are the ones grpc.aio 1.85 gives for a
refused connection, a server stopping under a live stream and a dropped socket.
"""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from hypothesis import given
from hypothesis import strategies as st
from testkit.vllm_engine import MAX_QUEUED_TOKENS_MESSAGE, QUEUE_OVERFLOW_MESSAGE

from sidecar_common.errors import (
    ORIGIN_ENGINE,
    EngineOrigin,
    FailureReason,
    from_engine_status,
    to_rpc_status,
)
from sidecar_vllm.refusals import BUSY_REFUSALS, generate_error

U = grpc.StatusCode.UNAVAILABLE
REFUSED = (
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:49325: "
    "Failed to connect to remote host: Connection refused"
)


@pytest.mark.parametrize("words", [QUEUE_OVERFLOW_MESSAGE, MAX_QUEUED_TOKENS_MESSAGE])
def test_a_busy_refusal_is_overloaded_in_the_engines_words(words: str) -> None:
    error = generate_error(U, words)
    assert error.reason is FailureReason.OVERLOADED
    assert error.message == words
    assert error.origin == EngineOrigin("Generate", "UNAVAILABLE")
    # The frontend reads it as a busy worker (not migratable: another may take it only while
    # nothing was delivered), the engine's words marked as such.
    status = to_rpc_status(error)
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert status.message == words
    assert not error.migratable
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert (info.reason, info.metadata["origin"]) == ("OVERLOADED", ORIGIN_ENGINE)


@pytest.mark.parametrize(
    ("code", "details", "reason"),
    [
        (U, REFUSED, FailureReason.CANNOT_CONNECT),
        (U, "Socket closed", FailureReason.CANNOT_CONNECT),
        (U, "Cancelling all calls", FailureReason.CANNOT_CONNECT),
        (U, "recvmsg:Connection reset by peer", FailureReason.CANNOT_CONNECT),
        (U, None, FailureReason.CANNOT_CONNECT),
        (U, "", FailureReason.CANNOT_CONNECT),
        # Only vLLM's sentence itself: a proxy's or a wrapper's text around it is not vLLM's.
        (U, "upstream: " + QUEUE_OVERFLOW_MESSAGE, FailureReason.CANNOT_CONNECT),
        (U, QUEUE_OVERFLOW_MESSAGE.upper(), FailureReason.CANNOT_CONNECT),
        # The sentence under another code is not the servicer's admission refusal.
        (grpc.StatusCode.INTERNAL, QUEUE_OVERFLOW_MESSAGE, FailureReason.UNKNOWN),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", FailureReason.OVERLOADED),
        (grpc.StatusCode.INVALID_ARGUMENT, "bad n", FailureReason.INVALID_ARGUMENT),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", FailureReason.CONNECTION_TIMEOUT),
    ],
)
def test_every_other_failure_reads_as_before(
    code: grpc.StatusCode, details: str | None, reason: FailureReason
) -> None:
    error = generate_error(code, details)
    assert error.reason is reason
    if reason is not FailureReason.INVALID_ARGUMENT:
        assert error.origin is None


def test_the_testkit_refuses_with_exactly_the_sentences_the_sidecar_recognises() -> None:
    assert frozenset({QUEUE_OVERFLOW_MESSAGE, MAX_QUEUED_TOKENS_MESSAGE}) == BUSY_REFUSALS


@given(st.sampled_from(list(grpc.StatusCode)), st.none() | st.text() | st.sampled_from(sorted(BUSY_REFUSALS)))
def test_only_a_busy_sentence_under_unavailable_differs_from_the_shared_table(
    code: grpc.StatusCode, details: str | None
) -> None:
    error = generate_error(code, details)
    if code is U and details in BUSY_REFUSALS:
        assert (error.reason, error.message) == (FailureReason.OVERLOADED, details)
        return
    shared = from_engine_status("Generate", code, details)
    assert (error.reason, error.message, error.origin) == (shared.reason, shared.message, shared.origin)
