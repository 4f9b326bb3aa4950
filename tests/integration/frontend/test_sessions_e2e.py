"""Sticky sessions through the frontend over testkit vLLM engines and their sidecars, observed
at the engines (which engine received which turn): a session's turns land on one worker, new
sessions on the least loaded, /finish_session frees a worker, a turn leaves a saturated worker
and a worker that failed it."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
from aiohttp import web
from testkit.faults import FaultKind, FaultPlan

from sidecar_frontend.handler import Frontend, HandlerConfig
from sidecar_frontend.metrics import Metrics
from sidecar_frontend.routing.router import RouterConfig, Routing
from sidecar_frontend.routing.wiring import RoutingParts
from sidecar_frontend.workers import WorkerSet
from tests.integration.frontend.fixtures import FAST_STREAMS, FAST_WORKERS
from tests.integration.frontend.plugin import FORMAT as PROBE
from tests.vllm_fixtures import Stack, vllm_stack


@dataclass
class Fleet:
    url: str
    http: aiohttp.ClientSession
    sidecars: list[Stack]
    metrics: Metrics

    def engine_of(self, rid: str) -> int:
        """The index of the one engine that received the request ``rid``."""
        found = [
            index
            for index, sidecar in enumerate(self.sidecars)
            for got, _ in sidecar.engine.book.received
            if got.endswith(f"-{rid}")
        ]
        assert len(found) == 1, f"{rid} reached engines {found}"
        return found[0]

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    async def turn(self, header: str, session: str, rid: str, prompt: list[int]) -> list[int]:
        """One unary turn of ``session`` (named by ``header``); the tokens it produced."""
        body = {"ids": prompt, "max": 3, "rid": rid}
        async with self.http.post(self.url + "/t/generate", json=body, headers={header: session}) as response:
            assert response.status == 200
            output = (await response.json())["outputs"][0]
        assert output["error"] is None
        tokens: list[int] = output["ids"]
        return tokens


@asynccontextmanager
async def fleet(count: int, **engine_config: Any) -> AsyncIterator[Fleet]:
    """``count`` vLLM sidecars over testkit engines behind a frontend with sessions on (the
    server's wiring: the routing parts' choice, middlewares and routes)."""
    async with AsyncExitStack() as stack:
        sidecars = [await stack.enter_async_context(vllm_stack(**engine_config)) for _ in range(count)]
        metrics = Metrics()
        parts = RoutingParts.build(
            RouterConfig(routing=Routing.APPROX),
            metrics.registry,
            rand=random.Random(7),
            streams=FAST_STREAMS,
        )
        workers = await stack.enter_async_context(WorkerSet(FAST_WORKERS, rand=random.Random(7)))
        choice = parts.choice(workers)
        for sidecar in sidecars:
            workers.add_worker(f"127.0.0.1:{sidecar.server.port}")
        with anyio.fail_after(20):
            await workers.wait_serving(count)
        frontend = Frontend(
            (PROBE,),
            workers,
            HandlerConfig(),
            metrics=metrics,
            choice=choice,
            watch=choice,
            middlewares=parts.middlewares(),
        )
        runner = web.AppRunner(
            frontend.build_app(parts.http_routes()), handler_cancellation=True, access_log=None
        )
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        http = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)))
        yield Fleet(f"http://127.0.0.1:{port}", http, sidecars, metrics)


def prompt_of(session: int) -> list[int]:
    return [100 + session * 10 + n for n in range(8)]


async def test_a_sessions_turns_land_on_one_worker_and_new_sessions_on_different_ones() -> None:
    headers = ("X-SMG-Routing-Key", "X-Session-ID", "x-session-id")  # slime, SkyRL, prime-rl
    async with fleet(3) as fe:

        async def conversation(n: int) -> None:
            prompt = prompt_of(n)
            for turn in range(3):
                prompt = [*prompt, *await fe.turn(headers[n], f"sess-{n}", f"s{n}-t{turn}", prompt), 7]

        # The first turns one after the other: each starts on the worker holding the fewest.
        for n in range(3):
            await fe.turn(headers[n], f"sess-{n}", f"s{n}-first", prompt_of(n))
        async with anyio.create_task_group() as group:
            for n in range(3):
                group.start_soon(conversation, n)
        homes = [fe.engine_of(f"s{n}-first") for n in range(3)]
        assert sorted(homes) == [0, 1, 2]
        for n in range(3):
            assert {fe.engine_of(f"s{n}-t{turn}") for turn in range(3)} == {homes[n]}
        assert fe.metric("frontend_sessions_started_total", role="agg") == 3
        assert fe.metric("frontend_sessions_moved_total", role="agg", reason="saturated") == 0


async def test_finish_session_frees_its_worker_for_the_next_new_session() -> None:
    async with fleet(2) as fe:
        await fe.turn("X-Session-ID", "a", "a-1", prompt_of(1))
        await fe.turn("X-Session-ID", "b", "b-1", prompt_of(2))
        assert {fe.engine_of("a-1"), fe.engine_of("b-1")} == {0, 1}
        async with fe.http.post(fe.url + "/finish_session", params={"session_id": "a"}) as response:
            assert response.status == 200
            assert await response.json() == {"status": "ok", "session_id": "a"}
        assert fe.metric("frontend_sessions_ended_total", reason="finished") == 1
        # a's worker now holds no session, b's one: the new session goes where a was.
        await fe.turn("X-Session-ID", "c", "c-1", prompt_of(3))
        assert fe.engine_of("c-1") == fe.engine_of("a-1")
        for sidecar in fe.sidecars:
            assert fe.metric("frontend_sessions_held", worker=f"127.0.0.1:{sidecar.server.port}") == 1


async def test_a_turn_leaves_its_saturated_worker_and_the_session_stays_where_it_moved() -> None:
    # Each engine runs one sequence at a time (max_num_seqs 1, its sidecar reports it): one
    # request in flight saturates a worker.
    async with fleet(2, max_num_seqs=1) as fe:
        first = await fe.turn("X-SMG-Routing-Key", "s", "t1", prompt_of(1))
        home = fe.engine_of("t1")
        away = 1 - home
        fe.sidecars[home].engine.faults.add("-t2", FaultPlan(FaultKind.HANG, after=1))
        body = {"ids": [*prompt_of(1), *first], "max": 50, "rid": "t2", "stream": True}
        async with fe.http.post(
            fe.url + "/t/generate", json=body, headers={"X-SMG-Routing-Key": "s"}
        ) as held:
            # Its first token came: the turn runs on the session's worker, which is now full.
            line = await held.content.readline()
            assert json.loads(line.decode().removeprefix("data: "))["ids"]
            assert fe.engine_of("t2") == home
            await fe.turn("X-SMG-Routing-Key", "s", "t3", [*prompt_of(1), *first, 5])
            assert fe.engine_of("t3") == away
            assert fe.metric("frontend_sessions_moved_total", role="agg", reason="saturated") == 1
        # The held turn is gone (its client left); the session stays where it moved.
        for turn in (4, 5, 6):
            await fe.turn("X-SMG-Routing-Key", "s", f"t{turn}", prompt_of(turn))
        assert [fe.engine_of(f"t{turn}") for turn in (4, 5, 6)] == [away] * 3
        assert fe.metric("frontend_sessions_moved_total", role="agg", reason="saturated") == 1


async def test_a_turn_its_worker_fails_moves_the_session_with_it() -> None:
    async with fleet(2) as fe:
        await fe.turn("X-Session-ID", "s", "f1", prompt_of(1))
        home = fe.engine_of("f1")
        # The session's worker refuses the next turn before any token: it is retried elsewhere.
        fe.sidecars[home].engine.faults.add("-f2", FaultPlan(FaultKind.FAIL_OPEN))
        await fe.turn("X-Session-ID", "s", "f2", prompt_of(1))
        for turn in (3, 4, 5):
            await fe.turn("X-Session-ID", "s", f"f{turn}", prompt_of(turn))
        away = 1 - home
        assert [fe.engine_of(f"f{turn}") for turn in (3, 4, 5)] == [away] * 3
        assert fe.metric("frontend_sessions_moved_total", role="agg", reason="failover") == 1
