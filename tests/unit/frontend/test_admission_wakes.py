"""What wakes a request waiting for admission at once, not at the ticker's next look (the tick
here is an hour): a load report that freed room (the engine's own queue emptied), and another
request's arrival after room grew with no event to announce it. One model on one stand-in
worker; the gate's clock is the test's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.admission.gate import Gate, Pass, WakeOnWorkerEvents
from sidecar_frontend.admission.state import AdmissionSettings, Refused
from sidecar_frontend.admission.who import Who
from sidecar_frontend.config import AdmissionConfig
from tests.e2e_helpers import until
from tests.unit.frontend.test_preempt_gate import LOW, MODEL, OTHER, Clock, OneWorker, StandInWorker

HOUR = 3600.0


@dataclass
class Fleet:
    gate: Gate
    worker: StandInWorker
    group: anyio.abc.TaskGroup
    looked: anyio.Event

    def queued(self) -> dict[tuple[int, str], int]:
        return self.gate.queued().get(MODEL, {})

    def enter_later(self, who: Who) -> list[Pass | Refused]:
        results: list[Pass | Refused] = []

        async def enter() -> None:
            results.append(await self.gate.enter(MODEL, who, 10, 1))

        self.group.start_soon(enter)
        return results


@asynccontextmanager
async def full_engine(slots: int) -> AsyncIterator[Fleet]:
    """A worker of ``slots`` running slots whose last (fresh) report says its engine has a
    request waiting in its own queue: admission counts it full (capacity.py)."""
    clock = Clock()
    worker = StandInWorker(
        "w:1",
        sidecar_pb2.ModelInfo(max_num_seqs=slots),
        waiting_requests=1,
        kv_usage=0.1,
        load_reported_at=0.0,
    )
    config = AdmissionConfig(
        settings=AdmissionSettings(max_queue_depth=8, max_queue_wait=HOUR, headroom=0.0), tick=HOUR
    )
    looked = anyio.Event()

    def on_backlog(waiting: bool) -> None:
        # Told before the ticker's first look at a new backlog, which it finishes with no
        # await: once the test runs again, the ticker sleeps for its hour.
        if waiting:
            looked.set()

    gate = Gate(OneWorker(worker), config, clock=clock, on_backlog=on_backlog)
    async with anyio.create_task_group() as group:
        group.start_soon(gate.run_ticker)
        with anyio.fail_after(30):
            yield Fleet(gate, worker, group, looked)
        group.cancel_scope.cancel()


async def test_a_load_report_that_frees_room_admits_the_waiting_request() -> None:
    async with full_engine(slots=1) as fe:
        waiting = fe.enter_later(LOW)
        await until(lambda: fe.queued() == {(0, "low"): 1}, "the request waits: the engine is full")
        await fe.looked.wait()
        fe.worker.waiting_requests = 0  # the next report: the engine's queue emptied
        WakeOnWorkerEvents(fe.gate).loaded(fe.worker)  # type: ignore[arg-type]
        await until(lambda: bool(waiting), "the request is admitted")
        (admitted,) = waiting
        assert isinstance(admitted, Pass)
        admitted.release(10)


async def test_an_arrival_admits_what_room_that_grew_unannounced_fits() -> None:
    async with full_engine(slots=2) as fe:
        first = fe.enter_later(LOW)
        await until(lambda: fe.queued() == {(0, "low"): 1}, "the request waits: the engine is full")
        await fe.looked.wait()
        # Its queue empties with nothing told (no listener wired here, as for a report that
        # aged, or the reserve shrinking with time): the next arrival finds the room.
        fe.worker.waiting_requests = 0
        second = fe.enter_later(OTHER)
        await until(lambda: bool(first) and bool(second), "both requests are admitted")
        for passed in (*first, *second):
            assert isinstance(passed, Pass)
            passed.release(10)
        assert fe.queued() == {}
