"""A session's turn whose worker is paused by its trainer waits for it rather than moving (its
fleet's engines continue a moment apart, and the session's prefix is cached there), for at most
--session-pause-wait-secs, then moves; a fresh turn with another worker running is no reason to
leave. vLLM testkit engines paused in ``keep`` mode (they take requests and run none: paused,
not down), each behind its sidecar, which reports the pause."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web

from sidecar_frontend.handler import Frontend, HandlerConfig
from sidecar_frontend.metrics import Metrics
from sidecar_frontend.routing.router import RouterConfig, Routing
from sidecar_frontend.routing.sessions import SessionSettings
from sidecar_frontend.routing.wiring import RoutingParts
from sidecar_frontend.workers import WorkerSet
from tests.integration.frontend.fixtures import FAST_STREAMS, FAST_WORKERS
from tests.integration.frontend.plugin import FORMAT as PROBE
from tests.integration.frontend.test_sessions_e2e import Fleet, prompt_of
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(90)

HEADER = "X-SMG-Routing-Key"


@asynccontextmanager
async def fleet(count: int, pause_wait: float) -> AsyncIterator[tuple[Fleet, WorkerSet]]:
    async with AsyncExitStack() as stack:
        sidecars = [await stack.enter_async_context(vllm_stack()) for _ in range(count)]
        metrics = Metrics()
        config = RouterConfig(routing=Routing.APPROX, sessions=SessionSettings(pause_wait=pause_wait))
        parts = RoutingParts.build(config, metrics.registry, rand=random.Random(7), streams=FAST_STREAMS)
        workers = await stack.enter_async_context(WorkerSet(FAST_WORKERS, rand=random.Random(7)))
        choice = parts.choice(workers)
        for sidecar in sidecars:
            workers.add_worker(f"127.0.0.1:{sidecar.server.port}")
        with anyio.fail_after(20):
            await workers.wait_serving(count)
        frontend = Frontend(
            (PROBE,), workers, HandlerConfig(), metrics=metrics, choice=choice, watch=choice,
            middlewares=parts.middlewares(),
        )  # fmt: skip
        runner = web.AppRunner(
            frontend.build_app(parts.http_routes()), handler_cancellation=True, access_log=None
        )
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        http = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)))
        yield Fleet(f"http://127.0.0.1:{runner.addresses[0][1]}", http, sidecars, metrics), workers


async def until_seen(workers: WorkerSet, address: str, paused: bool) -> None:
    with anyio.fail_after(30):
        while True:
            changed = workers.next_change()
            worker = workers.get(address)
            if worker is not None and worker.paused is paused:
                return
            await changed.wait()


def address_of(fe: Fleet, index: int) -> str:
    return f"127.0.0.1:{fe.sidecars[index].server.port}"


async def test_a_turn_waits_for_its_paused_worker_and_stays_there() -> None:
    async with fleet(2, pause_wait=60.0) as (fe, workers):
        await fe.turn(HEADER, "s", "first", prompt_of(1))
        home = fe.engine_of("first")
        engine: Any = fe.sidecars[home].engine
        await engine.pause_generation("keep")
        await until_seen(workers, address_of(fe, home), paused=True)
        turn = asyncio.ensure_future(fe.turn(HEADER, "s", "second", prompt_of(1)))
        engine.resume_generation()
        await turn
        assert fe.engine_of("second") == home
        assert fe.metric("frontend_sessions_moved_total", role="agg", reason="unavailable") == 0


async def test_a_turn_moves_once_its_worker_stayed_paused_past_the_wait() -> None:
    async with fleet(2, pause_wait=0.0) as (fe, workers):
        await fe.turn(HEADER, "s", "first", prompt_of(1))
        home = fe.engine_of("first")
        engine: Any = fe.sidecars[home].engine
        await engine.pause_generation("keep")
        try:
            await until_seen(workers, address_of(fe, home), paused=True)
            await fe.turn(HEADER, "s", "second", prompt_of(1))
        finally:
            engine.resume_generation()
        assert fe.engine_of("second") == 1 - home
        assert fe.metric("frontend_sessions_moved_total", role="agg", reason="unavailable") == 1
