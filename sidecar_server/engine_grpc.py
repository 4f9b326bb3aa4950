"""What every engine client over gRPC shares: the channel pool, one stub per channel, and unary
calls bounded in time that fail as typed errors (vLLM's service, SGLang's gRPC transport)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import grpc

from sidecar_common.pool import ChannelPool, Clock, Connector, Deadline, PoolConfig
from sidecar_common.rpc import StubCache, bounded_call, discovery_timeout, probe
from sidecar_server.engine import HEALTHY, EngineHealth

__all__ = ["EngineChannels"]

S = TypeVar("S")
C = TypeVar("C")
T = TypeVar("T")


class EngineChannels(Generic[S]):
    """``config.pool``'s channels to one engine and its service stub ``S`` on each."""

    def __init__(
        self,
        config: PoolConfig,
        make_stub: Callable[[grpc.aio.Channel], S],
        *,
        clock: Clock | None = None,
        connector: Connector | None = None,
    ) -> None:
        self._config = config
        self._pool = ChannelPool(config, clock=clock, connector=connector)
        self._caches: list[StubCache[object]] = []
        self._stubs = self.stubs(make_stub)

    @property
    def clock(self) -> Clock:
        return self._pool.clock

    @property
    def target(self) -> str:
        return self._config.endpoint.target

    def stubs(self, make: Callable[[grpc.aio.Channel], C]) -> StubCache[C]:
        """Another callable made once per channel (a raw method, say); cleared on close."""
        cache: StubCache[C] = StubCache(self._pool, make)
        self._caches.append(cache)  # type: ignore[arg-type]  # only cleared, never read
        return cache

    def stub(self) -> S:
        """The service stub of the next channel (the pool's round-robin)."""
        return self._stubs.next()

    async def connect(self, deadline: Deadline) -> None:
        await self._pool.connect(deadline)

    async def call(self, rpc: str, timeout: float, call: Callable[[S, float], Awaitable[T]]) -> T:
        """``call(stub, timeout)`` on the next channel; a gRPC status becomes its typed error,
        no answer in time CONNECTION_TIMEOUT."""
        stub = self.stub()
        return await bounded_call(rpc, timeout, lambda t: call(stub, t))

    async def discover(self, rpc: str, deadline: Deadline, call: Callable[[S, float], Awaitable[T]]) -> T:
        """One discovery call, bounded by an attempt's timeout and what is left of ``deadline``."""
        return await self.call(rpc, discovery_timeout(rpc, deadline, self._config.retry), call)

    async def probe(self, attempt: Callable[[float], Awaitable[object]], timeout: float) -> EngineHealth:
        """One health probe: the verdict of ``attempt(timeout)``, or TimeoutError when late."""
        why: list[str] = []
        if await probe(attempt, timeout, why.append):
            return HEALTHY
        return EngineHealth.unhealthy(why[-1] if why else "")

    async def close(self) -> None:
        for cache in self._caches:
            cache.clear()
        await self._pool.close()
