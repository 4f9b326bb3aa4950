"""A Generate call that gRPC's server core refused or dropped before the sidecar took it
(issue 29): the table of what is and is not such a call, and how the one decoder types it."""

from __future__ import annotations

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata
from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.errors import (
    FAILURE_RULES,
    FailureReason,
    SidecarError,
    decode_rpc_error,
    never_started,
    to_rpc_status,
)

C = grpc.StatusCode
R = FailureReason

# gRPC core's own words (src/core/server/server.cc): the pending-call limits, and a message
# over the receiver's limit.
TOO_MANY_PENDING = "Too many pending requests for this server"
TOO_LARGE = "Received message larger than max (5000000 vs. 4194304)"


@pytest.mark.parametrize(
    ("code", "details", "error_info", "started", "expected"),
    [
        # The two ways core ends a call nobody picked up.
        (C.RESOURCE_EXHAUSTED, TOO_MANY_PENDING, False, False, True),
        (C.CANCELLED, "", False, False, True),
        # Outputs came: the sidecar took the call, whatever came after is its own answer.
        (C.RESOURCE_EXHAUSTED, TOO_MANY_PENDING, False, True, False),
        (C.CANCELLED, "", False, True, False),
        # A sidecar's own status always carries its ErrorInfo.
        (C.RESOURCE_EXHAUSTED, "engine queue full", True, False, False),
        (C.CANCELLED, "draining", True, False, False),
        # The request is too large: it would be on any worker, any time.
        (C.RESOURCE_EXHAUSTED, TOO_LARGE, False, False, False),
        # A broken connection or a deadline is typed by its code as before.
        (C.UNAVAILABLE, "Connection reset", False, False, False),
        (C.DEADLINE_EXCEEDED, "Deadline Exceeded", False, False, False),
        (C.INTERNAL, "", False, False, False),
    ],
)
def test_which_statuses_say_the_call_never_started(
    code: grpc.StatusCode, details: str, error_info: bool, started: bool, expected: bool
) -> None:
    assert never_started(code, details, error_info=error_info, started=started) is expected


@given(st.sampled_from(list(C)), st.text(max_size=40), st.booleans())
def test_a_started_call_or_one_the_sidecar_typed_is_never_unstarted(
    code: grpc.StatusCode, details: str, error_info: bool
) -> None:
    assert not never_started(code, details, error_info=error_info, started=True)
    assert not never_started(code, details, error_info=True, started=False)


def _bare(code: grpc.StatusCode, details: str) -> AioRpcError:
    return AioRpcError(code, Metadata(), Metadata(), details, None)


@pytest.mark.parametrize("code", [C.RESOURCE_EXHAUSTED, C.CANCELLED])
def test_the_decoder_types_an_unstarted_call_as_not_started(code: grpc.StatusCode) -> None:
    error = decode_rpc_error(_bare(code, TOO_MANY_PENDING), started=False)
    assert error.reason is R.NOT_STARTED
    assert TOO_MANY_PENDING in error.message
    # Run again, never migrated (nothing was delivered), never charged as busy.
    rule = FAILURE_RULES[R.NOT_STARTED]
    assert (rule.retried, rule.busy, rule.migratable) == (True, False, False)


@pytest.mark.parametrize(
    ("code", "reason"), [(C.RESOURCE_EXHAUSTED, R.OVERLOADED), (C.CANCELLED, R.ENGINE_SHUTDOWN)]
)
def test_from_an_older_sidecar_the_decoder_reads_as_before(
    code: grpc.StatusCode, reason: FailureReason
) -> None:
    # An older sidecar (it may fail a call it took with a bare status) is read as before.
    assert decode_rpc_error(_bare(code, TOO_MANY_PENDING)).reason is reason
    # So is a call that delivered outputs.
    assert decode_rpc_error(_bare(code, TOO_MANY_PENDING), started=True).reason is reason


def test_a_sidecars_own_busy_answer_stays_overloaded_before_any_output() -> None:
    status = to_rpc_status(SidecarError(R.OVERLOADED, "engine queue full"))
    trailing = Metadata(("grpc-status-details-bin", status.SerializeToString()))
    error = AioRpcError(C.RESOURCE_EXHAUSTED, Metadata(), trailing, "engine queue full", None)
    assert decode_rpc_error(error, started=False).reason is R.OVERLOADED
