"""Metric accounting and the per-request log line, as an operator reads them.

The invariants: every Generate that arrives is counted as started (refusals too), ends once
as finished or failed, refused <= failed <= started at every moment, tokens and durations are
counted once per accepted request. Driven through the real servicer on a loopback grpc.aio
server with the in-process fake engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import grpc
import pytest
from prometheus_client import generate_latest
from structlog.testing import capture_logs

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_common.rpc import NotHealthy, probe
from sidecar_server.engine import EngineHealth
from sidecar_server.health import FAILURE_THRESHOLD
from sidecar_server.metrics import ABORT_OUTCOMES, Metrics
from sidecar_server.server import ServerConfig, SidecarServer
from tests.fake_engine import HANG, FakeEngine, terminal, tokens

pytestmark = pytest.mark.timeout(30)

ENGINE = {"engine": "fake"}


@dataclass
class Sidecar:
    server: SidecarServer
    engine: FakeEngine
    metrics: Metrics
    stub: Any

    def value(self, name: str, **labels: str) -> float:
        found = self.metrics.registry.get_sample_value(name, {**ENGINE, **labels})
        return 0.0 if found is None else found

    def total(self, family: str) -> float:
        """The sum over every label set of one counter family."""
        return sum(
            sample.value
            for metric in self.metrics.registry.collect()
            for sample in metric.samples
            if sample.name == family
        )

    def check_invariants(self) -> None:
        started = self.value("sidecar_requests_started_total")
        failed = self.total("sidecar_requests_failed_total")
        refused = self.total("sidecar_requests_refused_total")
        finished = self.total("sidecar_requests_finished_total")
        assert refused <= failed <= started
        assert finished + failed <= started


@asynccontextmanager
async def sidecar(engine: FakeEngine | None = None, *, serving: bool = True) -> AsyncIterator[Sidecar]:
    engine = engine if engine is not None else FakeEngine()
    metrics = Metrics("fake", version="9.9.9")
    server = SidecarServer(engine, ServerConfig(listen="127.0.0.1:0", abort_timeout=0.5), metrics=metrics)
    await server.start()
    if serving:
        server.set_serving()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield Sidecar(server, engine, metrics, sidecar_pb2_grpc.WorkerStub(channel))
    finally:
        await channel.close(None)
        await server.stop()


def request(request_id: str, prompt: int = 3) -> sidecar_pb2.PreprocessedRequest:
    return sidecar_pb2.PreprocessedRequest(request_id=request_id, token_ids=list(range(1, prompt + 1)))


async def drain(call: Any) -> grpc.StatusCode:
    try:
        while await call.read() is not grpc.aio.EOF:  # type: ignore[attr-defined]
            pass
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


# --- the Metrics object alone -----------------------------------------------------------------


def test_exposition_has_build_info_and_no_created_series() -> None:
    metrics = Metrics("vllm", version="1.2.3")
    metrics.arrived()
    metrics.started()
    metrics.finished("EOS")
    metrics.ended(0.5, prompt_tokens=7, completion_tokens=5)
    text = generate_latest(metrics.registry).decode()
    assert 'sidecar_build_info{engine="vllm",version="1.2.3"} 1.0' in text
    assert "_created" not in text
    reg = metrics.registry
    assert reg.get_sample_value("sidecar_prompt_tokens_total", {"engine": "vllm"}) == 7
    assert reg.get_sample_value("sidecar_completion_tokens_total", {"engine": "vllm"}) == 5
    assert reg.get_sample_value("sidecar_request_duration_seconds_count", {"engine": "vllm"}) == 1
    assert reg.get_sample_value("sidecar_request_duration_seconds_sum", {"engine": "vllm"}) == 0.5


def test_engine_aborts_are_counted_by_outcome() -> None:
    metrics = Metrics("vllm")
    for outcome in ("ok", "ok", "failed", "timed_out"):
        metrics.aborted(outcome)
    counts = {
        outcome: metrics.registry.get_sample_value(
            "sidecar_engine_aborts_total", {"engine": "vllm", "outcome": outcome}
        )
        for outcome in ABORT_OUTCOMES
    }
    assert counts == {"ok": 2, "failed": 1, "timed_out": 1}


def test_a_refusal_is_both_refused_and_failed() -> None:
    metrics = Metrics("vllm")
    metrics.arrived()
    metrics.refused("INVALID_ARGUMENT")
    labels = {"engine": "vllm", "reason": "INVALID_ARGUMENT"}
    assert metrics.registry.get_sample_value("sidecar_requests_refused_total", labels) == 1
    assert metrics.registry.get_sample_value("sidecar_requests_failed_total", labels) == 1
    # A refusal never entered the in-flight gauge: nothing to take back.
    assert metrics.registry.get_sample_value("sidecar_inflight_requests", {"engine": "vllm"}) == 0


# --- through the servicer ---------------------------------------------------------------------


async def test_every_arrival_is_started_and_ends_exactly_once() -> None:
    boom = SidecarError(FailureReason.CANNOT_CONNECT, "Generate: connection reset (UNAVAILABLE)")
    engine = FakeEngine(
        scripts={
            "errors": [tokens(1), tokens(2), boom],
            "hangs": [tokens(1), HANG],
            "long": [tokens(1, 2, 3), tokens(4), terminal(5)],
        }
    )
    async with sidecar(engine) as s:
        assert await drain(s.stub.Generate(request("ok", prompt=4))) == grpc.StatusCode.OK
        assert await drain(s.stub.Generate(request("long", prompt=2))) == grpc.StatusCode.OK
        empty = sidecar_pb2.PreprocessedRequest(request_id="empty")
        assert await drain(s.stub.Generate(empty)) == grpc.StatusCode.INVALID_ARGUMENT
        assert await drain(s.stub.Generate(request("errors", prompt=5))) == grpc.StatusCode.UNAVAILABLE
        s.check_invariants()

        # A request in flight: started, not yet ended either way.
        hanging = s.stub.Generate(request("hangs"))
        await hanging.read()
        assert s.value("sidecar_requests_started_total") == 5
        assert s.value("sidecar_inflight_requests") == 1
        s.check_invariants()
        hanging.cancel()
        await s.engine.wait_for("abort")
        assert await s.server.wait_idle(5)

        s.server._draining = True  # a drain refuses new work the same way
        assert await drain(s.stub.Generate(request("late"))) == grpc.StatusCode.UNAVAILABLE

        assert s.value("sidecar_requests_started_total") == 6
        assert s.value("sidecar_requests_finished_total", finish_reason="EOS") == 2
        assert s.value("sidecar_requests_failed_total", reason="INVALID_ARGUMENT") == 1
        assert s.value("sidecar_requests_failed_total", reason="CANNOT_CONNECT") == 1
        assert s.value("sidecar_requests_failed_total", reason="CANCELLED") == 1
        assert s.value("sidecar_requests_failed_total", reason="ENGINE_SHUTDOWN") == 1
        assert s.value("sidecar_requests_refused_total", reason="INVALID_ARGUMENT") == 1
        assert s.value("sidecar_requests_refused_total", reason="ENGINE_SHUTDOWN") == 1
        # Every arrival is accounted for once the sidecar is idle.
        started = s.value("sidecar_requests_started_total")
        assert (
            s.total("sidecar_requests_finished_total") + s.total("sidecar_requests_failed_total") == started
        )
        assert s.value("sidecar_inflight_requests") == 0
        # Tokens and durations: once per accepted request (ok, long, errors, hangs).
        assert s.value("sidecar_request_duration_seconds_count") == 4
        assert s.value("sidecar_prompt_tokens_total") == 4 + 2 + 5 + 3
        # Tokens sent: 3 (default) + 5 (long) + 2 (the prefix before the error) + 1 (hangs).
        assert s.value("sidecar_completion_tokens_total") == 3 + 5 + 2 + 1
        assert s.value("sidecar_engine_aborts_total", outcome="ok") == 2  # errors, hangs


async def test_requests_refused_before_serving_count_as_started_and_refused() -> None:
    async with sidecar(serving=False) as s:
        for i in range(3):
            assert await drain(s.stub.Generate(request(f"early-{i}"))) == grpc.StatusCode.UNAVAILABLE
        assert s.value("sidecar_requests_started_total") == 3
        assert s.value("sidecar_requests_refused_total", reason="ENGINE_SHUTDOWN") == 3
        assert s.value("sidecar_request_duration_seconds_count") == 0
        assert s.engine.calls == []


async def test_an_abort_that_times_out_is_counted_and_logged_as_such() -> None:
    engine = FakeEngine(scripts={"stuck": [tokens(1), HANG]}, abort_hangs=True)
    async with sidecar(engine) as s:
        with capture_logs() as logs:
            call = s.stub.Generate(request("stuck"))
            await call.read()
            call.cancel()
            # Unregistered only after its (bounded) abort: idle means the abort has ended.
            assert await s.server.wait_idle(5)
        assert s.value("sidecar_engine_aborts_total", outcome="timed_out") == 1
        assert s.value("sidecar_engine_aborts_total", outcome="ok") == 0
        line = next(e for e in logs if e["event"] == "generate finished")
        assert line["engine_aborted"] is True
        assert line["abort_outcome"] == "timed_out"
        assert line["error_reason"] == "CANCELLED"


# --- the one log line per request ---------------------------------------------------------------


async def test_one_info_line_per_finished_request_with_what_an_operator_needs() -> None:
    boom = SidecarError(FailureReason.CANNOT_CONNECT, "Generate: connection reset (UNAVAILABLE)")
    engine = FakeEngine(scripts={"errors": [tokens(1), boom]})
    async with sidecar(engine) as s:
        with capture_logs() as logs:
            await drain(s.stub.Generate(request("ok", prompt=4)))
            await drain(s.stub.Generate(request("errors", prompt=2)))
            await drain(s.stub.Generate(sidecar_pb2.PreprocessedRequest(request_id="empty")))
    finished = [e for e in logs if e["event"] == "generate finished"]
    assert [e["public_id"] for e in finished] == ["ok", "errors"]
    assert all(e["log_level"] == "info" for e in finished)
    ok, failed = finished
    assert ok["private_id"].endswith("-ok")
    assert ok["finish_reason"] == "EOS"
    assert "error_reason" not in ok
    assert (ok["prompt_tokens"], ok["completion_tokens"]) == (4, 3)
    assert ok["duration_secs"] >= 0
    assert (ok["engine_aborted"], ok["abort_outcome"]) == (False, None)
    assert failed["error_reason"] == "CANNOT_CONNECT"
    assert "finish_reason" not in failed
    assert (failed["prompt_tokens"], failed["completion_tokens"]) == (2, 1)
    assert (failed["engine_aborted"], failed["abort_outcome"]) == (True, "ok")
    refused = [e for e in logs if e["event"] == "generate refused"]
    assert len(refused) == 1
    assert refused[0]["log_level"] == "info"
    assert refused[0]["reason"] == "INVALID_ARGUMENT"
    assert "token_ids" in refused[0]["error"]
    # Nothing at INFO per chunk: the chunks of these requests left no lines of their own.
    assert len([e for e in logs if e["log_level"] == "info"]) == 3


async def test_an_abort_rpc_ends_the_request_as_cancelled_in_the_log() -> None:
    engine = FakeEngine(scripts={"x": [tokens(1), HANG]})
    async with sidecar(engine) as s:
        with capture_logs() as logs:
            call = s.stub.Generate(request("x"))
            await call.read()
            await s.stub.Abort(sidecar_pb2.AbortRequest(request_id="x"), timeout=5)
            assert await drain(call) == grpc.StatusCode.OK
    line = next(e for e in logs if e["event"] == "generate finished")
    assert line["finish_reason"] == "CANCELLED"
    assert line["cancelled_by"] == "abort_rpc"
    assert line["engine_aborted"] is True
    assert s.value("sidecar_requests_finished_total", finish_reason="CANCELLED") == 1


async def test_engine_unhealthy_says_why() -> None:
    class FailingProbe(FakeEngine):
        probed: anyio.Event | None = None
        probes: int = 0

        async def health(self) -> EngineHealth:
            assert self.probed is not None
            # The watch acts on a probe before its next await: once the threshold's failures
            # were made, a waiter woken at the next probe sees the line.
            self.probes += 1
            if self.probes > FAILURE_THRESHOLD:
                self.probed.set()
            raise SidecarError(FailureReason.CANNOT_CONNECT, "HealthCheck: connection refused (UNAVAILABLE)")

    engine = FailingProbe()
    engine.probed = anyio.Event()
    metrics = Metrics("fake")
    server = SidecarServer(
        engine, ServerConfig(listen="127.0.0.1:0", health_watch_interval=0.01), metrics=metrics
    )
    await server.start()
    try:
        with capture_logs() as logs:
            server.set_serving()
            with anyio.fail_after(5):
                await engine.probed.wait()
    finally:
        await server.stop()
    line = next(e for e in logs if e["event"].startswith("engine unhealthy"))
    assert line["log_level"] == "warning"
    assert "connection refused" in line["reason"]
    assert metrics.registry.get_sample_value("sidecar_engine_connected", ENGINE) == 0


async def test_a_failed_probe_tells_why() -> None:
    reasons: list[str] = []

    async def not_ready(timeout: float) -> None:
        raise NotHealthy("engine reports not healthy: loading weights")

    async def unreachable(timeout: float) -> None:
        raise SidecarError(FailureReason.CANNOT_CONNECT, "HealthCheck: connection refused (UNAVAILABLE)")

    async def silent(timeout: float) -> None:
        await anyio.sleep_forever()

    async def fine(timeout: float) -> None:
        return None

    assert not await probe(not_ready, 1.0, reasons.append)
    assert not await probe(unreachable, 1.0, reasons.append)
    with pytest.raises(TimeoutError):  # late, which is not unhealthy
        await probe(silent, 0.01, reasons.append)
    assert await probe(fine, 1.0, reasons.append)
    assert reasons[0] == "engine reports not healthy: loading weights"
    assert "connection refused" in reasons[1]
    assert "no health check answer within" in reasons[2]
    assert len(reasons) == 3
