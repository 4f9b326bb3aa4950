"""The sidecars know their engine's pause state and weight version from the engine itself
(docs/api.md, "Engine state"), over the testkit engines on loopback, paused through the
testkit's real endpoints: WatchLoad shows PAUSED and the version at once, RUNNING after
continue, a weight-version update's new version; the sidecar's health stays SERVING all along
(a paused engine is not down, and SGLang's generation probe is not run while it is paused);
a request sent meanwhile waits on SGLang and is refused ENGINE_PAUSED, in vLLM's words, by
vLLM; FlushCache flushes an idle engine and is refused in the engine's words."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import anyio
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar_common.api import sglang_pb2, sglang_pb2_grpc, sidecar_pb2
from sidecar_common.errors import FailureReason
from sidecar_server.server import WORKER_SERVICE
from tests.e2e_helpers import collect, public_request, reason_of
from tests.sglang_fixtures import Transport, sglang_stack
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(120)

WAIT = 30.0
RUNNING = sidecar_pb2.ENGINE_STATE_RUNNING
PAUSED = sidecar_pb2.ENGINE_STATE_PAUSED
UNSPECIFIED = sidecar_pb2.ENGINE_STATE_UNSPECIFIED
Report = sidecar_pb2.LoadReport


class Reports:
    """One WatchLoad stream, read on demand."""

    def __init__(self, call: Any) -> None:
        self._call = call

    async def until(self, matching: Callable[[Report], bool]) -> Report:
        with anyio.fail_after(WAIT):
            while True:
                report = await self._call.read()
                assert isinstance(report, Report), "the WatchLoad stream ended"
                if matching(report):
                    return report

    async def heartbeats(self, count: int) -> list[Report]:
        """The next ``count`` reports (an idle worker restates its load every second)."""
        return [await self.until(lambda r: True) for _ in range(count)]


@asynccontextmanager
async def watched(port: int, stub: Any) -> AsyncIterator[tuple[Reports, list[int]]]:
    """A WatchLoad stream, and every status the sidecar's health Watch sent meanwhile."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    health = health_pb2_grpc.HealthStub(channel)
    statuses: list[int] = []

    async def record() -> None:
        async for reply in health.Watch(health_pb2.HealthCheckRequest(service=WORKER_SERVICE)):
            statuses.append(reply.status)

    load = stub.WatchLoad(sidecar_pb2.WatchLoadRequest())
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(record)
            yield Reports(load), statuses
            tg.cancel_scope.cancel()
    finally:
        load.cancel()
        await channel.close(None)


SERVING = [health_pb2.HealthCheckResponse.SERVING]


# ----------------------------------------------------------------------------- SGLang


async def post(url: str, body: object = None) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as resp:
        return resp.status, await resp.text()


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
async def test_sglang_http_paused_by_its_trainer_is_paused_not_down(mode: str) -> None:
    # A pause holds /health's generation: 503 after 0.2 s, which three times in a row would
    # take the sidecar out of service were the probe run.
    async with sglang_stack("http", health_check_timeout_secs=0.2, weight_version="v1") as stack:
        base = f"http://127.0.0.1:{stack.engine.http_port}"
        async with watched(stack.server.port, stack.stub) as (reports, health):
            first = await reports.until(lambda r: r.engine_state == RUNNING)
            assert first.weight_version == "v1"

            assert (await post(f"{base}/pause_generation", {"mode": mode}))[0] == 200
            paused = await reports.until(lambda r: r.engine_state == PAUSED)
            assert paused.weight_version == "v1"
            # A request sent now waits on the engine (SGLang holds it), and is not refused.
            call = stack.stub.Generate(public_request("held", max_tokens=3))
            # Seconds of heartbeats while paused: the health watch ran many intervals meanwhile.
            assert all(r.engine_state == PAUSED for r in await reports.heartbeats(3))

            status, _ = await post(
                f"{base}/update_weight_version", {"new_version": "v2", "abort_all_requests": False}
            )
            assert status == 200
            updated = await reports.until(lambda r: r.weight_version == "v2")
            assert updated.engine_state == PAUSED

            assert (await post(f"{base}/continue_generation"))[0] == 200
            running = await reports.until(lambda r: r.engine_state == RUNNING)
            assert running.weight_version == "v2"
            outs = await collect(call)
            assert outs[-1].finish_reason == sidecar_pb2.LENGTH
            assert sum(len(o.token_ids) for o in outs) == 3
            assert health == SERVING
        assert stack.server.engine_status.paused is False


async def test_sglang_grpc_reports_its_weight_version_and_cannot_say_its_pause() -> None:
    async with sglang_stack("grpc", weight_version="v1") as stack:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{stack.engine.grpc_port}")
        engine = sglang_pb2_grpc.SglangServiceStub(channel)
        try:
            async with watched(stack.server.port, stack.stub) as (reports, health):
                first = await reports.until(lambda r: r.weight_version == "v1")
                assert first.engine_state == UNSPECIFIED
                await engine.PauseGeneration(sglang_pb2.PauseGenerationRequest(mode="in_place"), timeout=10)
                call = stack.stub.Generate(public_request("held", max_tokens=3))
                # The version changes on SGLang's HTTP wire (gRPC has no call for it).
                status, _ = await post(
                    f"http://127.0.0.1:{stack.engine.http_port}/update_weight_version",
                    {"new_version": "v2", "abort_all_requests": False},
                )
                assert status == 200
                updated = await reports.until(lambda r: r.weight_version == "v2")
                assert updated.engine_state == UNSPECIFIED
                await engine.ContinueGeneration(sglang_pb2.ContinueGenerationRequest(), timeout=10)
                outs = await collect(call)
                assert sum(len(o.token_ids) for o in outs) == 3
                assert health == SERVING
        finally:
            await channel.close(None)


@pytest.mark.parametrize(
    ("transport", "refusal"),
    [
        ("http", "Flush cache failed."),
        ("grpc", "the engine did not flush its cache (FlushCache success=false: 'Cache flushed.')"),
    ],
)
async def test_sglang_flush_cache_idle_and_refused_while_a_request_runs(
    transport: Transport, refusal: str
) -> None:
    async with sglang_stack(transport, token_latency_ms=50.0) as stack:
        flushed = await stack.stub.FlushCache(sidecar_pb2.FlushCacheRequest(), timeout=WAIT)
        assert flushed.message.startswith("Cache flushed.")
        call = stack.stub.Generate(public_request("busy", max_tokens=400))
        try:
            with anyio.fail_after(WAIT):
                while stack.engine.book.running_count == 0:  # noqa: ASYNC110 - the engine's count
                    await anyio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stack.stub.FlushCache(sidecar_pb2.FlushCacheRequest(), timeout=WAIT)
            assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert refused.value.details() == refusal
        finally:
            call.cancel()


# ----------------------------------------------------------------------------- vLLM


async def test_vllm_paused_by_its_trainer_is_paused_and_refuses_in_its_words() -> None:
    async with vllm_stack(admin_port=0) as stack:
        admin = f"http://127.0.0.1:{stack.engine.admin_port}"
        async with watched(stack.server.port, stack.stub) as (reports, health):
            # smg-grpc-servicer never fills is_paused: false is not believed before a true.
            first = await reports.until(lambda r: True)
            assert first.engine_state == UNSPECIFIED
            assert not first.HasField("weight_version")  # vLLM's gRPC wire reports none

            assert (await post(f"{admin}/pause?mode=abort"))[0] == 200
            await reports.until(lambda r: r.engine_state == PAUSED)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect(stack.stub.Generate(public_request("refused", max_tokens=3)))
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            assert reason_of(refused.value)[0] == FailureReason.ENGINE_PAUSED.value
            assert refused.value.details() == "Generation is paused. Please retry after it resumes."
            assert all(r.engine_state == PAUSED for r in await reports.heartbeats(2))

            assert (await post(f"{admin}/resume"))[0] == 200
            await reports.until(lambda r: r.engine_state == RUNNING)
            outs = await collect(stack.stub.Generate(public_request("after", max_tokens=3)))
            assert sum(len(o.token_ids) for o in outs) == 3
            assert health == SERVING


async def test_vllm_flush_cache_idle_and_refused_while_a_request_runs() -> None:
    async with vllm_stack(token_latency_ms=50.0) as stack:
        flushed = await stack.stub.FlushCache(sidecar_pb2.FlushCacheRequest(), timeout=WAIT)
        assert flushed.message == "prefix cache reset"
        call = stack.stub.Generate(public_request("busy", max_tokens=400))
        try:
            await call.read()  # the first output: the request holds blocks now
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stack.stub.FlushCache(sidecar_pb2.FlushCacheRequest(), timeout=WAIT)
            assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert refused.value.details() == "cannot reset the prefix cache: requests are running"
        finally:
            call.cancel()
