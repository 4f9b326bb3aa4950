"""The WatchLoad streams' shared loop (sidecar_server.load_watch): one read of the load for
every stream, only while one is open; a slow stream holds up nobody and gets the latest; a
failed read sends nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import pytest
import structlog.testing
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_server.load_push import PushTiming
from sidecar_server.load_watch import LoadWatch

WAIT = 30.0
# Every read that succeeds is sent to every stream (no coalescing, no heartbeat to wait for):
# what each stream receives is then exactly what the loop read.
EVERY_READ = PushTiming(interval=0.0, heartbeat=0.0)

Outcome = int | SidecarError | RuntimeError


@dataclass
class Engine:
    """A load that the test hands out one read at a time: each permit is what one read
    returns (a report with that many requests in flight) or raises."""

    permits: MemoryObjectSendStream[Outcome]
    _permits: MemoryObjectReceiveStream[Outcome]
    reads: int = 0
    active: int = 0
    most_active: int = 0
    ended: anyio.Event = field(default_factory=anyio.Event)

    async def read(self) -> sidecar_pb2.LoadReport:
        self.reads += 1
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            outcome = await self._permits.receive()
        finally:
            self.active -= 1
            if self.active == 0:
                self.ended.set()
        if isinstance(outcome, Exception):
            raise outcome
        return sidecar_pb2.LoadReport(inflight_requests=outcome)


def engine() -> Engine:
    send, receive = anyio.create_memory_object_stream[Outcome](100)
    return Engine(send, receive)


@dataclass
class Stream:
    """One client's stream: what it was sent, and a gate its writes can be made to wait on."""

    got: list[int] = field(default_factory=list)
    gate: anyio.Event | None = None
    arrived: anyio.Event = field(default_factory=anyio.Event)
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)

    async def write(self, report: sidecar_pb2.LoadReport) -> None:
        self.got.append(report.inflight_requests)
        arrived, self.arrived = self.arrived, anyio.Event()
        arrived.set()
        if self.gate is not None:
            await self.gate.wait()

    async def until(self, count: int) -> None:
        with anyio.fail_after(WAIT):
            while len(self.got) < count:
                await self.arrived.wait()


def open_stream(tasks: TaskGroup, watch: LoadWatch, stream: Stream | None = None) -> Stream:
    stream = stream if stream is not None else Stream()

    async def run() -> None:
        with stream.scope:
            await watch.watch(stream.write)

    tasks.start_soon(run)
    return stream


@asynccontextmanager
async def watching(
    eng: Engine, timing: PushTiming = EVERY_READ
) -> AsyncIterator[tuple[LoadWatch, TaskGroup]]:
    watch = LoadWatch(eng.read, timing)
    try:
        async with anyio.create_task_group() as tasks:
            yield watch, tasks
            tasks.cancel_scope.cancel()
    finally:
        await watch.close(5.0)


async def test_one_loop_reads_for_every_stream_and_each_gets_the_first_report() -> None:
    eng = engine()
    async with watching(eng) as (watch, tasks):
        streams = [open_stream(tasks, watch) for _ in range(3)]
        await eng.permits.send(5)
        for stream in streams:
            await stream.until(1)
            assert stream.got == [5]
        # One read for the three, and never two at once: the loop's next read waits for the
        # next permit (one loop per stream would have started three).
        assert eng.reads <= 2
        assert eng.most_active == 1
        assert watch.watchers == 3
        await eng.permits.send(6)
        for stream in streams:
            await stream.until(2)
            assert stream.got == [5, 6]
        assert eng.most_active == 1


async def test_the_loop_runs_only_while_a_stream_is_open_and_a_later_stream_gets_nothing_read_before_it() -> (
    None
):
    eng = engine()
    async with watching(eng) as (watch, tasks):
        assert not watch.reading
        first = open_stream(tasks, watch)
        await eng.permits.send(1)
        await first.until(1)
        assert watch.reading
        first.scope.cancel()
        with anyio.fail_after(WAIT):
            # The loop's pending read is cancelled with it.
            await eng.ended.wait()
        assert not watch.reading
        assert watch.watchers == 0

        second = open_stream(tasks, watch)
        await eng.permits.send(2)
        await second.until(1)
        assert second.got == [2]  # not the 1 read while the first stream was open


async def test_a_slow_stream_holds_up_nobody_and_then_gets_the_latest_report() -> None:
    eng = engine()
    async with watching(eng) as (watch, tasks):
        slow = open_stream(tasks, watch, Stream(gate=anyio.Event()))
        fast = open_stream(tasks, watch)
        await eng.permits.send(1)
        await slow.until(1)  # and now stuck in its write
        for figure in (2, 3, 4):
            await eng.permits.send(figure)
            await fast.until(figure)
        assert fast.got == [1, 2, 3, 4]
        assert slow.gate is not None
        slow.gate.set()
        await slow.until(2)
        assert slow.got == [1, 4]  # the latest; what came between is gone


async def test_a_failed_read_sends_nothing_is_logged_once_and_reports_resume_after_it() -> None:
    eng = engine()
    with structlog.testing.capture_logs() as logs:
        async with watching(eng) as (watch, tasks):
            stream = open_stream(tasks, watch)
            await eng.permits.send(1)
            await stream.until(1)
            await eng.permits.send(SidecarError(FailureReason.CONNECTION_TIMEOUT, "vllm load: no answer"))
            await eng.permits.send(SidecarError(FailureReason.CANNOT_CONNECT, "vllm load: refused"))
            await eng.permits.send(2)
            await stream.until(2)
            # Nothing for the failed reads (a stream that re-sent the last report as a
            # heartbeat would have sent 1 again).
            assert stream.got == [1, 2]
    failed = [e for e in logs if e["event"].startswith("load not read")]
    assert [(e["log_level"], e["error"]) for e in failed] == [("warning", "vllm load: no answer")]
    assert [e["event"] for e in logs if e["event"].startswith("load readable again")] == [
        "load readable again: WatchLoad reports resume"
    ]


async def test_a_bug_in_the_read_is_logged_with_its_traceback_and_the_loop_goes_on() -> None:
    eng = engine()
    with structlog.testing.capture_logs() as logs:
        async with watching(eng) as (watch, tasks):
            stream = open_stream(tasks, watch)
            await eng.permits.send(RuntimeError("boom"))
            await eng.permits.send(3)
            await stream.until(1)
            assert stream.got == [3]
    (failed,) = [e for e in logs if e["event"].startswith("load not read")]
    assert failed["log_level"] == "error"
    assert failed["error"] == "RuntimeError: boom"
    assert isinstance(failed["exc_info"], RuntimeError)


async def test_unchanged_figures_are_restated_at_the_heartbeat_only() -> None:
    eng = engine()
    async with watching(eng, PushTiming(interval=0.0, heartbeat=3600.0)) as (watch, tasks):
        stream = open_stream(tasks, watch)
        for figure in (1, 1, 1, 2):
            await eng.permits.send(figure)
        await stream.until(2)
        # The two reads that found 1 again within the heartbeat sent nothing.
        assert stream.got == [1, 2]


@pytest.mark.parametrize("streams", [1, 4])
async def test_closing_stops_the_loop_whatever_streams_are_open(streams: int) -> None:
    eng = engine()
    watch = LoadWatch(eng.read, EVERY_READ)
    async with anyio.create_task_group() as tasks:
        opened = [open_stream(tasks, watch) for _ in range(streams)]
        await eng.permits.send(1)
        for stream in opened:
            await stream.until(1)
        await watch.close(5.0)
        assert not watch.reading
        with anyio.fail_after(WAIT):
            await eng.ended.wait()
        tasks.cancel_scope.cancel()
