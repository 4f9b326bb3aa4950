"""A sidecar with several acceptors (``--acceptors``): gRPC servers sharing its port, one sidecar.

Each server takes up the calls of the connections the kernel gave it; they share every piece of
the sidecar's state, so a call on one connection sees what calls on the others did (an Abort
reaches a generation taken up by another server), health answers the same everywhere, and a
stop stops them all (the port is free again).
"""

from __future__ import annotations

import contextlib
from typing import Any

import anyio
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_common.errors import CALL_STARTED
from sidecar_common.ports import bind_problem
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(60)

ACCEPTORS = 3
CONNECTIONS = 12  # enough that the kernel hands every acceptor some (SO_REUSEPORT hashing)


def request(rid: str, max_tokens: int) -> sidecar_pb2.PreprocessedRequest:
    return sidecar_pb2.PreprocessedRequest(
        request_id=rid,
        token_ids=[5, 6, 7],
        stop_conditions=sidecar_pb2.StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )


def channel(port: int) -> grpc.aio.Channel:
    # A local subchannel pool: each channel is its own TCP connection.
    return grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])


async def test_every_connection_is_served_and_an_abort_reaches_a_call_on_another_one() -> None:
    async with vllm_stack(acceptors=ACCEPTORS, token_latency_ms=5) as s:
        port = s.server.port
        channels = [channel(port) for _ in range(CONNECTIONS)]
        try:
            stubs: list[Any] = [sidecar_pb2_grpc.WorkerStub(c) for c in channels]
            tokens: list[int] = []

            async def generate(stub: Any, rid: str) -> None:
                call = stub.Generate(request(rid, 4), timeout=30)
                metadata = await call.initial_metadata()
                assert metadata.get(CALL_STARTED[0]) == CALL_STARTED[1]
                got = 0
                async for output in call:
                    got += len(output.token_ids)
                tokens.append(got)

            with anyio.fail_after(30):
                async with anyio.create_task_group() as group:
                    for index, stub in enumerate(stubs * 4):
                        group.start_soon(generate, stub, f"r{index}")
            assert tokens == [4] * (CONNECTIONS * 4)

            # A long generation on one connection, aborted by id from every other connection
            # in turn until one answers: the abort reaches it whichever acceptor took it.
            victim = stubs[0].Generate(request("victim", 100_000), timeout=30)
            assert (await victim.read()).token_ids
            reply = await stubs[-1].Abort(sidecar_pb2.AbortRequest(request_id="victim"), timeout=5)
            assert reply.aborted == 1
            with contextlib.suppress(grpc.aio.AioRpcError):
                while await victim.read() is not grpc.aio.EOF:  # type: ignore[attr-defined]
                    pass
            for c in channels:
                health = health_pb2_grpc.HealthStub(c)
                answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            for c in channels:
                await c.close(None)
    # Stopped: every acceptor let go of the port.
    assert bind_problem("127.0.0.1", port) is None
