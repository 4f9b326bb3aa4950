"""Channel pool to the engine: N independent HTTP/2 connections, one shared startup
deadline, per-attempt timeouts and capped exponential backoff (spec/COMMON.md).

INTERFACE STUB: the signatures below are the contract; the implementation is being filled in.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import anyio
import grpc

from sidecar_common.endpoint import Endpoint

__all__ = [
    "ChannelPool",
    "Clock",
    "Connector",
    "Deadline",
    "PoolConfig",
    "RetryPolicy",
    "SystemClock",
    "retry_until_deadline",
]

T = TypeVar("T")


class Clock(Protocol):
    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)


@dataclass(frozen=True)
class Deadline:
    """Fixed once, before the first attempt; shared by every slot, the health wait and the
    discovery calls."""

    clock: Clock
    started_at: float
    seconds: float

    @classmethod
    def start(cls, clock: Clock, seconds: float) -> Deadline:
        return cls(clock, clock.monotonic(), seconds)

    def remaining(self) -> float:
        return max(0.0, self.started_at + self.seconds - self.clock.monotonic())

    def elapsed(self) -> float:
        return self.clock.monotonic() - self.started_at

    def expired(self) -> bool:
        return self.remaining() <= 0.0


@dataclass(frozen=True)
class RetryPolicy:
    attempt_timeout: float = 30.0  # --grpc-connect-attempt-timeout-secs
    max_interval: float = 1.0  # --grpc-retry-interval-secs (the backoff cap)
    initial_interval: float = 0.05


@dataclass(frozen=True)
class PoolConfig:
    endpoint: Endpoint
    connections: int = 8  # --grpc-connections
    startup_deadline: float = 1800.0  # --grpc-startup-deadline-secs
    retry: RetryPolicy = RetryPolicy()


# (target "host:port", attempt timeout in seconds) -> a channel that is READY.
Connector = Callable[[str, float], Awaitable[grpc.aio.Channel]]


async def retry_until_deadline(
    what: str,
    attempt: Callable[[float], Awaitable[T]],
    deadline: Deadline,
    policy: RetryPolicy,
) -> T:
    """Call ``attempt(timeout)`` until it returns, each bounded by min(attempt_timeout,
    remaining); back off with jitter between attempts, capped, never past the deadline.
    On failure raise SidecarError(CANNOT_CONNECT) naming ``what``, the deadline, the
    attempts, the time spent and the last underlying error."""
    raise NotImplementedError


class ChannelPool:
    def __init__(
        self,
        config: PoolConfig,
        *,
        clock: Clock | None = None,
        connector: Connector | None = None,
    ) -> None:
        raise NotImplementedError

    async def connect(self, deadline: Deadline) -> None:
        """Slot 1 first, then the rest concurrently, all within ``deadline``."""
        raise NotImplementedError

    def channel(self) -> grpc.aio.Channel:
        """The next channel, round-robin."""
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError
