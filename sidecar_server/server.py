"""The frontend-facing server: the Worker servicer, health, reflection and the drain.

Every typed error becomes a gRPC status here and nowhere else: the code and message of
:func:`sidecar_common.errors.to_rpc_status`, its serialized ``google.rpc.Status`` in
``grpc-status-details-bin`` (so ``grpc_status.rpc_status.from_call`` finds the ErrorInfo)
and a ``migratable`` trailing metadata entry for frontends that only read metadata.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import anyio
import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from structlog.typing import FilteringBoundLogger

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_common.errors import FailureReason, SidecarError, to_rpc_status
from sidecar_common.message_size import GRPC_MAX_MESSAGE_BYTES
from sidecar_common.tls import TlsFiles, TlsSettingsError, server_credentials
from sidecar_common.tracing import SpanKind, Tracing, from_metadata
from sidecar_server.dispatch import (
    CancelCause,
    Generation,
    Inflight,
    Registry,
    new_public_id,
)
from sidecar_server.engine import Engine, EngineLoad, GenerateCall, StatefulEngine
from sidecar_server.engine_health import EngineHealthMonitor
from sidecar_server.engine_state import Change, EngineStatus, proto_state
from sidecar_server.engine_state_watch import EngineStateWatch
from sidecar_server.health import FAILURE_THRESHOLD
from sidecar_server.kv_hub import KvCacheHub
from sidecar_server.load_push import DEFAULT_PUSH_INTERVAL_SECS, PushTiming
from sidecar_server.load_watch import LoadWatch
from sidecar_server.metrics import Metrics
from sidecar_server.relay import RelayConfig, relay

__all__ = ["HEALTH_SERVICES", "LIVENESS_SERVICE", "WORKER_SERVICE", "ServerConfig", "SidecarServer"]

_log = structlog.get_logger(__name__)

WORKER_SERVICE = sidecar_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
# Answers SERVING whenever it answers at all: the reply is written by the sidecar's own event
# loop, so it proves that loop turns and nothing about the engine. A liveness probe on it
# restarts a wedged sidecar, never one that waits out an engine outage.
LIVENESS_SERVICE = "liveness"
HEALTH_SERVICES = ("", WORKER_SERVICE, LIVENESS_SERVICE)
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

_Context = grpc.aio.ServicerContext[Any, Any]


@dataclass(frozen=True)
class ServerConfig:
    listen: str = "0.0.0.0:50061"
    drain_timeout: float = 30.0
    hold_decode_cancels: bool = False  # disaggregation mode "decode"
    decode_hold_timeout: float = 30.0
    health_watch_interval: float = 1.0  # background engine health watch period
    health_probe_timeout: float = 5.0
    # Failed probes in a row before new requests are refused (docs/common.md, "Engine health").
    health_failure_threshold: int = FAILURE_THRESHOLD
    # After a generation failed with an untyped engine error (INTERNAL...), how long the engine
    # has to report itself unhealthy for the failure to count as the engine going away.
    engine_fault_window: float = 1.0
    abort_timeout: float = 5.0
    # stop(): how long the final statuses (ENGINE_SHUTDOWN with its ErrorInfo) may take to
    # reach their clients before the server cuts what is left.
    stop_grace: float = 1.0
    relay_capacity: int = 32
    # From this many generations in flight, writers let the loop turn before each message
    # so that chunks that arrived meanwhile go out merged (fewer, fuller messages).
    coalesce_min_inflight: int = 16
    tls: TlsFiles | None = None  # None: plaintext
    reflection: bool = True
    # Larger request messages are refused by grpc itself (RESOURCE_EXHAUSTED) before any
    # handler runs: the bound on what one client can make the sidecar hold.
    max_request_bytes: int = GRPC_MAX_MESSAGE_BYTES
    # WatchLoad: at most one report per interval to each client, and the load read this often
    # while any client watches (--load-push-interval-ms).
    load_push_interval: float = DEFAULT_PUSH_INTERVAL_SECS
    # gRPC core's limits on calls waiting for this server to pick them up, soft and hard (None:
    # gRPC's, 1,000 and 3,000): past them core refuses calls (RESOURCE_EXHAUSTED) before any
    # handler runs. Frontends bound what they leave waiting here themselves (their start slots).
    pending_calls: tuple[int, int] | None = None


class _Health(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """grpc.health.v1 with a synchronous ``set`` (the stock aio servicer's is async)."""

    def __init__(self) -> None:
        self.status: int = _NOT_SERVING
        self._waiters: set[anyio.Event] = set()

    @property
    def watchers(self) -> int:
        """Watch streams waiting for the next change."""
        return len(self._waiters)

    def set(self, status: int) -> None:
        if status == self.status:
            return
        self.status = status
        waiters, self._waiters = self._waiters, set()
        for event in waiters:
            event.set()

    async def Check(self, request: Any, context: _Context) -> Any:
        if request.service not in HEALTH_SERVICES:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=self._status_of(request.service))

    def _status_of(self, service: str) -> int:
        return _SERVING if service == LIVENESS_SERVICE else self.status

    async def Watch(self, request: Any, context: _Context) -> None:
        known = request.service in HEALTH_SERVICES
        last: int | None = None
        while True:
            # Registered before reading the status, so a change during the write below
            # wakes this loop instead of being missed.
            event = anyio.Event()
            self._waiters.add(event)
            try:
                status = (
                    self._status_of(request.service)
                    if known
                    else health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
                )
                if status != last:
                    await context.write(health_pb2.HealthCheckResponse(status=status))
                    last = status
                # Ends when the client cancels or the server stops (the handler is cancelled).
                await event.wait()
            finally:
                # However the wait ends: a cancelled watch must not stay registered until
                # the next status change.
                self._waiters.discard(event)


async def _fail(context: _Context, error: SidecarError) -> NoReturn:
    details = to_rpc_status(error).SerializeToString()
    await context.abort(
        error.code,
        error.message,
        trailing_metadata=(
            ("grpc-status-details-bin", details),
            ("migratable", "true" if error.migratable else "false"),
        ),
    )
    raise AssertionError("context.abort returned")  # pragma: no cover


@dataclass
class _Run:
    """One admitted Generate call: its request (named), its registry entry, its generation,
    and what its one "generate finished" line says about how it ended."""

    request: sidecar_pb2.PreprocessedRequest
    entry: Inflight
    gen: Generation
    log: FilteringBoundLogger  # bound to the call's public and private ids
    started_at: float  # monotonic
    outcome: dict[str, str] = field(default_factory=dict)


class _Worker(sidecar_pb2_grpc.WorkerServicer):
    def __init__(self, owner: SidecarServer) -> None:
        self._owner = owner

    # The unary-stream handler writes through context.write (a coroutine, not an async
    # generator) so that its cancel scopes and task group live in one frame.
    async def Generate(  # type: ignore[override]
        self, request: sidecar_pb2.PreprocessedRequest, context: _Context
    ) -> None:
        owner = self._owner
        with owner._tracing.span(
            "sidecar.v1.Worker/Generate",
            from_metadata(context.invocation_metadata()),
            kind=SpanKind.SERVER,
            attributes={"llm.request_id": request.request_id, "llm.engine": owner._engine.name},
        ):
            await owner._generate(request, context)

    async def Abort(self, request: sidecar_pb2.AbortRequest, context: _Context) -> sidecar_pb2.AbortResponse:
        return await self._owner._abort(request)

    async def GetModelInfo(
        self, request: sidecar_pb2.GetModelInfoRequest, context: _Context
    ) -> sidecar_pb2.ModelInfo:
        return await self._owner._model_info(context)

    async def GetLoad(self, request: sidecar_pb2.GetLoadRequest, context: _Context) -> sidecar_pb2.LoadReport:
        return await self._owner._load(context)

    async def WatchLoad(  # type: ignore[override]
        self, request: sidecar_pb2.WatchLoadRequest, context: _Context
    ) -> None:
        await self._owner.load_watch.watch(context.write)

    async def WatchKvCache(  # type: ignore[override]
        self, request: sidecar_pb2.WatchKvCacheRequest, context: _Context
    ) -> None:
        await self._owner.kv_cache.watch(request, context.write)

    async def FlushCache(
        self, request: sidecar_pb2.FlushCacheRequest, context: _Context
    ) -> sidecar_pb2.FlushCacheResponse:
        return await self._owner._flush_cache(context)


class SidecarServer:
    """One sidecar's gRPC server: ``start`` (health NOT_SERVING), ``set_serving`` once the
    engine is discovered, ``drain`` on a stop signal, then ``stop``."""

    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        *,
        metrics: Metrics | None = None,
        engine_health_listener: Callable[[bool, str], None] | None = None,
        tracing: Tracing | None = None,
        kv_cache: KvCacheHub | None = None,
    ) -> None:
        self._engine = engine
        # The engine's KV-cache state (WatchKvCache); never fed without --kv-events-endpoint.
        self.kv_cache = kv_cache if kv_cache is not None else KvCacheHub(subscribed=False)
        self._config = config
        self._metrics = metrics
        self._tracing = tracing if tracing is not None else Tracing()
        # Told (healthy, why not) when the background health watch changes its verdict.
        self._engine_health_listener = engine_health_listener
        self._registry = Registry()
        self._health = _Health()
        self._relay_config = RelayConfig(
            capacity=config.relay_capacity,
            hold_timeout=config.decode_hold_timeout,
            drain_grace=config.abort_timeout,
        )
        self._server: grpc.aio.Server | None = None
        self._port = 0
        self._serving = False  # engine connected and discovered
        # The health watch and the probes after an engine fault: stop() ends them.
        self._engine_health = EngineHealthMonitor(
            engine,
            watch_interval=config.health_watch_interval,
            probe_timeout=config.health_probe_timeout,
            failure_threshold=config.health_failure_threshold,
            fault_window=config.engine_fault_window,
            on_change=self._engine_health_changed,
            internal_error=self._internal_error,
            activity=lambda: self._relay_config.activity.messages,
            paused=lambda: self._engine_state is not None and self._engine_state.paused,
        )
        # The engine's own pause state and weight version, read at the health watch's cadence
        # (engine_state.py says what each wire reports); None: the engine cannot say them.
        self._engine_state: EngineStateWatch | None = None
        if isinstance(engine, StatefulEngine):
            self._engine_state = EngineStateWatch(
                engine.status,
                interval=config.health_watch_interval,
                timeout=config.health_probe_timeout,
                on_change=self._engine_state_changed,
            )
        # The WatchLoad streams and the one loop that reads the load for them; stop() ends it.
        self.load_watch = LoadWatch(self._read_load, PushTiming(interval=config.load_push_interval))
        self._draining = False
        self._stopped = False
        # The drain's wait for in-flight work; cancel_inflight() ends it early.
        self._drain_wait: anyio.CancelScope | None = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def inflight(self) -> int:
        return self._registry.inflight

    @property
    def health_watchers(self) -> int:
        """Health Watch streams open right now."""
        return self._health.watchers

    async def wait_idle(self, seconds: float) -> bool:
        """Wait until no generation is in flight, at most ``seconds``; True if idle."""
        return await self._registry.wait_idle(seconds)

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("SidecarServer.start called twice")
        server = self._new_server()
        self._port = self._bind(server, self._config.listen)
        await server.start()
        self._server = server
        tls = self._config.tls
        _log.info(
            "sidecar listening",
            listen=self._config.listen,
            port=self._port,
            tls="mutual" if tls is not None and tls.mutual else "on" if tls is not None else "off",
            reflection=self._config.reflection,
            max_request_bytes=self._config.max_request_bytes,
        )

    def _new_server(self) -> grpc.aio.Server:
        server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", self._config.max_request_bytes),
                # grpcio turns SO_REUSEPORT on by default: a second sidecar (or the engine
                # itself) on the same port would bind too and silently split the traffic.
                # Off, a taken port fails the bind, and start-up says so.
                ("grpc.so_reuseport", 0),
                *self._pending_call_options(),
            ]
        )
        sidecar_pb2_grpc.add_WorkerServicer_to_server(_Worker(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        if self._config.reflection:
            reflection.enable_server_reflection(
                (
                    WORKER_SERVICE,
                    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                    reflection.SERVICE_NAME,
                ),
                server,
            )
        return server

    def _bind(self, server: grpc.aio.Server, listen: str) -> int:
        tls = self._config.tls
        try:
            if tls is None:
                return server.add_insecure_port(listen)
            return server.add_secure_port(listen, server_credentials(tls))
        except TlsSettingsError as exc:
            raise SidecarError(FailureReason.CANNOT_CONNECT, f"cannot serve TLS: {exc}") from exc
        except RuntimeError as exc:
            # With TLS, grpc reports a certificate and key that do not match as a bind failure.
            hint = " (or the TLS certificate and key were refused)" if tls is not None else ""
            raise SidecarError(
                FailureReason.CANNOT_CONNECT,
                f"cannot listen on {self._config.listen}: the address is in use or not available"
                f"{hint} ({exc})",
            ) from exc

    def set_serving(self) -> None:
        """The engine is connected and discovered: accept requests and watch its health."""
        self._serving = True
        self._engine_health.start()
        if self._engine_state is not None:
            self._engine_state.start()
        if self._metrics is not None:
            self._metrics.set_engine_connected(True)
        self._update_health()

    async def drain(self) -> None:
        """Refuse new work, let in-flight work finish up to drain_timeout, cancel the rest."""
        self._draining = True
        self._update_health()
        log = _log.bind(inflight=self._registry.inflight)
        log.info("drain started", timeout=self._config.drain_timeout)
        self._drain_wait = anyio.CancelScope(deadline=anyio.current_time() + self._config.drain_timeout)
        try:
            with self._drain_wait:
                await self._registry.wait_idle(float("inf"))
        finally:
            self._drain_wait = None
        if self._registry.inflight == 0:
            log.info("drain finished")
            return
        cancelled = self._registry.cancel_all()
        _log.warning("drain timed out, cancelling in-flight generations", cancelled=cancelled)
        # Each cancelled generation may hold for its first token, then aborts (bounded).
        await self._registry.wait_idle(self._cleanup_bound())

    def cancel_inflight(self) -> int:
        """Stop waiting: refuse new work and end every in-flight generation now with
        ENGINE_SHUTDOWN (migratable), each aborted on the engine. Returns how many.

        Does not wait: a running :meth:`drain` returns once their cleanup is done (bounded),
        and :meth:`stop` waits for it too.
        """
        self._draining = True
        self._update_health()
        if self._drain_wait is not None:
            self._drain_wait.cancel()
        cancelled = self._registry.cancel_all()
        if cancelled:
            _log.warning("cancelling in-flight generations", cancelled=cancelled)
        return cancelled

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.cancel_inflight()
        await self._engine_health.close()
        if self._engine_state is not None:
            await self._engine_state.close(self._config.health_probe_timeout)
        await self.load_watch.close(self._config.health_probe_timeout)
        if self._server is not None:
            # Each cancelled generation ends with its own ENGINE_SHUTDOWN status after its
            # engine abort; the grace lets those statuses reach the clients, where stop(None)
            # would cut them to a bare UNAVAILABLE. What is still running after it (health
            # watches, a handler stuck past its bounds) is cancelled.
            await self._registry.wait_idle(self._cleanup_bound())
            await self._server.stop(self._config.stop_grace)
            await self._registry.wait_idle(self._cleanup_bound())
        _log.info("sidecar stopped")

    def _cleanup_bound(self) -> float:
        hold = self._config.decode_hold_timeout if self._config.hold_decode_cancels else 0.0
        return hold + 2 * self._config.abort_timeout + 1.0

    def _under_load(self) -> bool:
        return self._registry.inflight >= self._config.coalesce_min_inflight

    def _update_health(self) -> None:
        accepting = self._serving and self._engine_health.healthy and not self._draining
        self._health.set(_SERVING if accepting else _NOT_SERVING)

    def _refusal(self) -> SidecarError | None:
        if self._draining:
            return SidecarError(FailureReason.ENGINE_SHUTDOWN, "sidecar is draining")
        if not self._serving:
            return SidecarError(FailureReason.ENGINE_SHUTDOWN, "sidecar is not serving")
        if not self._engine_health.healthy:
            return SidecarError(
                FailureReason.CANNOT_CONNECT,
                f"{self._engine.name} engine is unhealthy or unreachable: {self._engine_health.problem}",
            )
        return None

    def _pending_call_options(self) -> list[tuple[str, int]]:
        limits = self._config.pending_calls
        if limits is None:
            return []
        soft, hard = limits
        return [
            ("grpc.server.max_pending_requests", soft),
            ("grpc.server.max_pending_requests_hard_limit", hard),
        ]

    @property
    def engine_status(self) -> EngineStatus:
        """The engine's pause state and weight version as it last said them."""
        return self._engine_state.status if self._engine_state is not None else EngineStatus()

    def _engine_state_changed(self, status: EngineStatus, changes: tuple[Change, ...]) -> None:
        del changes  # said by the watch; every client hears the new state in its next report
        if self._metrics is not None:
            self._metrics.set_engine_status(status.paused, status.weight_version)
        self.load_watch.refresh()

    def _engine_health_changed(self, ok: bool, why: str) -> None:
        if self._metrics is not None:
            self._metrics.set_engine_connected(ok)
        self._update_health()
        if self._engine_health_listener is not None:
            self._engine_health_listener(ok, why)

    async def _generate(self, request: sidecar_pb2.PreprocessedRequest, context: _Context) -> None:
        """One Generate call: admitted (or refused), run, then concluded: its status, its
        metrics and its one "generate finished" line."""
        started_at = time.monotonic()
        if self._metrics is not None:
            self._metrics.arrived()
        run = await self._admit(request, context, started_at)
        try:
            await self._run(run, context)
        except SidecarError as failure:
            try:
                typed = await self._engine_health.typed_fault(failure)
            except asyncio.CancelledError:
                # The client went away while the engine's health was being asked.
                self._client_left(run)
                raise
            await self._end_failed(run, context, typed)
        except asyncio.CancelledError:
            # The client went away (cancel, deadline, connection lost).
            self._client_left(run)
            raise
        except Exception as exc:
            # Not a typed error: a bug here or in the engine adapter (the relay has already
            # aborted the engine request). Logged and counted as such, and the call still
            # ends with a status the frontend can read (UNKNOWN, ErrorInfo, not migratable).
            await self._end_failed(run, context, self._internal_error("generate", exc))
        finally:
            self._conclude(run)

    async def _admit(
        self, request: sidecar_pb2.PreprocessedRequest, context: _Context, started_at: float
    ) -> _Run:
        """Refuse the call (its status and its one line), or register it and build its
        generation."""
        refusal, native = self._refusal_of(request)
        if not request.request_id:
            # Named before anything is logged: a refused request's line carries an id too.
            named = sidecar_pb2.PreprocessedRequest()
            named.CopyFrom(request)
            named.request_id = new_public_id()
            request = named
        metrics = self._metrics
        if refusal is not None:
            if metrics is not None:
                metrics.refused(refusal.reason.value)
            _log.info(
                "generate refused",
                public_id=request.request_id,
                reason=refusal.reason.value,
                error=str(refusal),
            )
            await _fail(context, refusal)
        # Every frontend hears where this prompt's blocks are going before the prefill ends.
        self.kv_cache.announce(request)
        entry = self._registry.register(request.request_id)
        log = _log.bind(public_id=entry.public_id, private_id=entry.private_id)
        call = GenerateCall(request, entry.private_id, self._config.hold_decode_cancels, native)
        gen = Generation(self._engine, call, abort_timeout=self._config.abort_timeout)
        if request.output_options.unary:
            # Its caller waits for one answer: an Abort RPC lets the engine's answer through.
            entry.answer_on_abort = gen.abort_once
        if metrics is not None:
            metrics.started()
        log.debug("generate started", choices=gen.tracker.n, prompt_tokens=len(request.token_ids))
        return _Run(request, entry, gen, log, started_at)

    def _refusal_of(self, request: sidecar_pb2.PreprocessedRequest) -> tuple[SidecarError | None, object]:
        """Why the request is refused (None: admitted), and the engine's native request."""
        # A bad request is refused as such whatever the engine's state (it would fail on any
        # worker, so it must not look migratable); validation needs the discovered engine,
        # hence after the not-serving check.
        if not self._serving:
            return SidecarError(FailureReason.ENGINE_SHUTDOWN, "sidecar is not serving"), None
        try:
            native = self._engine.validate(request)
        except SidecarError as err:
            return err, None
        except Exception as exc:
            return self._internal_error("validate", exc), None
        return self._refusal(), native

    async def _run(self, run: _Run, context: _Context) -> None:
        """Relay the engine's stream to the client; raises the typed error the call ends with
        when it did not end with every terminal delivered."""
        entry, tracker, metrics = run.entry, run.gen.tracker, self._metrics
        ended_by_abort = False
        with entry.scope:
            try:
                await relay(
                    run.gen,
                    context.write,
                    self._relay_config,
                    metrics=metrics,
                    started_at=run.started_at,
                    under_load=self._under_load,
                )
            except SidecarError:
                if entry.cause is not CancelCause.ABORT_RPC:
                    raise
                # Asked to end it with the engine's answer, the engine ended it its own way
                # (a failed stream): still an abort, never a fault to run elsewhere.
                ended_by_abort = True
        # Once every terminal was delivered the call is a success, whatever stopped it
        # while the engine stream was still closing: a migratable error after a complete
        # answer would have the frontend run the request twice.
        stopped = (entry.scope.cancelled_caught or ended_by_abort) and not tracker.delivered_all
        if stopped and entry.cause is CancelCause.DRAIN:
            raise SidecarError(FailureReason.ENGINE_SHUTDOWN, "sidecar is draining: generation cancelled")
        if stopped:
            run.outcome["cancelled_by"] = "abort_rpc"
            if tracker.stalled:
                # No CANCELLED terminal can follow a write grpc still holds: the status
                # says it instead.
                raise SidecarError(
                    FailureReason.CANCELLED, "aborted by request (the frontend was not reading)"
                )
            for terminal in tracker.cancelled_terminals(len(run.request.token_ids)):
                tracker.delivered(terminal)
                await context.write(terminal)
        elif entry.cause is CancelCause.ABORT_RPC:
            run.outcome["cancelled_by"] = "abort_rpc"  # the engine answered its abort
        run.outcome["finish_reason"] = tracker.last_finish_reason()
        if metrics is not None:
            metrics.finished(run.outcome["finish_reason"])

    async def _end_failed(self, run: _Run, context: _Context, error: SidecarError) -> NoReturn:
        run.outcome.update(error_reason=error.reason.value, error=str(error))
        if self._metrics is not None:
            self._metrics.failed(error.reason.value)
        await _fail(context, error)

    def _client_left(self, run: _Run) -> None:
        run.outcome.update(error_reason=FailureReason.CANCELLED.value, cancelled_by="client")
        if self._metrics is not None:
            self._metrics.failed(FailureReason.CANCELLED.value)

    def _conclude(self, run: _Run) -> None:
        """However the call ended: unregistered, measured, and its one line."""
        self._registry.unregister(run.entry)
        duration = time.monotonic() - run.started_at
        prompt_tokens = len(run.request.token_ids)
        completion_tokens = run.gen.tracker.completion_tokens
        if self._metrics is not None:
            self._metrics.ended(duration, prompt_tokens, completion_tokens)
        # One line per request at INFO (never per chunk): what an operator greps for.
        run.log.info(
            "generate finished",
            duration_secs=round(duration, 6),
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            engine_aborted=run.gen.aborted,
            abort_outcome=run.gen.abort_outcome,
            **run.outcome,
        )

    def _internal_error(self, where: str, exc: BaseException) -> SidecarError:
        """An untyped exception is a bug: logged with its traceback at error level and
        counted (sidecar_internal_errors_total{where}); returned as the UNKNOWN error the
        caller ends the call with."""
        _log.error("internal error", where=where, error=repr(exc), exc_info=exc)
        if self._metrics is not None:
            self._metrics.internal_error(where)
        return SidecarError(
            FailureReason.UNKNOWN, f"{self._engine.name} {where}: {type(exc).__name__}: {exc}"
        )

    async def _abort(self, request: sidecar_pb2.AbortRequest) -> sidecar_pb2.AbortResponse:
        count = await self._registry.abort_public(request.request_id, self._config.abort_timeout)
        _log.info("abort requested", public_id=request.request_id, aborted=count)
        return sidecar_pb2.AbortResponse(aborted=count)

    async def _model_info(self, context: _Context) -> sidecar_pb2.ModelInfo:
        if not self._serving:
            await _fail(context, SidecarError(FailureReason.ENGINE_SHUTDOWN, "sidecar is not serving"))
        try:
            info = sidecar_pb2.ModelInfo()
            info.CopyFrom(self._engine.model_info())
        except SidecarError as err:
            await _fail(context, err)
        except Exception as exc:
            await _fail(context, self._internal_error("model_info", exc))
        # Every failure of a call taken up is typed (_end_failed, _fail): a bare status before
        # any output is gRPC core's (sidecar_common.errors.never_started).
        info.generate_failures_typed = True
        return info

    async def _load(self, context: _Context) -> sidecar_pb2.LoadReport:
        try:
            with anyio.fail_after(self._config.health_probe_timeout):
                load = await self._engine.load()
        except SidecarError as err:
            await _fail(context, err)
        except TimeoutError:
            await _fail(
                context,
                SidecarError(
                    FailureReason.CONNECTION_TIMEOUT, f"{self._engine.name} load: no answer in time"
                ),
            )
        except Exception as exc:
            await _fail(context, self._internal_error("load", exc))
        return self._load_report(load)

    async def _read_load(self) -> sidecar_pb2.LoadReport:
        """One read of the load for the WatchLoad streams (raises SidecarError when the engine
        does not answer in time)."""
        timeout = self._config.health_probe_timeout
        try:
            # asyncio's own timeout: this runs in a plain asyncio task (engine_health.py says why).
            async with asyncio.timeout(timeout):
                load = await self._engine.load()
        except TimeoutError:
            raise SidecarError(
                FailureReason.CONNECTION_TIMEOUT, f"{self._engine.name} load: no answer within {timeout:g}s"
            ) from None
        return self._load_report(load)

    def _load_report(self, load: EngineLoad) -> sidecar_pb2.LoadReport:
        status = self.engine_status
        report = sidecar_pb2.LoadReport(
            inflight_requests=self._registry.inflight,
            ranks=list(load.ranks),
            engine_state=proto_state(status.paused),
        )
        if status.weight_version is not None:
            report.weight_version = status.weight_version
        if self.kv_cache.subscribed:  # absent: this worker publishes no cache state
            report.kv_cache.CopyFrom(self.kv_cache.status())
        return report

    async def _flush_cache(self, context: _Context) -> sidecar_pb2.FlushCacheResponse:
        """The engine's cache flush: its message when done; its refusal FAILED_PRECONDITION in
        its words; a failed call as its typed error (no answer in time: CONNECTION_TIMEOUT)."""
        engine = self._engine
        if not isinstance(engine, StatefulEngine):
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, f"this {engine.name} engine cannot flush its cache"
            )
            raise AssertionError("context.abort returned")  # pragma: no cover
        if not self._serving:
            await _fail(context, SidecarError(FailureReason.ENGINE_SHUTDOWN, "sidecar is not serving"))
        # The engine client bounds the call (EngineTimeouts.flush); the caller's deadline, when
        # sooner, ends it with the call.
        try:
            outcome = await engine.flush_cache()
        except SidecarError as err:
            await _fail(context, err)
        except Exception as exc:
            await _fail(context, self._internal_error("flush_cache", exc))
        if not outcome.flushed:
            words = outcome.message or f"the {engine.name} engine refused to flush its cache"
            _log.info("engine cache flush refused", message=words)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, words)
        _log.info("engine cache flushed", message=outcome.message)
        return sidecar_pb2.FlushCacheResponse(message=outcome.message)
