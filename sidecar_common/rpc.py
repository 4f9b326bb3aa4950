"""Bounded unary calls to an engine over the channel pool, shared by the gRPC adapters.

The grpc timeout is the real bound on each call; an outer anyio bound a little later only
catches a call that ignores it. Failures come out as typed errors, named after the RPC.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Final, Generic, TypeVar

import anyio
import grpc

from sidecar_common.errors import FailureReason, SidecarError, decode_rpc_error, from_rpc_error
from sidecar_common.pool import ChannelPool, Deadline, NotReady, RetryPolicy

__all__ = [
    "GRACE",
    "NotHealthy",
    "StubCache",
    "bounded_call",
    "call_failures",
    "cancel_is_ours",
    "discovery_timeout",
    "probe",
]

GRACE: Final = 0.5

S = TypeVar("S")
T = TypeVar("T")


class NotHealthy(NotReady):
    """The engine answered its health check but is not ready: retried within the deadline."""


class StubCache(Generic[S]):
    """One stub per pool channel, made once rather than per call; ``next()`` follows the
    pool's round-robin."""

    def __init__(self, pool: ChannelPool, make: Callable[[grpc.aio.Channel], S]) -> None:
        self._pool = pool
        self._make = make
        self._stubs: dict[int, S] = {}

    def next(self) -> S:
        channel = self._pool.channel()
        stub = self._stubs.get(id(channel))
        if stub is None:
            stub = self._stubs[id(channel)] = self._make(channel)
        return stub

    def clear(self) -> None:
        self._stubs.clear()


def cancel_is_ours() -> bool:
    """Whether a ``CancelledError`` just caught around a grpc.aio call cancels the calling task
    (someone cancelled it: a cancel scope, a task group), rather than ending the call alone.

    grpc.aio raises a bare ``CancelledError`` out of a call that was cancelled locally while
    nobody cancelled the task: its channel was closed under it (a redial retiring the old
    connections, a pool closing). That is a failed call, and must not pass for a cancel of the
    task, which a task group would take as a request to stop. A real cancel of the task goes
    through ``Task.cancel()`` (anyio's scopes and asyncio's timeouts alike), which
    ``Task.cancelling()`` counts until it is taken back."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


@contextmanager
def call_failures(rpc: str, *, engine: bool = False) -> Iterator[None]:
    """Around one grpc.aio call (unary or a stream being read): its failures typed. An
    ``RpcError`` becomes the error of the status table (an engine's when ``engine``, else a
    worker's); a ``CancelledError`` that is not a cancel of this task (:func:`cancel_is_ours`)
    becomes CANNOT_CONNECT, so retries and supervision treat it as the broken call it is."""
    try:
        yield
    except grpc.RpcError as err:
        raise (from_rpc_error(rpc, err) if engine else decode_rpc_error(err)) from None
    except asyncio.CancelledError:
        if cancel_is_ours():
            raise
        raise SidecarError(
            FailureReason.CANNOT_CONNECT, f"{rpc}: the call was cancelled under us (its connection closed)"
        ) from None


async def bounded_call(rpc: str, timeout: float, call: Callable[[float], Awaitable[T]]) -> T:
    """``call(timeout)``; its failures typed as :func:`call_failures` does for an engine's, no
    answer in time CONNECTION_TIMEOUT."""
    try:
        with anyio.fail_after(timeout + GRACE), call_failures(rpc, engine=True):
            return await call(timeout)
    except TimeoutError:
        raise SidecarError(FailureReason.CONNECTION_TIMEOUT, f"{rpc}: no answer in {timeout:.3f}s") from None


def discovery_timeout(rpc: str, deadline: Deadline, policy: RetryPolicy) -> float:
    """A discovery call's bound: one attempt's timeout, never past the start-up deadline.
    Discovery is not retried: the engine is healthy by then, and a server of another kind
    (answering UNIMPLEMENTED) must fail at once rather than spin until the deadline."""
    timeout = min(policy.attempt_timeout, deadline.remaining())
    if timeout <= 0:
        raise SidecarError(
            FailureReason.CONNECTION_TIMEOUT,
            f"{rpc}: the startup deadline ({deadline.seconds:g}s) ran out before discovery",
        )
    return timeout


async def probe(
    attempt: Callable[[float], Awaitable[object]],
    timeout: float,
    on_failure: Callable[[str], object] | None = None,
) -> bool:
    """One health probe: True when ``attempt(timeout)`` returns in time; False when it fails
    as an unreachable or unready engine does. No answer in time (a busy engine answers late)
    is not the same: it raises TimeoutError. ``on_failure`` is told why, in words for the
    operator's log lines, in both cases."""
    why = f"no health check answer within {timeout + GRACE:g}s"
    late = True
    # asyncio's own timeout: the health watch runs this in a plain asyncio task, where an
    # anyio scope's cancel could outlive the scope and end the task.
    try:
        async with asyncio.timeout(timeout + GRACE):
            await attempt(timeout)
            return True
    except TimeoutError:
        pass
    except grpc.RpcError as err:
        why = from_rpc_error("HealthCheck", err).message
        late = getattr(err, "code", lambda: None)() == grpc.StatusCode.DEADLINE_EXCEEDED
    except SidecarError as err:
        why, late = err.message, False
    except NotHealthy as err:
        why, late = str(err), False
    if on_failure is not None:
        on_failure(why)
    if late:
        raise TimeoutError(why)
    return False
