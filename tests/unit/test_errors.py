"""Both status tables, row by row: engine status -> typed error (docs/common.md), and typed
error -> frontend status with its ErrorInfo (docs/api.md)."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2

from sidecar_common.errors import (
    ENGINE_NOT_FOUND,
    SIDECAR_REASONS,
    EngineOrigin,
    FailureReason,
    SidecarError,
    engine_words,
    from_engine_status,
    from_rpc_error,
    invalid_argument,
    protocol_error,
    to_rpc_status,
)

R = FailureReason
C = grpc.StatusCode

# Written out by hand from the spec, not derived from the module's own table.
ENGINE_TO_REASON = {
    C.OK: R.UNKNOWN,
    C.CANCELLED: R.CANCELLED,
    C.UNKNOWN: R.UNKNOWN,
    C.INVALID_ARGUMENT: R.INVALID_ARGUMENT,
    C.DEADLINE_EXCEEDED: R.CONNECTION_TIMEOUT,
    C.NOT_FOUND: R.INVALID_ARGUMENT,
    C.ALREADY_EXISTS: R.INVALID_ARGUMENT,
    C.PERMISSION_DENIED: R.UNKNOWN,
    C.RESOURCE_EXHAUSTED: R.OVERLOADED,
    C.FAILED_PRECONDITION: R.INVALID_ARGUMENT,
    C.ABORTED: R.UNKNOWN,
    C.OUT_OF_RANGE: R.INVALID_ARGUMENT,
    C.UNIMPLEMENTED: R.UNKNOWN,
    C.INTERNAL: R.UNKNOWN,
    C.UNAVAILABLE: R.CANNOT_CONNECT,
    C.DATA_LOSS: R.UNKNOWN,
    C.UNAUTHENTICATED: R.UNKNOWN,
}

REASON_TO_FRONTEND = {
    R.INVALID_ARGUMENT: (C.INVALID_ARGUMENT, False),
    R.CANNOT_CONNECT: (C.UNAVAILABLE, True),
    R.CONNECTION_TIMEOUT: (C.DEADLINE_EXCEEDED, True),
    R.ENGINE_SHUTDOWN: (C.UNAVAILABLE, True),
    R.CANCELLED: (C.CANCELLED, False),
    R.OVERLOADED: (C.RESOURCE_EXHAUSTED, False),
    R.PROTOCOL_ERROR: (C.INTERNAL, False),
    R.UNKNOWN: (C.UNKNOWN, False),
    R.ENGINE_PAUSED: (C.UNAVAILABLE, False),
}


def test_the_tables_cover_every_status_code_and_every_reason() -> None:
    assert set(ENGINE_TO_REASON) == set(grpc.StatusCode)
    # Every reason but the frontend's own three, which no sidecar sends.
    assert set(REASON_TO_FRONTEND) == set(FailureReason) - {R.NO_WORKER, R.DEADLINE, R.NOT_STARTED}
    assert set(REASON_TO_FRONTEND) == SIDECAR_REASONS


@pytest.mark.parametrize("reason", [R.NO_WORKER, R.DEADLINE, R.NOT_STARTED])
def test_the_frontends_own_reasons_have_no_sidecar_status(reason: FailureReason) -> None:
    with pytest.raises(ValueError, match="the frontend's own reason"):
        to_rpc_status(SidecarError(reason, "m"))


@pytest.mark.parametrize(("code", "reason"), list(ENGINE_TO_REASON.items()), ids=lambda v: str(v))
def test_engine_status_maps_to_its_reason_keeping_the_rpc_and_engine_words(
    code: grpc.StatusCode, reason: FailureReason
) -> None:
    error = from_engine_status("Generate", code, "model is warming up")
    assert error.reason is reason
    if reason is R.INVALID_ARGUMENT:
        # A refusal: the engine's words are the message, unchanged; the call and the code
        # travel beside them.
        assert error.message == "model is warming up"
        assert error.origin == EngineOrigin("Generate", code.name)
    else:
        assert error.message == f"Generate: model is warming up ({code.name})"
        assert error.origin is None
    assert str(error) == f"Generate: model is warming up ({code.name})"


@pytest.mark.parametrize("details", ["", None])
def test_empty_engine_details_say_so(details: str | None) -> None:
    error = from_engine_status("GetModelInfo", C.INTERNAL, details)
    assert error.message == "GetModelInfo: engine error with no details (INTERNAL)"


def test_a_real_rpc_error_is_mapped_by_its_code_and_details() -> None:
    rpc_error = grpc.aio.AioRpcError(
        C.RESOURCE_EXHAUSTED,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details="queue full",
        debug_error_string=None,
    )
    error = from_rpc_error("Generate", rpc_error)
    assert error.reason is R.OVERLOADED
    assert error.message == "Generate: queue full (RESOURCE_EXHAUSTED)"


def test_an_rpc_error_without_a_status_is_unknown() -> None:
    error = from_rpc_error("Abort", grpc.RpcError())
    assert error.reason is R.UNKNOWN
    assert error.message == "Abort: engine error with no details (UNKNOWN)"


@pytest.mark.parametrize(
    ("reason", "frontend"), list(REASON_TO_FRONTEND.items()), ids=lambda v: getattr(v, "name", str(v))
)
def test_every_reason_has_its_frontend_code_migratable_flag_and_error_info(
    reason: FailureReason, frontend: tuple[grpc.StatusCode, bool]
) -> None:
    code, migratable = frontend
    error = SidecarError(reason, "what happened")
    assert error.code is code
    assert error.migratable is migratable

    status = to_rpc_status(error)
    assert status.code == code.value[0]
    assert status.message == "what happened"
    assert len(status.details) == 1
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert info.reason == reason.value
    assert info.domain == "sidecar"
    assert dict(info.metadata) == {"migratable": "true" if migratable else "false"}


def test_helpers_put_the_field_and_the_engine_first() -> None:
    bad = invalid_argument("sampling_options.temperature", "must be >= 0")
    assert bad.reason is R.INVALID_ARGUMENT
    assert bad.message == "sampling_options.temperature: must be >= 0"
    malformed = protocol_error("vllm", "token_ids missing")
    assert malformed.reason is R.PROTOCOL_ERROR
    assert malformed.message == "invalid vllm response: token_ids missing"


def test_a_refusal_in_the_engines_words_says_where_it_came_from_beside_them() -> None:
    words = (
        "Requested sample logprobs of 21, which is greater than max allowed: 20 "
        "(parameter=logprobs, value=21)"
    )
    error = from_engine_status("Generate", C.INVALID_ARGUMENT, words)
    status = to_rpc_status(error)
    assert status.code == C.INVALID_ARGUMENT.value[0]
    assert status.message == words
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert info.reason == "INVALID_ARGUMENT"
    assert dict(info.metadata) == {
        "migratable": "false",
        "origin": "engine",
        "engine_call": "Generate",
        "engine_status": "INVALID_ARGUMENT",
    }


def test_a_refusal_without_words_is_described_by_the_sidecar() -> None:
    error = from_engine_status("Generate", C.INVALID_ARGUMENT, "")
    assert error.message == "Generate: engine error with no details (INVALID_ARGUMENT)"
    assert error.origin is None


def test_engine_words_of_another_transport_keep_its_status() -> None:
    error = engine_words(R.OVERLOADED, "queue is full", "POST /generate", "503")
    assert (error.message, str(error)) == ("queue is full", "POST /generate: queue is full (503)")
    info = error_details_pb2.ErrorInfo()
    assert to_rpc_status(error).details[0].Unpack(info)
    assert info.metadata["engine_status"] == "503"
    assert info.metadata["origin"] == "engine"


@pytest.mark.parametrize(
    ("code", "not_found"),
    [
        (C.NOT_FOUND, True),  # vLLM's servicer for a VLLMNotFoundError (an adapter it cannot find)
        (C.INVALID_ARGUMENT, False),
        (C.FAILED_PRECONDITION, False),
    ],
)
def test_a_refusal_for_something_the_engine_lacks_keeps_its_code_for_the_frontend(
    code: grpc.StatusCode, not_found: bool
) -> None:
    error = from_engine_status("Generate", code, "No adapter found for /a/sql")
    assert error.reason is R.INVALID_ARGUMENT
    assert error.origin is not None
    assert (error.origin.status in ENGINE_NOT_FOUND) is not_found
    info = error_details_pb2.ErrorInfo()
    assert to_rpc_status(error).details[0].Unpack(info)
    assert info.metadata["engine_status"] == code.name
