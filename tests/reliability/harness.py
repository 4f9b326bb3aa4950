"""Shared rig for the reliability suites: one engine kind, its sidecar and a public client.

``rig(kind)`` runs a testkit engine (vLLM, or SGLang served over its gRPC or HTTP wire), the
matching adapter and a ``SidecarServer`` on loopback in one event loop, with the server's
timings under the test's control. The helpers read the engine's book the same way for every
kind: what arrived (private ids), what was aborted, what is still running.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from testkit.book import Book, Outcome
from testkit.faults import FaultBook
from testkit.generator import ModelSpec, SamplingSpec, generate
from testkit.sglang_engine import SglangTestEngine
from testkit.sglang_info import SglangEngineConfig
from testkit.vllm_engine import VllmEngineConfig, VllmTestEngine

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_server.engine import Engine
from sidecar_server.metrics import Metrics
from sidecar_server.server import ServerConfig, SidecarServer
from sidecar_vllm.engine import VllmEngine
from tests import sglang_fixtures, vllm_fixtures

__all__ = [
    "KINDS",
    "Ended",
    "Kind",
    "Rig",
    "error_reason",
    "expected_tokens",
    "fd_count",
    "finish",
    "outcomes",
    "request",
    "rig",
    "rss_bytes",
    "until",
]

Kind = Literal["vllm", "sglang-grpc", "sglang-http"]
KINDS: tuple[Kind, ...] = ("vllm", "sglang-grpc", "sglang-http")
Out = sidecar_pb2.LLMEngineOutput
HTTP_CONNECTIONS = 1100
TestEngine = VllmTestEngine | SglangTestEngine


@dataclass
class Rig:
    kind: Kind
    engine: TestEngine
    adapter: Engine
    server: SidecarServer
    stub: Any  # sidecar_pb2_grpc.WorkerStub (its async face is typing-only)
    health: Any  # health_pb2_grpc.HealthStub
    channel: grpc.aio.Channel

    @property
    def book(self) -> Book:
        return self.engine.book

    @property
    def faults(self) -> FaultBook:
        return self.engine.faults

    @property
    def model(self) -> ModelSpec:
        if isinstance(self.engine, VllmTestEngine):
            return self.engine.config.model
        return self.engine.model

    def received_ids(self) -> list[str]:
        return [rid for rid, _ in self.book.received]

    def engine_busy(self) -> int:
        """Requests the engine still runs or queues (plus SGLang's live table)."""
        live = len(self.engine.live_ids()) if isinstance(self.engine, SglangTestEngine) else 0
        return self.book.running_count + self.book.waiting_count + live

    async def health_status(self) -> int:
        reply = await self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        return int(reply.status)

    async def kill_engine(self) -> None:
        """The engine dies now: streams break mid-way, connections are refused."""
        if isinstance(self.engine, VllmTestEngine):
            await self.engine.die()
        else:
            await self.engine.kill()

    async def restart_engine(self) -> None:
        """The engine serves again on the same port(s), with the same book."""
        if isinstance(self.engine, VllmTestEngine):
            await self.engine.start()
        else:
            await self.engine.start()


def _engine(kind: Kind, engine_config: dict[str, Any]) -> TestEngine:
    if kind == "vllm":
        return VllmTestEngine(VllmEngineConfig(**engine_config))
    return SglangTestEngine(SglangEngineConfig(**engine_config))


@asynccontextmanager
async def rig(
    kind: Kind,
    *,
    connections: int | None = None,
    server: ServerConfig | None = None,
    channel_options: Sequence[tuple[str, Any]] = (),
    metrics: Metrics | None = None,
    **engine_config: Any,
) -> AsyncIterator[Rig]:
    engine = _engine(kind, engine_config)
    if connections is None:
        # HTTP/1.1 holds one connection per stream, and the HTTP adapter's connection limit
        # is the pool size: give it room for every stream the suites keep open.
        connections = HTTP_CONNECTIONS if kind == "sglang-http" else 2
    adapter: Engine
    if isinstance(engine, VllmTestEngine):
        port = await engine.start()
        adapter = VllmEngine(vllm_fixtures.sidecar_config(port, connections=connections))
    else:
        await engine.start()
        transport: sglang_fixtures.Transport = "grpc" if kind == "sglang-grpc" else "http"
        adapter = sglang_fixtures.adapter_for(engine, transport, connections=connections)
    config = server or ServerConfig(listen="127.0.0.1:0", health_watch_interval=0.2)
    sidecar = SidecarServer(adapter, config, metrics=metrics)
    channel: grpc.aio.Channel | None = None
    try:
        await adapter.start()
        await sidecar.start()
        sidecar.set_serving()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}", options=list(channel_options))
        yield Rig(
            kind,
            engine,
            adapter,
            sidecar,
            sidecar_pb2_grpc.WorkerStub(channel),
            health_pb2_grpc.HealthStub(channel),
            channel,
        )
    finally:
        if channel is not None:
            await channel.close(None)
        await sidecar.stop()
        await adapter.close()
        if isinstance(engine, VllmTestEngine):
            await engine.stop(0)
        else:
            await engine.stop()


def request(public_id: str, prompt: Sequence[int], max_tokens: int) -> sidecar_pb2.PreprocessedRequest:
    req = sidecar_pb2.PreprocessedRequest(request_id=public_id, token_ids=prompt)
    req.stop_conditions.max_tokens = max_tokens
    return req


def expected_tokens(model: ModelSpec, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """What the deterministic generator produces for this request (choice 0)."""
    return [t.token_id for t in generate(model, prompt, SamplingSpec(max_tokens=max_tokens), 0)]


def error_reason(err: grpc.aio.AioRpcError) -> tuple[str, str] | None:
    """(ErrorInfo reason, migratable) of a sidecar status; None when it carries none."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    if status is None or not status.details:
        return None
    info = error_details_pb2.ErrorInfo()
    if not status.details[0].Unpack(info):
        return None
    return info.reason, info.metadata["migratable"]


@dataclass
class Ended:
    """How one Generate call ended, as the client saw it."""

    outs: list[Out] = field(default_factory=list)
    error: grpc.aio.AioRpcError | None = None

    @property
    def tokens(self) -> list[int]:
        return [t for o in self.outs for t in o.token_ids]

    @property
    def terminals(self) -> list[Out]:
        return [o for o in self.outs if o.finish_reason != sidecar_pb2.UNSPECIFIED]

    @property
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.OK if self.error is None else self.error.code()


async def finish(call: Any, ended: Ended | None = None) -> Ended:
    """Read the rest of a stream into ``ended``; a non-OK status is kept, not raised."""
    ended = ended or Ended()
    try:
        while (out := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            ended.outs.append(out)
    except grpc.aio.AioRpcError as err:
        ended.error = err
    return ended


async def until(cond: Callable[[], bool], what: str, secs: float = 10.0) -> None:
    """Poll ``cond`` (the engine's book has no events), bounded; fail naming ``what``."""
    with anyio.move_on_after(secs):
        while not cond():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    assert cond(), what


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def outcomes(book: Book) -> dict[str, Outcome]:
    """The last recorded outcome of every request the engine saw end."""
    return {rec.request_id: rec.outcome for rec in book.finished}
