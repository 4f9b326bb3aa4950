"""Abort by id: a call that asked its worker for one answer is not cancelled but given a
deadline, and the registry names it so its sidecar is told to abort it on the engine (whose
answer carries the tokens so far); every other sub-request is cancelled at once, as before."""

from __future__ import annotations

from typing import Any, cast

import anyio

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.attempt_runner import SubCall
from sidecar_frontend.attempts import Attempts
from sidecar_frontend.exchange import AbortRegistry, AnsweredAbort
from sidecar_frontend.formats.base import AbortCall
from sidecar_frontend.workers import Worker

WORKER = cast(Worker, object())


def _sub(public_id: str, index: int = 0) -> SubCall:
    request = sidecar_pb2.PreprocessedRequest(request_id=f"{public_id}-{index}", token_ids=[1, 2])
    return SubCall(public_id, index, Attempts(request, 3))


async def test_only_a_call_asking_for_one_answer_waits_for_it() -> None:
    registry = AbortRegistry()
    unary, streaming, between = _sub("job"), _sub("job", 1), _sub("other")
    for sub in (unary, streaming, between):
        registry.add(sub)
    unary.scope, streaming.scope = anyio.CancelScope(), anyio.CancelScope()
    unary_scope, streaming_scope = unary.scope, streaming.scope
    unary.unary_call = (WORKER, "job-0")
    count, answered = registry.abort(AbortCall(all_requests=True), now=100.0, grace=10.0)
    assert count == 3
    assert answered == [AnsweredAbort(unary, WORKER, "job-0")]
    assert all(sub.aborted for sub in (unary, streaming, between))
    assert not unary_scope.cancel_called
    assert unary_scope.deadline == 110.0
    assert streaming_scope.cancel_called


async def test_an_abort_by_id_reaches_only_that_id() -> None:
    registry = AbortRegistry()
    job, other = _sub("job"), _sub("other")
    registry.add(job)
    registry.add(other)
    count, answered = registry.abort(AbortCall(request_ids=("job",)), now=0.0, grace=10.0)
    assert (count, answered) == (1, [])
    assert job.aborted
    assert not other.aborted


def test_a_sub_request_between_calls_is_cancelled_even_if_it_last_asked_for_one_answer() -> None:
    sub: Any = _sub("job")
    sub.unary_call = (WORKER, "job-0")  # no scope: not in a call
    assert sub.abort_for_answer(0.0, 10.0) is None
    assert sub.aborted


def test_sglangs_abort_by_a_rid_in_flight_takes_every_rid_it_starts() -> None:
    registry = AbortRegistry()
    job, job2, other = _sub("job"), _sub("job-2"), _sub("jobless")
    for sub in (job, job2, other):
        registry.add(sub)
    count, _ = registry.abort(AbortCall(request_ids=("jo",), by_prefix=True), now=0.0, grace=10.0)
    assert count == 0  # names no request in flight: nothing, as SGLang's tokenizer manager
    assert not any(sub.aborted for sub in (job, job2, other))
    count, _ = registry.abort(AbortCall(request_ids=("job",), by_prefix=True), now=0.0, grace=10.0)
    assert count == 3
    assert job.aborted
    assert job2.aborted
    assert other.aborted  # "jobless" starts with "job" too, as in SGLang's scheduler
    exact = AbortRegistry()
    first, second = _sub("a"), _sub("ab")
    exact.add(first)
    exact.add(second)
    assert exact.abort(AbortCall(request_ids=("a",)), now=0.0, grace=10.0)[0] == 1  # vLLM's: exact
    assert not second.aborted


def test_the_ids_in_flight_are_a_view_every_request_shares_not_a_copy_each() -> None:
    # Every request's validation reads them (SGLang refuses a duplicate rid); a copy per
    # request costs in proportion to the requests in flight.
    registry = AbortRegistry()
    first, second = _sub("a"), _sub("b")
    registry.add(first)
    ids = registry.ids()
    registry.add(second)
    assert "b" in ids
    registry.discard(first)
    assert "a" not in ids
    assert sorted(ids) == ["b"]
