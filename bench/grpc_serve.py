"""What the benchmark's stand-in engines share: serve a grpc.aio server with gRPC health on
``listen`` until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

__all__ = ["serve_until_signal"]


async def serve_until_signal(server: grpc.aio.Server, listen: str, name: str) -> None:
    """Add gRPC health (SERVING) to ``server``, listen on ``listen`` (exit naming ``name`` when
    the address cannot be bound), and serve until SIGTERM or SIGINT."""
    checker = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    if server.add_insecure_port(listen) == 0:
        raise SystemExit(f"{name}: cannot listen on {listen}")
    await server.start()
    await checker.set("", health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0.5)
