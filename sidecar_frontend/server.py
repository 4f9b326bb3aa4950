"""The frontend process: start, serve, drain on a signal, exit.

Start-up: logging -> formats -> the worker set, fed by discovery (the ``--worker`` list, DNS
or etcd; serving starts once its first view is applied or its first attempt failed; workers
connect in the background, and a request that arrives before one serves gets 503) -> metrics
endpoint -> HTTP listener -> the ``serving`` log line (with the bound port). A listen or metrics
address that cannot be bound (taken, not of this host, not resolving) is found before the worker
set starts: one log line naming the address, the cause and the flag (or its variable), exit 1.

Before the worker set, the host's limits on connections (sidecar_frontend/host_limits.py): the
open files limit is raised to the hard limit (``--min-open-files`` refuses to start below it),
and the listen backlog (``--listen-backlog``) is logged with the kernel's cap on it, in one
``connection limits`` line.

The first SIGTERM/SIGINT stops accepting connections at once, lets in-flight requests finish
within ``--drain-timeout-secs``, then ends what is left (each running sub-request is cancelled,
so its sidecar aborts it; the client gets the format's error for ENGINE_SHUTDOWN). A second
signal skips the wait. Exit 0: it stopped as asked.

With ``--processes N`` above 1, :func:`run` hands over to the supervising parent
(sidecar_frontend/processes/), which starts N processes that each run :func:`serve` with an
:class:`Inherited`: the listening sockets the parent bound (the bind checks and the limits are
the parent's), and a metrics endpoint on a loopback port of its own, which the parent merges.
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Final

import anyio
import structlog
from aiohttp import web
from anyio.abc import TaskStatus
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sidecar_common.endpoint import parse_host_port
from sidecar_common.errors import FailureReason
from sidecar_common.logs import configure_logging
from sidecar_common.operations_flags import metrics_address_flags
from sidecar_common.ports import bind_problem
from sidecar_common.programs import EXIT_OK, EXIT_STARTUP_FAILED, run_event_loop
from sidecar_common.tracing import Tracing
from sidecar_common.version import package_version
from sidecar_frontend.admin import AdminApi, MembershipControl, ParentLink, RelayedControl, keep_registered
from sidecar_frontend.admission.gate import Gate, WakeOnWorkerEvents
from sidecar_frontend.admission.metrics import AdmissionMetrics
from sidecar_frontend.admission.rate_file import follow_rate_file, load_rate_file
from sidecar_frontend.admission.rates import RateConfigError, RateLimiter
from sidecar_frontend.bare_children import BareSidecars
from sidecar_frontend.bare_sidecars import ChildSettings
from sidecar_frontend.cli import FORMATS, FrontendConfig
from sidecar_frontend.collector import CollectorThresholds
from sidecar_frontend.discovery import DiscoverySink, run_discovery
from sidecar_frontend.fleet_watch import FleetWatch
from sidecar_frontend.formats.base import Format, WorkerFailure
from sidecar_frontend.handler import Frontend
from sidecar_frontend.host_limits import connection_limits
from sidecar_frontend.membership import Membership
from sidecar_frontend.metrics import Metrics, WorkerRow
from sidecar_frontend.misbehaviour import MisbehaviourReporter, quiet_grpc_decode_failures
from sidecar_frontend.registry import Refusal
from sidecar_frontend.routing.sessions_choice import SessionChoice
from sidecar_frontend.routing.streams import StreamConfig
from sidecar_frontend.routing.wiring import RoutingParts
from sidecar_frontend.supervisor import FAILURE_HOOK, Supervisor, SupervisorConfig, fault_file_from
from sidecar_frontend.workers import Worker, WorkerSet

__all__ = [
    "Inherited",
    "WorkerMetrics",
    "load_formats",
    "run",
    "serve",
    "split_listen",
    "start_metrics_endpoint",
]

# After the drain, how long the cancelled requests get to write their last bytes.
_STOP_GRACE: Final = 5.0
# A process of --processes N listens (and so takes its share of the connections) once a worker
# serves, or after this long whatever the fleet does (an outage answers 503 from every process).
_FIRST_WORKER_WAIT: Final = 10.0

log = structlog.get_logger("sidecar_frontend.server")


@dataclass(frozen=True)
class Inherited:
    """What one process of ``--processes N`` gets from its parent (sidecar_frontend/processes/)."""

    index: int
    # Bound by the parent (SO_REUSEPORT, one per address of --listen), not yet listening: the
    # kernel sends this process connections only once it listens, that is once it serves.
    listeners: tuple[socket.socket, ...]
    # Told the port of this process's own metrics endpoint (loopback) once it serves.
    serving: Callable[[int], None]
    # The membership API's changes go through the parent, which applies them to every process.
    parent: ParentLink | None = None


def load_formats(names: Sequence[str], *, sglang_incremental_streaming_output: bool = False) -> list[Format]:
    """The formats named, each made with its own options (only SGLang has any)."""
    formats: list[Format] = []
    for name in names:
        module = importlib.import_module(FORMATS[name])
        if name == "sglang":
            formats.append(
                module.SglangFormat(incremental_streaming_output=sglang_incremental_streaming_output)
            )
        else:
            formats.append(module.FORMAT)
    return formats


def split_listen(listen: str) -> tuple[str, int]:
    """``--listen`` (already checked by its flag) -> (host without brackets, port)."""
    address = parse_host_port(listen, port_zero_allowed=True)
    return address.host, address.port


async def start_metrics_endpoint(metrics: Metrics, host: str, port: int) -> web.AppRunner:
    """The ``/metrics`` endpoint on ``host:port``, started (the caller cleans it up; its
    ``addresses`` say the port when ``port`` is 0)."""

    async def scrape(_: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(metrics.registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    app = web.Application()
    app.router.add_get("/metrics", scrape)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    log.info("metrics endpoint up", host=host, port=_bound_port(runner, port))
    return runner


class WorkerMetrics:
    """The metrics' subscription to the worker set's events: each refusal counted once, a
    departed worker's series removed."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        # The refusal each worker was last counted for.
        self._refused: dict[str, Refusal] = {}

    def joined(self, worker: Worker) -> None:
        pass

    def changed(self, worker: Worker) -> None:
        refusal = worker.refusal
        if refusal is None:
            self._refused.pop(worker.address, None)
        elif self._refused.get(worker.address) is not refusal:
            self._refused[worker.address] = refusal
            self._metrics.worker_refused(refusal.value)

    def left(self, worker: Worker) -> None:
        self._refused.pop(worker.address, None)
        self._metrics.forget_worker(worker.address)


def _rows(workers: WorkerSet) -> list[WorkerRow]:
    return [
        WorkerRow(
            w.address,
            w.role,
            w.state.value,
            w.served_model,
            w.refusal.value if w.refusal is not None else "",
        )
        for w in workers.workers()
    ]


async def serve(config: FrontendConfig, inherited: Inherited | None = None) -> int:
    """One frontend, to its exit code; ``inherited``: as one process of ``--processes N``."""
    # What start-up loaded lives as long as the process: kept out of the collector's passes.
    gc.freeze()
    collector = CollectorThresholds()
    configure_logging(config.log_format, config.log_level)
    quiet_grpc_decode_failures()
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        return await _serve(config, signals, inherited, collector)


async def _serve(
    config: FrontendConfig,
    signals: AsyncIterator[signal.Signals],
    inherited: Inherited | None,
    collector: CollectorThresholds,
) -> int:
    try:
        formats = load_formats(
            config.formats, sglang_incremental_streaming_output=config.sglang_incremental_streaming_output
        )
    except (ImportError, AttributeError) as err:
        log.error("format not available", formats=list(config.formats), error=str(err))
        return EXIT_STARTUP_FAILED
    metrics = Metrics(version=package_version(), request_timeout=config.handler.request_timeout)

    # A process of --processes N inherits its limits and sockets, both checked by its parent.
    problem = None if inherited is not None else connection_limits(config) or _listen_problem(config)
    if problem is not None:
        log.error("start-up failed", error=problem)
        return EXIT_STARTUP_FAILED
    log.info(
        "starting",
        version=package_version(),
        listen=config.listen,
        discovery=config.discovery.mode,
        workers=[address for address, _ in config.discovery.static_workers],
        formats=list(config.formats),
        request_timeout_secs=config.handler.request_timeout,
        drain_timeout_secs=config.drain_timeout,
        metrics_port=config.metrics_port,
        metrics_host=config.metrics_host,
        models=sorted(config.worker_set.models) or None,
        sglang_incremental_streaming_output=config.sglang_incremental_streaming_output,
        routing=config.routing.routing.value if config.routing.routing is not None else "kv/approx",
        admin_listen=config.admin.listen or "on --listen",
        admin_auth="bearer token" if config.admin.token is not None else "loopback only",
    )
    limits = config.worker_set
    routing = RoutingParts.build(
        config.routing,
        metrics.registry,
        streams=StreamConfig(
            max_snapshot_keys=limits.kv_max_snapshot_keys, max_update_keys=limits.kv_max_update_keys
        ),
    )
    supervisor_config = SupervisorConfig(fault_file=fault_file_from(os.environ.get(FAILURE_HOOK)))
    # Every background task (each worker's, discovery's, the TLS files') runs under this one
    # supervisor, entered here by the main task: a failure is logged, counted and restarted;
    # leaving the block (the drain is over) ends them all.
    async with Supervisor(supervisor_config, registry=metrics.registry) as supervisor:
        workers = WorkerSet(
            config.worker_set,
            supervisor=supervisor,
            misbehaviour=MisbehaviourReporter(metrics.registry),
            outliers=config.worker_set.outliers,
        )
        try:
            workers.events.subscribe(WorkerMetrics(metrics))
            workers.events.subscribe(FleetWatch(metrics.registry, workers.registry))
            metrics.watch_fleet(lambda: _rows(workers))
            try:
                gate = _start_admission(config, supervisor, workers, metrics, collector.backlog)
            except RateConfigError as err:
                log.error("start-up failed", error=str(err))
                return EXIT_STARTUP_FAILED
            choice = routing.choice(workers, with_room=gate.with_room if gate is not None else None)
            # Discovery and the membership API each list workers; each lets go only of its own.
            membership = Membership(workers, config.discovery.mode)
            control: MembershipControl | None = None
            if inherited is not None and inherited.parent is not None:
                # One of --processes N: the parent's registrations so far, then its changes.
                for registration in inherited.parent.registrations:
                    membership.adopt(registration)
                relayed = RelayedControl(
                    membership, inherited.parent, apply_weight_version=workers.set_weight_version
                )
                inherited.parent.attach(relayed.deliver)
                supervisor.start("report_serving", relayed.report_serving)
                control = relayed
            supervisor.start("keep_registered", lambda: keep_registered(workers, membership))
            # Serving starts once discovery applied its first view (or its first attempt failed).
            await _start_discovery(supervisor, config, membership)
            if config.discovery.mode == "static" and not config.discovery.static_workers:
                log.warning("no worker yet: they come through the membership API (POST /workers, docs/rl.md)")
            # The sidecars of bare engines registered through the API: stopped when this block
            # ends, after the HTTP side's drain (sidecar_frontend/bare_children.py). With
            # --processes N the parent runs them instead.
            async with BareSidecars(
                workers,
                ChildSettings(sys.executable, config.log_format, config.log_level),
                worker_tls=config.worker_set.tls is not None,
                registry=metrics.registry,
            ) as bare:
                admin = AdminApi(
                    workers,
                    membership,
                    token=config.admin.token,
                    control=control,
                    bare=bare if control is None else None,
                )
                code = await _serve_http(
                    config, formats, workers, choice, metrics, signals, gate, inherited, admin, routing
                )
        finally:
            await workers.aclose()
    log.info("stopped")
    return code


def _start_admission(
    config: FrontendConfig,
    supervisor: Supervisor,
    workers: WorkerSet,
    metrics: Metrics,
    on_backlog: Callable[[bool], None],
) -> Gate | None:
    """The admission gate, its metrics, its ticker and the rate limits file's follower (None
    with --no-admission); ``on_backlog`` is told when requests start and stop waiting. A rate
    limits file that cannot be read fails start-up."""
    settings = config.admission
    if not settings.enabled:
        return None
    limiter = RateLimiter(load_rate_file(settings.rate_limits)) if settings.rate_limits else None
    observer = AdmissionMetrics(metrics.registry, max_wait=settings.settings.max_queue_wait)
    gate = Gate(
        workers.registry,
        settings,
        limiter=limiter,
        observer=observer,
        held=workers.held,
        on_backlog=on_backlog,
    )
    observer.watch(gate.queued, gate.every_load)
    wake = WakeOnWorkerEvents(gate)
    workers.events.subscribe(wake)
    workers.events.subscribe_load(wake.loaded)
    supervisor.start("admission", gate.run_ticker)
    if limiter is not None and settings.rate_limits is not None:
        path = settings.rate_limits
        supervisor.start("rate_limits", lambda: follow_rate_file(path, limiter))
    return gate


async def _start_discovery(supervisor: Supervisor, config: FrontendConfig, workers: DiscoverySink) -> None:
    """Discovery as a supervised task (restarted if it fails); returns once its first view is
    applied or its first attempt failed, as ``run_discovery`` reports through its status."""
    first_view = anyio.Event()

    async def discover() -> None:
        try:
            await run_discovery(config.discovery, workers, task_status=_FirstView(first_view))
        finally:
            first_view.set()  # a failed first attempt: serve with what there is meanwhile

    supervisor.start("discovery", discover)
    await first_view.wait()


class _FirstView(TaskStatus[None]):
    def __init__(self, event: anyio.Event) -> None:
        self._event = event

    def started(self, value: None = None) -> None:
        self._event.set()


async def _serve_http(
    config: FrontendConfig,
    formats: list[Format],
    workers: WorkerSet,
    choice: SessionChoice,
    metrics: Metrics,
    signals: AsyncIterator[signal.Signals],
    gate: Gate | None = None,
    inherited: Inherited | None = None,
    admin: AdminApi | None = None,
    routing: RoutingParts | None = None,
) -> int:
    tracing = Tracing.from_environment(os.environ, service="sidecar-frontend")
    frontend = Frontend(
        formats,
        workers,
        config.handler,
        metrics=metrics,
        tracing=tracing,
        choice=choice,
        watch=choice,
        gate=gate,
        middlewares=routing.middlewares() if routing is not None else (),
    )
    # The admin endpoints beside the formats' routes, or alone on --admin-listen.
    beside = admin.routes() if admin is not None and config.admin.listen is None else ()
    runner = web.AppRunner(
        frontend.build_app([*beside, *(routing.http_routes() if routing is not None else ())]),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=_STOP_GRACE,
        keepalive_timeout=config.connections.keepalive_timeout,
    )
    await runner.setup()
    metrics_runner: web.AppRunner | None = None
    admin_runner: web.AppRunner | None = None
    backlog = config.connections.backlog
    try:
        host, port = split_listen(config.listen)
        sites: list[web.BaseSite]
        if inherited is None:
            sites = [web.TCPSite(runner, host, port, backlog=backlog)]
        else:
            sites = [web.SockSite(runner, sock, backlog=backlog) for sock in inherited.listeners]
        try:
            if inherited is not None:
                # Its parent merges it into the one endpoint of --metrics-port, and watches it.
                metrics_runner = await start_metrics_endpoint(metrics, "127.0.0.1", 0)
            elif config.metrics_port is not None:
                metrics_host = config.metrics_host or host
                metrics_runner = await start_metrics_endpoint(metrics, metrics_host, config.metrics_port)
            if admin is not None and config.admin.listen is not None:
                admin_runner = await _start_admin_endpoint(admin, config.admin.listen)
            if inherited is not None:
                await _until_a_worker_serves(workers, _FIRST_WORKER_WAIT)
            for site in sites:
                await site.start()
        except OSError as err:
            # Taken between the check and the bind: aiohttp's words, still one line.
            log.error("start-up failed", error=f"cannot listen: {err}")
            return EXIT_STARTUP_FAILED
        log.info(
            "serving", port=_bound_port(runner, port), formats=list(config.formats), tracing=tracing.exporting
        )
        if inherited is not None and metrics_runner is not None:
            inherited.serving(_bound_port(metrics_runner, 0))
        return await _until_stopped(frontend, sites, config.drain_timeout, signals)
    finally:
        await runner.cleanup()
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        if admin_runner is not None:
            await admin_runner.cleanup()
        with anyio.move_on_after(_STOP_GRACE, shield=True):
            await tracing.aclose()  # the spans still queued


async def _start_admin_endpoint(admin: AdminApi, listen: str) -> web.AppRunner:
    """The admin endpoints alone on ``listen`` (``--admin-listen``), started."""
    runner = web.AppRunner(admin.app(), access_log=None)
    await runner.setup()
    host, port = split_listen(listen)
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    log.info("admin endpoint up", host=host, port=_bound_port(runner, port))
    return runner


async def _until_a_worker_serves(workers: WorkerSet, bound: float) -> None:
    """Until a worker serves (agg or decode: one that places generations), at most ``bound``
    seconds. A process restarted beside others would otherwise take connections while its
    workers connect, and answer its share of them 503 while the others serve."""
    with anyio.move_on_after(bound) as waited:
        while True:
            changed = workers.next_change()
            if workers.serving("agg") or workers.serving("decode"):
                return
            await changed.wait()
    if waited.cancelled_caught:
        log.warning("no worker serves yet: listening anyway", waited_secs=bound)


def _listen_problem(config: FrontendConfig) -> str | None:
    """Why the HTTP or the metrics address cannot be bound, naming the flags (or variables)
    that chose it, or None. Asked before the worker set starts, as the sidecars do
    (sidecar_common/ports.py); the bind itself stays the final word."""
    host, port = split_listen(config.listen)
    problem = bind_problem(host, port)
    if problem is not None:
        return f"{problem} ({config.sources.naming('listen')})"
    if config.admin.listen is not None:
        problem = bind_problem(*split_listen(config.admin.listen), serving="serve admin calls on")
        if problem is not None:
            return f"{problem} ({config.sources.naming('admin_listen')})"
    if config.metrics_port is None:
        return None
    problem = bind_problem(config.metrics_host or host, config.metrics_port, serving="serve metrics on")
    if problem is None:
        return None
    return f"{problem} ({metrics_address_flags(config.sources)})"


def _bound_port(runner: web.AppRunner, asked: int) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return asked


async def _until_stopped(
    frontend: Frontend,
    sites: Sequence[web.BaseSite],
    drain_timeout: float,
    signals: AsyncIterator[signal.Signals],
) -> int:
    first = await signals.__anext__()
    log.info("stop requested", signal=first.name, inflight=frontend.inflight)
    for site in sites:
        await site.stop()  # no new connections
    async with anyio.create_task_group() as group:

        async def second_signal() -> None:
            async for signum in signals:
                log.warning("second stop signal: ending in-flight requests now", signal=signum.name)
                group.cancel_scope.cancel()

        group.start_soon(second_signal)
        with anyio.move_on_after(drain_timeout) as drain:
            await frontend.wait_idle()
        if drain.cancelled_caught:
            log.warning(
                "drain did not finish in time", timeout_secs=drain_timeout, inflight=frontend.inflight
            )
        group.cancel_scope.cancel()
    frontend.stop_all(WorkerFailure.of(FailureReason.ENGINE_SHUTDOWN, "the frontend is shutting down"))
    with anyio.move_on_after(_STOP_GRACE):
        await frontend.wait_idle()
    return EXIT_OK


def run(config: FrontendConfig) -> int:
    """Synchronous entry: :func:`~sidecar_common.programs.run_event_loop` over :func:`serve`,
    or with ``--processes`` above 1 the parent that runs that many (sidecar_frontend/processes/)."""
    if config.processes > 1:
        from sidecar_frontend.processes.parent import run_parent

        return run_parent(config)
    return run_event_loop(serve, config)
