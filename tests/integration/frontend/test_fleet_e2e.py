"""The pause-aware fleet end to end (issue 28, "Must show"): testkit SGLang HTTP engines, their
sidecars and a frontend on loopback, the engines paused and updated through their own endpoints
as a trainer does. A fully paused fleet holds new requests (a stream's status too) and serves
them on continue; an engine paused alone is never ejected while the others take the traffic; with
--route-latest-weights a weight update on one engine moves the traffic to it and the others are
pending until they report the new version."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web
from testkit.vllm_engine import VllmEngineConfig, VllmTestEngine

from sidecar_frontend.admin import AdminApi
from sidecar_frontend.fleet import FleetSettings
from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.handler import Frontend, HandlerConfig
from sidecar_frontend.membership import Membership
from sidecar_frontend.metrics import Metrics
from sidecar_frontend.workers import Worker, WorkerSet
from sidecar_server.server import ServerConfig, SidecarServer
from sidecar_vllm.engine import VllmEngine
from tests.integration.frontend.fixtures import FAST_WORKERS, sse_json_events
from tests.sglang_fixtures import sglang_stack
from tests.vllm_fixtures import Stack as VllmStack
from tests.vllm_fixtures import sidecar_config as vllm_sidecar_config

pytestmark = pytest.mark.timeout(120)

WAIT = 30.0
PROMPT = [1, 2, 3, 4, 5]


@dataclass
class Fleet:
    workers: WorkerSet
    engines: list[Any]  # the sidecar stacks (sglang_fixtures.Stack, or a vLLM one)
    url: str
    http: aiohttp.ClientSession
    metrics: Metrics

    def worker(self, index: int) -> Worker:
        worker = self.workers.get(f"127.0.0.1:{self.engines[index].server.port}")
        assert worker is not None
        return worker

    def engine_url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.engines[index].engine.http_port}"

    async def engine_call(self, index: int, path: str, body: object = None) -> None:
        async with self.http.post(self.engine_url(index) + path, json=body) as response:
            assert response.status == 200, await response.text()

    async def pause(self, index: int) -> None:
        await self.engine_call(index, "/pause_generation", {"mode": "in_place"})

    async def resume(self, index: int) -> None:
        await self.engine_call(index, "/continue_generation")

    async def set_version(self, index: int, version: str) -> None:
        await self.engine_call(
            index, "/update_weight_version", {"new_version": version, "abort_all_requests": False}
        )

    async def until(self, done: Callable[[], bool]) -> None:
        """Until the frontend's view satisfies ``done`` (woken by each change of its workers)."""
        with anyio.fail_after(WAIT):
            while True:
                changed = self.workers.next_change()
                if done():
                    return
                await changed.wait()

    async def until_holding(self, count: int) -> None:
        """Until ``count`` requests wait in the frontend for a worker (no event announces it)."""
        with anyio.fail_after(WAIT):
            while self.workers.registry.holding < count:  # noqa: ASYNC110
                await anyio.sleep(0.01)

    async def generate(self, max_tokens: int = 4, **extra: Any) -> tuple[int, dict[str, Any]]:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": max_tokens}, **extra}
        async with self.http.post(self.url + "/generate", json=body) as response:
            return response.status, await response.json()

    async def rows(self) -> dict[str, dict[str, Any]]:
        async with self.http.get(self.url + "/workers") as response:
            assert response.status == 200
            listed = await response.json()
        return {row["url"].removeprefix("grpc://"): row for row in listed["workers"]}


@asynccontextmanager
async def fleet(
    versions: Sequence[str], *, latest: bool = False, hold: float = 600.0
) -> AsyncIterator[Fleet]:
    """One testkit SGLang HTTP engine per version (its launch version), each behind its sidecar,
    and a frontend over them, once every worker serves and its version is known."""
    async with AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(sglang_stack("http", weight_version=v, token_latency_ms=5.0))
            for v in versions
        ]
        running = await stack.enter_async_context(frontend(engines, latest=latest, hold=hold))
        await running.until(lambda: all(w.weight_version is not None for w in running.workers.workers()))
        yield running


@asynccontextmanager
async def frontend(
    engines: Sequence[Any], *, latest: bool = False, hold: float = 600.0
) -> AsyncIterator[Fleet]:
    """A frontend (the SGLang format and the admin routes) over the sidecars of ``engines``,
    once every worker serves."""
    async with AsyncExitStack() as stack:
        config = replace(FAST_WORKERS, fleet=FleetSettings(route_latest_weights=latest, paused_hold=hold))
        workers = await stack.enter_async_context(WorkerSet(config, rand=random.Random(3)))
        for engine in engines:
            workers.add_worker(f"127.0.0.1:{engine.server.port}")
        metrics = Metrics()
        app = Frontend([SGLANG], workers, HandlerConfig(), metrics=metrics).build_app()
        app.add_routes(AdminApi(workers, Membership(workers, "static"), token=None).routes())
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        http = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)))
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        running = Fleet(workers, list(engines), url, http, metrics)
        await running.until(lambda: all(w.eligible for w in workers.workers()))
        yield running


async def test_a_fully_paused_fleet_holds_new_requests_and_serves_them_on_continue() -> None:
    async with fleet(["v1", "v1"]) as f:
        for index in (0, 1):
            await f.pause(index)
        await f.until(lambda: all(w.paused for w in f.workers.workers()))
        assert f.workers.held(f.worker(0).served_model)
        answers: list[tuple[int, dict[str, Any]]] = []
        stream_status: list[int] = []
        stream_events: list[dict[str, Any]] = []

        async def streaming() -> None:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}, "stream": True}
            async with f.http.post(f.url + "/generate", json=body) as response:
                stream_status.append(response.status)
                stream_events.extend(await sse_json_events(response))

        async def plain() -> None:
            answers.append(await f.generate(max_tokens=3))

        async with anyio.create_task_group() as group:
            group.start_soon(plain)
            group.start_soon(streaming)
            await f.until_holding(2)
            assert stream_status == [], "a stream's status waits with its request"
            assert answers == []
            await f.resume(1)
        assert answers[0][0] == 200, answers
        assert answers[0][1]["meta_info"]["completion_tokens"] == 3
        assert stream_status == [200]
        assert stream_events[-1]["meta_info"]["finish_reason"]["type"] == "length"
        assert all(w.ejected_until is None for w in f.workers.workers())
        await f.resume(0)


async def test_a_held_request_whose_client_leaves_is_gone_at_once() -> None:
    async with fleet(["v1"]) as f:
        await f.pause(0)
        await f.until(lambda: f.worker(0).paused)
        async with anyio.create_task_group() as group:
            group.start_soon(f.generate)
            await f.until_holding(1)
            group.cancel_scope.cancel()  # the client goes away
        with anyio.fail_after(WAIT):
            while f.workers.registry.holding:  # noqa: ASYNC110 - no event announces it
                await anyio.sleep(0.01)
        await f.resume(0)
        await f.until(lambda: f.worker(0).takes_new)
        book = f.engines[0].engine.book
        assert book.requests() == [], "it never reached the engine"
        status, _ = await f.generate()
        assert status == 200
        assert len(book.requests()) == 1


async def test_past_the_hold_a_request_is_answered_503_with_the_reason() -> None:
    async with fleet(["v1"], hold=0.2) as f:
        await f.pause(0)
        await f.until(lambda: f.worker(0).paused)
        status, body = await f.generate()
        assert status == 503
        assert "paused" in str(body)
        assert "--paused-hold-secs" in str(body)
        await f.resume(0)
        await f.until(lambda: f.worker(0).takes_new)
        status, _ = await f.generate()
        assert status == 200


async def test_an_engine_paused_alone_is_not_ejected_and_the_others_take_the_traffic() -> None:
    # Each engine at its own launch version: the answer's meta_info names the one that served.
    async with fleet(["a", "b", "c"]) as f:
        await f.pause(0)
        await f.until(lambda: f.worker(0).paused)
        served = []
        for _ in range(12):
            status, body = await f.generate()
            assert status == 200, body
            served.append(body["meta_info"]["weight_version"])
        assert len(served) == 12
        assert set(served) <= {"b", "c"}, "never the paused engine"
        paused = f.worker(0)
        assert paused.eligible, "paused is not down"
        assert paused.ejected_until is None
        rows = await f.rows()
        assert rows[paused.address]["state"] == "paused"
        assert rows[paused.address]["weight_version"] == "a"
        await f.resume(0)
        await f.until(lambda: f.worker(0).takes_new)
        assert (await f.rows())[paused.address]["state"] == "serving"


async def test_a_request_at_an_engine_paused_in_place_stays_there_and_ends_on_continue() -> None:
    async with fleet(["a", "b"]) as f:
        await f.pause(1)  # so that the request goes to engine a
        await f.until(lambda: f.worker(1).paused)
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 200}, "stream": True}
        async with f.http.post(f.url + "/generate", json=body) as response:
            assert response.status == 200
            first = await response.content.readline()
            assert first.startswith(b"data: ")
            await f.pause(0)  # mid-generation: SGLang keeps it, to run on continue
            await f.until(lambda: f.worker(0).paused)
            await f.resume(1)  # somewhere to move to, were it moved: it is not
            await f.until(lambda: f.worker(1).takes_new)
            await f.resume(0)
            events = [json.loads(first.decode().removeprefix("data: "))]
            events += await sse_json_events(response)
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
        assert events[-1]["meta_info"]["completion_tokens"] == 200
        assert {e["meta_info"]["weight_version"] for e in events} == {"a"}, "it stayed on its engine"
        assert f.metrics.registry.get_sample_value(
            "frontend_migrations_total", {"format": "sglang", "outcome": "migrated"}
        ) in (None, 0.0)
        assert f.worker(0).ejected_until is None


async def test_with_route_latest_weights_an_update_moves_the_traffic_and_the_others_are_pending() -> None:
    async with fleet(["v1", "v1", "v1"], latest=True) as f:
        await f.set_version(1, "v2")
        await f.until(lambda: f.workers.registry.versions.newest == "v2")
        for _ in range(8):
            status, body = await f.generate()
            assert status == 200, body
            assert body["meta_info"]["weight_version"] == "v2", "never an engine behind the newest version"
        rows = await f.rows()
        states = {address: row["state"] for address, row in rows.items()}
        assert states == {
            f.worker(0).address: "pending",
            f.worker(1).address: "serving",
            f.worker(2).address: "pending",
        }
        await f.set_version(0, "v2")
        await f.until(lambda: f.worker(0).takes_new)
        assert (await f.rows())[f.worker(0).address]["state"] == "serving"
        assert (await f.rows())[f.worker(2).address]["state"] == "pending"
        async with f.http.get(f.url + "/weight_version") as response:
            answer = await response.json()
        assert answer["weight_version"] == "v2"
        assert answer["mixed"] is True
        assert answer["versions"] == {"v1": 1, "v2": 2}


async def test_a_recovered_engine_is_pending_until_it_reports_the_current_version() -> None:
    async with fleet(["v1", "v1"], latest=True) as f:
        for index in (0, 1):
            await f.set_version(index, "v2")
        await f.until(lambda: all(w.weight_version == "v2" for w in f.workers.workers()))
        # Engine 0 dies and comes back at its launch weights (v1), as a restarted engine does.
        restarted = f.engines[0].engine.restart(startup_delay_secs=1.0)
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: restarted)
            await f.until(lambda: not f.worker(0).eligible)
        await f.until(lambda: f.worker(0).eligible and f.worker(0).weight_version == "v1")
        assert f.workers.registry.versions.newest == "v2", "a recovered engine does not pull the fleet back"
        assert (await f.rows())[f.worker(0).address]["state"] == "pending"
        for _ in range(6):
            status, body = await f.generate()
            assert status == 200, body
            assert body["meta_info"]["weight_version"] == "v2"
        await f.set_version(0, "v2")
        await f.until(lambda: f.worker(0).takes_new)
        assert (await f.rows())[f.worker(0).address]["state"] == "serving"


@asynccontextmanager
async def vllm_unwatched() -> AsyncIterator[VllmStack]:
    """A testkit vLLM engine and its sidecar, which reads its engine's pause state only once a
    minute: the frontend learns of a pause only from the engine's refusals."""
    engine = VllmTestEngine(VllmEngineConfig(token_latency_ms=5.0))
    port = await engine.start()
    adapter = VllmEngine(vllm_sidecar_config(port))
    server = SidecarServer(adapter, ServerConfig(listen="127.0.0.1:0", health_watch_interval=60.0))
    try:
        await adapter.start()
        await server.start()
        server.set_serving()
        yield VllmStack(engine, adapter, server, None)
    finally:
        await server.stop()
        await adapter.close()
        await engine.stop(0)


async def test_a_request_a_paused_engine_refuses_goes_on_elsewhere_and_counts_against_nothing() -> None:
    async with AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(vllm_unwatched()) for _ in range(2)]
        f = await stack.enter_async_context(frontend(engines))
        await engines[0].engine.pause_generation("abort")  # vLLM refuses new requests meanwhile
        # Until a request meets the pause (each is placed at random among the two workers).
        for _ in range(60):
            status, body = await f.generate()
            assert status == 200, body
            if f.worker(0).paused:
                break
        assert f.worker(0).paused, "the engine's refusal marked it paused"
        assert f.worker(0).ejected_until is None
        status, body = await f.generate()
        assert status == 200, body
        retried = f.metrics.registry.get_sample_value("frontend_retries_total", {"format": "sglang"})
        assert retried in (None, 0.0), "a paused engine's refusal is no move"
        engines[0].engine.resume_generation()
