"""The worker set against a scripted sidecar (a grpc.aio server on loopback whose answers a
test controls): the paths real sidecars rarely take on their own."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import anyio
import grpc
import pytest
import structlog
import structlog.testing
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_frontend.workers import Refusal, Worker, WorkerSet, WorkerState, role_mismatch
from tests.e2e_helpers import until
from tests.integration.frontend.fixtures import FAST_WORKERS

pytestmark = pytest.mark.timeout(30)


class ScriptedSidecar(sidecar_pb2_grpc.WorkerServicer, health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    def __init__(
        self, model: str = "m", model_info_failures: int = 0, mode: str = "agg", watch_fails: bool = False
    ) -> None:
        self.watch_fails = watch_fails
        self.model = model
        self.mode = mode
        self.model_info_failures = model_info_failures
        self.model_info_calls = 0
        self.status = health_pb2.HealthCheckResponse.SERVING
        self.changed = anyio.Event()

    async def GetModelInfo(self, request: Any, context: Any) -> sidecar_pb2.ModelInfo:
        self.model_info_calls += 1
        if self.model_info_calls <= self.model_info_failures:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")
        return sidecar_pb2.ModelInfo(
            engine="vllm", served_model_name=self.model, disaggregation_mode=self.mode
        )

    async def GetLoad(self, request: Any, context: Any) -> sidecar_pb2.LoadReport:
        return sidecar_pb2.LoadReport(inflight_requests=0)

    def set_status(self, status: int) -> None:
        self.status = status
        changed, self.changed = self.changed, anyio.Event()
        changed.set()

    async def Watch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        if self.watch_fails:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "watch broken")
        while True:
            changed = self.changed
            yield health_pb2.HealthCheckResponse(status=self.status)
            await changed.wait()


class Observer:
    """Listens to the worker set's events: each refusal (once), each worker that left."""

    def __init__(self) -> None:
        self.refused: list[tuple[str, str]] = []
        self.forgotten: list[str] = []

    def joined(self, worker: Worker) -> None:
        pass

    def changed(self, worker: Worker) -> None:
        refusal = (worker.address, worker.refusal.value) if worker.refusal is not None else None
        if refusal is not None and refusal not in self.refused:
            self.refused.append(refusal)

    def left(self, worker: Worker) -> None:
        self.forgotten.append(worker.address)


@asynccontextmanager
async def scripted(sidecar: ScriptedSidecar, port: int = 0) -> AsyncIterator[str]:
    server = grpc.aio.server()
    sidecar_pb2_grpc.add_WorkerServicer_to_server(sidecar, server)
    health_pb2_grpc.add_HealthServicer_to_server(sidecar, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
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


async def test_every_model_the_workers_serve_is_served_and_a_pick_stays_within_its_model() -> None:
    first, other = ScriptedSidecar("m"), ScriptedSidecar("other")
    async with scripted(first) as a, scripted(other) as b, WorkerSet(FAST_WORKERS) as workers:
        workers.add_worker(a)
        workers.add_worker(b)
        with anyio.fail_after(10):
            await workers.wait_serving(2)
        assert sorted(workers.models()) == ["m", "other"]
        for _ in range(10):
            assert workers.pick(model="m") is workers.get(a)
            assert workers.pick(model="other") is workers.get(b)
        assert workers.pick(model="nobody") is None


async def test_a_model_outside_the_frontends_models_is_refused_and_counted() -> None:
    first, other = ScriptedSidecar("m"), ScriptedSidecar("other")
    observer = Observer()
    config = replace(FAST_WORKERS, models=frozenset({"m"}))
    async with scripted(first) as a, scripted(other) as b, WorkerSet(config) as workers:
        workers.events.subscribe(observer)
        workers.add_worker(a)
        workers.add_worker(b)
        refused = workers.get(b)
        assert refused is not None
        await until(lambda: refused.state is WorkerState.REFUSED, "the other model is refused")
        assert refused.refusal is Refusal.MODEL
        with anyio.fail_after(10):  # the two health watches run apart: a may come second
            await workers.wait_serving()
        assert [w.address for w in workers.serving()] == [a]
        assert list(workers.models()) == ["m"]
        assert observer.refused == [(b, "model")]


@pytest.mark.parametrize(
    ("role", "mode"), [("agg", "decode"), ("agg", "prefill"), ("prefill", "agg"), ("decode", "prefill")]
)
async def test_a_worker_whose_sidecar_runs_another_role_is_refused_and_the_fleet_says_why(
    role: str, mode: str
) -> None:
    sidecar = ScriptedSidecar(mode=mode)
    observer = Observer()
    async with scripted(sidecar) as address, WorkerSet(FAST_WORKERS) as workers:
        workers.events.subscribe(observer)
        workers.add_worker(address, role)
        worker = workers.get(address)
        assert worker is not None
        await until(lambda: worker.state is WorkerState.REFUSED, "refused for its role")
        assert worker.refusal is Refusal.ROLE
        assert not workers.routable()
        assert workers.misconfiguration() == role_mismatch(address, role, mode)
        assert observer.refused == [(address, "role")]


async def test_a_refused_worker_is_checked_again_when_its_sidecar_restarts() -> None:
    sidecar = ScriptedSidecar(mode="decode")
    async with WorkerSet(FAST_WORKERS) as workers:
        async with scripted(sidecar) as address:
            workers.add_worker(address)
            worker = workers.get(address)
            assert worker is not None
            await until(lambda: worker.state is WorkerState.REFUSED, "refused for its role")
        sidecar.mode = "agg"  # the operator fixed the sidecar's flags and restarted it
        async with scripted(sidecar, port=int(address.rsplit(":", 1)[1])):
            with anyio.fail_after(20):
                await workers.wait_serving()
        assert worker.refusal is None
        assert workers.misconfiguration() is None


@pytest.mark.parametrize(
    ("role", "mode", "fits"),
    [
        ("agg", "agg", True),
        ("agg", "", True),
        ("prefill", "prefill", True),
        ("decode", "decode", True),
        ("agg", "decode", False),
        ("agg", "prefill", False),
        ("prefill", "agg", False),
        ("prefill", "decode", False),
        ("decode", "agg", False),
        ("decode", "prefill", False),
    ],
)
def test_role_mismatch_names_the_worker_its_role_and_the_fix(role: str, mode: str, fits: bool) -> None:
    why = role_mismatch("10.0.0.1:50051", role, mode)
    if fits:
        assert why is None
        return
    assert why is not None
    assert why.startswith("worker 10.0.0.1:50051 was given as ")
    assert ("aggregated" if role == "agg" else role) in why
    assert f"--disaggregation-mode {role}" in why


async def test_a_worker_that_does_not_answer_is_reported_with_where_it_dials_at_a_growing_interval() -> None:
    with socket.socket() as sock:  # a port nothing listens on: every dial is refused
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    with structlog.testing.capture_logs() as logs:
        async with WorkerSet(FAST_WORKERS) as workers:
            workers.add_worker(address)

            def reports() -> list[MutableMapping[str, Any]]:
                return [e for e in logs if e["event"] == "waiting for worker"]

            await until(lambda: len(reports()) >= 3, "three reports", secs=30)
    first = reports()[0]
    assert first["dialling"] == f"worker {address} slot 1/1"
    assert "connection to" in first["error"]
    assert first["log_level"] == "warning"
    assert [e["next_report_secs"] for e in reports()[:3]] == [2.0, 4.0, 8.0]


async def test_a_worker_whose_health_watch_keeps_failing_is_reported_at_a_growing_interval() -> None:
    sidecar = ScriptedSidecar(watch_fails=True)
    config = replace(FAST_WORKERS, report_first_secs=0.1, report_max_secs=0.4)
    with structlog.testing.capture_logs() as logs:
        async with scripted(sidecar) as address, WorkerSet(config) as workers:
            workers.add_worker(address)

            def reports() -> list[MutableMapping[str, Any]]:
                return [e for e in logs if e["event"] == "worker not answering"]

            await until(lambda: len(reports()) >= 4, "four reports")
    first = reports()[0]
    assert (first["worker"], first["dialling"]) == (address, address)
    assert "UNAVAILABLE" in first["error"]
    assert [e["next_report_secs"] for e in reports()[:4]] == [0.1, 0.2, 0.4, 0.4]


async def test_prefill_workers_without_a_decode_worker_are_warned_about_once() -> None:
    prefill, aggregated = ScriptedSidecar(mode="prefill"), ScriptedSidecar()
    with structlog.testing.capture_logs() as logs:
        async with scripted(prefill) as p, scripted(aggregated) as a, WorkerSet(FAST_WORKERS) as workers:
            workers.add_worker(p, "prefill")
            workers.add_worker(a)
            with anyio.fail_after(10):
                await workers.wait_serving(1, "prefill")
                await workers.wait_serving(1, "agg")
            worker = workers.get(p)
            assert worker is not None
            aggregated.set_status(health_pb2.HealthCheckResponse.NOT_SERVING)  # another change
            await until(lambda: not workers.serving("agg"), "the aggregated worker stopped serving")
            assert workers.pick("prefill") is worker  # it serves, but nothing sends it work
    warnings = [
        e for e in logs if e["event"] == "prefill workers unused: no decode worker serves their model"
    ]
    assert len(warnings) == 1
    assert warnings[0]["prefill_workers"] == [p]
    assert warnings[0]["log_level"] == "warning"
