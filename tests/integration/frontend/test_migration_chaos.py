"""Seeded chaos: sidecars are stopped and replaced under 200 concurrent streams (both formats)
through one frontend. Every stream that completes equals the no-failure output (the
continuation law, for every request that migrated); a stream that does not complete ends with
a typed error in its format; each engine request ends exactly once (one completion or one
abort, never both, never twice) and nothing is left running anywhere.

The sidecars run in-process over testkit vLLM engines that outlive them: a stopped sidecar's
generations end with a migratable ENGINE_SHUTDOWN, and its replacement (a new sidecar on the
same engine, a new address) joins the worker set as discovery would add it."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web
from testkit.book import Outcome
from testkit.generator import SamplingSpec, generate
from testkit.vllm_engine import VllmEngineConfig, VllmTestEngine

from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from sidecar_frontend.handler import Frontend, HandlerConfig
from sidecar_frontend.metrics import Metrics
from sidecar_frontend.workers import WorkerSet
from sidecar_server.server import ServerConfig, SidecarServer
from sidecar_vllm.engine import VllmEngine
from tests.e2e_helpers import until
from tests.integration.frontend.fixtures import FAST_WORKERS
from tests.vllm_fixtures import sidecar_config

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow(10)]

SEED = 20261201
STREAMS = 200
MAX_TOKENS = 30
WORKERS = 3
KILLS = 4


@dataclass(eq=False)
class Sidecar:
    engine: VllmTestEngine
    adapter: VllmEngine
    server: SidecarServer

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    async def stop(self) -> None:
        await self.server.stop()
        await self.adapter.close()


async def start_sidecar(engine: VllmTestEngine) -> Sidecar:
    adapter = VllmEngine(sidecar_config(engine.port))
    server = SidecarServer(
        adapter, ServerConfig(listen="127.0.0.1:0", drain_timeout=0.0, health_watch_interval=0.2)
    )
    await adapter.start()
    await server.start()
    server.set_serving()
    return Sidecar(engine, adapter, server)


@dataclass
class Fleet:
    engines: list[VllmTestEngine]
    live: list[Sidecar]
    workers: WorkerSet
    frontend: Frontend
    metrics: Metrics
    url: str
    http: aiohttp.ClientSession
    stopped: list[Sidecar] = field(default_factory=list)


@asynccontextmanager
async def fleet() -> AsyncIterator[Fleet]:
    async with AsyncExitStack() as stack:
        engines = []
        for _ in range(WORKERS):
            engine = VllmTestEngine(VllmEngineConfig(token_latency_ms=20.0, max_num_seqs=512))
            await engine.start()
            stack.push_async_callback(engine.stop, 0)
            engines.append(engine)
        live = [await start_sidecar(engine) for engine in engines]
        metrics = Metrics()
        workers = await stack.enter_async_context(WorkerSet(FAST_WORKERS, rand=random.Random(SEED)))
        for sidecar in live:
            workers.add_worker(sidecar.address)
        with anyio.fail_after(20):
            await workers.wait_serving(WORKERS)
        frontend = Frontend((SGLANG, VLLM), workers, HandlerConfig(), metrics=metrics)
        runner = web.AppRunner(frontend.build_app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        connector = aiohttp.TCPConnector(limit=0)
        http = await stack.enter_async_context(
            aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60))
        )
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        the_fleet = Fleet(engines, live, workers, frontend, metrics, url, http)
        try:
            yield the_fleet
        finally:
            for sidecar in the_fleet.live:
                await sidecar.stop()


def prompt_of(n: int) -> list[int]:
    return [1000 + n, 2000 + n % 7, 3000 + n % 11]


def expected(model: Any, n: int) -> list[int]:
    return [t.token_id for t in generate(model, prompt_of(n), SamplingSpec(max_tokens=MAX_TOKENS))]


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None


async def run_stream(fl: Fleet, n: int, delivered: list[int]) -> Result:
    """Stream ``n``: even ones SGLang /generate (incremental events here), odd ones vLLM."""
    result = Result()
    if n % 2 == 0:
        path = "/generate"
        body: dict[str, Any] = {
            "input_ids": prompt_of(n),
            "rid": f"c{n}",
            "stream": True,
            "sampling_params": {"max_new_tokens": MAX_TOKENS},
        }
    else:
        path = "/inference/v1/generate"
        body = {
            "token_ids": prompt_of(n),
            "request_id": f"c{n}",
            "stream": True,
            "sampling_params": {"max_tokens": MAX_TOKENS},
        }
    async with fl.http.post(fl.url + path, json=body) as response:
        assert response.status == 200
        async for line in response.content:
            text = line.decode().rstrip("\r\n")
            if not text.startswith("data: ") or text == "data: [DONE]":
                continue
            event = json.loads(text[len("data: ") :])
            before = len(result.tokens)
            if n % 2 == 0:
                result.tokens = event["output_ids"]  # cumulative
                reason = event["meta_info"]["finish_reason"]
                if reason is not None:
                    result.finish = reason["type"]
                    if reason["type"] == "abort":
                        result.error = reason.get("message", "abort")
            elif "error" in event:
                result.error = event["error"]["message"]
            else:
                for choice in event["choices"]:
                    result.tokens.extend(choice["token_ids"])
                    if choice.get("finish_reason"):
                        result.finish = choice["finish_reason"]
            delivered[0] += len(result.tokens) - before
    return result


async def test_seeded_chaos_keeps_every_completed_stream_whole_and_every_engine_request_ends_once() -> None:
    rand = random.Random(SEED)
    async with fleet() as fl:
        model = fl.engines[0].config.model
        delivered = [0]
        results: dict[int, Result] = {}
        total = STREAMS * MAX_TOKENS
        # Kill points: after these many tokens reached the clients (events, not clocks).
        marks = sorted(rand.randrange(total // 10, total * 7 // 10) for _ in range(KILLS))

        async def one(n: int) -> None:
            results[n] = await run_stream(fl, n, delivered)

        async with anyio.create_task_group() as group:
            for n in range(STREAMS):
                group.start_soon(one, n)
            for mark in marks:
                await until(lambda m=mark: delivered[0] >= m or len(results) == STREAMS, "tokens flowed", 60)  # type: ignore[misc]
                victim = fl.live.pop(rand.randrange(len(fl.live)))
                # As etcd discovery sees it: the key goes first, then the sidecar stops.
                fl.workers.drain_worker(victim.address)
                await victim.stop()
                fl.stopped.append(victim)
                replacement = await start_sidecar(victim.engine)
                fl.live.append(replacement)
                fl.workers.add_worker(replacement.address)

        migrated = 0
        for n, result in sorted(results.items()):
            if result.error is None:
                assert result.tokens == expected(model, n), (n, result)
                assert result.finish == "length", n
            else:
                # Only a request that moved more than the limit allows may fail; typed as the format does.
                assert result.finish in (None, "abort"), (n, result)
        migrated = int(
            fl.metrics.registry.get_sample_value(
                "frontend_migrations_total", {"format": "sglang", "outcome": "migrated"}
            )
            or 0
        ) + int(
            fl.metrics.registry.get_sample_value(
                "frontend_migrations_total", {"format": "vllm", "outcome": "migrated"}
            )
            or 0
        )
        completed = sum(1 for r in results.values() if r.error is None)
        assert migrated >= KILLS, "each kill cut streams that had delivered tokens"
        assert completed >= STREAMS - 5, f"only {completed} of {STREAMS} completed"

        await until(lambda: fl.frontend.inflight == 0, "the frontend is idle")
        await until(lambda: all(e.running_count() == 0 for e in fl.engines), "the engines are idle")
        for engine in fl.engines:
            book = engine.book
            ends = Counter(r.request_id for r in book.finished)
            received = [rid for rid, _ in book.received]
            assert len(received) == len(set(received))
            assert all(ends[rid] == 1 for rid in received), "every engine request ended exactly once"
            aborts = Counter(book.aborts)
            assert all(count == 1 for count in aborts.values()), "no request aborted twice"
            # Engine requests cut by a stop ended aborted; a completion may cross the abort on
            # the wire (the engine ignores an abort of a finished request), so a FINISHED
            # record may have one abort too, but an aborted one always has its abort.
            for record in book.finished:
                if record.outcome is Outcome.ABORTED:
                    assert aborts[record.request_id] == 1
