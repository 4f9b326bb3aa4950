"""WatchLoad on a real sidecar over the testkit vLLM engine (and SGLang's, over both
transports): a report at once, a new one as soon as a generation runs (the client never asks),
the heartbeat restating an idle load, and one read of the engine for every stream, only while
one is open."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import grpc
import pytest

from sidecar_common.api import sidecar_pb2
from tests.sglang_fixtures import Transport, sglang_stack
from tests.vllm_fixtures import public_request, vllm_stack

pytestmark = pytest.mark.timeout(120)

WAIT = 30.0


async def reports(call: Any) -> AsyncIterator[sidecar_pb2.LoadReport]:
    async for report in call:
        yield report


async def first_report(
    call: Any, matching: Callable[[sidecar_pb2.LoadReport], bool]
) -> sidecar_pb2.LoadReport:
    with anyio.fail_after(WAIT):
        async for report in reports(call):
            if matching(report):
                return report
    raise AssertionError("the stream ended")


def running(report: sidecar_pb2.LoadReport) -> int:
    return sum(rank.running_requests for rank in report.ranks)


async def until(done: Callable[[], bool]) -> None:
    with anyio.fail_after(WAIT):
        while not done():  # noqa: ASYNC110 - polling a count, no event to wait on
            await anyio.sleep(0.01)


async def test_a_report_at_once_then_one_as_soon_as_a_generation_runs_without_the_client_asking() -> None:
    # 50 ms a token, 400 tokens: the generation runs for far longer than the test looks.
    async with vllm_stack(token_latency_ms=50.0) as stack:
        watch = stack.stub.WatchLoad(sidecar_pb2.WatchLoadRequest())
        try:
            idle = await first_report(watch, lambda r: True)
            assert idle.inflight_requests == 0
            assert [rank.dp_rank for rank in idle.ranks] == [0]
            assert running(idle) == 0
            assert idle.ranks[0].HasField("waiting_requests")
            assert idle.ranks[0].HasField("kv_usage")
            assert not idle.HasField("kv_cache")  # this sidecar relays no KV events

            generate = stack.stub.Generate(public_request("busy", max_tokens=400))
            try:
                busy = await first_report(watch, lambda r: running(r) >= 1)
                assert busy.inflight_requests == 1
                assert busy.ranks[0].kv_usage > 0.0
            finally:
                generate.cancel()
            # And back once it is cancelled (aborted on the engine).
            after = await first_report(watch, lambda r: running(r) == 0 and r.inflight_requests == 0)
            assert after.ranks[0].waiting_requests == 0
        finally:
            watch.cancel()


async def test_an_idle_load_is_restated_at_the_heartbeat_and_agrees_with_get_load() -> None:
    async with vllm_stack() as stack:
        watch = stack.stub.WatchLoad(sidecar_pb2.WatchLoadRequest())
        try:
            stream = reports(watch)
            with anyio.fail_after(WAIT):
                first = await anext(stream)
                # Nothing changes on an idle worker: the next report is the heartbeat's.
                second = await anext(stream)
            assert second == first
            assert await stack.stub.GetLoad(sidecar_pb2.GetLoadRequest(), timeout=WAIT) == first
        finally:
            watch.cancel()


async def test_streams_share_one_read_of_the_engine_which_stops_when_the_last_leaves() -> None:
    async with vllm_stack() as stack:
        load_watch = stack.server.load_watch
        assert not load_watch.reading
        calls = [stack.stub.WatchLoad(sidecar_pb2.WatchLoadRequest()) for _ in range(3)]
        for call in calls:
            await first_report(call, lambda r: True)
        assert load_watch.watchers == 3
        assert load_watch.reading
        for call in calls:
            call.cancel()
        await until(lambda: load_watch.watchers == 0)
        assert not load_watch.reading
        # A later stream starts it again, and gets a report at once.
        again = stack.stub.WatchLoad(sidecar_pb2.WatchLoadRequest())
        try:
            await first_report(again, lambda r: True)
            assert load_watch.reading
        finally:
            again.cancel()


async def test_the_stream_ends_with_the_server() -> None:
    async with vllm_stack() as stack:
        watch = stack.stub.WatchLoad(sidecar_pb2.WatchLoadRequest())
        await first_report(watch, lambda r: True)
        await stack.server.stop()
        with anyio.fail_after(WAIT), pytest.raises(grpc.aio.AioRpcError):
            async for _ in reports(watch):
                pass
        assert not stack.server.load_watch.reading


@pytest.mark.parametrize("transport", ["grpc", "http"])
async def test_an_sglang_sidecar_pushes_its_engines_load_as_get_load_reports_it(transport: Transport) -> None:
    async with sglang_stack(transport, token_latency_ms=50.0) as stack:
        watch = stack.stub.WatchLoad(sidecar_pb2.WatchLoadRequest())
        try:
            idle = await first_report(watch, lambda r: True)
            assert running(idle) == 0
            assert idle == await stack.stub.GetLoad(sidecar_pb2.GetLoadRequest(), timeout=WAIT)
            generate = stack.stub.Generate(public_request("busy", max_tokens=400))
            try:
                busy = await first_report(watch, lambda r: running(r) >= 1)
                assert busy.inflight_requests == 1
            finally:
                generate.cancel()
        finally:
            watch.cancel()
