"""The background health watch under a scripted engine (hooks, no timing): new requests are
turned away only after ``health_failure_threshold`` failed probes in a row, a late probe is
logged as such, one success brings the engine back, and a flowing stream is never failed by
the probes, whatever they say."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from structlog.testing import capture_logs

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_server.engine import HEALTHY, EngineHealth
from sidecar_server.server import ServerConfig, SidecarServer
from tests.fake_engine import FakeEngine, Gate, Step, terminal, tokens
from tests.reliability.harness import error_reason

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def quiet_logs() -> None:
    """The suite's fixture of that name silences warnings; these tests read them."""


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class ScriptedHealth(FakeEngine):
    """Each probe takes the next answer of ``answers`` ("ok", "unhealthy", "late": no answer in
    time, "hang": never answers); once they are used up, the next probe parks (sets
    ``parked``) until the test ends, so every scripted answer has been acted on by then."""

    answers: list[str] = field(default_factory=list)
    probes: int = 0
    parked: anyio.Event = field(default_factory=anyio.Event)
    # Probes wait for this before taking an answer: a test that must act before the watch
    # reaches its verdict holds the probes until it has (the watch runs every millisecond).
    probes_open: anyio.Event | None = None

    async def health(self) -> EngineHealth:
        if self.probes_open is not None:
            await self.probes_open.wait()
        if not self.answers:
            self.parked.set()
            await anyio.sleep_forever()
        self.probes += 1
        answer = self.answers.pop(0)
        if answer == "late":
            raise TimeoutError("GET /health: no answer within 3s")
        if answer == "hang":
            await anyio.sleep_forever()
        return HEALTHY if answer == "ok" else EngineHealth.unhealthy("")


@dataclass
class Watched:
    server: SidecarServer
    engine: ScriptedHealth
    stub: Any
    health: Any
    verdicts: list[tuple[bool, str, int]]  # (healthy, why, probes made by then)

    async def status(self) -> int:
        reply = await self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        return int(reply.status)


@asynccontextmanager
async def watched(
    answers: Sequence[str], probe_timeout: float = 60, *, hold_probes: bool = False, **config: Any
) -> AsyncIterator[Watched]:
    """``hold_probes``: every probe waits until the test sets ``engine.probes_open``."""
    engine = ScriptedHealth(answers=list(answers), probes_open=anyio.Event() if hold_probes else None)
    verdicts: list[tuple[bool, str, int]] = []
    server = SidecarServer(
        engine,
        ServerConfig(
            listen="127.0.0.1:0", health_watch_interval=0.001, health_probe_timeout=probe_timeout, **config
        ),
        engine_health_listener=lambda ok, why: verdicts.append((ok, why, engine.probes)),
    )
    await server.start()
    server.set_serving()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield Watched(
            server,
            engine,
            sidecar_pb2_grpc.WorkerStub(channel),
            health_pb2_grpc.HealthStub(channel),
            verdicts,
        )
    finally:
        await channel.close(None)
        await server.stop()


async def parked(w: Watched) -> None:
    with anyio.fail_after(30):
        await w.engine.parked.wait()


async def test_two_late_probes_in_a_row_turn_nothing_away() -> None:
    with capture_logs() as logs:
        async with watched(["late", "late", "ok", "late", "late", "ok", "unhealthy", "ok"]) as w:
            await parked(w)
            assert w.verdicts == []
            assert await w.status() == SERVING
            outs = [out async for out in w.stub.Generate(sidecar_pb2.PreprocessedRequest(token_ids=[1]))]
            assert outs[-1].finish_reason == sidecar_pb2.EOS
            late = [e for e in logs if e["event"] == "engine health probe late"]
            failed = [e for e in logs if e["event"] == "engine health probe failed"]
            assert [(e["failures"], e["threshold"], e["log_level"]) for e in late] == [
                (1, 3, "warning"),
                (2, 3, "warning"),
                (1, 3, "warning"),
                (2, 3, "warning"),
            ]
            assert late[0]["reason"] == "GET /health: no answer within 3s"
            assert [(e["failures"], e["threshold"]) for e in failed] == [(1, 3)]
            assert failed[0]["reason"] == "the health check answered not serving"


async def test_the_third_failure_in_a_row_turns_new_requests_away_and_one_success_brings_them_back() -> None:
    async with watched(["late", "ok", "late", "unhealthy", "late", "ok"]) as w:
        await parked(w)
        # Unhealthy at the fifth probe (the third failure in a row), healthy at the sixth.
        assert [(ok, probes) for ok, _, probes in w.verdicts] == [(False, 5), (True, 6)]
        assert w.verdicts[0][1] == "GET /health: no answer within 3s"
        assert await w.status() == SERVING


async def test_after_the_threshold_new_requests_are_refused_migratable() -> None:
    async with watched(["unhealthy", "unhealthy", "unhealthy"]) as w:
        await parked(w)
        assert [(ok, probes) for ok, _, probes in w.verdicts] == [(False, 3)]
        assert await w.status() == NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await w.stub.Generate(sidecar_pb2.PreprocessedRequest(token_ids=[1])).read()
        assert error_reason(info.value) == ("CANNOT_CONNECT", "true")
        assert info.value.details() == (
            "fake engine is unhealthy or unreachable: the health check answered not serving"
        )


async def test_a_probe_that_never_answers_is_late_after_the_probe_timeout() -> None:
    # The server's own bound ends each hung probe (health_probe_timeout, small here).
    async with watched(["hang", "hang"], probe_timeout=0.05, health_failure_threshold=2) as w:
        await parked(w)
        assert [(ok, probes) for ok, _, probes in w.verdicts] == [(False, 2)]
        assert "no health check answer within 0.05s" in w.verdicts[0][1]


async def test_a_flowing_stream_is_never_failed_by_the_probes() -> None:
    release = anyio.Event()
    script: list[Step] = [tokens(1), Gate(release), tokens(2), tokens(3), terminal(4)]
    # The probes are held until the stream has delivered its first chunk: with the 1 ms
    # watch interval they could otherwise reach their verdict before the request arrives.
    # The first probe, started before the request and held while its first chunk went out,
    # finds the engine busy rather than gone (a late probe while the engine streams:
    # test_engine_health); the stream then waits while the next three run, late, and this
    # test is about that verdict of unhealthy.
    async with watched(["late", "late", "late", "late", "hang"], hold_probes=True) as w:
        w.engine.scripts["flow"] = script
        call = w.stub.Generate(sidecar_pb2.PreprocessedRequest(request_id="flow", token_ids=[1]))
        first = await call.read()
        assert list(first.token_ids) == [1]
        assert w.verdicts == []
        assert w.engine.probes == 0
        assert w.engine.probes_open is not None
        w.engine.probes_open.set()
        # The probes time out, the engine is called unhealthy and new requests are turned away...
        with anyio.fail_after(30):
            while not w.verdicts:  # noqa: ASYNC110 - the listener has no event of its own
                await anyio.sleep(0.01)
        assert await w.status() == NOT_SERVING
        # ... and the stream in flight carries on to its end.
        release.set()
        rest = []
        while (out := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            rest.append(out)
        assert [t for o in [first, *rest] for t in o.token_ids] == [1, 2, 3, 4]
        assert rest[-1].finish_reason == sidecar_pb2.EOS
        assert await call.code() == grpc.StatusCode.OK
