"""A delivered stream ends OK whatever stops the sidecar next, for every engine kind: the
testkit engine sends every terminal, then holds its stream open (fault
``hold_after_terminal``), and the sidecar is told to stop (drain timeout, the second
SIGTERM's ``cancel_inflight()``, ``stop()``). No engine abort is sent for it.

SGLang over HTTP waits for ``[DONE]`` after the terminal, so there the stop lands while the
adapter is still reading: the window the rule is about. The gRPC adapters return at the
terminal; for them the test shows that an engine holding its stream does not change the
outcome either.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from testkit.book import Book
from testkit.faults import FaultBook, FaultKind, FaultPlan
from testkit.sglang_engine import SglangTestEngine
from testkit.sglang_info import SglangEngineConfig
from testkit.vllm_engine import VllmEngineConfig, VllmTestEngine

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_server.engine import Engine
from sidecar_server.server import ServerConfig, SidecarServer
from sidecar_sglang import http_transport
from sidecar_vllm.engine import VllmEngine
from tests.e2e_helpers import collect_until_error, public_request, tokens, until
from tests.sglang_fixtures import adapter_for
from tests.vllm_fixtures import sidecar_config as vllm_sidecar_config

pytestmark = pytest.mark.timeout(60)

KINDS = ("vllm", "sglang-grpc", "sglang-http")
# Long enough that a test relying on it running out would time out instead of passing.
_FOREVER = 600.0


@dataclass
class _Stack:
    server: SidecarServer
    stub: Any  # sidecar_pb2_grpc.WorkerStub (its async face is typing-only)
    book: Book
    faults: FaultBook


@asynccontextmanager
async def _stack(kind: str, drain_timeout: float) -> AsyncIterator[_Stack]:
    config = ServerConfig(listen="127.0.0.1:0", drain_timeout=drain_timeout, abort_timeout=_FOREVER)
    stop_engine: Callable[[], Awaitable[object]]
    adapter: Engine
    if kind == "vllm":
        vllm = VllmTestEngine(VllmEngineConfig())
        port = await vllm.start()
        adapter = VllmEngine(vllm_sidecar_config(port))
        book, faults = vllm.book, vllm.faults

        async def stop_engine() -> None:
            await vllm.stop(0)
    else:
        sglang = SglangTestEngine(SglangEngineConfig())
        await sglang.start()
        adapter = adapter_for(sglang, "grpc" if kind == "sglang-grpc" else "http")
        book, faults = sglang.book, sglang.faults
        stop_engine = sglang.stop
    server = SidecarServer(adapter, config)
    channel: grpc.aio.Channel | None = None
    try:
        await adapter.start()
        await server.start()
        server.set_serving()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        yield _Stack(server, sidecar_pb2_grpc.WorkerStub(channel), book, faults)
    finally:
        if channel is not None:
            await channel.close(None)
        await server.stop()
        await adapter.close()
        await stop_engine()


async def _drain_with_timeout(server: SidecarServer) -> None:
    await server.drain()  # a 0.05 s drain timeout: it runs out and cancels what is left


async def _cancel_inflight(server: SidecarServer) -> None:
    server.cancel_inflight()


async def _stop(server: SidecarServer) -> None:
    await server.stop()


STOPS: dict[str, Callable[[SidecarServer], Awaitable[None]]] = {
    "drain_timeout": _drain_with_timeout,
    "cancel_inflight": _cancel_inflight,
    "server_stop": _stop,
}


@pytest.mark.parametrize("stop", list(STOPS))
@pytest.mark.parametrize("kind", KINDS)
async def test_a_delivered_stream_ends_ok_and_unaborted_whatever_stops_the_sidecar(
    kind: str, stop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The HTTP adapter's own wait for [DONE] must outlast the test's stop.
    monkeypatch.setattr(http_transport, "_TRAILER_TIMEOUT", _FOREVER)
    async with _stack(kind, drain_timeout=0.05) as s:
        s.faults.add("-held", FaultPlan(FaultKind.HOLD_AFTER_TERMINAL))
        call = s.stub.Generate(public_request("held", max_tokens=4), timeout=30)
        outs: list[sidecar_pb2.LLMEngineOutput] = []
        while not outs or outs[-1].finish_reason == sidecar_pb2.UNSPECIFIED:
            out = await call.read()
            assert out is not grpc.aio.EOF  # type: ignore[attr-defined]
            outs.append(out)
        if kind == "sglang-http":
            assert s.server.inflight == 1  # still reading the engine stream for [DONE]
        await STOPS[stop](s.server)
        assert await call.read() is grpc.aio.EOF  # type: ignore[attr-defined]
        assert await call.code() == grpc.StatusCode.OK
        assert len(tokens(outs)) == 4
        assert outs[-1].finish_reason == sidecar_pb2.LENGTH
        await until(lambda: s.server.inflight == 0, "the generation ended")
        assert s.book.aborts == []


async def test_an_sglang_http_read_error_keeps_its_cause() -> None:
    async with _stack("sglang-http", drain_timeout=30) as s:
        # The engine drops the connection mid-body (as SGLang does when its handler dies).
        s.faults.add("-cut", FaultPlan(FaultKind.CLOSE_AFTER, after=2))
        call = s.stub.Generate(public_request("cut", max_tokens=8), timeout=30)
        outs, err = await collect_until_error(call)
        assert len(tokens(outs)) == 2
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        details = err.details() or ""
        assert "reading the SGLang stream failed" in details
        assert "ClientPayloadError" in details, details
