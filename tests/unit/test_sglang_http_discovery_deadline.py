"""SGLang over HTTP: the discovery GETs after /health are bounded by what is left of the one
start-up deadline, not by a fresh attempt timeout each."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from sidecar_common.endpoint import parse_endpoint
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_common.pool import PoolConfig, RetryPolicy
from sidecar_server.config import SidecarConfig
from sidecar_sglang.http_transport import over_http
from tests.fakes_clock import FakeClock

pytestmark = pytest.mark.timeout(30)

STARTUP_DEADLINE = 10.0
ATTEMPT_TIMEOUT = 5.0
# Virtual seconds the engine took to become healthy: what is left for discovery is 0.3 s.
HEALTHY_AFTER = 9.7


@asynccontextmanager
async def engine_that_hangs_on(path: str, clock: FakeClock) -> AsyncIterator[int]:
    async def health(request: web.Request) -> web.Response:
        clock.advance(HEALTHY_AFTER)
        return web.Response(status=200)

    async def hang(request: web.Request) -> web.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"disaggregation_mode": "null"})

    app = web.Application()
    app.router.add_get("/health", health)
    for name in ("/model_info", "/server_info", "/v1/models"):
        app.router.add_get(name, hang if name == path else answer)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("path", ["/model_info", "/server_info"])
async def test_a_discovery_get_gets_only_what_is_left_of_the_startup_deadline(path: str) -> None:
    clock = FakeClock()
    async with engine_that_hangs_on(path, clock) as port:
        retry = RetryPolicy(attempt_timeout=ATTEMPT_TIMEOUT, max_interval=0.1, initial_interval=0.02)
        pool = PoolConfig(parse_endpoint("127.0.0.1:1"), startup_deadline=STARTUP_DEADLINE, retry=retry)
        engine = over_http(SidecarConfig(pool=pool), parse_endpoint(f"127.0.0.1:{port}"), clock=clock)
        try:
            with pytest.raises(SidecarError) as caught:
                await engine.start()
        finally:
            await engine.close()
    assert caught.value.reason is FailureReason.CONNECTION_TIMEOUT
    # The bound the GET really had (the attempt timeout would say 5.000s).
    assert caught.value.message == f"GET {path}: no answer in 0.300s"
