"""The Worker servicer over a real grpc.aio server on loopback, against the fake engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_server.metrics import Metrics
from sidecar_server.server import ServerConfig, SidecarServer
from tests.fake_engine import HANG, FakeEngine, Gate, terminal, tokens

pytestmark = pytest.mark.timeout(30)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Harness:
    server: SidecarServer
    engine: FakeEngine
    stub: Any  # sidecar_pb2_grpc.WorkerAsyncStub (a typing-only class)
    health: Any
    metrics: Metrics

    async def health_of(self, service: str = "") -> int:
        resp = await self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        status: int = resp.status
        return status

    async def wait_health(self, want: int) -> None:
        with anyio.fail_after(5):
            while True:
                if await self.health_of() == want:
                    return
                await anyio.sleep(0.01)


@asynccontextmanager
async def servicer_running(
    engine: FakeEngine | None = None, *, serving: bool = True, **config: Any
) -> AsyncIterator[Harness]:
    engine = engine if engine is not None else FakeEngine()
    metrics = Metrics("fake")
    server = SidecarServer(engine, ServerConfig(listen="127.0.0.1:0", **config), metrics=metrics)
    await server.start()
    if serving:
        server.set_serving()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield Harness(
            server,
            engine,
            sidecar_pb2_grpc.WorkerStub(channel),
            health_pb2_grpc.HealthStub(channel),
            metrics,
        )
    finally:
        await channel.close(None)
        await server.stop()
        # Nothing left running on the engine after the sidecar stopped, and no engine request
        # aborted twice (a second abort can come after "closed": only the stop bounds it).
        assert not engine.running
        assert len(engine.aborts) == len(set(engine.aborts)), f"aborted more than once: {engine.aborts}"


def request(request_id: str = "req", n: int | None = None, **kw: Any) -> sidecar_pb2.PreprocessedRequest:
    req = sidecar_pb2.PreprocessedRequest(
        request_id=request_id, token_ids=kw.pop("token_ids", [1, 2, 3]), **kw
    )
    if n is not None:
        req.sampling_options.n = n
    return req


async def collect(call: Any) -> list[sidecar_pb2.LLMEngineOutput]:
    """The rest of the stream (read() based, so it mixes with earlier read() calls)."""
    outs = []
    while (out := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
        outs.append(out)
    return outs


async def collect_until_error(call: Any) -> tuple[list[sidecar_pb2.LLMEngineOutput], grpc.aio.AioRpcError]:
    outs = []
    try:
        while (out := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            outs.append(out)
    except grpc.aio.AioRpcError as err:
        return outs, err
    raise AssertionError("the stream ended OK")


def error_info(err: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    # AioRpcError is the grpc.Call whose trailing metadata from_call can read synchronously.
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return info


async def test_tokens_stream_in_order_per_choice_and_are_never_aborted() -> None:
    async with servicer_running() as h:
        outs = await collect(h.stub.Generate(request(n=2)))
        for index in (0, 1):
            mine = [o for o in outs if o.index == index]
            assert [t for o in mine for t in o.token_ids] == [100, 101, 102]
            assert [o.finish_reason for o in mine][-1] == sidecar_pb2.EOS
            assert all(o.finish_reason == sidecar_pb2.UNSPECIFIED for o in mine[:-1])
        assert h.engine.aborts == []
        assert h.server.inflight == 0


async def test_scripted_chunks_arrive_in_engine_order() -> None:
    engine = FakeEngine(scripts={"r": [tokens(i) for i in range(50)] + [terminal(50)]})
    async with servicer_running(engine) as h:
        outs = await collect(h.stub.Generate(request("r")))
        assert [t for o in outs for t in o.token_ids] == list(range(51))
        assert outs[-1].finish_reason == sidecar_pb2.EOS
        assert engine.aborts == []


async def test_engine_error_mid_stream_gives_prefix_then_typed_status() -> None:
    boom = SidecarError(FailureReason.CANNOT_CONNECT, "Generate: connection reset (UNAVAILABLE)")
    engine = FakeEngine(scripts={"r": [tokens(1), tokens(2), boom]})
    async with servicer_running(engine) as h:
        call = h.stub.Generate(request("r"))
        outs, err = await collect_until_error(call)
        # The relay may have merged the two chunks into one message; the tokens are the same.
        assert [t for o in outs for t in o.token_ids] == [1, 2]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            raise err
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert info.value.details() == "Generate: connection reset (UNAVAILABLE)"
        detail = error_info(info.value)
        assert (detail.reason, detail.domain, detail.metadata["migratable"]) == (
            "CANNOT_CONNECT",
            "sidecar",
            "true",
        )
        # grpc.aio.Metadata at run time (key, value pairs); the stubs type it otherwise.
        metadata: Any = info.value.trailing_metadata()
        trailing = dict(metadata)
        assert trailing["migratable"] == "true"
        assert engine.aborts == [engine.calls[0].private_id]


@pytest.mark.parametrize(
    ("steps", "code", "reason", "words"),
    [
        ([tokens(1), RuntimeError("kaput")], grpc.StatusCode.UNKNOWN, "UNKNOWN", "RuntimeError: kaput"),
        ([tokens(1)], grpc.StatusCode.UNAVAILABLE, "ENGINE_SHUTDOWN", "ended before every choice finished"),
        ([tokens(1, index=3)], grpc.StatusCode.INTERNAL, "PROTOCOL_ERROR", "choice index 3"),
    ],
)
async def test_engine_failures_are_typed_and_aborted_once(
    steps: list[Any], code: grpc.StatusCode, reason: str, words: str
) -> None:
    engine = FakeEngine(scripts={"r": steps})
    async with servicer_running(engine) as h:
        call = h.stub.Generate(request("r"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(call)
        assert info.value.code() == code
        assert words in (info.value.details() or "")
        assert error_info(info.value).reason == reason
        assert engine.aborts == [engine.calls[0].private_id]


async def test_invalid_request_is_refused_before_any_engine_call() -> None:
    async with servicer_running() as h:
        call = h.stub.Generate(request(token_ids=[]))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(call)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == "token_ids: must not be empty"
        assert error_info(info.value).metadata["migratable"] == "false"
        assert h.engine.calls == []


async def test_empty_request_id_gets_one_made_by_the_sidecar() -> None:
    async with servicer_running() as h:
        await collect(h.stub.Generate(request("")))
        public = h.engine.calls[0].request.request_id
        assert len(public) == 32
        assert h.engine.calls[0].private_id.endswith("-" + public)


async def test_client_cancel_reaches_the_engine_as_one_abort() -> None:
    engine = FakeEngine(scripts={"r": [tokens(1), HANG]})
    async with servicer_running(engine) as h:
        call = h.stub.Generate(request("r"))
        first = await call.read()
        assert list(first.token_ids) == [1]
        call.cancel()
        await engine.wait_for("closed")
        # The handler is done with the call: nothing can abort it any more.
        assert await h.server.wait_idle(5)
        pid = engine.calls[0].private_id
        assert engine.aborts == [pid]
        # Abort first, then the stream is closed.
        assert [e for e in engine.events if e[0] in ("abort", "closed")] == [("abort", pid), ("closed", pid)]


async def test_client_deadline_reaches_the_engine_as_one_abort() -> None:
    engine = FakeEngine(scripts={"r": [tokens(1), HANG]})
    async with servicer_running(engine) as h:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(h.stub.Generate(request("r"), timeout=0.3))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await engine.wait_for("closed")
        assert await h.server.wait_idle(5)
        assert engine.aborts == [engine.calls[0].private_id]


async def test_duplicate_public_ids_get_their_own_private_ids() -> None:
    engine = FakeEngine(scripts={"dup": [tokens(1), HANG]})
    async with servicer_running(engine) as h:
        first = h.stub.Generate(request("dup"))
        second = h.stub.Generate(request("dup"))
        await first.read()
        await second.read()
        ids = {c.private_id for c in engine.calls}
        assert len(ids) == 2
        first.cancel()
        await engine.wait_for("closed")
        assert len(engine.aborts) == 1
        assert ids - set(engine.aborts) == engine.running  # the other one still runs
        second.cancel()
        await engine.wait_for("closed", 2)


async def test_abort_by_public_id_cancels_all_with_that_id() -> None:
    engine = FakeEngine(scripts={"x": [tokens(7, 8), HANG], "y": [tokens(9), HANG]})
    async with servicer_running(engine) as h:
        xs = [h.stub.Generate(request("x", token_ids=[1, 2, 3, 4])) for _ in range(2)]
        y = h.stub.Generate(request("y"))
        for call in [*xs, y]:
            await call.read()
        resp = await h.stub.Abort(sidecar_pb2.AbortRequest(request_id="x"), timeout=5)
        assert resp.aborted == 2
        for call in xs:
            rest = await collect(call)
            assert await call.code() == grpc.StatusCode.OK
            assert [o.finish_reason for o in rest] == [sidecar_pb2.CANCELLED]
            assert rest[0].completion_usage == sidecar_pb2.CompletionUsage(
                prompt_tokens=4, completion_tokens=2, total_tokens=6
            )
        x_ids = {c.private_id for c in engine.calls if c.request.request_id == "x"}
        assert set(engine.aborts) == x_ids
        assert len(engine.aborts) == 2
        assert engine.running == {c.private_id for c in engine.calls if c.request.request_id == "y"}
        assert (await h.stub.Abort(sidecar_pb2.AbortRequest(request_id="nobody"), timeout=5)).aborted == 0
        y.cancel()


async def test_health_follows_start_serving_and_drain() -> None:
    async with servicer_running(serving=False) as h:
        assert await h.health_of("") == NOT_SERVING
        assert await h.health_of("sidecar.v1.Worker") == NOT_SERVING
        call = h.stub.Generate(request())
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(call)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert info.value.details() == "sidecar is not serving"
        assert error_info(info.value).reason == "ENGINE_SHUTDOWN"
        h.server.set_serving()
        assert await h.health_of("") == SERVING
        assert await h.health_of("sidecar.v1.Worker") == SERVING
        await h.server.drain()
        assert await h.health_of("") == NOT_SERVING
        call = h.stub.Generate(request())
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(call)
        assert info.value.details() == "sidecar is draining"
        assert error_info(info.value).reason == "ENGINE_SHUTDOWN"


async def test_drain_waits_for_in_flight_work() -> None:
    gate = anyio.Event()
    engine = FakeEngine(scripts={"r": [tokens(1), Gate(gate), terminal(2)]})
    async with servicer_running(engine, drain_timeout=10) as h:
        call = h.stub.Generate(request("r"))
        await call.read()
        async with anyio.create_task_group() as tg:
            tg.start_soon(h.server.drain)
            await h.wait_health(NOT_SERVING)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(h.stub.Generate(request("other")))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            gate.set()
            rest = await collect(call)
            assert rest[-1].finish_reason == sidecar_pb2.EOS
        assert engine.aborts == []


async def test_drain_timeout_cancels_and_aborts_what_remains() -> None:
    engine = FakeEngine(scripts={"r": [tokens(1), HANG]})
    async with servicer_running(engine, drain_timeout=0.2) as h:
        call = h.stub.Generate(request("r"))
        await call.read()
        await h.server.drain()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(call)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error_info(info.value).reason == "ENGINE_SHUTDOWN"
        assert engine.aborts == [engine.calls[0].private_id]
        assert h.server.inflight == 0


async def test_cancel_inflight_ends_a_long_drain_with_engine_shutdown_and_one_abort() -> None:
    engine = FakeEngine(scripts={"r": [tokens(1), HANG], "s": [tokens(1), HANG]})
    async with servicer_running(engine, drain_timeout=3600) as h:
        calls = [h.stub.Generate(request("r")), h.stub.Generate(request("s"))]
        for call in calls:
            await call.read()
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(h.server.drain)
                await h.wait_health(NOT_SERVING)
                assert h.server.cancel_inflight() == 2
            # drain() returned: the hour-long wait ended, and every cleanup ran.
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(call)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            info_detail = error_info(info.value)
            assert info_detail.reason == "ENGINE_SHUTDOWN"
            assert info_detail.metadata["migratable"] == "true"
        assert sorted(engine.aborts) == sorted(c.private_id for c in engine.calls)
        assert h.server.inflight == 0
        assert h.server.cancel_inflight() == 0


async def test_stop_ends_in_flight_work_with_engine_shutdown_not_a_bare_status() -> None:
    engine = FakeEngine(scripts={"r": [tokens(1), HANG]})
    async with servicer_running(engine) as h:
        call = h.stub.Generate(request("r"))
        await call.read()
        await h.server.stop()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(call)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error_info(info.value).reason == "ENGINE_SHUTDOWN"
        assert engine.aborts == [engine.calls[0].private_id]


async def test_decode_hold_aborts_only_after_the_first_token() -> None:
    gate = anyio.Event()
    engine = FakeEngine(scripts={"r": [Gate(gate), tokens(1), HANG]})
    async with servicer_running(engine, hold_decode_cancels=True) as h:
        call = h.stub.Generate(request("r"))
        await engine.wait_for("generate")
        assert engine.calls[0].hold_cancel_until_first_token
        call.cancel()
        await engine.wait_handler_cancelled()
        assert engine.aborts == []
        gate.set()
        await engine.wait_for("abort")
        pid = engine.calls[0].private_id
        assert engine.events == [("generate", pid), ("yield", pid), ("abort", pid), ("closed", pid)]


async def test_decode_hold_is_bounded() -> None:
    engine = FakeEngine(scripts={"r": [HANG]})
    async with servicer_running(engine, hold_decode_cancels=True, decode_hold_timeout=0.2) as h:
        call = h.stub.Generate(request("r"))
        await engine.wait_for("generate")
        call.cancel()
        await engine.wait_for("abort")
        assert engine.aborts == [engine.calls[0].private_id]


async def test_decode_hold_ends_on_an_engine_error_and_still_aborts() -> None:
    gate = anyio.Event()
    boom = SidecarError(FailureReason.CANNOT_CONNECT, "Generate: reset (UNAVAILABLE)")
    engine = FakeEngine(scripts={"r": [Gate(gate), boom]})
    async with servicer_running(engine, hold_decode_cancels=True) as h:
        call = h.stub.Generate(request("r"))
        await engine.wait_for("generate")
        call.cancel()
        await engine.wait_handler_cancelled()  # the sidecar is now holding
        assert engine.aborts == []
        gate.set()
        await engine.wait_for("abort")
        assert engine.aborts == [engine.calls[0].private_id]


async def test_without_the_hold_a_cancel_before_the_first_token_aborts_at_once() -> None:
    engine = FakeEngine(scripts={"r": [HANG]})
    async with servicer_running(engine) as h:
        call = h.stub.Generate(request("r"))
        await engine.wait_for("generate")
        assert not engine.calls[0].hold_cancel_until_first_token
        call.cancel()
        await engine.wait_for("closed")
        assert engine.aborts == [engine.calls[0].private_id]


async def test_a_hanging_engine_abort_does_not_hang_the_request() -> None:
    engine = FakeEngine(scripts={"r": [tokens(1), HANG]}, abort_hangs=True)
    async with servicer_running(engine, abort_timeout=0.1) as h:
        call = h.stub.Generate(request("r"))
        await call.read()
        call.cancel()
        assert await h.server.wait_idle(5)
        assert engine.aborts == [engine.calls[0].private_id]


async def test_health_watch_follows_the_engine() -> None:
    engine = FakeEngine()
    async with servicer_running(engine, health_watch_interval=0.02) as h:
        assert await h.health_of() == SERVING
        engine.healthy_answer = False
        await h.wait_health(NOT_SERVING)
        call = h.stub.Generate(request())
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(call)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        detail = error_info(info.value)
        assert (detail.reason, detail.metadata["migratable"]) == ("CANNOT_CONNECT", "true")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(h.stub.Generate(request(token_ids=[])))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # bad anywhere: not migratable
        engine.healthy_answer = True
        await h.wait_health(SERVING)
        assert (await collect(h.stub.Generate(request())))[-1].finish_reason == sidecar_pb2.EOS


async def test_model_info_and_load() -> None:
    rank = sidecar_pb2.RankLoad(dp_rank=0, running_requests=3, waiting_requests=1, kv_usage=0.5)
    engine = FakeEngine(scripts={"r": [tokens(1), HANG]}, load_ranks=(rank,))
    async with servicer_running(engine) as h:
        info = await h.stub.GetModelInfo(sidecar_pb2.GetModelInfoRequest(), timeout=5)
        assert info.served_model_name == "fake-model"
        call = h.stub.Generate(request("r"))
        await call.read()
        load = await h.stub.GetLoad(sidecar_pb2.GetLoadRequest(), timeout=5)
        assert load.inflight_requests == 1
        assert list(load.ranks) == [rank]
        call.cancel()
        engine.load_error = SidecarError(
            FailureReason.CONNECTION_TIMEOUT, "GetLoad: slow (DEADLINE_EXCEEDED)"
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.stub.GetLoad(sidecar_pb2.GetLoadRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_metrics_count_requests() -> None:
    async with servicer_running() as h:
        await collect(h.stub.Generate(request()))
        reg = h.metrics.registry
        assert reg.get_sample_value("sidecar_requests_started_total", {"engine": "fake"}) == 1
        finished = {"engine": "fake", "finish_reason": "EOS"}
        assert reg.get_sample_value("sidecar_requests_finished_total", finished) == 1
        assert reg.get_sample_value("sidecar_inflight_requests", {"engine": "fake"}) == 0
        with pytest.raises(grpc.aio.AioRpcError):
            await collect(h.stub.Generate(request(token_ids=[])))
        failed = {"engine": "fake", "reason": "INVALID_ARGUMENT"}
        assert reg.get_sample_value("sidecar_requests_failed_total", failed) == 1
        assert reg.get_sample_value("sidecar_engine_connected", {"engine": "fake"}) == 1


async def test_health_watch_stream_sees_every_transition() -> None:
    async with servicer_running(serving=False) as h:
        watch = h.health.Watch(health_pb2.HealthCheckRequest(service="sidecar.v1.Worker"))
        assert (await watch.read()).status == NOT_SERVING
        h.server.set_serving()
        assert (await watch.read()).status == SERVING
        await h.server.drain()
        assert (await watch.read()).status == NOT_SERVING
        watch.cancel()
        unknown = h.health.Watch(health_pb2.HealthCheckRequest(service="other"))
        assert (await unknown.read()).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        unknown.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.health_of("other")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_stop_without_drain_aborts_in_flight_work_once() -> None:
    engine = FakeEngine(scripts={"r": [tokens(1), HANG]})
    async with servicer_running(engine) as h:
        call = h.stub.Generate(request("r"))
        await call.read()
        await h.server.stop()
        assert engine.aborts == [engine.calls[0].private_id]
        assert h.server.inflight == 0
        await h.server.stop()  # idempotent


async def test_reflection_lists_the_services() -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async with servicer_running() as h:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{h.server.port}")
        try:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = stub.ServerReflectionInfo()
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            resp = await call.read()
            await call.done_writing()
            names = {s.name for s in resp.list_services_response.service}
            assert {"sidecar.v1.Worker", "grpc.health.v1.Health"} <= names
        finally:
            await channel.close(None)


async def test_cancel_of_a_client_that_stopped_reading_aborts_once() -> None:
    # 10 MB of tokens against a 64 KiB window (no BDP growth): the handler is soon blocked
    # in its write, and the pump on a full buffer, when the client cancels.
    big = [tokens(*([300] * 1000)) for _ in range(5000)]
    engine = FakeEngine(scripts={"r": [*big, terminal(1)]}, abort_latency=0.05)
    async with servicer_running(engine) as h:
        channel = grpc.aio.insecure_channel(
            f"127.0.0.1:{h.server.port}", options=[("grpc.http2.bdp_probe", 0)]
        )
        try:
            call = sidecar_pb2_grpc.WorkerStub(channel).Generate(request("r"))
            await call.read()
            await anyio.sleep(0.3)  # the windows and the relay's buffer fill, then nothing moves
            yielded = sum(1 for kind, _ in engine.events if kind == "yield")
            assert yielded < len(big)  # backpressure reached the engine
            call.cancel()
            await engine.wait_for("closed")
            assert engine.aborts == [engine.calls[0].private_id]
        finally:
            await channel.close(None)
