"""The pool against real sockets on loopback: N channels are N TCP connections, calls rotate
over them, and an engine that is absent or never speaks HTTP/2 fails start-up by the deadline."""

from __future__ import annotations

import re
import socket
from collections.abc import AsyncIterator, Iterator

import anyio
import grpc
import pytest

from sidecar_common.endpoint import Endpoint
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_common.pool import (
    ChannelPool,
    Deadline,
    PoolConfig,
    RetryPolicy,
    SystemClock,
    connect_channel,
)

WHO = "/test.Peer/Who"


async def _who(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    return context.peer().encode()


async def _echo(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    return request


def _peer_server(address: str) -> tuple[grpc.aio.Server, int]:
    big = 64 * 1024 * 1024
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", big), ("grpc.max_send_message_length", big)]
    )
    handler = grpc.method_handlers_generic_handler(
        "test.Peer",
        {
            "Who": grpc.unary_unary_rpc_method_handler(_who),
            "Echo": grpc.unary_unary_rpc_method_handler(_echo),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    return server, server.add_insecure_port(address)


@pytest.fixture
async def peer_server() -> AsyncIterator[int]:
    """A gRPC server whose one method answers with the caller's address as the server sees it."""
    server, port = _peer_server("127.0.0.1:0")
    await server.start()
    try:
        yield port
    finally:
        await server.stop(None)


async def _ask_who(channel: grpc.aio.Channel) -> str:
    reply: bytes = await channel.unary_unary(WHO, None, None)(b"", timeout=5.0)
    return reply.decode()


def _pool(port: int, n: int, deadline_secs: float = 10.0, attempt: float = 5.0) -> ChannelPool:
    config = PoolConfig(
        Endpoint("127.0.0.1", port),
        connections=n,
        startup_deadline=deadline_secs,
        retry=RetryPolicy(attempt_timeout=attempt),
    )
    return ChannelPool(config)


async def test_n_channels_make_n_tcp_connections_used_round_robin(peer_server: int) -> None:
    pool = _pool(peer_server, 3)
    await pool.connect(Deadline.start(SystemClock(), 10.0))
    try:
        peers = [await _ask_who(pool.channel()) for _ in range(6)]
    finally:
        await pool.close()

    assert len(set(peers[:3])) == 3, peers
    assert peers[3:] == peers[:3]
    assert all(peer.startswith("ipv4:127.0.0.1:") for peer in peers)


@pytest.fixture
def half_open_port() -> Iterator[int]:
    """A socket that completes TCP handshakes (the kernel's backlog) and never says a word."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener.getsockname()[1]


@pytest.mark.timeout(10)
async def test_a_half_open_peer_cannot_stall_start_up_past_the_deadline(half_open_port: int) -> None:
    pool = _pool(half_open_port, 2, attempt=30.0)

    with pytest.raises(SidecarError) as info:
        await pool.connect(Deadline.start(SystemClock(), 1.0))

    assert info.value.reason is FailureReason.CANNOT_CONNECT
    assert f"engine 127.0.0.1:{half_open_port} slot 1/2" in info.value.message
    assert "startup deadline 1s" in info.value.message
    # The connector's own timeout normally reports first; the pool's real-time bound is the
    # backstop on a starved event loop. Either way the attempt timed out.
    assert re.search(r"was not ready within|attempt timed out after", info.value.message)
    assert pool.size == 0


@pytest.mark.timeout(20)
async def test_the_connector_gives_up_on_a_half_open_peer_within_its_own_timeout(half_open_port: int) -> None:
    # The outer bound only keeps a broken connector from hanging the test; it must not fire.
    with anyio.fail_after(10), pytest.raises(TimeoutError) as info:
        await connect_channel(f"127.0.0.1:{half_open_port}", 0.2)
    assert str(info.value) == f"127.0.0.1:{half_open_port} was not ready within 0.200s (channel CONNECTING)"


@pytest.fixture
def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@pytest.mark.timeout(10)
async def test_nothing_listening_is_cannot_connect_naming_the_endpoint(closed_port: int) -> None:
    pool = _pool(closed_port, 2)

    with pytest.raises(SidecarError) as info:
        await pool.connect(Deadline.start(SystemClock(), 0.5))

    message = info.value.message
    assert info.value.reason is FailureReason.CANNOT_CONNECT
    assert f"engine 127.0.0.1:{closed_port} slot 1/2" in message
    # Refused, or (when the last attempt had only a sliver of deadline on a loaded machine)
    # not yet failed when that sliver ran out.
    assert re.search(r"last error: .*(refused, reset|not ready within|timed out after)", message)


@pytest.mark.timeout(20)
async def test_slots_keep_trying_until_an_engine_that_starts_late_is_up(closed_port: int) -> None:
    pool = _pool(closed_port, 2)
    server, port = _peer_server(f"127.0.0.1:{closed_port}")
    assert port == closed_port
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(pool.connect, Deadline.start(SystemClock(), 10.0))
            await anyio.sleep(0.3)  # a few refused attempts first
            await server.start()
        peers = {await _ask_who(pool.channel()) for _ in range(2)}
        assert len(peers) == 2
    finally:
        await pool.close()
        await server.stop(None)


async def test_messages_far_above_grpcs_4_mib_default_get_through(peer_server: int) -> None:
    pool = _pool(peer_server, 1)
    await pool.connect(Deadline.start(SystemClock(), 10.0))
    payload = b"x" * (20 * 1024 * 1024)
    try:
        echo = pool.channel().unary_unary("/test.Peer/Echo", None, None)
        reply: bytes = await echo(payload, timeout=10.0)
    finally:
        await pool.close()
    assert reply == payload
