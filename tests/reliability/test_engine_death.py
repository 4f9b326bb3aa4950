"""Engine death and return: with 100 streams in flight the engine dies; every stream ends with
a migratable status, health goes NOT_SERVING, new requests fail migratable; the engine comes
back on the same port and the same sidecar (never restarted) serves again, driven by its
background health watch (``ServerConfig.health_watch_interval``). How fast the streams end and
a new request fails is measured by ``python -m bench.fault_timings``, not asserted."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from testkit.generator import ModelSpec

from sidecar_common.api import sidecar_pb2_grpc
from sidecar_server.server import ServerConfig, SidecarServer
from sidecar_vllm.engine import VllmEngine
from tests import vllm_fixtures
from tests.reliability.harness import (
    KINDS,
    Ended,
    Kind,
    error_reason,
    expected_tokens,
    finish,
    request,
    rig,
    until,
)

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow(60)]

STREAMS = 100
WATCH = 0.2  # the server's health watch period in these tests
# The engine, the sidecar and the client share this test's one process: at 20 ms a token,
# 100 streams are 5,000 tokens a second through all three, more than a loaded 2-core machine
# gives the process, and the sidecar's grpc server then picked up new calls so late that grpc
# cancelled the ones left waiting over 30 s (its server_max_unrequested_time_in_server).
# At 250 ms the streams are as much in flight (1000 tokens outlast the test) at 1/12 the rate.
TOKEN_LATENCY_MS = 250
PROMPT = [101, 202, 303]
MIGRATABLE_ENDS = {"CANNOT_CONNECT", "ENGINE_SHUTDOWN"}
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def open_streams(stub: Any, count: int) -> list[tuple[Any, Ended]]:
    """``count`` long generations, each having delivered its first chunk."""
    calls = [stub.Generate(request(f"d{i:03d}", PROMPT, 1000), timeout=60) for i in range(count)]
    opened = []
    for call in calls:
        ended = Ended()
        first = await call.read()
        assert first is not grpc.aio.EOF  # type: ignore[attr-defined]
        ended.outs.append(first)
        opened.append((call, ended))
    return opened


async def ends_of(opened: list[tuple[Any, Ended]]) -> list[Ended]:
    """Read every stream to its end."""
    return list(await asyncio.gather(*(finish(call, ended) for call, ended in opened)))


def assert_migratable_ends(ends: list[Ended], full: list[int]) -> None:
    for ended in ends:
        assert ended.error is not None, "a stream ended OK although its engine died"
        assert ended.code is grpc.StatusCode.UNAVAILABLE, (ended.code, ended.error.details())
        why = error_reason(ended.error)
        assert why is not None
        assert why[0] in MIGRATABLE_ENDS, why
        assert why[1] == "true", why
        assert ended.tokens == full[: len(ended.tokens)], "the delivered prefix is exact"
        assert not ended.terminals


async def health_of(stub: Any) -> int:
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return int(reply.status)


async def wait_health(stub: Any, want: int, secs: float) -> None:
    deadline = time.monotonic() + secs
    while (status := await health_of(stub)) != want and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)  # a probe of the sidecar's health, as a frontend polls it
    assert status == want, f"health is {status}, want {want} within {secs}s"


async def fails_migratable(stub: Any) -> None:
    """A new request while the engine is gone: a migratable status."""
    ended = await finish(stub.Generate(request("new", PROMPT, 5), timeout=30))
    assert ended.error is not None
    assert not ended.outs
    why = error_reason(ended.error)
    assert why is not None
    assert why[1] == "true", (why, ended.error.details())


async def serves_again(stub: Any, model: ModelSpec, secs: float = 10.0) -> None:
    """After the engine's return, requests succeed again (retrying for at most ``secs``: see
    test_serving_means_requests_succeed for the window where they do not), and then several
    in a row do, so that every connection of the sidecar's pool (round-robin) carries one."""
    deadline = time.monotonic() + secs
    while True:
        ended = await finish(stub.Generate(request("again", PROMPT, 6), timeout=10))
        if ended.error is None or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert ended.error is None, f"no request succeeded within {secs}s: {ended.error.details()}"
    await asyncio.sleep(2.0)  # every pool connection past grpc's first reconnect backoff
    for i in range(8):
        ended = await finish(stub.Generate(request(f"again{i}", PROMPT, 6), timeout=10))
        assert ended.error is None, f"request {i}: {ended.code.name} {ended.error.details()}"
        assert ended.tokens == expected_tokens(model, PROMPT, 6)
        assert len(ended.terminals) == 1


async def death_and_return(
    stub: Any,
    health: Any,
    server: SidecarServer,
    model: ModelSpec,
    kill: Callable[[], Awaitable[None]],
    revive: Callable[[], Awaitable[None]],
) -> None:
    await wait_health(health, SERVING, 5)
    opened = await open_streams(stub, STREAMS)
    full = expected_tokens(model, PROMPT, 1000)
    await kill()
    ends = await ends_of(opened)
    assert_migratable_ends(ends, full)
    await wait_health(health, NOT_SERVING, 10 * WATCH + 5)
    await fails_migratable(stub)
    assert await server.wait_idle(5.0), "the sidecar still counts requests in flight"
    await revive()
    await wait_health(health, SERVING, 60)  # a brand-new engine process may start cold on a loaded machine
    await serves_again(stub, model)


@pytest.mark.parametrize("kind", KINDS)
async def test_engine_death_ends_every_stream_and_the_engines_return_is_noticed(kind: Kind) -> None:
    config = ServerConfig(listen="127.0.0.1:0", health_watch_interval=WATCH, health_probe_timeout=1.0)
    async with rig(kind, server=config, token_latency_ms=TOKEN_LATENCY_MS) as r:
        await death_and_return(r.stub, r.health, r.server, r.model, r.kill_engine, r.restart_engine)
        await until(lambda: r.engine_busy() == 0, "the engine is left with nothing running")


# ------------------------------------------------------------- a real engine process, SIGKILL


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def engine_process(port: int) -> Iterator[subprocess.Popen[bytes]]:
    script = Path(sys.executable).parent / "testkit-engine"
    argv = [str(script), "vllm", "--listen", f"127.0.0.1:{port}", "--token-latency-ms", "20"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


@pytest.mark.timeout(120)
async def test_a_sigkilled_engine_process_and_its_restart_on_the_same_port() -> None:
    port = free_port()
    adapter = VllmEngine(vllm_fixtures.sidecar_config(port, deadline=30))
    server = SidecarServer(
        adapter, ServerConfig(listen="127.0.0.1:0", health_watch_interval=WATCH, health_probe_timeout=1.0)
    )
    with engine_process(port) as first:
        procs = [first]
        try:
            await adapter.start()
            await server.start()
            server.set_serving()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:

                async def kill() -> None:
                    first.send_signal(signal.SIGKILL)

                async def revive() -> None:  # a brand-new process on the same port
                    cm = engine_process(port)
                    procs.append(cm.__enter__())
                    stack.append(cm)

                stack: list[Any] = []
                try:
                    await death_and_return(
                        sidecar_pb2_grpc.WorkerStub(channel),
                        health_pb2_grpc.HealthStub(channel),
                        server,
                        ModelSpec(32000, (2,), 4096),
                        kill,
                        revive,
                    )
                    assert first.wait(timeout=5) == -signal.SIGKILL
                finally:
                    for cm in stack:
                        cm.__exit__(None, None, None)
        finally:
            await server.stop()
            await adapter.close()


async def test_serving_means_requests_succeed() -> None:
    """Once health says SERVING after an outage, requests on every pool connection succeed."""
    config = ServerConfig(listen="127.0.0.1:0", health_watch_interval=WATCH, health_probe_timeout=1.0)
    async with rig("vllm", server=config, connections=4) as r:
        await r.kill_engine()
        await wait_health(r.health, NOT_SERVING, 5)
        await asyncio.sleep(3.0)  # an outage of a few seconds: reconnect backoffs grow
        await r.restart_engine()
        await wait_health(r.health, SERVING, 15)
        failures = []
        for i in range(8):
            ended = await finish(r.stub.Generate(request(f"s{i}", PROMPT, 4), timeout=10))
            if ended.error is not None:
                failures.append(f"{i}: {ended.code.name} {ended.error.details()}")
        assert not failures, "health said SERVING but requests failed:\n" + "\n".join(failures)
