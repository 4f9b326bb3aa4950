"""A worker is not trusted: the checks of its Generate outputs (misbehaviour.OutputCheck), the
reading of its failed calls (attempts.read_rpc_error), what runs after it misbehaved
(attempts.Attempts), and the reporter (rate-limited log, counter, subscribers)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import grpc
import pytest
import structlog.testing
from google.protobuf import any_pb2
from google.rpc import status_pb2
from grpc.aio import AioRpcError, Metadata
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason, SidecarError, to_rpc_status
from sidecar_frontend.attempts import (
    Attempts,
    Refusal,
    RefusalReason,
    failure_from_rpc_error,
    misbehaved,
    read_rpc_error,
)
from sidecar_frontend.formats.base import WorkerFailure
from sidecar_frontend.misbehaviour import (
    GRPC_DECODE_FAILURE,
    NO_REPORTS,
    Fault,
    Misbehaviour,
    MisbehaviourReporter,
    OutputCheck,
    quiet_grpc_decode_failures,
)

_M = Misbehaviour
EOS, LENGTH, STOP = sidecar_pb2.EOS, sidecar_pb2.LENGTH, sidecar_pb2.STOP


def request(n: int | None = None, max_tokens: int | None = 5) -> sidecar_pb2.PreprocessedRequest:
    req = sidecar_pb2.PreprocessedRequest(request_id="r", token_ids=[1, 2, 3])
    if n is not None:
        req.sampling_options.n = n
    if max_tokens is not None:
        req.stop_conditions.max_tokens = max_tokens
    return req


def out(ids: Sequence[int] = (), index: int = 0, finish: int = 0) -> sidecar_pb2.LLMEngineOutput:
    return sidecar_pb2.LLMEngineOutput(token_ids=list(ids), index=index, finish_reason=finish)  # type: ignore[arg-type]


def first_fault(
    req: sidecar_pb2.PreprocessedRequest, outputs: Sequence[sidecar_pb2.LLMEngineOutput], vocab: int = 100
) -> tuple[int, Misbehaviour] | None:
    check = OutputCheck(req)
    for position, output in enumerate(outputs):
        fault = check.check(output, vocab)
        if fault is not None:
            return position, fault.kind
    return None


@pytest.mark.parametrize(
    ("req", "outputs", "vocab", "expected"),
    [
        (request(), [out([5]), out([6], finish=EOS)], 100, None),
        (request(), [out([99], finish=EOS)], 100, None),  # the largest id of the vocabulary
        (request(), [out([5]), out([100], finish=EOS)], 100, (1, _M.OUT_OF_VOCAB)),
        (request(), [out([2**32 - 1])], 100, (0, _M.OUT_OF_VOCAB)),
        (request(), [out([2**32 - 1], finish=EOS)], 0, None),  # vocab_size 0: not known, unchecked
        (request(), [out(finish=LENGTH)], 100, (0, _M.EMPTY_LENGTH)),
        # No budget: the engine's own from its context, which can be 0 (SGLang's scheduler).
        (request(max_tokens=None), [out(finish=LENGTH)], 100, None),
        (request(max_tokens=0), [out(finish=LENGTH)], 100, None),  # a prompt-only request
        (request(max_tokens=1), [out(finish=LENGTH)], 100, (0, _M.EMPTY_LENGTH)),
        (request(), [out([5]), out(finish=LENGTH)], 100, None),  # its tokens came before
        (request(), [out(finish=EOS)], 100, None),  # EOS at once: the model's own choice
        (request(), [out(finish=STOP)], 100, None),
        (request(), [out([5], index=1)], 100, (0, _M.BAD_INDEX)),
        (request(n=2), [out([5], index=1), out([6], index=0, finish=EOS)], 100, None),
        (request(n=2), [out([5], index=2)], 100, (0, _M.BAD_INDEX)),
        (request(), [out([5], finish=EOS), out([6])], 100, (1, _M.OUTPUT_AFTER_FINAL)),
        (request(n=2), [out([5], finish=EOS), out([6], index=1), out([7])], 100, (2, _M.OUTPUT_AFTER_FINAL)),
        # Per choice: choice 1's tokens do not make choice 0's empty LENGTH whole.
        (request(n=2), [out([5], index=1), out(index=0, finish=LENGTH)], 100, (1, _M.EMPTY_LENGTH)),
    ],
)
def test_output_checks(
    req: sidecar_pb2.PreprocessedRequest,
    outputs: list[sidecar_pb2.LLMEngineOutput],
    vocab: int,
    expected: tuple[int, Misbehaviour] | None,
) -> None:
    assert first_fault(req, outputs, vocab) == expected


def test_a_refused_output_is_not_recorded() -> None:
    check = OutputCheck(request())
    assert check.check(out([500]), 100) is not None
    # The refused output neither counted its tokens nor its terminal.
    assert check.check(out(finish=LENGTH), 100) == Fault(
        _M.EMPTY_LENGTH, "choice 0 ended LENGTH with no token"
    )


@st.composite
def honest_streams(
    draw: st.DrawFn,
) -> tuple[sidecar_pb2.PreprocessedRequest, int, list[sidecar_pb2.LLMEngineOutput]]:
    """A request, a vocabulary and any stream an honest worker may send for it: each choice's
    chunks of in-vocabulary ids, its terminal last, choices interleaved."""
    vocab = draw(st.integers(1, 2**32 - 1))
    n = draw(st.integers(1, 3))
    req = request(n=n if n > 1 else None, max_tokens=draw(st.none() | st.integers(0, 8)))
    per_choice: list[list[sidecar_pb2.LLMEngineOutput]] = []
    for index in range(n):
        chunks = draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3), max_size=4))
        outputs = [out(ids, index) for ids in chunks]
        budget_set = req.stop_conditions.HasField("max_tokens") and req.stop_conditions.max_tokens > 0
        finishes = [EOS, STOP, LENGTH] if chunks or not budget_set else [EOS, STOP]
        terminal_ids = draw(st.lists(st.integers(0, vocab - 1), max_size=2))
        finish = draw(st.sampled_from(finishes if not terminal_ids else [EOS, STOP, LENGTH]))
        outputs.append(out(terminal_ids, index, finish))
        per_choice.append(outputs)
    order = draw(st.permutations([i for i, outputs in enumerate(per_choice) for _ in outputs]))
    cursors = [0] * n
    stream = []
    for index in order:
        stream.append(per_choice[index][cursors[index]])
        cursors[index] += 1
    return req, vocab, stream


@given(honest_streams())
def test_no_honest_stream_is_refused(case: tuple[sidecar_pb2.PreprocessedRequest, int, list[Any]]) -> None:
    req, vocab, stream = case
    assert first_fault(req, stream, vocab) is None


@given(honest_streams(), st.data())
def test_any_id_at_or_past_the_vocabulary_is_refused_where_it_comes(
    case: tuple[sidecar_pb2.PreprocessedRequest, int, list[Any]], data: st.DataObject
) -> None:
    req, vocab, stream = case
    position = data.draw(st.integers(0, len(stream) - 1))
    bad = sidecar_pb2.LLMEngineOutput()
    bad.CopyFrom(stream[position])
    bad.token_ids.append(data.draw(st.integers(vocab, 2**32 - 1)))
    stream[position] = bad
    assert first_fault(req, stream, vocab) == (position, _M.OUT_OF_VOCAB)


# ---------------------------------------------------------------- failed calls


def rpc_error(details: bytes | None, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> AioRpcError:
    trailing = Metadata(("grpc-status-details-bin", details)) if details is not None else Metadata()
    return AioRpcError(code, Metadata(), trailing, "engine went away", None)


def status_with_error_info(value: bytes) -> bytes:
    detail = any_pb2.Any(type_url="type.googleapis.com/google.rpc.ErrorInfo", value=value)
    status = status_pb2.Status(
        code=grpc.StatusCode.UNAVAILABLE.value[0], message="engine went away", details=[detail]
    )
    return bytes(status.SerializeToString())


@pytest.mark.parametrize(
    "details",
    [b"\x0a\xff\xff\xff\x0f\x01", status_with_error_info(b"\x0a\xff\xff\xff\x0f\x01")],
    ids=["status", "error-info"],
)
def test_a_status_whose_details_do_not_decode_is_the_workers_fault(details: bytes) -> None:
    read = read_rpc_error(rpc_error(details))
    assert isinstance(read, Fault)
    assert read.kind is _M.UNDECODABLE_STATUS
    failure = failure_from_rpc_error(rpc_error(details), "10.0.0.1:50061")
    assert failure.reason is FailureReason.PROTOCOL_ERROR
    assert failure.misbehaved
    assert "10.0.0.1:50061" in failure.message


def test_a_status_that_decodes_is_read_as_the_sidecar_typed_it() -> None:
    error = SidecarError(FailureReason.ENGINE_SHUTDOWN, "engine went away")
    read = read_rpc_error(rpc_error(to_rpc_status(error).SerializeToString()))
    assert read == WorkerFailure(FailureReason.ENGINE_SHUTDOWN, "engine went away", True)
    # No details at all: typed by its code, as before.
    assert read_rpc_error(rpc_error(None)) == WorkerFailure(
        FailureReason.CANNOT_CONNECT, "engine went away (UNAVAILABLE)", True
    )


def test_a_misbehaving_worker_is_retried_elsewhere_before_any_output_and_never_migrated_after() -> None:
    failure = misbehaved("w:1", Fault(_M.OUT_OF_VOCAB, "token id 100000"))
    req = request()
    fresh = Attempts(req)
    assert fresh.after_failure(failure) is req
    limited = Attempts(req, migration_limit=0)
    assert limited.after_failure(failure) is req  # one retry even with migration off
    assert limited.after_failure(failure) == Refusal(RefusalReason.LIMIT)
    started = Attempts(req)
    started.delivered(out([5]))
    assert started.after_failure(failure) == Refusal(RefusalReason.NOT_MIGRATABLE)


# ---------------------------------------------------------------- the reporter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def reporter(interval: float = 60.0) -> tuple[MisbehaviourReporter, CollectorRegistry, Clock]:
    registry = CollectorRegistry()
    clock = Clock()
    return MisbehaviourReporter(registry, interval=interval, clock=clock), registry, clock


def counted(registry: CollectorRegistry, kind: Misbehaviour) -> float:
    value = registry.get_sample_value("frontend_worker_misbehaviour_total", {"kind": kind.value})
    return 0.0 if value is None else value


def test_a_worker_is_logged_once_per_kind_per_interval_and_counted_every_time() -> None:
    rep, registry, clock = reporter()
    with structlog.testing.capture_logs() as logs:
        for _ in range(5):
            rep.report("a:1", _M.UNDECODABLE_OUTPUT, "garbage")
        rep.report("a:1", _M.OUT_OF_VOCAB, "id 7")
        rep.report("b:1", _M.UNDECODABLE_OUTPUT, "garbage")
        clock.now += 59.9
        rep.report("a:1", _M.UNDECODABLE_OUTPUT, "garbage")
        clock.now += 0.1
        rep.report("a:1", _M.UNDECODABLE_OUTPUT, "garbage again")
    lines = [(e["worker"], e["kind"], e["unlogged"]) for e in logs if e["event"] == "worker misbehaved"]
    assert lines == [
        ("a:1", "undecodable_output", 0),
        ("a:1", "out_of_vocab", 0),
        ("b:1", "undecodable_output", 0),
        ("a:1", "undecodable_output", 5),
    ]
    assert all(e["log_level"] == "error" for e in logs)
    assert logs[-1]["detail"] == "garbage again"
    assert counted(registry, _M.UNDECODABLE_OUTPUT) == 8
    assert counted(registry, _M.OUT_OF_VOCAB) == 1
    assert counted(registry, _M.BAD_INDEX) == 0  # every kind's series exists from the start


def test_subscribers_are_told_every_report_until_they_unsubscribe() -> None:
    rep, _, _ = reporter()
    heard: list[tuple[str, Misbehaviour, str]] = []
    other: list[str] = []
    unsubscribe = rep.subscribe(lambda address, kind, detail: heard.append((address, kind, detail)))
    rep.subscribe(lambda address, kind, detail: other.append(address))
    rep.report("a:1", _M.ABSURD_LOAD, "NaN")
    rep.report("a:1", _M.ABSURD_LOAD, "NaN")  # not logged, still told
    unsubscribe()
    unsubscribe()  # twice is harmless
    rep.report("b:1", _M.HUNG_LOAD, "no answer")
    assert heard == [("a:1", _M.ABSURD_LOAD, "NaN")] * 2
    assert other == ["a:1", "a:1", "b:1"]


def test_a_failing_subscriber_is_logged_and_the_others_are_still_told() -> None:
    rep, _, _ = reporter()
    heard: list[str] = []

    def broken(address: str, kind: Misbehaviour, detail: str) -> None:
        raise RuntimeError("bug")

    rep.subscribe(broken)
    rep.subscribe(lambda address, kind, detail: heard.append(address))
    with structlog.testing.capture_logs() as logs:
        rep.report("a:1", _M.KV_RESYNC_STORM, "gap after every snapshot")
    assert heard == ["a:1"]
    failed = [e for e in logs if e["event"] == "misbehaviour subscriber failed"]
    assert len(failed) == 1
    assert failed[0]["worker"] == "a:1"
    assert failed[0]["log_level"] == "error"


def test_quiet_workers_are_forgotten_so_the_table_stays_bounded() -> None:
    rep, _, clock = reporter(interval=1.0)
    for index in range(100):
        rep.report(f"w{index}:1", _M.UNDECODABLE_LOAD, "garbage")
    clock.now += 4.0
    rep.report("w0:1", _M.UNDECODABLE_LOAD, "garbage")
    assert len(rep._logged) == 1


def test_no_reports_goes_nowhere() -> None:
    NO_REPORTS.report("a:1", _M.UNDECODABLE_OUTPUT, "garbage")  # nothing raised, nothing kept


def test_grpcs_own_line_for_an_undecodable_reply_is_dropped_and_its_other_lines_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    quiet_grpc_decode_failures()
    quiet_grpc_decode_failures()  # once is enough; twice changes nothing
    grpc_log = logging.getLogger("grpc._common")
    assert len(grpc_log.filters) == 1
    with caplog.at_level(logging.DEBUG, logger="grpc._common"):
        grpc_log.error(GRPC_DECODE_FAILURE)
        grpc_log.error("Exception serializing message!")
    assert [r.getMessage() for r in caplog.records] == ["Exception serializing message!"]
