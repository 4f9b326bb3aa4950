"""Overload (issue 27), end to end over scripted workers (tests/hostile_worker.py, honest
unless told otherwise): a frontend with two workers.

- A worker that fails every Generate of its own fault is ejected at the configured number of
  failures in a row (logged, counted); while it is out no call reaches it and every request
  succeeds on the other; after the backoff it is back on probation and takes one request at a
  time; once that probe succeeds it is restored (logged, counted).
- Workers that all answer busy: each refused request is retried on the other worker only
  while the retry budget allows, so the calls the workers see are bounded by the requests plus
  the budget; every client gets the busy 503, and the refusals are counted and logged.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import grpc
import pytest
import structlog.testing

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from sidecar_frontend.outliers import Outliers, OutlierSettings
from sidecar_frontend.registry import Worker
from sidecar_frontend.retry_budget import RetryBudget, RetryBudgetSettings
from sidecar_frontend.workers import WorkerSet
from tests.hostile_worker import HostileWorker
from tests.integration.frontend.fixtures import FrontendStack, frontend_over

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow(10)]

WAIT = 30.0
FAILURES = 3  # own-fault failures in a row that eject


class ScriptedWorker(HostileWorker):
    """An honest hostile worker whose Generate a test can make fail with a bare status
    (``fail_with``: the frontend types it as an engine's status) or hold until released
    (``hold``). ``arrivals`` counts every Generate that reached it; ``on_arrival`` is told of
    each as it arrives, and ``arrival`` is set (then replaced) at each."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_with: grpc.StatusCode | None = None
        self.hold: anyio.Event | None = None
        self.held = anyio.Event()
        self.arrivals = 0
        self.arrived_ids: list[str] = []
        self.on_arrival: Callable[[], None] = lambda: None
        self.arrival = anyio.Event()

    async def _generate(self, request: sidecar_pb2.PreprocessedRequest, context: Any) -> AsyncIterator[Any]:
        self.arrivals += 1
        self.arrived_ids.append(request.request_id)
        self.on_arrival()
        arrival, self.arrival = self.arrival, anyio.Event()
        arrival.set()
        if self.fail_with is not None:
            self._count("Generate")
            await context.abort(self.fail_with, "scripted failure")
        if self.hold is not None:
            self.held.set()
            await self.hold.wait()
        async for output in super()._generate(request, context):
            yield output


@asynccontextmanager
async def scripted_worker() -> AsyncIterator[ScriptedWorker]:
    worker = ScriptedWorker()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(worker.handlers())
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    worker.address = f"127.0.0.1:{port}"
    try:
        yield worker
    finally:
        await server.stop(None)


@asynccontextmanager
async def two_scripted() -> AsyncIterator[tuple[FrontendStack, ScriptedWorker, ScriptedWorker]]:
    async with (
        scripted_worker() as one,
        scripted_worker() as two,
        frontend_over([one.address, two.address], [], formats=(VLLM,)) as fe,
    ):
        yield fe, one, two


async def generate(fe: FrontendStack, rid: str) -> tuple[int, dict[str, Any]]:
    body = {"token_ids": [5, 6, 7], "request_id": rid, "sampling_params": {"max_tokens": 4}}
    with anyio.fail_after(WAIT):
        async with fe.http.post(fe.url + "/inference/v1/generate", json=body) as response:
            data: dict[str, Any] = await response.json()
    return response.status, data


async def until(done: Callable[[], bool], workers: WorkerSet, what: str) -> None:
    """Until ``done()``, woken by each change of the worker set (bounded)."""
    with anyio.fail_after(WAIT):
        while True:
            changed = workers.next_change()
            if done():
                return
            await changed.wait()
    raise AssertionError(what)


async def first_of(*events: anyio.Event) -> None:
    """Until one of ``events`` is set (bounded)."""
    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as group:

            async def wait(event: anyio.Event) -> None:
                await event.wait()
                group.cancel_scope.cancel()

            for event in events:
                group.start_soon(wait, event)


def sample(fe: FrontendStack, name: str, **labels: str) -> float:
    value = fe.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def frontend_worker(fe: FrontendStack, address: str) -> Worker:
    worker = fe.workers.get(address)
    assert worker is not None
    return worker


async def test_a_failing_worker_is_ejected_probed_with_one_request_and_restored() -> None:
    with structlog.testing.capture_logs() as logs:
        async with two_scripted() as (fe, bad, good):
            fe.workers.outliers = Outliers(
                OutlierSettings(consecutive_failures=FAILURES, first_ejection=1.0, max_ejection=2.0)
            )
            worker = frontend_worker(fe, bad.address)
            # Any call that reaches the bad worker while the frontend holds it out of routing.
            reached_while_out: list[float] = []

            def arrived() -> None:
                if worker.ejected_until is not None:
                    reached_while_out.append(worker.ejected_until)

            bad.on_arrival = arrived
            bad.fail_with = grpc.StatusCode.UNAVAILABLE  # the frontend reads CANNOT_CONNECT: its own fault

            # Requests one at a time until the bad worker failed FAILURES of them: each is
            # retried on the good worker, so every client succeeds.
            for n in range(200):
                if bad.arrivals >= FAILURES:
                    break
                status, data = await generate(fe, f"before-{n}")
                assert status == 200, data
            assert bad.arrivals == FAILURES
            ejected = [e for e in logs if e["event"] == "worker ejected"]
            assert [(e["worker"], e["failures"], e["reason"]) for e in ejected] == [
                (bad.address, FAILURES, "consecutive failures")
            ]
            assert sample(fe, "frontend_worker_ejections_total", reason="consecutive_failures") == 1

            # While it is out, every request goes to the good worker (as many as fit in the
            # ejection; the check above holds whatever the machine's speed).
            for n in range(10):
                if worker.ejected_until is None:
                    break
                status, data = await generate(fe, f"while-out-{n}")
                assert status == 200, data

            # Back after its backoff, on probation.
            await until(lambda: worker.eligible, fe.workers, "back in routing")
            assert worker.probation
            back = [e for e in logs if e["event"] == "worker back in routing after its ejection"]
            assert [(e["worker"], e["probation"]) for e in back] == [(bad.address, True)]

            # It behaves now, but holds its first call: that call is the probe, and while it is
            # in flight no other request goes there, however busy the other worker is (each
            # request below is held there too, so by load alone the probing one would win).
            bad.fail_with = None
            bad.hold = anyio.Event()
            statuses: list[int] = []

            async def one(rid: str, finished: anyio.Event) -> None:
                status, _ = await generate(fe, rid)
                statuses.append(status)
                finished.set()

            async with anyio.create_task_group() as group:
                for n in range(200):
                    finished = anyio.Event()
                    group.start_soon(one, f"probing-{n}", finished)
                    await first_of(finished, bad.held)
                    if bad.held.is_set():
                        break
                assert bad.held.is_set(), "no request went to the worker on probation"
                probes, elsewhere = bad.arrivals, good.arrivals
                good.hold = anyio.Event()
                for n in range(5):
                    next_arrival = (bad.arrival, good.arrival)
                    group.start_soon(one, f"during-probe-{n}", anyio.Event())
                    await first_of(*next_arrival)
                assert bad.arrivals == probes, "a worker on probation takes one call at a time"
                assert good.arrivals == elsewhere + 5
                assert worker.probation
                good.hold.set()
                bad.hold.set()
            assert statuses
            assert set(statuses) == {200}
            assert not worker.probation
            assert sample(fe, "frontend_worker_restorations_total") == 1
            assert reached_while_out == [], "a call reached the worker while it was out of routing"
    each_way = {"worker ejected", "worker back in routing after its ejection", "worker restored"}
    said = [e["event"] for e in logs if e.get("worker") == bad.address and e["event"] in each_way]
    assert said == ["worker ejected", "worker back in routing after its ejection", "worker restored"]


async def test_the_retry_budget_bounds_the_calls_a_busy_fleet_sees() -> None:
    requests = 10
    reserve = 2  # retries the budget allows with no success (min_per_second * window)
    window = 4096.0  # longer than any run of this test: the reserve never refills
    with structlog.testing.capture_logs() as logs:
        async with two_scripted() as (fe, one, two):
            fe.frontend.runner.retry_budget = RetryBudget(
                RetryBudgetSettings(ratio=0.5, min_per_second=reserve / window, window=window)
            )
            for worker in (one, two):
                worker.fail_with = grpc.StatusCode.RESOURCE_EXHAUSTED  # busy: OVERLOADED
            for n in range(requests):
                status, data = await generate(fe, f"busy-{n}")
                assert status == 503, data
            calls = one.arrivals + two.arrivals
            assert requests <= calls <= requests + reserve
            for worker in (one, two):
                assert len(set(worker.arrived_ids)) == worker.arrivals, "a busy worker is not asked again"
            assert set(one.arrived_ids) & set(two.arrived_ids), "the budget allowed a retry on the other one"
            refused = sample(fe, "frontend_retries_refused_total", format=VLLM.name)
            assert refused >= requests - reserve
            # Busy is no fault: nobody was ejected.
            assert {w.address for w in fe.workers.serving()} == {one.address, two.address}
            assert sample(fe, "frontend_worker_ejections_total", reason="consecutive_failures") == 0
    said = [e for e in logs if e["event"] == "retry refused: the retry budget is spent"]
    assert len(said) == refused
    assert {e["reason"] for e in said} == {"OVERLOADED"}


async def test_a_gone_workers_requests_are_retried_whatever_the_retry_budget() -> None:
    # The budget bounds what busy answers multiply; a worker that went away (UNAVAILABLE: its
    # connection broke, its engine stopped) leaves requests the rest of the fleet must take, and
    # a spent budget must not turn them into errors.
    async with two_scripted() as (fe, one, two):
        fe.frontend.runner.retry_budget = RetryBudget(
            RetryBudgetSettings(ratio=0.0, min_per_second=1 / 4096.0, window=4096.0)  # one retry, ever
        )
        one.fail_with = grpc.StatusCode.UNAVAILABLE
        for n in range(20):
            status, data = await generate(fe, f"gone-{n}")
            assert status == 200, data
        # Each call "one" took failed and was retried on "two": more retries than the budget's one.
        assert one.arrivals >= 2
        assert two.arrivals == 20
        assert sample(fe, "frontend_retries_refused_total", format=VLLM.name) == 0
