"""The hot path: engine stream -> bounded buffer -> coalescing writer -> frontend.

One task (the pump) reads the engine stream into a small bounded buffer; the writer (the
Generate handler) takes whatever is buffered, merges it per choice and sends it. The writer
never waits to fill a message, so an idle frontend gets each chunk as it comes and a busy
one gets fewer, fuller messages. The bounded buffer is the backpressure: when the frontend
does not drain, the pump stops reading the engine.

Cleanup follows the abort rule of :mod:`sidecar_server.dispatch`: abort once (unless every
terminal arrived), then close the engine stream. With the decode hold, a cancel before the
first token lets the pump keep draining (discarding) until a token, a terminal, an error or
the hold timeout, and only then aborts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import structlog

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_server.coalesce import coalesce
from sidecar_server.dispatch import ChoiceTracker, Generation, run_to_completion
from sidecar_server.metrics import Metrics

__all__ = ["EngineActivity", "RelayConfig", "Write", "relay"]

_log = structlog.get_logger(__name__)

Write = Callable[[sidecar_pb2.LLMEngineOutput], Awaitable[None]]


@dataclass
class EngineActivity:
    """Engine messages relayed since the sidecar started: the health watch's evidence that an
    engine whose health check is late is busy, not gone (sidecar_server.engine_health)."""

    messages: int = 0


@dataclass(frozen=True)
class RelayConfig:
    capacity: int = 32  # engine chunks buffered before the pump stops reading
    hold_timeout: float = 30.0  # decode hold: how long a cancel waits for the first token
    drain_grace: float = 5.0  # after the last terminal, how long the engine iterator may take to end
    # Under load: loop turns before taking the buffer, then more while chunks keep coming
    # (an engine burst is still being read: the next turns likely merge more), up to
    # max_busy_turns, stopping once `patience` turns in a row brought nothing. One grpc.aio
    # read takes 2-3 turns to complete (op, poller thread, loop), hence patience 2; measured
    # at 256 streams K=1: tokens/msg ~1.2 with 2 fixed turns, ~2.5 with (3, 8, 2).
    busy_turns: int = 3
    max_busy_turns: int = 8
    patience: int = 2
    # Counts every engine message relayed (one counter per sidecar, shared by its calls).
    activity: EngineActivity = field(default_factory=EngineActivity)


class _Buffer:
    """A bounded FIFO from the pump to the writer.

    Plain asyncio futures rather than anyio events or memory streams: this runs once per
    engine chunk, and anyio's per-call backend lookup and checkpoints cost more than the
    queueing itself. Cancellation is unchanged: a cancelled waiter's future is cancelled
    with it, and wakers skip futures already done.
    """

    __slots__ = ("_capacity", "_data", "_items", "_loop", "_space", "detached", "ended")

    def __init__(self, capacity: int) -> None:
        self._items: list[sidecar_pb2.LLMEngineOutput] = []
        self._capacity = capacity
        self._loop = asyncio.get_running_loop()
        self.ended = False  # the pump is done: nothing more will come
        # Nobody reads any more: the pump discards and, with the decode hold, stops at the
        # first token instead of blocking on a full buffer.
        self.detached = False
        self._data: asyncio.Future[None] | None = None  # the writer waits for an item
        self._space: asyncio.Future[None] | None = None  # the pump waits for room

    def __len__(self) -> int:
        return len(self._items)

    @property
    def full(self) -> bool:
        return len(self._items) >= self._capacity

    async def put(self, item: sidecar_pb2.LLMEngineOutput) -> bool:
        """Queue one chunk; False (and nothing queued) once the writer is gone."""
        while len(self._items) >= self._capacity and not self.detached:
            self._space = self._loop.create_future()
            await self._space
        if self.detached:
            return False
        self._items.append(item)
        data = self._data
        if data is not None:
            self._data = None
            if not data.done():
                data.set_result(None)
        return True

    async def wait(self) -> bool:
        """Wait for a chunk; False once the pump ended and everything was taken, or once
        the relay is stopping (detached)."""
        while not self._items:
            if self.ended or self.detached:
                return False
            self._data = self._loop.create_future()
            await self._data
        return True

    def take(self) -> list[sidecar_pb2.LLMEngineOutput]:
        items, self._items = self._items, []
        self._wake_pump()
        return items

    def end(self) -> None:
        self.ended = True
        self._wake_writer()

    def detach(self) -> None:
        self.detached = True
        self._items.clear()
        self._wake_pump()
        self._wake_writer()

    def _wake_writer(self) -> None:
        data = self._data
        if data is not None:
            self._data = None
            if not data.done():
                data.set_result(None)

    def _wake_pump(self) -> None:
        space = self._space
        if space is not None:
            self._space = None
            if not space.done():
                space.set_result(None)


async def _pump(
    gen: Generation,
    buffer: _Buffer,
    scope: anyio.CancelScope,
    metrics: Metrics | None,
    activity: EngineActivity,
) -> None:
    with scope:
        try:
            tracker = gen.tracker
            put = buffer.put
            async for out in gen.stream():
                activity.messages += 1
                tracker.observe(out)
                if not await put(out) and tracker.saw_token_or_terminal:
                    return
            if not gen.complete:
                gen.fail(gen.ended_early())
        except SidecarError as exc:
            gen.fail(exc)
        except Exception as exc:
            # An engine adapter bug: logged and counted as one, and it must still end the
            # call with a typed status and an abort.
            _log.error(
                "internal error",
                where="engine_generate",
                private_id=gen.private_id,
                error=repr(exc),
                exc_info=exc,
            )
            if metrics is not None:
                metrics.internal_error("engine_generate")
            gen.fail(
                SidecarError(
                    FailureReason.UNKNOWN, f"{gen.engine.name} generate: {type(exc).__name__}: {exc}"
                )
            )
        finally:
            buffer.end()


async def _gather_turns(buffer: _Buffer, least: int, most: int, patience: int) -> None:
    """Let the loop turn ``least`` times, then on until ``patience`` turns in a row queued
    nothing (at most ``most`` turns, never past a full buffer). A turn is one event-loop
    iteration: microseconds when the loop is idle, long only when the loop is busy, which is
    exactly when merging pays. No timer, so an idle stream is never held back long."""
    queued = len(buffer)
    turns = idle = 0
    while turns < most and not buffer.full:
        await asyncio.sleep(0)
        turns += 1
        now = len(buffer)
        idle = idle + 1 if now == queued else 0
        queued = now
        if turns >= least and idle >= patience:
            return


async def _write_loop(
    buffer: _Buffer,
    write: Write,
    tracker: ChoiceTracker,
    config: RelayConfig,
    under_load: Callable[[], bool] | None,
    metrics: Metrics | None,
    started_at: float,
) -> None:
    backlog = False
    last_sent: float | None = None
    delivered = tracker.delivered
    while await buffer.wait():
        # A writer that wakes for each chunk usually finds only that one queued. When the
        # frontend is slower than the engine (backlog) or the sidecar is busy, a loop turn
        # or a few let the pump queue what has already arrived, so the next message carries
        # more. No timer: when idle, a chunk goes out as soon as it comes.
        if under_load is not None and under_load():
            await _gather_turns(
                buffer, config.busy_turns, max(config.max_busy_turns, config.busy_turns), config.patience
            )
        elif backlog:
            await _gather_turns(buffer, 1, 1, 1)
        batch = buffer.take()
        backlog = len(batch) > 1
        msgs = coalesce(batch) if backlog else batch
        for msg in msgs:
            # Counted before the write: a cancel that lands during the write does not take
            # back a message already handed to gRPC, and counting it first means the
            # CANCELLED terminals that may follow never duplicate a terminal it carried.
            delivered(msg)
            await write(msg)
            if metrics is not None:
                now = time.monotonic()
                if last_sent is None:
                    metrics.first_token(now - started_at)
                else:
                    metrics.inter_chunk(now - last_sent)
                last_sent = now
        if metrics is not None and backlog:
            metrics.merged(len(batch) - len(msgs))
        if tracker.delivered_all:
            # Every terminal is out: the call's outcome is settled, whatever the engine
            # stream does before it ends (the pump gets drain_grace for that).
            return


class _Writer:
    """The writer task's outcome, kept out of the task group (no ExceptionGroup)."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.error: Exception | None = None


async def _run_writer(
    gen: Generation,
    writer: _Writer,
    scope: anyio.CancelScope,
    buffer: _Buffer,
    write: Write,
    config: RelayConfig,
    under_load: Callable[[], bool] | None,
    metrics: Metrics | None,
    started_at: float,
) -> None:
    with scope:
        try:
            await _write_loop(buffer, write, gen.tracker, config, under_load, metrics, started_at)
        except Exception as exc:
            writer.error = exc
        finally:
            writer.done.set()
    if scope.cancelled_caught:
        gen.tracker.stalled = True
        _log.warning(
            "write to the frontend cut: it stopped reading",
            private_id=gen.private_id,
            grace=config.drain_grace,
        )


async def relay(
    gen: Generation,
    write: Write,
    config: RelayConfig,
    *,
    metrics: Metrics | None = None,
    started_at: float | None = None,
    under_load: Callable[[], bool] | None = None,
) -> None:
    """Stream ``gen`` to ``write``. Raises the engine's SidecarError after the delivered
    prefix, unless every terminal was delivered (then the call's outcome is settled: what
    the engine stream does afterwards is logged, not reported). However it ends (including
    by cancellation), the engine request is aborted exactly once unless every terminal
    arrived, and the engine stream is closed.

    A cancellation never cuts a write in flight: the writer runs in its own shielded task,
    stops at the next message boundary, and a write still pending after ``drain_grace`` (a
    frontend that stopped reading) is the only one cut. An interrupted write leaves grpc's
    per-call bookkeeping behind (the first one: "initial metadata not sent"), and the
    status sent after it then fails, reaching the client as a bare UNAVAILABLE without its
    ErrorInfo.
    """
    t0 = time.monotonic() if started_at is None else started_at
    buffer = _Buffer(config.capacity)
    pump_scope = anyio.CancelScope(shield=True)
    writer_scope = anyio.CancelScope(shield=True)
    writer = _Writer()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_pump, gen, buffer, pump_scope, metrics, config.activity)
            tg.start_soon(
                _run_writer,
                gen,
                writer,
                writer_scope,
                buffer,
                write,
                config,
                under_load,
                metrics,
                t0,
            )
            try:
                await writer.done.wait()
            finally:
                buffer.detach()
                if not writer.done.is_set():
                    # Stopped from outside: the message in flight may finish, bounded.
                    writer_scope.deadline = anyio.current_time() + config.drain_grace
                if gen.complete:
                    # Every terminal arrived: the iterator is about to end; never abort.
                    # Unshielded, a stop of the call (drain, cancel) ends that wait at once.
                    pump_scope.deadline = anyio.current_time() + config.drain_grace
                    pump_scope.shield = False
                elif gen.hold_pending:
                    pump_scope.deadline = anyio.current_time() + config.hold_timeout
                else:
                    try:
                        # The abort goes out before the stream is cut (pump cancelled).
                        with anyio.CancelScope(shield=True):
                            await run_to_completion(_abort(gen, metrics))
                    finally:
                        pump_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await run_to_completion(_finish(gen, metrics))
    if gen.tracker.delivered_all:
        if gen.error is not None:
            _log.warning(
                "engine stream failed after every terminal was delivered",
                private_id=gen.private_id,
                error=str(gen.error),
            )
        return
    if writer.error is not None:
        raise writer.error
    if gen.error is not None:
        raise gen.error


async def _finish(gen: Generation, metrics: Metrics | None) -> None:
    await _abort(gen, metrics)
    await gen.close_stream()


async def _abort(gen: Generation, metrics: Metrics | None) -> None:
    if gen.aborted or gen.complete:
        return
    await gen.abort_once()
    if metrics is not None and gen.abort_outcome is not None:
        metrics.aborted(gen.abort_outcome)
