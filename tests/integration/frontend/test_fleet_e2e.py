"""The pause-aware fleet end to end (issue 28, "Must show"): testkit SGLang HTTP engines, their
sidecars and a frontend on loopback, the engines paused and updated through their own endpoints
as a trainer does. A fully paused fleet holds new requests (a stream's status too) and serves
them on continue; an engine paused alone is never ejected while the others take the traffic; with
--route-latest-weights a weight update on one engine moves the traffic to it and the others are
pending until they report the new version."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web

from sidecar_frontend.admin import AdminApi
from sidecar_frontend.fleet import FleetSettings
from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.handler import Frontend, HandlerConfig
from sidecar_frontend.membership import Membership
from sidecar_frontend.metrics import Metrics
from sidecar_frontend.workers import Worker, WorkerSet
from tests.integration.frontend.fixtures import FAST_WORKERS, sse_json_events
from tests.sglang_fixtures import Stack, sglang_stack

pytestmark = pytest.mark.timeout(120)

WAIT = 30.0
PROMPT = [1, 2, 3, 4, 5]


@dataclass
class Fleet:
    workers: WorkerSet
    engines: list[Stack]
    url: str
    http: aiohttp.ClientSession

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
    and a frontend (the SGLang format and the admin routes) over them."""
    async with AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(sglang_stack("http", weight_version=v, token_latency_ms=5.0))
            for v in versions
        ]
        config = replace(FAST_WORKERS, fleet=FleetSettings(route_latest_weights=latest, paused_hold=hold))
        workers = await stack.enter_async_context(WorkerSet(config, rand=random.Random(3)))
        for engine in engines:
            workers.add_worker(f"127.0.0.1:{engine.server.port}")
        frontend = Frontend([SGLANG], workers, HandlerConfig(), metrics=Metrics())
        app = frontend.build_app()
        app.add_routes(AdminApi(workers, Membership(workers, "static"), token=None).routes())
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        http = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)))
        running = Fleet(workers, engines, f"http://127.0.0.1:{runner.addresses[0][1]}", http)
        # Every worker serving and its version known: the fleet as a trainer finds it.
        await running.until(
            lambda: (
                all(
                    w.takes_new or (latest and w.eligible and w.weight_version is not None)
                    for w in workers.workers()
                )
                and all(w.weight_version is not None for w in workers.workers())
            )
        )
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
        assert "a" not in served
        assert set(served) == {"b", "c"}
        paused = f.worker(0)
        assert paused.eligible, "paused is not down"
        assert paused.ejected_until is None
        rows = await f.rows()
        assert rows[paused.address]["state"] == "paused"
        assert rows[paused.address]["weight_version"] == "a"
        await f.resume(0)
        await f.until(lambda: f.worker(0).takes_new)
        assert (await f.rows())[paused.address]["state"] == "serving"


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
