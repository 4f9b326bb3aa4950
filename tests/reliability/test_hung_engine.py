"""A hung engine (accepts the stream, then never answers) cannot hold a request past the
client's deadline, nor the drain past drain_timeout; either way the engine request is
aborted once and nothing is left running. (The hung stream never ends by itself, so the
request ending at all is the proof; how long each took is measured by ``python -m
bench.fault_timings``, not asserted.)"""

from __future__ import annotations

import grpc
import pytest
from testkit.faults import FaultKind, FaultPlan

from sidecar_server.server import ServerConfig
from tests.reliability.harness import KINDS, Kind, Rig, error_reason, finish, request, rig, until

pytestmark = pytest.mark.timeout(60)

PROMPT = [101, 202, 303]


async def aborted_once_and_idle(r: Rig, public_id: str) -> None:
    await until(lambda: r.engine_busy() == 0, f"the engine still runs {r.book.running_ids()}")
    assert await r.server.wait_idle(5.0)
    [pid] = [rid for rid in r.received_ids() if rid.endswith(f"-{public_id}")]
    assert r.book.aborts.count(pid) == 1, r.book.aborts


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("after", [0, 3])
async def test_a_client_deadline_ends_a_hung_generation(kind: Kind, after: int) -> None:
    async with rig(kind) as r:
        r.faults.add("-hung", FaultPlan(FaultKind.HANG, after=after))
        deadline = 0.5
        ended = await finish(r.stub.Generate(request("hung", PROMPT, 50), timeout=deadline))
        assert ended.code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert len(ended.tokens) == after
        await aborted_once_and_idle(r, "hung")


@pytest.mark.parametrize("kind", KINDS)
async def test_a_hung_generation_cannot_hold_the_drain(kind: Kind) -> None:
    drain_timeout, abort_timeout = 0.5, 1.0
    config = ServerConfig(
        listen="127.0.0.1:0",
        drain_timeout=drain_timeout,
        abort_timeout=abort_timeout,
        health_watch_interval=0.2,
    )
    async with rig(kind, server=config) as r:
        r.faults.add("-hung", FaultPlan(FaultKind.HANG, after=2))
        call = r.stub.Generate(request("hung", PROMPT, 50), timeout=60)
        # A healthy neighbour that finishes within the drain is not cut short.
        ok = r.stub.Generate(request("fine", PROMPT, 4), timeout=60)
        await until(lambda: len(r.received_ids()) == 2, "both requests reached the engine")
        # The drain waits drain_timeout, then cancels; each cancelled generation's cleanup
        # (abort, then close) is bounded by abort_timeout. The hung stream would hold it forever.
        await r.server.drain()
        hung = await finish(call)
        assert hung.code is grpc.StatusCode.UNAVAILABLE
        assert error_reason(hung.error) == ("ENGINE_SHUTDOWN", "true")  # type: ignore[arg-type]
        assert len(hung.tokens) == 2
        fine = await finish(ok)
        assert fine.error is None
        assert len(fine.terminals) == 1
        await aborted_once_and_idle(r, "hung")
        assert not [rid for rid in r.book.aborts if rid.endswith("-fine")]
