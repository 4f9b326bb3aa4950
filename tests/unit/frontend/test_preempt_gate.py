"""The gate's side of preemption: the ticker pauses a running request for a more urgent one that
waited ``preempt_after``, and the paused request's readmission (shared by its sub-requests, no
deadline, taken out of the queue when its client leaves, refused when the frontend stops).
One model on one stand-in worker of one running slot; the gate's clock is the test's."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import anyio
import structlog.testing

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import RefusalReason
from sidecar_frontend.admission.gate import AdmissionObserver, Gate, Pass
from sidecar_frontend.admission.state import AdmissionSettings, Preemption, Refused
from sidecar_frontend.admission.who import Who
from sidecar_frontend.config import AdmissionConfig
from sidecar_frontend.registry import Worker
from tests.e2e_helpers import until

MODEL = "m"
AFTER = 0.5
LOW, OTHER, HIGH = Who("low", 0), Who("other", 0), Who("high", 5)


@dataclass
class StandInWorker:
    """What the gate reads of a worker. Never reporting load, it counts on the frontend's own
    requests only (capacity.py: every worker stale)."""

    address: str
    model: sidecar_pb2.ModelInfo
    inflight: int = 0
    reported_inflight: int = 0
    own_at_report: int = 0
    waiting_requests: int | None = None
    kv_usage: float | None = None
    load_reported_at: float | None = None


@dataclass
class OneWorker:
    worker: StandInWorker

    def eligible_of(self, role: str, model: str) -> list[Worker]:
        return [cast(Worker, self.worker)] if role == "agg" and model == MODEL else []

    def workers(self) -> list[Worker]:
        return [cast(Worker, self.worker)]

    def models(self) -> dict[str, object]:
        return {MODEL: self.worker.model}


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Told(AdmissionObserver):
    preemptions: list[tuple[str, Who]] = field(default_factory=list)

    def preempted(self, model: str, who: Who) -> None:
        self.preemptions.append((model, who))


@dataclass
class Fleet:
    gate: Gate
    clock: Clock
    told: Told
    group: Any

    def queued(self) -> dict[tuple[int, str], int]:
        return self.gate.queued().get(MODEL, {})

    def held(self) -> int:
        return self.gate.held().get(MODEL, 0)


@asynccontextmanager
async def fleet(slots: int = 1, preempt_after: float | None = AFTER) -> AsyncIterator[Fleet]:
    clock, told = Clock(), Told()
    view = OneWorker(StandInWorker("w:1", sidecar_pb2.ModelInfo(max_num_seqs=slots)))
    config = AdmissionConfig(
        settings=AdmissionSettings(max_queue_depth=8, max_queue_wait=60.0, headroom=0.0),
        tick=0.005,
        preempt_after=preempt_after,
    )
    gate = Gate(view, config, clock=clock, observer=told)
    async with anyio.create_task_group() as group:
        group.start_soon(gate.run_ticker)
        with anyio.fail_after(30):
            yield Fleet(gate, clock, told, group)
        group.cancel_scope.cancel()


async def admitted(fe: Fleet, who: Who) -> Pass:
    entered = await fe.gate.enter(MODEL, who, 10, 1)
    assert isinstance(entered, Pass)
    return entered


def later(fe: Fleet, job: Callable[[], Awaitable[Any]]) -> list[Any]:
    """Run ``job`` in the fleet's task group; its result lands in the list returned."""
    results: list[Any] = []

    async def run() -> None:
        results.append(await job())

    fe.group.start_soon(run)
    return results


class Stops:
    """A request's on_preempt: records each preemption."""

    def __init__(self) -> None:
        self.causes: list[Preemption] = []
        self.stopped = anyio.Event()

    def __call__(self, cause: Preemption) -> None:
        self.causes.append(cause)
        self.stopped.set()


async def test_a_request_that_waited_preempts_the_running_one_which_resumes_after_it() -> None:
    async with fleet() as fe:
        low = await admitted(fe, LOW)
        stops = Stops()
        low.allow_preemption(stops)
        high = later(fe, lambda: fe.gate.enter(MODEL, HIGH, 10, 1))
        await until(lambda: fe.queued() == {(5, "high"): 1}, "the urgent request waits")
        fe.clock.now = AFTER
        await stops.stopped.wait()
        assert stops.causes == [Preemption(urgency=0, waiting_urgency=5, waited=AFTER)]
        assert low.preemption == stops.causes[0]
        assert fe.told.preemptions == [(MODEL, LOW)]
        # Its request stopped: each of its sub-requests waits for the same readmission.
        resumed = [later(fe, low.readmit), later(fe, low.readmit)]
        await until(lambda: bool(high), "the urgent request is admitted")
        urgent = high[0]
        assert isinstance(urgent, Pass)
        assert fe.queued() == {(0, "low"): 1}
        assert fe.held() == 1
        fe.clock.now = 1e6  # a preempted request has no deadline
        urgent.release(20)
        await until(lambda: all(resumed), "the paused request is admitted again")
        assert resumed == [[True], [True]]
        assert low.preemption is None
        assert fe.held() == 1
        assert await low.readmit()  # not preempted: at once
        low.release(70)
        assert fe.held() == 0
        assert fe.told.preemptions == [(MODEL, LOW)]


async def test_only_a_request_whose_handler_allowed_it_is_preempted() -> None:
    async with fleet(slots=2) as fe:
        allowed = await admitted(fe, LOW)
        stops = Stops()
        allowed.allow_preemption(stops)
        # Admitted last, so the first choice were it allowed (the least work lost).
        not_allowed = await admitted(fe, OTHER)
        later(fe, lambda: fe.gate.enter(MODEL, HIGH, 10, 1))
        await until(lambda: fe.queued() == {(5, "high"): 1}, "the urgent request waits")
        fe.clock.now = AFTER
        await stops.stopped.wait()
        assert allowed.preemption is not None
        assert not_allowed.preemption is None


async def test_a_paused_request_whose_client_leaves_leaves_the_queue() -> None:
    async with fleet() as fe:
        low = await admitted(fe, LOW)
        stops = Stops()
        low.allow_preemption(stops)
        high = later(fe, lambda: fe.gate.enter(MODEL, HIGH, 10, 1))
        await until(lambda: fe.queued() == {(5, "high"): 1}, "the urgent request waits")
        fe.clock.now = AFTER
        await stops.stopped.wait()
        async with anyio.create_task_group() as waiting:
            waiting.start_soon(low.readmit)
            await until(lambda: bool(high), "the urgent request is admitted")
            waiting.cancel_scope.cancel()  # the client leaves while its request waits again
        low.release(None)
        assert fe.queued() == {}
        assert fe.held() == 1
        high[0].release(20)
        assert fe.held() == 0


async def test_a_paused_request_is_refused_when_the_frontend_stops() -> None:
    async with fleet() as fe:
        low = await admitted(fe, LOW)
        stops = Stops()
        low.allow_preemption(stops)
        high = later(fe, lambda: fe.gate.enter(MODEL, HIGH, 10, 1))
        await until(lambda: fe.queued() == {(5, "high"): 1}, "the urgent request waits")
        fe.clock.now = AFTER
        await stops.stopped.wait()
        resumed = later(fe, low.readmit)
        await until(lambda: bool(high), "the urgent request is admitted")
        fe.gate.close(Refused(RefusalReason.NO_CAPACITY, 1, "the frontend is shutting down"))
        await until(lambda: bool(resumed), "the paused request is answered")
        assert resumed == [False]
        assert not await low.readmit()
        low.release(None)
        assert fe.queued() == {}


async def test_a_request_preempted_as_the_frontend_stops_is_not_queued_again() -> None:
    async with fleet() as fe:
        low = await admitted(fe, LOW)
        stops = Stops()
        low.allow_preemption(stops)
        later(fe, lambda: fe.gate.enter(MODEL, HIGH, 10, 1))
        await until(lambda: fe.queued() == {(5, "high"): 1}, "the urgent request waits")
        fe.clock.now = AFTER
        await stops.stopped.wait()
        fe.gate.close(Refused(RefusalReason.NO_CAPACITY, 1, "the frontend is shutting down"))
        assert not await low.readmit()
        assert fe.queued() == {}
        low.release(None)
        assert fe.held() == 0


async def test_the_debug_lines_name_a_preemption_and_how_long_its_request_took_to_stop() -> None:
    async with fleet() as fe:
        low = await admitted(fe, LOW)
        stops = Stops()
        low.allow_preemption(stops)
        with structlog.testing.capture_logs() as logs:
            high = later(fe, lambda: fe.gate.enter(MODEL, HIGH, 10, 1))
            await until(lambda: fe.queued() == {(5, "high"): 1}, "the urgent request waits")
            fe.clock.now = AFTER
            await stops.stopped.wait()
            fe.clock.now = AFTER + 0.25  # its request takes a quarter second to stop
            resumed = later(fe, low.readmit)
            await until(lambda: bool(high), "the urgent request is admitted")
        (preempting,) = [e for e in logs if e["event"] == "preempting"]
        assert {k: preempting[k] for k in ("tenant", "urgency", "for_tenant", "for_urgency")} == {
            "tenant": "low",
            "urgency": 0,
            "for_tenant": "high",
            "for_urgency": 5,
        }
        assert preempting["waited_ms"] == round(AFTER * 1000, 3)
        (stopped,) = [e for e in logs if e["event"] == "preempted request stopped"]
        assert (stopped["tenant"], stopped["after_ms"]) == ("low", 250.0)
        urgent = high[0]
        assert isinstance(urgent, Pass)
        urgent.release(20)
        await until(lambda: bool(resumed), "the paused request is admitted again")
        low.release(20)
