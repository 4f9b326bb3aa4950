"""A frontend over real sidecars on loopback, in-process: testkit engines, their sidecars
(tests/vllm_fixtures, tests/sglang_fixtures), a WorkerSet and the aiohttp app on a free port.
(Plain async context managers, as the other suites' stacks.)"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
from aiohttp import web
from testkit.faults import FaultBook

from sidecar_common.tracing import Tracing
from sidecar_frontend.admission.gate import Gate, WakeOnWorkerEvents
from sidecar_frontend.admission.metrics import AdmissionMetrics
from sidecar_frontend.admission.rates import RateLimiter
from sidecar_frontend.config import AdmissionConfig
from sidecar_frontend.formats.base import Format
from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from sidecar_frontend.handler import Frontend, HandlerConfig
from sidecar_frontend.metrics import Metrics
from sidecar_frontend.routing.router import RouterConfig
from sidecar_frontend.routing.streams import StreamConfig
from sidecar_frontend.routing.wiring import RoutingParts
from sidecar_frontend.workers import Worker, WorkerListener, WorkerSet, WorkerSetConfig
from tests.integration.frontend.plugin import FORMAT as PROBE
from tests.sglang_fixtures import sglang_stack
from tests.vllm_fixtures import Stack, vllm_stack

__all__ = [
    "FAST_WORKERS",
    "FrontendStack",
    "frontend_over",
    "frontend_stack",
    "sse_events",
    "sse_json_events",
    "two_workers",
]

FAST_WORKERS = WorkerSetConfig(connections=1, rpc_timeout=2.0, load_poll_interval=0.1, rewatch_interval=0.05)
FAST_STREAMS = StreamConfig(ready_check_secs=0.05, retry_first_secs=0.05, retry_max_secs=0.5)


@dataclass
class FrontendStack:
    frontend: Frontend
    workers: WorkerSet
    metrics: Metrics
    url: str
    http: aiohttp.ClientSession
    sidecars: list[Any]  # the sidecar stacks (vllm_fixtures.Stack / sglang_fixtures.Stack)
    routing: RoutingParts | None = None  # None: routed by load
    gate: Gate | None = None  # None: no admission

    def address(self, index: int) -> str:
        return f"127.0.0.1:{self.sidecars[index].server.port}"


@asynccontextmanager
async def frontend_over(
    addresses: Sequence[str],
    sidecars: list[Any],
    *,
    formats: Sequence[Format] = (PROBE,),
    config: HandlerConfig | None = None,
    serving: int | None = None,
    seed: int = 7,
    tracing: Tracing | None = None,
    routing: RouterConfig | None = None,
    listener: WorkerListener[Worker] | None = None,
    metrics: Metrics | None = None,
    admission: AdmissionConfig | None = None,
    limiter: RateLimiter | None = None,
) -> AsyncIterator[FrontendStack]:
    """A frontend whose workers are ``addresses``; waits until ``serving`` of them serve.
    Without ``routing`` it chooses by load (the worker set's power of two choices). Without
    ``admission`` (or with it disabled) every request goes straight to a worker."""
    metrics = metrics if metrics is not None else Metrics()
    parts = (
        RoutingParts.build(routing, metrics.registry, rand=random.Random(seed), streams=FAST_STREAMS)
        if routing is not None
        else None
    )
    async with WorkerSet(FAST_WORKERS, rand=random.Random(seed)) as workers:
        if listener is not None:
            workers.events.subscribe(listener)
        choice = parts.choice(workers) if parts is not None else None
        for address in addresses:
            workers.add_worker(address)
        with anyio.fail_after(20):
            await workers.wait_serving(len(addresses) if serving is None else serving)
        gate: Gate | None = None
        if admission is not None and admission.enabled:
            observer = AdmissionMetrics(metrics.registry, max_wait=admission.settings.max_queue_wait)
            gate = Gate(workers.registry, admission, limiter=limiter, observer=observer)
            observer.watch(gate.queued, gate.every_load)
            workers.events.subscribe(WakeOnWorkerEvents(gate))
        frontend = Frontend(
            formats,
            workers,
            config or HandlerConfig(),
            metrics=metrics,
            tracing=tracing,
            choice=choice,
            watch=choice,
            gate=gate,
        )
        runner = web.AppRunner(frontend.build_app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http,
                anyio.create_task_group() as group,
            ):
                if gate is not None:
                    group.start_soon(gate.run_ticker)
                yield FrontendStack(
                    frontend, workers, metrics, f"http://127.0.0.1:{port}", http, sidecars, parts, gate
                )
                group.cancel_scope.cancel()
        finally:
            await runner.cleanup()


@asynccontextmanager
async def frontend_stack(
    count: int = 1,
    *,
    config: HandlerConfig | None = None,
    engines: Sequence[dict[str, Any]] = (),
    **kwargs: Any,
) -> AsyncIterator[FrontendStack]:
    """``count`` vLLM sidecars (each over its own testkit engine) behind one frontend."""
    async with AsyncExitStack() as stack:
        sidecars: list[Stack] = []
        for index in range(count):
            engine_config = engines[index] if index < len(engines) else {}
            sidecars.append(await stack.enter_async_context(vllm_stack(**engine_config)))
        addresses = [f"127.0.0.1:{s.server.port}" for s in sidecars]
        async with frontend_over(addresses, list(sidecars), config=config, **kwargs) as fe:
            yield fe


@asynccontextmanager
async def two_workers(
    engine: str,
    config: HandlerConfig | None = None,
    *,
    formats: Sequence[Format] = (SGLANG, VLLM),
    shared_faults: bool = False,
) -> AsyncIterator[FrontendStack]:
    """Two sidecars of one engine kind ("vllm", "sglang-grpc", "sglang-http"), their testkit
    engines 15 ms a token, behind one frontend: the migration tests' fleet.

    ``shared_faults``: one fault book for both engines, so a fault fires once, on whichever
    runs the request first, and the continuation on the other one runs clean."""
    async with AsyncExitStack() as stack:
        sidecars: list[Any] = []
        for _ in range(2):
            if engine == "vllm":
                cm: Any = vllm_stack(token_latency_ms=15.0)
            else:
                cm = sglang_stack(engine.removeprefix("sglang-"), token_latency_ms=15.0)  # type: ignore[arg-type]
            sidecars.append(await stack.enter_async_context(cm))
        if shared_faults:
            shared = FaultBook()
            for sidecar in sidecars:
                sidecar.engine.faults = shared
        addresses = [f"127.0.0.1:{s.server.port}" for s in sidecars]
        async with frontend_over(addresses, sidecars, formats=formats, config=config) as fe:
            yield fe


async def sse_json_events(response: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    """Every ``data:`` payload of an SSE response but the closing ``[DONE]``, as JSON, in order."""
    return [json.loads(event) for event in await sse_events(response) if event != "[DONE]"]


async def sse_events(response: aiohttp.ClientResponse) -> list[str]:
    """Every ``data:`` payload of an SSE response, in order."""
    events = []
    async for line in response.content:
        text = line.decode().rstrip("\r\n")
        if text.startswith("data: "):
            events.append(text[len("data: ") :])
    return events
