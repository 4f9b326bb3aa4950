"""The ``liveness`` health service: SERVING whenever the sidecar's event loop answers, so a
Kubernetes liveness probe on it restarts a wedged sidecar and never one that is waiting out
an engine outage, a start-up or a drain."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from sidecar_server.server import LIVENESS_SERVICE, WORKER_SERVICE
from tests.fake_engine import FakeEngine
from tests.integration.test_servicer import NOT_SERVING, SERVING, servicer_running

pytestmark = pytest.mark.timeout(30)


async def _rest_of(watch: Any) -> list[int]:
    """The statuses a watch still delivers until its stream ends, however it ends."""
    statuses: list[int] = []
    try:
        # read() gives grpc.aio.EOF (no message) when the stream ends cleanly.
        while isinstance(message := await watch.read(), health_pb2.HealthCheckResponse):
            statuses.append(message.status)
    except grpc.aio.AioRpcError:
        pass  # the server stopped: the end of the stream
    return statuses


async def test_liveness_stays_serving_through_startup_engine_outage_and_drain() -> None:
    engine = FakeEngine()
    async with servicer_running(engine, serving=False, health_watch_interval=0.02) as h:
        liveness = h.health.Watch(health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE))
        assert (await liveness.read()).status == SERVING
        worker = h.health.Watch(health_pb2.HealthCheckRequest(service=WORKER_SERVICE))
        seen: list[tuple[int, int]] = []

        async def step(want_worker: int) -> None:
            # Each step waits for readiness to move, then asks liveness at that moment.
            assert (await worker.read()).status == want_worker
            seen.append((want_worker, await h.health_of(LIVENESS_SERVICE)))

        await step(NOT_SERVING)  # engine not connected yet
        h.server.set_serving()
        await step(SERVING)
        engine.healthy_answer = False  # the engine goes down
        await step(NOT_SERVING)
        engine.healthy_answer = True
        await step(SERVING)
        await h.server.drain()
        await step(NOT_SERVING)
        assert seen == [
            (NOT_SERVING, SERVING),
            (SERVING, SERVING),
            (NOT_SERVING, SERVING),
            (SERVING, SERVING),
            (NOT_SERVING, SERVING),
        ]
        worker.cancel()
        # Whatever the liveness watch wrote meanwhile arrives before its stream ends with the
        # server: it must never have said anything but SERVING.
        await h.server.stop()
        assert NOT_SERVING not in await _rest_of(liveness)
