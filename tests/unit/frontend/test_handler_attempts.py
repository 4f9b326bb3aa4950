"""The retry seam (attempts.Attempts: retry before the first output, migration after) and
how a worker's failure is read."""

from __future__ import annotations

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import (
    SIDECAR_REASONS,
    FailureReason,
    SidecarError,
    from_engine_status,
    to_rpc_status,
)
from sidecar_frontend.attempts import (
    Attempts,
    Finish,
    Progress,
    Refusal,
    RefusalReason,
    failure_from_rpc_error,
)
from sidecar_frontend.formats.base import WorkerFailure

REQUEST = sidecar_pb2.PreprocessedRequest(request_id="r", token_ids=[1, 2, 3])
REQUEST.stop_conditions.max_tokens = 5


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
        ("UNKNOWN", True, True),  # the sidecar says so (a reason this version does not know)
    ],
)
def test_before_the_first_output_a_failure_runs_again_only_where_another_worker_may_succeed(
    reason: str, migratable: bool, retried: bool
) -> None:
    following = Attempts(REQUEST).after_failure(WorkerFailure(FailureReason(reason), "m", migratable))
    assert following == (REQUEST if retried else Refusal(RefusalReason.NOT_MIGRATABLE))


@pytest.mark.parametrize(
    ("reason", "patient"),
    [
        ("CANNOT_CONNECT", True),  # the worker may come back, or another may be started
        ("ENGINE_SHUTDOWN", True),
        ("CONNECTION_TIMEOUT", True),
        ("OVERLOADED", False),  # the worker is there, busy: answer now if none other serves
    ],
)
def test_a_retry_after_a_busy_worker_neither_waits_nor_goes_back_to_it(reason: str, patient: bool) -> None:
    attempts = Attempts(REQUEST)
    assert attempts.patient, "the first attempt: the handler waits for no worker anyway"
    attempts.after_failure(WorkerFailure(FailureReason(reason), "m", reason != "OVERLOADED"))
    assert attempts.patient is patient


def test_patience_follows_the_last_failure() -> None:
    attempts = Attempts(REQUEST)
    attempts.after_failure(WorkerFailure(FailureReason.OVERLOADED, "m", False))
    attempts.after_failure(WorkerFailure(FailureReason.CANNOT_CONNECT, "m", True))
    assert attempts.patient


def test_before_the_first_output_n_choices_and_guided_requests_are_retried_too() -> None:
    request = sidecar_pb2.PreprocessedRequest(request_id="r", token_ids=[1])
    request.sampling_options.n = 2
    assert Attempts(request).after_failure(WorkerFailure(FailureReason.CANNOT_CONNECT, "m", True)) == request


def test_one_retry_before_the_first_output_even_with_migration_off() -> None:
    attempts = Attempts(REQUEST, migration_limit=0)
    failure = WorkerFailure(FailureReason.CANNOT_CONNECT, "m", True)
    assert attempts.after_failure(failure) == REQUEST
    assert attempts.after_failure(failure) == Refusal(RefusalReason.LIMIT)


def test_after_an_output_a_migratable_failure_continues_from_the_delivered_tokens() -> None:
    attempts = Attempts(REQUEST)
    attempts.delivered(out([7, 8]))
    following = attempts.after_failure(WorkerFailure(FailureReason.ENGINE_SHUTDOWN, "m", True))
    assert isinstance(following, sidecar_pb2.PreprocessedRequest)
    assert list(following.token_ids) == [1, 2, 3, 7, 8]
    assert following.stop_conditions.max_tokens == 3
    assert attempts.moves == 1


def test_after_an_output_a_failure_not_marked_migratable_is_reported() -> None:
    attempts = Attempts(REQUEST)
    attempts.delivered(out([]))  # even an empty chunk may have reached the client
    following = attempts.after_failure(WorkerFailure(FailureReason.OVERLOADED, "m", False))
    assert following == Refusal(RefusalReason.NOT_MIGRATABLE)


def test_retries_and_migrations_share_the_limit() -> None:
    attempts = Attempts(REQUEST, migration_limit=2)
    failure = WorkerFailure(FailureReason.CANNOT_CONNECT, "m", True)
    assert attempts.after_failure(failure) == REQUEST
    attempts.delivered(out([7]))
    assert isinstance(attempts.after_failure(failure), sidecar_pb2.PreprocessedRequest)
    attempts.delivered(out([8]))
    assert attempts.after_failure(failure) == Refusal(RefusalReason.LIMIT)


def test_a_failure_after_the_whole_budget_ends_with_a_length_terminal() -> None:
    attempts = Attempts(REQUEST)
    attempts.delivered(out([1, 2, 3, 4, 5]))
    following = attempts.after_failure(WorkerFailure(FailureReason.CANNOT_CONNECT, "m", True))
    assert isinstance(following, Finish)
    terminal = attempts.finish(following)
    assert terminal.finish_reason == sidecar_pb2.LENGTH
    assert terminal.completion_usage.completion_tokens == 5
    assert attempts.complete


def test_a_finished_request_never_runs_again() -> None:
    attempts = Attempts(REQUEST)
    attempts.delivered(out([4], finish=sidecar_pb2.EOS))
    assert attempts.complete
    following = attempts.after_failure(WorkerFailure(FailureReason.CANNOT_CONNECT, "m", True))
    assert following == Refusal(RefusalReason.FINISHED)


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


@pytest.mark.parametrize("reason", [r for r in FailureReason if r in SIDECAR_REASONS])
def test_the_sidecars_error_info_gives_reason_and_migratable(reason: FailureReason) -> None:
    error = SidecarError(reason, "it broke")
    status = to_rpc_status(error)
    trailing = Metadata(("grpc-status-details-bin", status.SerializeToString()))
    failure = failure_from_rpc_error(rpc_error(error.code, "it broke", trailing))
    assert failure == WorkerFailure(reason, "it broke", error.migratable)


def test_a_reason_this_version_does_not_know_is_unknown_keeping_its_migratable_flag() -> None:
    from google.protobuf import any_pb2
    from google.rpc import error_details_pb2, status_pb2

    detail = any_pb2.Any()
    info = error_details_pb2.ErrorInfo(
        reason="SOMETHING_NEW", domain="sidecar", metadata={"migratable": "true"}
    )
    detail.Pack(info)
    status = status_pb2.Status(code=14, message="m", details=[detail])
    trailing = Metadata(("grpc-status-details-bin", status.SerializeToString()))
    failure = failure_from_rpc_error(rpc_error(grpc.StatusCode.UNAVAILABLE, "m", trailing))
    assert failure == WorkerFailure(FailureReason.UNKNOWN, "m", True)
    # Retried as the sidecar's flag says.
    assert Attempts(REQUEST).after_failure(failure) == REQUEST


@pytest.mark.parametrize(
    ("code", "words", "not_found"),
    [
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            "Requested sample logprobs of 21, which is greater than max allowed: 20 "
            "(parameter=logprobs, value=21)",
            False,
        ),
        # vLLM's gRPC servicer ends a VLLMNotFoundError (e.g. a LoRA adapter it cannot load)
        # with NOT_FOUND.
        (grpc.StatusCode.NOT_FOUND, "Loading lora sql failed: No adapter found for /a/sql", True),
    ],
)
def test_an_engine_refusal_arrives_in_the_engines_words_with_what_the_engine_answered(
    code: grpc.StatusCode, words: str, not_found: bool
) -> None:
    error = from_engine_status("Generate", code, words)
    status = to_rpc_status(error)
    trailing = Metadata(("grpc-status-details-bin", status.SerializeToString()))
    failure = failure_from_rpc_error(rpc_error(error.code, words, trailing))
    assert failure == WorkerFailure(
        FailureReason.INVALID_ARGUMENT, words, False, from_engine=True, engine_status=code.name
    )
    assert failure.not_found is not_found


def test_only_the_engines_own_words_carry_its_status() -> None:
    # The sidecar's own refusal names no engine status, whatever its message says.
    assert not WorkerFailure(FailureReason.INVALID_ARGUMENT, "m", engine_status="NOT_FOUND").not_found
    assert WorkerFailure(FailureReason.INVALID_ARGUMENT, "m", from_engine=True, engine_status="404").not_found


@pytest.mark.parametrize(
    ("code", "reason", "migratable"),
    [
        (grpc.StatusCode.UNAVAILABLE, "CANNOT_CONNECT", True),  # the connection broke
        (grpc.StatusCode.DEADLINE_EXCEEDED, "CONNECTION_TIMEOUT", True),
        (grpc.StatusCode.INTERNAL, "UNKNOWN", False),
    ],
)
def test_a_status_without_error_info_is_typed_by_its_code(
    code: grpc.StatusCode, reason: str, migratable: bool
) -> None:
    failure = failure_from_rpc_error(rpc_error(code, "socket closed"))
    assert failure == WorkerFailure(FailureReason(reason), f"socket closed ({code.name})", migratable)


def test_a_bare_cancelled_status_is_the_worker_stopping_and_migratable() -> None:
    # The frontend's own cancels never surface as a status; a worker's server stopping does.
    failure = failure_from_rpc_error(rpc_error(grpc.StatusCode.CANCELLED, "server shutdown"))
    assert failure == WorkerFailure(
        FailureReason.ENGINE_SHUTDOWN, "server shutdown (CANCELLED by the worker)", True
    )


def test_error_info_of_another_domain_is_not_the_sidecars() -> None:
    from google.protobuf import any_pb2
    from google.rpc import error_details_pb2, status_pb2

    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason="QUOTA", domain="elsewhere"))
    status = status_pb2.Status(code=14, message="m", details=[detail])
    trailing = Metadata(("grpc-status-details-bin", status.SerializeToString()))
    failure = failure_from_rpc_error(rpc_error(grpc.StatusCode.UNAVAILABLE, "m", trailing))
    assert failure.reason is FailureReason.CANNOT_CONNECT
