"""A virtual clock and a scripted connector, so the pool's deadline arithmetic is tested
without sockets and without real sleeping."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import anyio
import anyio.lowlevel
import grpc

__all__ = ["Call", "FakeChannel", "FakeClock", "ScriptedConnector", "Step"]


class FakeClock:
    """``sleep`` advances virtual time at once and records how long it was asked to sleep."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await anyio.lowlevel.checkpoint()


class FakeChannel:
    def __init__(self, number: int) -> None:
        self.number = number
        self.closed = 0
        self.state = grpc.ChannelConnectivity.READY

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.state

    async def close(self, grace: float | None = None) -> None:
        # grpc's close awaits: a caller being cancelled must shield it or the close is lost.
        await anyio.lowlevel.checkpoint()
        self.closed += 1


@dataclass(frozen=True)
class Step:
    """One connection attempt: it takes ``takes`` virtual seconds, then raises ``error`` or
    returns a channel. An attempt needing more than its timeout uses the whole timeout and
    times out, as the real connector does."""

    takes: float = 0.0
    error: Exception | None = None
    forever: bool = False  # never returns: only a real-time bound or cancellation ends it


@dataclass
class Call:
    target: str
    timeout: float
    at: float


@dataclass
class ScriptedConnector:
    clock: FakeClock
    script: Sequence[Step] = ()
    then: Step = field(default_factory=Step)  # every call after the script
    calls: list[Call] = field(default_factory=list)
    channels: list[FakeChannel] = field(default_factory=list)

    async def __call__(self, target: str, timeout: float) -> grpc.aio.Channel:
        index = len(self.calls)
        self.calls.append(Call(target, timeout, self.clock.now))
        step = self.script[index] if index < len(self.script) else self.then
        await anyio.lowlevel.checkpoint()
        if step.forever:
            await anyio.sleep_forever()
        if step.takes > timeout:
            self.clock.advance(timeout)
            raise TimeoutError(f"not ready within {timeout:.3f}s")
        self.clock.advance(step.takes)
        if step.error is not None:
            raise step.error
        channel = FakeChannel(index)
        self.channels.append(channel)
        return cast(grpc.aio.Channel, channel)
