"""The sidecar process: start-up in a fixed order, serve, drain on a signal, exit.

Start-up order (docs/common.md "Daemon"): logging -> build the engine adapter (no I/O) ->
metrics endpoint -> gRPC server with health NOT_SERVING -> engine.start() (pool connect and
discovery within the one startup deadline) -> health SERVING -> systemd READY=1.

Signals: the first SIGTERM/SIGINT stops the start-up if it is still running, or starts the
graceful drain (health NOT_SERVING at once, in-flight generations get --drain-timeout-secs,
then are cancelled and aborted on the engine). A second signal during the drain skips the
rest of the wait: the in-flight generations are cancelled right away, each still ending with
ENGINE_SHUTDOWN (migratable) after its engine abort; a third stops waiting for that cleanup.
Either way the process exits 0, because it stopped as asked.

A start-up failure is one log line (no traceback for an expected failure such as an engine
that cannot be reached) and exit code 1, after closing whatever had been opened. When the
engine's answer shows the configuration cannot work (it speaks another protocol: a wrong port
or --transport; it is a server of another kind; its disaggregation mode is not ours), the line
is "invalid configuration" and the exit code 2, as for a bad flag: restarting with the same
flags cannot help.
"""

from __future__ import annotations

import argparse
import errno
import gc
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Final

import anyio
import grpc
import structlog
from anyio.abc import TaskGroup

from sidecar_common.api import sidecar_pb2
from sidecar_common.endpoint import format_host_port, parse_host_port
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_common.flags import FlagSources, flag_sources
from sidecar_common.logs import configure_logging
from sidecar_common.operations_flags import metrics_address_flags
from sidecar_common.ports import bind_problem
from sidecar_common.programs import EXIT_OK, EXIT_STARTUP_FAILED, EXIT_USAGE, run_event_loop
from sidecar_common.registration_record import RecordError, WorkerRecord, advertise_address
from sidecar_common.tracing import Tracing
from sidecar_common.version import package_version
from sidecar_server import systemd
from sidecar_server.config import EngineSpec, SidecarConfig
from sidecar_server.engine import Engine
from sidecar_server.kv_hub import KvCacheHub
from sidecar_server.kv_metrics import register_kv_events_metrics
from sidecar_server.metrics import Metrics
from sidecar_server.registration import Registration, registered
from sidecar_server.server import ServerConfig, SidecarServer

__all__ = ["run", "run_daemon"]


# Bound on the close steps that have no deadline of their own: a wedged close must not keep
# the process (and a systemd stop job or a Kubernetes pod) hanging forever.
_CLOSE_TIMEOUT: Final = 10.0
# Every chunk allocates a few objects (messages, futures), so CPython's default young
# generation threshold (700) runs a collection every few hundred chunks, and each older
# collection walks every long-lived object (channels, descriptors). Those are frozen once
# serving, and collections run less often; memory still comes back by reference counting.
_GC_THRESHOLDS: Final = (20_000, 20, 20)
_STARTUP_SLACK: Final = 30.0
# Start-up failures that are the engine's answer to a configuration that cannot work with it
# (PROTOCOL_ERROR: it does not speak the expected protocol; INVALID_ARGUMENT: what it runs
# contradicts a flag, e.g. its disaggregation mode). Anything else may pass: exit 1, retried.
_CONFIGURATION_REASONS: Final = frozenset({FailureReason.PROTOCOL_ERROR, FailureReason.INVALID_ARGUMENT})

log = structlog.get_logger("sidecar_server.daemon")


def _is_configuration_mistake(err: SidecarError) -> bool:
    """A start-up failure restarting cannot cure: the engine answered, and what it said shows
    the flags do not fit it."""
    if err.reason in _CONFIGURATION_REASONS:
        return True
    # A server of another kind (SGLang's port given to sidecar-vllm) or without the engine's
    # service answers its RPCs UNIMPLEMENTED. The typed error (UNKNOWN, as the status table
    # says) keeps the code only in its words; the grpc error it was made from is its context.
    context = err.__context__
    code = getattr(context, "code", None)
    return isinstance(context, grpc.RpcError) and callable(code) and code() == grpc.StatusCode.UNIMPLEMENTED


class _StartupFailed(Exception):
    """Internal: a start-up step failed; the message is the one line to log."""


@dataclass
class _Stopper:
    """Turns signals into cancellation of whatever phase is current."""

    startup: anyio.CancelScope
    drain: anyio.CancelScope
    requested: anyio.Event
    signals_seen: int = 0
    # Set once the server is up: what a second signal calls to end in-flight work now.
    cancel_inflight: Callable[[], object] | None = None

    async def watch(self, signals: AsyncIterator[signal.Signals]) -> None:
        async for signum in signals:
            self.signals_seen += 1
            if self.signals_seen == 1:
                log.info("stop requested", signal=signum.name)
                self.requested.set()
                self.startup.cancel()
            elif self.signals_seen == 2 and self.cancel_inflight is not None:
                # Cancelled through the server, not by cutting the drain: each stream still
                # gets its ENGINE_SHUTDOWN status and its engine abort.
                log.warning("second stop signal: cancelling in-flight generations now", signal=signum.name)
                self.cancel_inflight()
            else:
                log.warning("another stop signal: not waiting for the cleanup", signal=signum.name)
                self.drain.cancel()


def _server_config(config: SidecarConfig) -> ServerConfig:
    return ServerConfig(
        listen=config.listen,
        drain_timeout=config.drain_timeout,
        hold_decode_cancels=config.disaggregation_mode == "decode",
        tls=config.tls,
        reflection=config.reflection,
        max_request_bytes=config.max_request_bytes,
        load_push_interval=config.load_push_interval,
    )


def _cleanup_allowance(server_config: ServerConfig) -> float:
    """Time the server may need, after its drain wait, to cancel and abort what is left:
    a decode hold, an abort per request (bounded), the health watch's last probe."""
    hold = server_config.decode_hold_timeout if server_config.hold_decode_cancels else 0.0
    return hold + 2 * server_config.abort_timeout + server_config.health_probe_timeout + 5.0


def _listen_host(listen: str) -> str:
    """``host:port`` / ``[v6]:port`` -> the host, as a socket binds it."""
    return parse_host_port(listen, port_zero_allowed=True).host


def _start_metrics_http(
    host: str, port: int, metrics: Metrics, sources: FlagSources
) -> Callable[[], Awaitable[None]]:
    from prometheus_client import start_http_server

    shown = format_host_port(host, port)
    problem = bind_problem(host, port, serving="serve metrics on")
    if problem is not None:
        raise _StartupFailed(f"{problem} ({metrics_address_flags(sources)})")
    try:
        httpd, thread = start_http_server(port, addr=host, registry=metrics.registry)
    except OSError as err:
        why = "the address is in use" if err.errno == errno.EADDRINUSE else (err.strerror or str(err))
        raise _StartupFailed(f"cannot serve metrics on {shown}: {why}") from None
    log.info("metrics endpoint up", host=host, port=httpd.server_port)

    def stop_blocking() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=_CLOSE_TIMEOUT)

    async def stop() -> None:
        # shutdown() blocks until the serving thread notices (up to its poll interval).
        await anyio.to_thread.run_sync(stop_blocking, abandon_on_cancel=True)

    return stop


async def _bounded(what: str, step: Callable[[], Awaitable[Any]], seconds: float) -> None:
    """Run one shutdown step, shielded from outer cancellation but never past ``seconds``."""
    with anyio.move_on_after(seconds, shield=True) as scope:
        try:
            await step()
        except SidecarError as err:
            log.warning("shutdown step failed", step=what, error=err.message)
        except Exception as err:  # a failing close must not skip the remaining ones
            log.warning("shutdown step failed", step=what, error=repr(err))
    if scope.cancelled_caught:
        log.warning("shutdown step timed out", step=what, timeout_secs=seconds)


@asynccontextmanager
async def _signal_watch(tg: TaskGroup, stopper: _Stopper) -> AsyncIterator[None]:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        tg.start_soon(stopper.watch, signals)
        yield


async def run_daemon(spec: EngineSpec, config: SidecarConfig, namespace: argparse.Namespace) -> int:
    """Run one sidecar until a signal; returns the process exit code."""
    configure_logging(config.log_format, config.log_level)
    stopper = _Stopper(anyio.CancelScope(), anyio.CancelScope(), anyio.Event())
    async with anyio.create_task_group() as tg, _signal_watch(tg, stopper):
        watchdog = systemd.watchdog_period()
        if watchdog is not None:
            # From the first moment: systemd's clock may run while the engine loads.
            tg.start_soon(systemd.feed_watchdog, watchdog)
        code = await _serve(spec, config, namespace, stopper)
        tg.cancel_scope.cancel()
    return code


async def _serve(
    spec: EngineSpec, config: SidecarConfig, namespace: argparse.Namespace, stopper: _Stopper
) -> int:
    endpoint = config.pool.endpoint
    log.info(
        "starting",
        engine=spec.name,
        version=package_version(),
        endpoint=str(endpoint),
        connections=config.pool.connections,
        startup_deadline_secs=config.pool.startup_deadline,
        listen=config.listen,
        disaggregation_mode=config.disaggregation_mode,
        drain_timeout_secs=config.drain_timeout,
        metrics_port=config.metrics_port,
    )
    try:
        engine: Engine = spec.build(config, namespace)
    except ValueError as err:
        # EngineSpec's contract: a bad engine-specific flag value is a usage error.
        log.error("invalid configuration", engine=spec.name, error=str(err))
        return EXIT_USAGE
    except SidecarError as err:
        log.error("invalid configuration", engine=spec.name, error=err.message)
        return EXIT_USAGE
    async with AsyncExitStack() as closing:
        closing.push_async_callback(_bounded, "engine close", engine.close, _CLOSE_TIMEOUT)
        try:
            with stopper.startup:
                server = await _start(spec, config, engine, closing, flag_sources(namespace))
                systemd.notify(f"STATUS=connecting to {spec.name} at {endpoint}")
                log.info("connecting to engine", engine=spec.name, endpoint=str(endpoint), port=server.port)
                # engine.start() is bounded by the startup deadline itself; this outer bound
                # only guarantees the daemon cannot hang on an adapter that overruns it.
                with anyio.move_on_after(config.pool.startup_deadline + _STARTUP_SLACK) as bound:
                    await engine.start()
                if bound.cancelled_caught:
                    raise _StartupFailed(
                        f"{spec.name} engine at {endpoint} did not start within the startup deadline "
                        f"({config.pool.startup_deadline:g}s)"
                    )
        except (SidecarError, _StartupFailed) as err:
            if stopper.requested.is_set():
                # The failure is the cancelled start-up itself: a requested stop, not an error.
                log.info("stopped during start-up", engine=spec.name)
                systemd.notify("STOPPING=1")
                return EXIT_OK
            # str(): an error in the engine's own words also names the call and its status.
            message = str(err)
            if isinstance(err, SidecarError) and _is_configuration_mistake(err):
                log.error(
                    "invalid configuration",
                    engine=spec.name,
                    endpoint=str(endpoint),
                    error=f"the {spec.name} engine at {endpoint} answered: {message}",
                )
                return EXIT_USAGE
            log.error("start-up failed", engine=spec.name, endpoint=str(endpoint), error=message)
            return EXIT_STARTUP_FAILED
        except Exception:
            # Not one of the typed failures: a bug, so the traceback is worth its lines.
            log.exception("start-up failed with an unexpected error", engine=spec.name)
            return EXIT_STARTUP_FAILED
        if stopper.requested.is_set():
            log.info("stopped during start-up", engine=spec.name)
            systemd.notify("STOPPING=1")
            return EXIT_OK

        server.set_serving()
        stopper.cancel_inflight = server.cancel_inflight
        gc.freeze()  # what start-up built lives as long as the process: never rescanned
        info = engine.model_info()
        if config.kv_events is not None:
            await closing.enter_async_context(_kv_events(config, server.kv_cache, info))
        status = f"serving {info.served_model_name or spec.name} on port {server.port}"
        systemd.notify(f"READY=1\nSTATUS={status}")
        log.info("serving", engine=spec.name, model=info.served_model_name, port=server.port)
        registration = await _register(spec, config, server, info, closing)

        await stopper.requested.wait()
        if registration is not None:
            # The key goes first: frontends watching etcd stop routing here before the
            # drain below starts refusing work.
            await registration.withdraw()
        systemd.notify("STOPPING=1\nSTATUS=draining")
        drain_bound = config.drain_timeout + _cleanup_allowance(_server_config(config))
        with stopper.drain, anyio.move_on_after(drain_bound) as drain_scope:
            try:
                await server.drain()
            except Exception:
                # Stopping must still happen (server.stop cancels and aborts what is left).
                log.exception("drain failed")
        if drain_scope.cancelled_caught and stopper.signals_seen < 2:
            log.warning("drain did not finish in time", timeout_secs=drain_bound)
        # Leaving the exit stack: server.stop() (cancels what is left), engine.close(), metrics.
    log.info("stopped", engine=spec.name)
    return EXIT_OK


async def _register(
    spec: EngineSpec,
    config: SidecarConfig,
    server: SidecarServer,
    info: sidecar_pb2.ModelInfo,
    closing: AsyncExitStack,
) -> Registration | None:
    """Start keeping this worker's key in etcd (when configured); withdrawn on exit."""
    if config.registration is None:
        return None
    try:
        address = advertise_address(config.listen, config.registration.advertise, server.port)
    except RecordError as err:  # the CLI refuses these; a config built in code may not
        log.error("cannot register in etcd", error=str(err))
        return None
    record = WorkerRecord(
        address=address,
        engine=spec.name,
        model=info.served_model_name,
        role=config.disaggregation_mode,
        data_parallel_size=max(1, info.data_parallel_size),
        version=package_version(),
    )
    return await closing.enter_async_context(registered(config.registration, record))


@asynccontextmanager
async def _kv_events(
    config: SidecarConfig, hub: KvCacheHub, info: sidecar_pb2.ModelInfo
) -> AsyncIterator[None]:
    """Subscribe to the engine's KV events for as long as the daemon serves."""
    from sidecar_server.kv_subscriber import KvSubscriber  # pyzmq only where it is used

    kv_events = config.kv_events
    assert kv_events is not None
    hub.set_model(info.served_model_name, info.kv_block_size)
    if info.kv_block_size == 1:
        # SGLang's default page: every prompt token is a block, so the engine publishes, this
        # sidecar relays, and each frontend hashes, one block per token (an 8,192-token prompt
        # costs a frontend about 4 ms of CPU per routing decision, 0.3 ms in blocks of 16).
        log.warning(
            "KV events in blocks of one token: routing by them costs every frontend a key per"
            " prompt token; an engine page of 16 tokens or more (SGLang: --page-size 16) costs"
            " a sixteenth",
            engine_block_size=1,
        )
    ranks = kv_events.data_parallel_size or max(1, info.data_parallel_size)
    subscriber = KvSubscriber(kv_events, hub, ranks=ranks)
    async with anyio.create_task_group() as tg:
        tg.start_soon(subscriber.run)
        try:
            yield
        finally:
            tg.cancel_scope.cancel()


def _engine_status(
    spec: EngineSpec, config: SidecarConfig, kv_cache: KvCacheHub
) -> Callable[[bool, str], None]:
    """What `systemctl status` says when the engine's health changes while serving (and the
    KV-event subscriber hears of it: a bad verdict resyncs its state)."""
    where = f"{spec.name} engine at {config.pool.endpoint}"

    def report(healthy: bool, why: str) -> None:
        kv_cache.engine_health(healthy)
        if healthy:
            systemd.notify(f"STATUS=serving: {where} is healthy again")
        else:
            systemd.notify(f"STATUS=engine down: {where}: {why}; refusing new requests")

    return report


async def _start(
    spec: EngineSpec, config: SidecarConfig, engine: Engine, closing: AsyncExitStack, sources: FlagSources
) -> SidecarServer:
    listen = parse_host_port(config.listen, port_zero_allowed=True)
    problem = bind_problem(listen.host, listen.port)
    if problem is not None:
        # Asked first: grpc would report only "Failed to bind" (and print its own C++ line).
        raise _StartupFailed(f"{problem} ({sources.naming('listen')})")
    metrics: Metrics | None = None
    if config.metrics_port is not None:
        metrics = Metrics(spec.name, version=package_version())
        metrics_host = config.metrics_host or _listen_host(config.listen)
        stop_metrics = _start_metrics_http(metrics_host, config.metrics_port, metrics, sources)
        closing.push_async_callback(_bounded, "metrics stop", stop_metrics, _CLOSE_TIMEOUT)
    tracing = Tracing.from_environment(os.environ, service=f"sidecar-{spec.name}")
    if tracing.exporting:
        log.info("exporting traces over OTLP")
        closing.push_async_callback(_bounded, "traces flush", tracing.aclose, _CLOSE_TIMEOUT)
    kv_cache = KvCacheHub(subscribed=config.kv_events is not None)
    if metrics is not None and config.kv_events is not None:
        register_kv_events_metrics(metrics.registry, kv_cache, spec.name)
    server = SidecarServer(
        engine,
        _server_config(config),
        metrics=metrics,
        engine_health_listener=_engine_status(spec, config, kv_cache),
        tracing=tracing,
        kv_cache=kv_cache,
    )
    try:
        await server.start()
    except SidecarError:
        raise
    except (OSError, RuntimeError) as err:
        # grpcio reports a port in use as a RuntimeError ("Failed to bind").
        raise _StartupFailed(f"cannot listen on {config.listen}: {err}") from None
    stop_bound = _cleanup_allowance(_server_config(config))
    closing.push_async_callback(_bounded, "server stop", server.stop, stop_bound)
    return server


def run(spec: EngineSpec, config: SidecarConfig, namespace: argparse.Namespace) -> int:
    """Synchronous entry: :func:`~sidecar_common.programs.run_event_loop` over :func:`run_daemon`."""
    gc.set_threshold(*_GC_THRESHOLDS)
    return run_event_loop(run_daemon, spec, config, namespace)
