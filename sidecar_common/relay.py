"""The hot path: engine stream -> bounded buffer -> coalescing writer -> frontend.

One task (the pump) reads the engine stream into a small bounded buffer; the writer (the
Generate handler) takes whatever is buffered, merges it per choice and sends it. The writer
never waits to fill a message, so an idle frontend gets each chunk as it comes and a busy
one gets fewer, fuller messages. The bounded buffer is the backpressure: when the frontend
does not drain, the pump stops reading the engine.

Cleanup follows the abort rule of :mod:`sidecar_common.dispatch`: abort once (unless every
terminal arrived), then close the engine stream. With the decode hold, a cancel before the
first token lets the pump keep draining (discarding) until a token, a terminal, an error or
the hold timeout, and only then aborts.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from sidecar_common.api import sidecar_pb2
from sidecar_common.coalesce import coalesce
from sidecar_common.dispatch import Delivery, Generation
from sidecar_common.errors import ErrorReason, SidecarError
from sidecar_common.metrics import Metrics

__all__ = ["RelayConfig", "Write", "relay"]

Write = Callable[[sidecar_pb2.LLMEngineOutput], Awaitable[None]]


@dataclass(frozen=True)
class RelayConfig:
    capacity: int = 32  # engine chunks buffered before the pump stops reading
    hold_timeout: float = 30.0  # decode hold: how long a cancel waits for the first token
    drain_grace: float = 5.0  # after the last terminal, how long the engine iterator may take to end
    busy_turns: int = 2  # loop turns before taking the buffer while the sidecar is under load


class _PumpState:
    def __init__(self) -> None:
        # Set when nobody reads the buffer any more: the pump discards and stops at the
        # first token (decode hold) instead of blocking on a full buffer.
        self.detached = False


async def _pump(
    gen: Generation,
    send: MemoryObjectSendStream[sidecar_pb2.LLMEngineOutput],
    scope: anyio.CancelScope,
    state: _PumpState,
) -> None:
    with scope, send:
        try:
            async for out in gen.stream():
                gen.tracker.observe(out)
                if not state.detached:
                    try:
                        await send.send(out)
                        continue
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        state.detached = True
                if gen.tracker.saw_token_or_terminal:
                    return
            if not gen.complete:
                gen.fail(gen.ended_early())
        except SidecarError as exc:
            gen.fail(exc)
        except Exception as exc:
            # An engine bug must still end the call with a typed status and an abort.
            gen.fail(
                SidecarError(ErrorReason.UNKNOWN, f"{gen.engine.name} generate: {type(exc).__name__}: {exc}")
            )


async def _write_loop(
    recv: MemoryObjectReceiveStream[sidecar_pb2.LLMEngineOutput],
    write: Write,
    delivery: Delivery,
    config: RelayConfig,
    under_load: Callable[[], bool] | None,
    metrics: Metrics | None,
    started_at: float,
) -> None:
    capacity = config.capacity
    backlog = False
    last_sent: float | None = None
    while True:
        try:
            first = await recv.receive()
        except anyio.EndOfStream:
            return
        # A writer that wakes for each chunk usually finds only that one queued. When the
        # frontend is slower than the engine (backlog) or the sidecar is busy, a loop turn
        # or two lets the pump queue what has already arrived, so the next message carries
        # more. No timer: when idle, a chunk goes out as soon as it comes.
        turns = config.busy_turns if under_load is not None and under_load() else int(backlog)
        for _ in range(turns):
            await anyio.lowlevel.checkpoint()
        batch = [first]
        while len(batch) < capacity:
            try:
                batch.append(recv.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream):
                break
        backlog = len(batch) > 1
        msgs = coalesce(batch)
        for msg in msgs:
            # Counted before the write: a cancel that lands during the write does not take
            # back a message already handed to gRPC, and counting it first means the
            # CANCELLED terminals that may follow never duplicate a terminal it carried.
            delivery.observe(msg)
            await write(msg)
            if metrics is not None:
                now = time.monotonic()
                if last_sent is None:
                    metrics.first_token(now - started_at)
                else:
                    metrics.inter_chunk(now - last_sent)
                last_sent = now
        if metrics is not None:
            metrics.merged(len(batch) - len(msgs))


async def relay(
    gen: Generation,
    write: Write,
    delivery: Delivery,
    config: RelayConfig,
    *,
    metrics: Metrics | None = None,
    started_at: float | None = None,
    under_load: Callable[[], bool] | None = None,
) -> None:
    """Stream ``gen`` to ``write``. Raises the engine's SidecarError after the delivered
    prefix. However it ends (including by cancellation), the engine request is aborted
    exactly once unless every terminal arrived, and the engine stream is closed."""
    t0 = time.monotonic() if started_at is None else started_at
    send, recv = anyio.create_memory_object_stream[sidecar_pb2.LLMEngineOutput](config.capacity)
    pump_scope = anyio.CancelScope(shield=True)
    state = _PumpState()
    # Kept out of the task group so that it is not wrapped in an ExceptionGroup.
    write_error: Exception | None = None
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_pump, gen, send, pump_scope, state)
            try:
                with recv:
                    await _write_loop(recv, write, delivery, config, under_load, metrics, t0)
            except Exception as exc:
                write_error = exc
            finally:
                state.detached = True
                with anyio.CancelScope(shield=True):
                    if gen.complete:
                        # Every terminal arrived: the iterator is about to end; never abort.
                        pump_scope.deadline = anyio.current_time() + config.drain_grace
                    elif gen.hold_pending:
                        pump_scope.deadline = anyio.current_time() + config.hold_timeout
                    else:
                        await _abort(gen, metrics)
                        pump_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await _abort(gen, metrics)
            await gen.close_stream()
    if write_error is not None:
        raise write_error
    if gen.error is not None:
        raise gen.error


async def _abort(gen: Generation, metrics: Metrics | None) -> None:
    if gen.aborted or gen.complete:
        return
    await gen.abort_once()
    if metrics is not None:
        metrics.aborted()
