"""The worker set against a scripted sidecar (a grpc.aio server on loopback whose answers a
test controls): the paths real sidecars rarely take on their own."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_frontend.workers import WorkerSet, WorkerState
from tests.e2e_helpers import until
from tests.integration.frontend.fixtures import FAST_WORKERS

pytestmark = pytest.mark.timeout(30)


class ScriptedSidecar(sidecar_pb2_grpc.WorkerServicer, health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    def __init__(self, model: str = "m", model_info_failures: int = 0) -> None:
        self.model = model
        self.model_info_failures = model_info_failures
        self.model_info_calls = 0
        self.status = health_pb2.HealthCheckResponse.SERVING
        self.changed = anyio.Event()

    async def GetModelInfo(self, request: Any, context: Any) -> sidecar_pb2.ModelInfo:
        self.model_info_calls += 1
        if self.model_info_calls <= self.model_info_failures:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")
        return sidecar_pb2.ModelInfo(engine="vllm", served_model_name=self.model)

    async def GetLoad(self, request: Any, context: Any) -> sidecar_pb2.LoadReport:
        return sidecar_pb2.LoadReport(inflight_requests=0)

    def set_status(self, status: int) -> None:
        self.status = status
        changed, self.changed = self.changed, anyio.Event()
        changed.set()

    async def Watch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        while True:
            changed = self.changed
            yield health_pb2.HealthCheckResponse(status=self.status)
            await changed.wait()


@asynccontextmanager
async def scripted(sidecar: ScriptedSidecar) -> AsyncIterator[str]:
    server = grpc.aio.server()
    sidecar_pb2_grpc.add_WorkerServicer_to_server(sidecar, server)
    health_pb2_grpc.add_HealthServicer_to_server(sidecar, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def test_a_worker_whose_model_info_fails_at_first_serves_once_it_answers() -> None:
    sidecar = ScriptedSidecar(model_info_failures=2)
    async with scripted(sidecar) as address, WorkerSet(FAST_WORKERS) as workers:
        workers.add_worker(address)
        with anyio.fail_after(10):
            await workers.wait_serving()
        assert sidecar.model_info_calls == 3
        assert workers.model is not None
        assert workers.model.served_model_name == "m"


async def test_health_changes_follow_the_watch() -> None:
    sidecar = ScriptedSidecar()
    async with scripted(sidecar) as address, WorkerSet(FAST_WORKERS) as workers:
        workers.add_worker(address)
        with anyio.fail_after(10):
            await workers.wait_serving()
        worker = workers.get(address)
        assert worker is not None
        sidecar.set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
        await until(lambda: worker.state is WorkerState.NOT_SERVING, "NOT_SERVING seen")
        assert workers.pick() is None
        sidecar.set_status(health_pb2.HealthCheckResponse.SERVING)
        with anyio.fail_after(10):
            await workers.wait_serving()
        assert workers.pick() is worker


async def test_the_first_model_wins_and_another_is_refused() -> None:
    first, other = ScriptedSidecar("m"), ScriptedSidecar("other")
    async with scripted(first) as a, scripted(other) as b, WorkerSet(FAST_WORKERS) as workers:
        workers.add_worker(a)
        with anyio.fail_after(10):
            await workers.wait_serving()
        workers.add_worker(b)
        refused = workers.get(b)
        assert refused is not None
        await until(lambda: refused.state is WorkerState.REFUSED, "the other model is refused")
        assert [w.address for w in workers.serving()] == [a]
