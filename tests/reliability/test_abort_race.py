"""The cleanup abort must survive the client's cancel.

When the engine stream fails, the sidecar starts its (shielded) cleanup abort; if the client
cancels the call while that abort is in flight, the abort must still reach the engine and
complete. Found by the soak (a few per 3,000 requests on SGLang's gRPC wire); fixed in the relay
(5ad398d: cleanup runs as its own task).
"""

from __future__ import annotations

import anyio
import grpc
import pytest

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_server.server import ServerConfig, SidecarServer
from tests.fake_engine import FakeEngine, tokens

pytestmark = pytest.mark.timeout(30)


class SlowAbortEngine(FakeEngine):
    """An engine whose Abort takes until ``release`` is set, and says when it completed."""

    def __init__(self) -> None:
        super().__init__()
        self.release = anyio.Event()
        self.completed: list[str] = []

    async def abort(self, private_id: str) -> None:
        await super().abort(private_id)
        await self.release.wait()
        self.completed.append(private_id)


async def test_a_client_cancel_during_the_cleanup_abort_does_not_interrupt_it() -> None:
    engine = SlowAbortEngine()
    engine.scripts["x"] = [tokens(7), SidecarError(FailureReason.ENGINE_SHUTDOWN, "stream cut")]
    server = SidecarServer(engine, ServerConfig(listen="127.0.0.1:0", abort_timeout=5.0))
    await server.start()
    server.set_serving()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = sidecar_pb2_grpc.WorkerStub(channel)
            call = stub.Generate(sidecar_pb2.PreprocessedRequest(request_id="x", token_ids=[1]), timeout=10)
            first = await call.read()
            assert isinstance(first, sidecar_pb2.LLMEngineOutput)
            assert list(first.token_ids) == [7]
            await engine.wait_for("abort")  # the engine failed; the sidecar's abort is in flight
            assert call.cancel()
            await engine.wait_handler_cancelled()  # the cancel reached the sidecar's handler
            engine.release.set()
            assert await server.wait_idle(5.0)
            [pid] = engine.aborts
            assert engine.completed == [pid], "the engine abort was cut short by the client's cancel"
    finally:
        await server.stop()
