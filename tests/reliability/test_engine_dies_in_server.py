"""An engine that dies inside a running server: its streams end migratable.

vLLM's engine core dies while its gRPC server stays up: every stream in flight ends INTERNAL
("EngineCore encountered an issue…") and HealthCheck answers not healthy from then on. The
sidecar asks the engine's health after such an untyped failure and, the engine reporting itself
unhealthy, ends the streams ENGINE_SHUTDOWN (migratable) in the engine's own words, and turns its
own health NOT_SERVING. SGLang's scheduler dies: streams stall, then its server process goes
away, which ends them migratable too. An INTERNAL failure of one request while the engine stays
healthy is not the engine going away: it stays UNKNOWN, not migratable."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import grpc
import pytest
from grpc_health.v1 import health_pb2
from testkit.faults import FaultKind, FaultPlan
from testkit.vllm_engine import ENGINE_DEAD_MESSAGE

from sidecar_server.server import ServerConfig
from tests.reliability.harness import (
    KINDS,
    Ended,
    Kind,
    Rig,
    error_reason,
    expected_tokens,
    finish,
    request,
    rig,
)

pytestmark = pytest.mark.timeout(90)

PROMPT = [101, 202, 303]
STREAMS = 20
MIGRATABLE = {"ENGINE_SHUTDOWN", "CANNOT_CONNECT"}
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def opened(stub: Any, public_id: str) -> tuple[Any, Ended]:
    call = stub.Generate(request(public_id, PROMPT, 1000), timeout=60)
    ended = Ended()
    first = await call.read()
    assert first is not grpc.aio.EOF  # type: ignore[attr-defined]
    ended.outs.append(first)
    return call, ended


async def until_health(r: Rig, want: int) -> None:
    with anyio.move_on_after(10):
        while await r.health_status() != want:  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # polled as a frontend's probe would
    assert await r.health_status() == want


def assert_migratable(ended: Ended, full: list[int], kind: Kind) -> None:
    assert ended.error is not None, "a stream ended OK although its engine died"
    why = error_reason(ended.error)
    assert why is not None, ended.error.details()
    assert why[0] in MIGRATABLE, (why, ended.error.details())
    assert why[1] == "true", why
    assert ended.tokens == full[: len(ended.tokens)]
    if kind == "vllm":
        # The engine's own words reach the frontend.
        assert ENGINE_DEAD_MESSAGE in (ended.error.details() or "")


@pytest.mark.parametrize("kind", KINDS)
async def test_streams_of_an_engine_that_dies_inside_its_server_end_migratable(kind: Kind) -> None:
    config = ServerConfig(listen="127.0.0.1:0", health_watch_interval=0.2)
    async with rig(kind, server=config, token_latency_ms=20) as r:
        r.faults.add("-victim", FaultPlan(FaultKind.ENGINE_DIES, after=3), times=1)
        others = [await opened(r.stub, f"other{i}") for i in range(STREAMS)]
        victim = await opened(r.stub, "victim")
        ends = await asyncio.gather(*(finish(call, ended) for call, ended in [*others, victim]))
        full = expected_tokens(r.model, PROMPT, 1000)
        for ended in ends:
            assert_migratable(ended, full, kind)
        # No new request should follow them there: health says so (for vLLM at once: the
        # departure was confirmed; SGLang's server is gone, which the watch notices after its
        # failure threshold), and one sent anyway is refused migratable too.
        if kind == "vllm":
            assert await r.health_status() == NOT_SERVING
        else:
            await until_health(r, NOT_SERVING)
        fresh = await finish(r.stub.Generate(request("after", PROMPT, 5), timeout=30))
        assert fresh.error is not None
        assert not fresh.outs
        why = error_reason(fresh.error)
        assert why is not None
        assert why[1] == "true", (why, fresh.error.details())
        assert await r.server.wait_idle(15.0)


@pytest.mark.parametrize("kind", KINDS)
async def test_an_internal_failure_of_a_healthy_engine_is_not_migratable(kind: Kind) -> None:
    config = ServerConfig(listen="127.0.0.1:0", health_watch_interval=0.2, engine_fault_window=0.3)
    async with rig(kind, server=config) as r:
        r.faults.add("-bug", FaultPlan(FaultKind.ERROR_AFTER, after=2, code="INTERNAL"), times=1)
        ended = await finish(r.stub.Generate(request("bug", PROMPT, 10), timeout=30))
        assert ended.error is not None
        assert error_reason(ended.error) == ("UNKNOWN", "false"), ended.error.details()
        assert ended.tokens == expected_tokens(r.model, PROMPT, 10)[:2]
        assert await r.health_status() == health_pb2.HealthCheckResponse.SERVING
