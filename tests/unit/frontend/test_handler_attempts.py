"""The retry seam (attempts.next_attempt) and how a worker's failure is read."""

from __future__ import annotations

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import ErrorReason, SidecarError, to_rpc_status
from sidecar_frontend.attempts import MAX_ATTEMPTS, Attempt, Progress, failure_from_rpc_error, next_attempt
from sidecar_frontend.formats.base import WorkerFailure

REQUEST = sidecar_pb2.PreprocessedRequest(request_id="r", token_ids=[1, 2, 3])


def out(
    tokens: list[int], index: int = 0, finish: int = sidecar_pb2.UNSPECIFIED
) -> sidecar_pb2.LLMEngineOutput:
    return sidecar_pb2.LLMEngineOutput(token_ids=tokens, index=index, finish_reason=finish)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("reason", "migratable", "retried"),
    [
        ("CANNOT_CONNECT", True, True),
        ("ENGINE_SHUTDOWN", True, True),
        ("CONNECTION_TIMEOUT", True, True),
        ("OVERLOADED", False, True),  # another worker may have room
        ("INVALID_ARGUMENT", False, False),  # fails the same everywhere
        ("PROTOCOL_ERROR", False, False),
        ("UNKNOWN", False, False),
        ("CANCELLED", False, False),  # the frontend's own doing
        ("DEADLINE", False, False),
        ("NO_WORKER", False, False),
        ("SOMETHING_NEW", True, True),  # the sidecar says so
    ],
)
def test_before_the_first_output_a_failure_runs_again_only_where_another_worker_may_succeed(
    reason: str, migratable: bool, retried: bool
) -> None:
    attempt = next_attempt(REQUEST, Progress(), WorkerFailure(reason, "m", migratable), ["w1"])
    assert attempt == (Attempt(REQUEST, frozenset({"w1"})) if retried else None)


def test_after_any_output_nothing_runs_again() -> None:
    progress = Progress()
    progress.observe(out([]))  # even an empty chunk may have reached the client
    assert next_attempt(REQUEST, progress, WorkerFailure("CANNOT_CONNECT", "m", True), ["w1"]) is None


def test_only_one_retry() -> None:
    tried = [f"w{n}" for n in range(MAX_ATTEMPTS)]
    assert next_attempt(REQUEST, Progress(), WorkerFailure("CANNOT_CONNECT", "m", True), tried) is None


def test_progress_keeps_what_a_migration_would_need() -> None:
    progress = Progress()
    progress.observe(out([5, 6]))
    progress.observe(out([7], index=1))
    progress.observe(out([8], finish=sidecar_pb2.LENGTH))
    assert progress.tokens == {0: [5, 6, 8], 1: [7]}
    assert progress.finished == {0}
    assert progress.completion_tokens() == 4
    assert progress.delivered


def rpc_error(code: grpc.StatusCode, details: str, trailing: Metadata | None = None) -> AioRpcError:
    return AioRpcError(code, Metadata(), trailing or Metadata(), details, None)


@pytest.mark.parametrize("reason", list(ErrorReason))
def test_the_sidecars_error_info_gives_reason_and_migratable(reason: ErrorReason) -> None:
    error = SidecarError(reason, "it broke")
    status = to_rpc_status(error)
    trailing = Metadata(("grpc-status-details-bin", status.SerializeToString()))
    failure = failure_from_rpc_error(rpc_error(error.code, "it broke", trailing))
    assert failure == WorkerFailure(reason.value, "it broke", error.migratable)


@pytest.mark.parametrize(
    ("code", "reason", "migratable"),
    [
        (grpc.StatusCode.UNAVAILABLE, "CANNOT_CONNECT", True),  # the connection broke
        (grpc.StatusCode.DEADLINE_EXCEEDED, "CONNECTION_TIMEOUT", True),
        (grpc.StatusCode.CANCELLED, "CANCELLED", False),
        (grpc.StatusCode.INTERNAL, "UNKNOWN", False),
    ],
)
def test_a_status_without_error_info_is_typed_by_its_code(
    code: grpc.StatusCode, reason: str, migratable: bool
) -> None:
    failure = failure_from_rpc_error(rpc_error(code, "socket closed"))
    assert failure == WorkerFailure(reason, f"socket closed ({code.name})", migratable)


def test_error_info_of_another_domain_is_not_the_sidecars() -> None:
    from google.protobuf import any_pb2
    from google.rpc import error_details_pb2, status_pb2

    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason="QUOTA", domain="elsewhere"))
    status = status_pb2.Status(code=14, message="m", details=[detail])
    trailing = Metadata(("grpc-status-details-bin", status.SerializeToString()))
    failure = failure_from_rpc_error(rpc_error(grpc.StatusCode.UNAVAILABLE, "m", trailing))
    assert failure.reason == "CANNOT_CONNECT"
