"""Helpers of the fleet tests: the console-script command lines and waiting on etcd keys."""

from __future__ import annotations

import anyio

from sidecar_common.registration_etcd import open_session
from sidecar_common.registration_record import DEFAULT_PREFIX
from tests.e2e_helpers import WAIT, script
from tests.etcd_fixture import EtcdServer

__all__ = ["engine_argv", "sidecar_argv", "static_sidecar_argv", "wait_key", "worker_key"]


def engine_argv(port: int, *extra: str) -> list[str]:
    return [script("testkit-engine"), "vllm", "--listen", f"127.0.0.1:{port}", *extra]


def sidecar_argv(engine_port: int, etcd: EtcdServer, *extra: str) -> list[str]:
    return [
        script("sidecar-vllm"),
        "--grpc-endpoint",
        f"127.0.0.1:{engine_port}",
        "--listen",
        "127.0.0.1:0",
        "--grpc-connections",
        "1",
        "--log-format",
        "json",
        "--etcd-endpoints",
        etcd.endpoint,
        *extra,
    ]


def static_sidecar_argv(engine_port: int, port: int, *extra: str) -> list[str]:
    """A vLLM sidecar on ``port`` over the engine on ``engine_port``, without etcd (for a
    frontend told its workers by --worker or DNS)."""
    return [
        script("sidecar-vllm"),
        *("--grpc-endpoint", f"127.0.0.1:{engine_port}", "--listen", f"127.0.0.1:{port}"),
        *("--grpc-connections", "1", "--log-format", "json"),
        *extra,
    ]


def worker_key(port: int) -> bytes:
    return f"{DEFAULT_PREFIX}127.0.0.1:{port}".encode()


async def wait_key(etcd: EtcdServer, key: bytes, *, present: bool) -> bytes | None:
    """Wait (on watch events, bounded) until ``key`` exists or is gone; returns its value."""
    with anyio.fail_after(WAIT):
        async with open_session(etcd.endpoint, 5.0) as s:
            snapshot = await s.get_prefix(key)
            found = dict(snapshot.items).get(key)
            if (found is not None) == present:
                return found
            async with s.watch_prefix(key, snapshot.revision + 1) as events:
                async for event in events:
                    if event.key == key and (event.kind == "put") == present:
                        return event.value if present else None
    raise AssertionError("unreachable: the watch ends with an error")
