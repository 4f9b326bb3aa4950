"""Lifecycle rules of the servicer and the relay, against the scripted fake engine:

* a generation whose every terminal was delivered ends OK, whatever stops the sidecar while
  the engine stream is still closing, and is never aborted;
* a stop never cuts a write to the frontend that is already in flight (a cut write made the
  status after it fail, reaching the client as a bare UNAVAILABLE without its ErrorInfo);
* a cancelled health Watch leaves nothing behind;
* an untyped exception (a bug) in the handler, the engine adapter, ``validate``, a unary call
  or the health probe is logged at error level with its traceback, counted in
  ``sidecar_internal_errors_total{where}``, and the call still ends UNKNOWN with its ErrorInfo.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
import grpc
import pytest
from grpc_health.v1 import health_pb2
from structlog.testing import capture_logs

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_server.dispatch import ChoiceTracker, Generation
from sidecar_server.engine import EngineHealth, EngineLoad, GenerateCall
from sidecar_server.relay import RelayConfig, relay
from sidecar_server.server import SidecarServer
from tests.fake_engine import HANG, FakeEngine, Gate, terminal, tokens
from tests.integration.test_servicer import Harness, error_info, request, servicer_running

pytestmark = pytest.mark.timeout(60)

# Long enough that a test which relied on it running out would time out instead of passing.
_FOREVER = 600.0


async def _read_through_terminal(call: Any) -> list[sidecar_pb2.LLMEngineOutput]:
    outs: list[sidecar_pb2.LLMEngineOutput] = []
    while not outs or outs[-1].finish_reason == sidecar_pb2.UNSPECIFIED:
        out = await call.read()
        assert out is not grpc.aio.EOF, "the stream ended before its terminal"  # type: ignore[attr-defined]
        outs.append(out)
    return outs


async def _read_to_the_end(call: Any) -> None:
    while await call.read() is not grpc.aio.EOF:  # type: ignore[attr-defined]
        pass


async def _read_until_error(call: Any) -> tuple[list[sidecar_pb2.LLMEngineOutput], grpc.aio.AioRpcError]:
    outs: list[sidecar_pb2.LLMEngineOutput] = []
    try:
        while (out := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            outs.append(out)
    except grpc.aio.AioRpcError as err:
        return outs, err
    raise AssertionError("the stream ended OK")


async def _drain_with_timeout(server: SidecarServer) -> None:
    await server.drain()  # drain_timeout is short in these tests: it runs out and cancels


async def _cancel_inflight(server: SidecarServer) -> None:
    assert server.cancel_inflight() == 1


async def _stop(server: SidecarServer) -> None:
    await server.stop()


STOPS: dict[str, Callable[[SidecarServer], Awaitable[None]]] = {
    "drain_timeout": _drain_with_timeout,
    "cancel_inflight": _cancel_inflight,
    "server_stop": _stop,
}


@pytest.mark.parametrize("stop", list(STOPS))
async def test_a_delivered_stream_ends_ok_whatever_stops_it_before_the_engine_closes(stop: str) -> None:
    # The engine sends every terminal, then holds its stream open (as SGLang over HTTP does
    # until [DONE]); the sidecar is told to stop in that window.
    engine = FakeEngine(scripts={"r": [tokens(1), terminal(2, index=0), terminal(3, index=1), HANG]})
    async with servicer_running(engine, drain_timeout=0.05, abort_timeout=_FOREVER) as h:
        call = h.stub.Generate(request("r", n=2))
        outs = await _read_through_terminal(call)
        while {o.index for o in outs if o.finish_reason != sidecar_pb2.UNSPECIFIED} != {0, 1}:
            outs.append(await call.read())
        assert h.server.inflight == 1  # still waiting for the engine stream to end
        await STOPS[stop](h.server)
        assert await call.read() is grpc.aio.EOF  # type: ignore[attr-defined]
        assert await call.code() == grpc.StatusCode.OK
        assert [t for o in outs for t in o.token_ids] == [1, 2, 3]
        await engine.wait_for("closed")
        assert engine.aborts == []
        finished = {"engine": "fake", "finish_reason": "EOS"}
        assert h.metrics.registry.get_sample_value("sidecar_requests_finished_total", finished) == 1


async def test_a_delivered_stream_ends_ok_on_a_public_abort_before_the_engine_closes() -> None:
    engine = FakeEngine(scripts={"r": [tokens(1), terminal(2), HANG]})
    async with servicer_running(engine, abort_timeout=_FOREVER) as h:
        call = h.stub.Generate(request("r"))
        outs = await _read_through_terminal(call)
        reply = await h.stub.Abort(sidecar_pb2.AbortRequest(request_id="r"), timeout=5)
        assert reply.aborted == 1
        # No CANCELLED terminal after the real one, no engine abort.
        assert await call.read() is grpc.aio.EOF  # type: ignore[attr-defined]
        assert await call.code() == grpc.StatusCode.OK
        assert [o.finish_reason for o in outs] == [sidecar_pb2.UNSPECIFIED, sidecar_pb2.EOS]
        await engine.wait_for("closed")
        assert engine.aborts == []


async def test_an_engine_that_holds_its_stream_open_after_the_terminal_is_cut_after_the_grace() -> None:
    # No stop at all: the status must not wait for the engine forever.
    engine = FakeEngine(scripts={"r": [terminal(1), HANG]})
    async with servicer_running(engine, abort_timeout=0.2) as h:
        call = h.stub.Generate(request("r"))
        with anyio.fail_after(10):
            outs = [o async for o in call]
        assert await call.code() == grpc.StatusCode.OK
        assert [o.finish_reason for o in outs] == [sidecar_pb2.EOS]
        assert engine.aborts == []
        assert ("closed", engine.calls[0].private_id) in engine.events


async def test_an_engine_error_after_every_terminal_is_logged_not_reported() -> None:
    # A chunk after the terminal breaks the engine contract, but the frontend already has
    # its whole answer: failing the call now would make it look retryable or broken.
    engine = FakeEngine(scripts={"r": [terminal(1), Gate(anyio.Event()), tokens(2)]})
    gate = engine.scripts["r"][1]
    assert isinstance(gate, Gate)
    async with servicer_running(engine, abort_timeout=_FOREVER) as h:
        call = h.stub.Generate(request("r"))
        await _read_through_terminal(call)
        gate.event.set()
        assert await call.read() is grpc.aio.EOF  # type: ignore[attr-defined]
        assert await call.code() == grpc.StatusCode.OK
        assert engine.aborts == []


async def test_an_unfinished_stream_still_ends_engine_shutdown_on_a_stop() -> None:
    # The counterpart: the rule above only covers streams whose terminals were all sent.
    engine = FakeEngine(scripts={"r": [tokens(1), terminal(2, index=0), HANG]})
    async with servicer_running(engine, abort_timeout=_FOREVER) as h:
        call = h.stub.Generate(request("r", n=2))
        await _read_through_terminal(call)
        assert h.server.cancel_inflight() == 1
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _read_to_the_end(call)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error_info(info.value).reason == "ENGINE_SHUTDOWN"
        assert engine.aborts == [engine.calls[0].private_id]


# --- a stop never cuts a write in flight ---------------------------------------------------


class _SlowWrites:
    """A frontend whose writes complete only when the test says so."""

    def __init__(self) -> None:
        self.started = anyio.Event()
        self.release = anyio.Event()
        self.completed: list[sidecar_pb2.LLMEngineOutput] = []
        self.cut = 0

    async def write(self, out: sidecar_pb2.LLMEngineOutput) -> None:
        self.started.set()
        try:
            await self.release.wait()
        except BaseException:
            self.cut += 1
            raise
        self.completed.append(out)


def _generation(engine: FakeEngine, request_id: str) -> Generation:
    return Generation(engine, GenerateCall(request(request_id), f"00000000000000000000-{request_id}"))


async def test_a_stop_lets_the_write_in_flight_finish_and_aborts_meanwhile() -> None:
    engine = FakeEngine(scripts={"r": [tokens(1), HANG]})
    gen = _generation(engine, "r")
    frontend = _SlowWrites()
    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()

        async def run() -> None:
            with scope:
                await relay(gen, frontend.write, RelayConfig(drain_grace=_FOREVER))

        tg.start_soon(run)
        await frontend.started.wait()
        scope.cancel()  # the drain, while the first write is in flight
        await engine.wait_for("abort")  # the engine abort does not wait for the frontend
        assert frontend.cut == 0
        frontend.release.set()
    assert frontend.cut == 0
    assert [list(o.token_ids) for o in frontend.completed] == [[1]]
    assert engine.aborts == [gen.private_id]
    assert next(e for e in engine.events if e[0] in ("abort", "closed")) == ("abort", gen.private_id)


async def test_a_write_the_frontend_never_completes_is_cut_after_the_grace() -> None:
    engine = FakeEngine(scripts={"r": [tokens(1), HANG]})
    gen = _generation(engine, "r")
    frontend = _SlowWrites()
    with anyio.fail_after(10):
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:

                async def stop_when_writing() -> None:
                    await frontend.started.wait()
                    scope.cancel()

                tg.start_soon(stop_when_writing)
                await relay(gen, frontend.write, RelayConfig(drain_grace=0.1))
    assert frontend.cut == 1
    assert engine.aborts == [gen.private_id]


# --- health Watch ----------------------------------------------------------------------------


async def _watchers_gone(h: Harness) -> None:
    with anyio.fail_after(20):
        while h.server.health_watchers:  # noqa: ASYNC110 - polling a count, no event to wait on
            await anyio.sleep(0.01)


async def test_cancelled_health_watches_leave_nothing_behind() -> None:
    async with servicer_running() as h:
        for _ in range(10):
            calls = [h.health.Watch(health_pb2.HealthCheckRequest(service="")) for _ in range(100)]
            for call in calls:
                assert (await call.read()).status == health_pb2.HealthCheckResponse.SERVING
            assert h.server.health_watchers == 100
            for call in calls:
                call.cancel()
            await _watchers_gone(h)
        # A watch that is still open keeps working after all that.
        watch = h.health.Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        await h.server.drain()
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
        await _watchers_gone(h)


# --- errors must not hide bugs -------------------------------------------------------------


class _BuggyEngine(FakeEngine):
    """A fake engine whose chosen method raises an untyped exception (a bug)."""

    def __init__(self, broken: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.broken = broken

    def validate(self, request: sidecar_pb2.PreprocessedRequest) -> None:
        if self.broken == "validate":
            raise KeyError("sampling_options")
        super().validate(request)

    def model_info(self) -> sidecar_pb2.ModelInfo:
        if self.broken == "model_info":
            raise AttributeError("'NoneType' object has no attribute 'served_model_name'")
        return super().model_info()

    async def load(self) -> EngineLoad:
        if self.broken == "load":
            raise TypeError("'NoneType' object is not iterable")
        return await super().load()

    async def health(self) -> EngineHealth:
        if self.broken == "health_watch":
            raise ZeroDivisionError("division by zero")
        return await super().health()


def _internal_errors(h: Harness, where: str) -> float:
    value = h.metrics.registry.get_sample_value(
        "sidecar_internal_errors_total", {"engine": "fake", "where": where}
    )
    return value or 0.0


def _logged_bug(
    logs: Sequence[Mapping[str, Any]], where: str, exc_type: type[BaseException]
) -> Mapping[str, Any]:
    [entry] = [e for e in logs if e.get("event") == "internal error" and e.get("where") == where]
    assert entry["log_level"] == "error"
    assert isinstance(entry["exc_info"], exc_type)  # rendered as a traceback by the log config
    assert entry["exc_info"].__traceback__ is not None
    return entry


async def _unknown_status(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == grpc.StatusCode.UNKNOWN
    detail = error_info(info.value)
    assert (detail.reason, detail.metadata["migratable"]) == ("UNKNOWN", "false")
    return info.value


async def test_a_bug_in_the_engine_stream_is_logged_counted_and_ends_unknown() -> None:
    engine = FakeEngine(scripts={"r": [tokens(1), RuntimeError("kaput")]})
    async with servicer_running(engine) as h:
        with capture_logs() as logs:
            err = await _unknown_status(_read_to_the_end(h.stub.Generate(request("r"))))
        assert "RuntimeError: kaput" in (err.details() or "")
        _logged_bug(logs, "engine_generate", RuntimeError)
        assert _internal_errors(h, "engine_generate") == 1
        assert engine.aborts == [engine.calls[0].private_id]


async def test_a_bug_in_validate_is_logged_counted_and_ends_unknown() -> None:
    async with servicer_running(_BuggyEngine("validate")) as h:
        with capture_logs() as logs:
            err = await _unknown_status(_read_to_the_end(h.stub.Generate(request("r"))))
        assert "fake validate: KeyError" in (err.details() or "")
        _logged_bug(logs, "validate", KeyError)
        assert _internal_errors(h, "validate") == 1
        assert h.engine.calls == []


@pytest.mark.parametrize(("where", "exc_type"), [("model_info", AttributeError), ("load", TypeError)])
async def test_a_bug_in_a_unary_call_is_logged_counted_and_ends_unknown(
    where: str, exc_type: type[BaseException]
) -> None:
    async with servicer_running(_BuggyEngine(where)) as h:
        with capture_logs() as logs:
            if where == "model_info":
                await _unknown_status(h.stub.GetModelInfo(sidecar_pb2.GetModelInfoRequest(), timeout=5))
            else:
                await _unknown_status(h.stub.GetLoad(sidecar_pb2.GetLoadRequest(), timeout=5))
        _logged_bug(logs, where, exc_type)
        assert _internal_errors(h, where) == 1


async def test_a_bug_in_the_health_probe_is_logged_counted_and_reads_as_unhealthy() -> None:
    async with servicer_running(_BuggyEngine("health_watch"), health_watch_interval=0.01) as h:
        with capture_logs() as logs:
            await h.wait_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        _logged_bug(
            [e for e in logs if e.get("where") == "health_watch"][:1], "health_watch", ZeroDivisionError
        )
        assert _internal_errors(h, "health_watch") >= 1


async def test_a_bug_in_the_handler_itself_is_logged_counted_and_ends_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with servicer_running() as h:

        def broken(prompt_tokens: int) -> list[sidecar_pb2.LLMEngineOutput]:
            raise IndexError("list index out of range")

        monkeypatch.setattr(
            ChoiceTracker, "cancelled_terminals", lambda self, prompt_tokens: broken(prompt_tokens)
        )
        h.engine.scripts["r"] = [tokens(1), HANG]
        call = h.stub.Generate(request("r"))
        await call.read()
        with capture_logs() as logs:
            assert (await h.stub.Abort(sidecar_pb2.AbortRequest(request_id="r"), timeout=5)).aborted == 1
            err = await _unknown_status(_read_to_the_end(call))
        assert "IndexError" in (err.details() or "")
        _logged_bug(logs, "generate", IndexError)
        assert _internal_errors(h, "generate") == 1
        failed = {"engine": "fake", "reason": "UNKNOWN"}
        assert h.metrics.registry.get_sample_value("sidecar_requests_failed_total", failed) == 1


async def test_a_public_abort_of_a_frontend_that_stopped_reading_ends_cancelled_not_as_a_bug() -> None:
    # The second message (1.2 MB) cannot pass a client window of 64 KiB that nobody drains: its
    # write never completes, is cut after the grace, and no CANCELLED terminal can follow it.
    engine = FakeEngine(scripts={"r": [tokens(1), tokens(*([7] * 300_000)), HANG]})
    async with servicer_running(engine, abort_timeout=0.2) as h:
        channel = grpc.aio.insecure_channel(
            f"127.0.0.1:{h.server.port}", options=[("grpc.http2.bdp_probe", 0)]
        )
        try:
            call = sidecar_pb2_grpc.WorkerStub(channel).Generate(request("r"))
            await call.read()
            await engine.wait_for("yield", 2)  # the writer is in the big write from here on
            with capture_logs() as logs:
                assert (await h.stub.Abort(sidecar_pb2.AbortRequest(request_id="r"), timeout=5)).aborted == 1
                await engine.wait_for("abort")  # at once, whatever the frontend does
                with anyio.fail_after(10):
                    while not [e for e in logs if e["event"].startswith("write to the frontend cut")]:  # noqa: ASYNC110
                        await anyio.sleep(0.01)
                # The status can only follow the message grpc still holds: read on.
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await _read_to_the_end(call)
                assert await h.server.wait_idle(10)
            assert info.value.code() == grpc.StatusCode.CANCELLED
            assert error_info(info.value).reason == "CANCELLED"
            assert engine.aborts == [engine.calls[0].private_id]
            assert _internal_errors(h, "generate") == 0
            assert not [e for e in logs if e.get("log_level") == "error"]
        finally:
            await channel.close(None)


async def test_a_stop_during_the_first_write_still_ends_engine_shutdown_with_its_error_info() -> None:
    # The second-SIGTERM race, forced: the first message (1.2 MB) is still being written (the
    # client's 64 KiB window is not drained) when cancel_inflight() lands. Cutting that write
    # made the status fail in grpc (initial metadata sent twice) and the client saw a bare
    # status without ErrorInfo.
    engine = FakeEngine(scripts={"r": [tokens(*([7] * 300_000)), HANG]})
    async with servicer_running(engine, abort_timeout=_FOREVER) as h:
        channel = grpc.aio.insecure_channel(
            f"127.0.0.1:{h.server.port}", options=[("grpc.http2.bdp_probe", 0)]
        )
        try:
            call = sidecar_pb2_grpc.WorkerStub(channel).Generate(request("r"))
            await engine.wait_for("yield")  # the writer is in the big first write from here on
            assert h.server.cancel_inflight() == 1
            await engine.wait_for("abort")  # the engine abort does not wait for the write
            with anyio.fail_after(20):  # before the fix the status never came (or came bare)
                outs, err = await _read_until_error(call)
            assert [len(o.token_ids) for o in outs] == [300_000]
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            detail = error_info(err)
            assert (detail.reason, detail.metadata["migratable"]) == ("ENGINE_SHUTDOWN", "true")
            assert engine.aborts == [engine.calls[0].private_id]
        finally:
            await channel.close(None)


class _ProbeNeverAnswers(FakeEngine):
    """Every health probe hangs until cancelled; ``probing`` is set once one is running."""

    probing: anyio.Event | None = None

    async def health(self) -> EngineHealth:
        assert self.probing is not None
        self.probing.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


def _server_tasks() -> set[asyncio.Task[Any]]:
    return {t for t in asyncio.all_tasks() if t.get_name().startswith("sidecar server") and not t.done()}


async def test_stopping_the_server_leaves_no_background_task_running() -> None:
    # The health watch is inside a probe and a failed generation's probe after the engine
    # fault is running too, neither of which would ever end by itself.
    engine = _ProbeNeverAnswers(
        scripts={"r": [SidecarError(FailureReason.UNKNOWN, "Generate: boom (INTERNAL)")]}
    )
    engine.probing = anyio.Event()
    async with servicer_running(
        engine, health_watch_interval=0.01, health_probe_timeout=_FOREVER, engine_fault_window=_FOREVER
    ) as h:
        call = h.stub.Generate(request("r"))
        with anyio.fail_after(10):
            await engine.probing.wait()
            while len(_server_tasks()) < 2:  # noqa: ASYNC110 - tasks, not an event
                await anyio.sleep(0.01)
        names = sorted(t.get_name() for t in _server_tasks())
        assert names == ["sidecar server: health watch", "sidecar server: probe after engine fault"]
        with anyio.fail_after(10):
            await h.server.stop()
        assert _server_tasks() == set()
        # The failure stands as it was (no verdict came), and reaches its client.
        _, err = await _read_until_error(call)
        assert err.code() == grpc.StatusCode.UNKNOWN
        # Stopped, the server starts nothing new.
        h.server.set_serving()
        assert _server_tasks() == set()
