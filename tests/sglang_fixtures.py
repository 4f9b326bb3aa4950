"""Helpers for the SGLang end-to-end tests: a running stack per transport.

``sglang_stack`` runs the testkit SGLang engine (both native wires), the SGLang engine
adapter for the chosen transport and a ``SidecarServer`` on loopback in-process, and yields a
public-API client; everything is torn down on exit. (Plain async context managers: a
non-root conftest cannot register fixture plugins.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import grpc
from testkit.sglang_engine import SglangTestEngine
from testkit.sglang_info import SglangEngineConfig

from sidecar_common.api import sidecar_pb2_grpc
from sidecar_common.disaggregation import DisaggregationMode
from sidecar_common.endpoint import parse_endpoint
from sidecar_common.pool import PoolConfig, RetryPolicy
from sidecar_common.tracing import Tracing
from sidecar_server.config import SidecarConfig
from sidecar_server.engine import Engine
from sidecar_server.server import ServerConfig, SidecarServer
from sidecar_sglang.grpc_transport import over_grpc
from sidecar_sglang.http_transport import over_http
from tests.e2e_helpers import public_request

__all__ = [
    "Stack",
    "Transport",
    "adapter_for",
    "assert_engine_idle",
    "public_request",
    "sglang_stack",
    "sidecar_config",
]

Transport = Literal["grpc", "http"]
_ENGINE_MODES: dict[DisaggregationMode, str] = {"agg": "null", "prefill": "prefill", "decode": "decode"}


def sidecar_config(
    port: int, mode: DisaggregationMode = "agg", *, deadline: float = 10.0, connections: int = 2
) -> SidecarConfig:
    retry = RetryPolicy(attempt_timeout=1.0, max_interval=0.1, initial_interval=0.02)
    pool = PoolConfig(
        parse_endpoint(f"127.0.0.1:{port}"), connections=connections, startup_deadline=deadline, retry=retry
    )
    return SidecarConfig(pool=pool, listen="127.0.0.1:0", disaggregation_mode=mode)


def adapter_for(
    engine: SglangTestEngine, transport: Transport, mode: DisaggregationMode = "agg", **config: Any
) -> Engine:
    if transport == "grpc":
        return over_grpc(sidecar_config(engine.grpc_port, mode, **config))
    http = parse_endpoint(f"127.0.0.1:{engine.http_port}")
    return over_http(sidecar_config(engine.grpc_port or 1, mode, **config), http)


async def assert_engine_idle(engine: SglangTestEngine, secs: float = 5.0) -> None:
    """Bounded wait for the engine to have no request running or waiting (a leak fails)."""
    with anyio.move_on_after(secs):
        while engine.live_ids() or engine.book.running_count or engine.book.waiting_count:  # noqa: ASYNC110
            await anyio.sleep(0.01)
    assert not engine.live_ids(), f"requests left running on the engine: {engine.live_ids()}"
    assert engine.book.running_count == 0
    assert engine.book.waiting_count == 0


@dataclass
class Stack:
    engine: SglangTestEngine
    adapter: Engine
    server: SidecarServer
    stub: Any  # sidecar_pb2_grpc.WorkerStub (its async face is typing-only)
    transport: Transport


@asynccontextmanager
async def sglang_stack(
    transport: Transport,
    engine: SglangTestEngine | None = None,
    mode: DisaggregationMode = "agg",
    connections: int = 2,
    tracing: Tracing | None = None,
    **engine_config: Any,
) -> AsyncIterator[Stack]:
    """A testkit engine (``engine`` or one built from ``engine_config``), adapter and server."""
    if engine is None:
        engine_config.setdefault("disaggregation_mode", _ENGINE_MODES[mode])
        engine = SglangTestEngine(SglangEngineConfig(**engine_config))
    await engine.start()
    adapter = adapter_for(engine, transport, mode, connections=connections)
    server = SidecarServer(
        adapter,
        ServerConfig(listen="127.0.0.1:0", hold_decode_cancels=mode == "decode", health_watch_interval=0.2),
        tracing=tracing,
    )
    channel: grpc.aio.Channel | None = None
    try:
        await adapter.start()
        await server.start()
        server.set_serving()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        yield Stack(engine, adapter, server, sidecar_pb2_grpc.WorkerStub(channel), transport)
        # Every test, whatever it did, must leave nothing running on the engine.
        await assert_engine_idle(engine)
    finally:
        if channel is not None:
            await channel.close(None)
        await server.stop()
        await adapter.close()
        await engine.stop()
