"""The parent of ``sidecar-frontend --processes N``: binds, starts, watches, restarts, stops.

Start-up, in the parent (plain asyncio; it does no request work):

1. the connection limits (the open files limit raised to the hard limit, which the processes
   inherit; ``--min-open-files``), then the bind checks of ``--listen`` and ``--metrics-port``,
   each one log line and exit 1, as one frontend does;
2. for each of the N processes, one socket per address of ``--listen``, bound with
   SO_REUSEPORT to the same port (the first bind picks it for port 0) and not yet listening:
   the kernel spreads new connections over the sockets that listen, so a process receives
   connections only from when it serves (it listens at that moment) and about 1/N of them;
3. the processes (``python -m sidecar_frontend.processes.child``), each in its own process
   group (a terminal's Ctrl-C reaches the parent only, which stops them in order), given its
   sockets and its spec (sidecar_frontend/processes/spec.py); the merged ``/metrics`` on
   ``--metrics-port``; one ``serving`` line once every process has served.

The membership API (sidecar_frontend/membership_relay.py): the parent holds the one list of
registrations; a change a process asks for on its status pipe is recorded and sent to every
process on its stdin, in one order (or refused to the asking process alone); a process started
or restarted gets the list in its spec. The parent also runs the sidecars of bare engines
registered through the API, one per engine for all the processes
(sidecar_frontend/bare_children.py): it picks each one's address when the registration comes,
and stops it once every process that held the worker reported it gone after its removal (a
process that ends meanwhile counts as gone: it is restarted with the list, without it). The
fleet's weight version an admin call sets (``POST /weight_version``) is relayed the same way,
never refused, and a process started or restarted gets the last one set in its spec.

While serving: a process that ends is logged and restarted on the same sockets (connections
that arrive meanwhile wait in its backlog for the new process) after a pause, within bounds
(sidecar_frontend/processes/policy.py); one whose metrics endpoint stops answering is killed,
then restarted the same way. ``/metrics`` asks every process for its own and answers with them
all (sidecar_frontend/processes/exposition.py), plus ``frontend_process_up{process}`` and
``frontend_process_restarts_total{process}``.

The first SIGTERM/SIGINT: the parent closes its copies of the sockets (each closes for good
once its process stops listening), forwards SIGTERM to every process, which drains as one
frontend does, and waits for them all; a second signal is forwarded too (each process then
ends its requests at once). Exit 0 when every process ended as asked; 1 when one did not, when
the processes could not start, or when one kept failing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    generate_latest,
)

from sidecar_common.endpoint import format_host_port, parse_host_port
from sidecar_common.logs import configure_logging
from sidecar_common.operations_flags import metrics_address_flags
from sidecar_common.ports import bind_problem
from sidecar_common.programs import EXIT_OK, EXIT_STARTUP_FAILED
from sidecar_common.version import package_version
from sidecar_frontend.bare_children import BareSidecars
from sidecar_frontend.bare_sidecars import ChildSettings
from sidecar_frontend.cli import FrontendConfig
from sidecar_frontend.host_limits import connection_limits
from sidecar_frontend.membership import AdminError
from sidecar_frontend.membership_relay import (
    Apply,
    Refused,
    RelayBook,
    RelayRequest,
    VersionDone,
    VersionRequest,
    apply_line,
    everywhere_line,
    parse_left,
    parse_request,
    parse_serving,
    parse_version_applied,
    parse_version_request,
    refused_line,
    set_version_line,
    version_done_line,
)
from sidecar_frontend.processes.exposition import PROCESS_LABEL, merge_expositions
from sidecar_frontend.processes.policy import (
    Liveness,
    Next,
    RestartPolicy,
    after_exit,
    describe_exit,
    stopped_exit_code,
)
from sidecar_frontend.processes.spec import ChildSpec, parse_status, spec_bytes

__all__ = ["LIVENESS_HOOK", "ParentSettings", "liveness_from", "run_parent", "supervise"]

log = structlog.get_logger("sidecar_frontend.processes")

CHILD_MODULE: Final = "sidecar_frontend.processes.child"
# Tests of real processes ask a stopped process's metrics endpoint more often than production
# does (`SECS,FAILURES`: the interval, which is also each answer's timeout, and the failures in
# a row before the kill), so that a wedged process is found within seconds. Unset in production.
LIVENESS_HOOK: Final = "SIDECAR_TEST_PROCESS_LIVENESS"
# How long the merged /metrics waits for each process's own (less than the manifests' probe
# timeout, 10 s, so a process that does not answer leaves the others' answer in time).
SCRAPE_TIMEOUT: Final = 5.0
# After the drain and the processes' own bound on ending what is left: SIGKILL to a process
# still running (one that is wedged); its requests are lost either way.
_STOP_MARGIN: Final = 30.0


@dataclass(frozen=True)
class ParentSettings:
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    liveness: Liveness = field(default_factory=Liveness)


@dataclass
class _Slot:
    """One of the N processes, across its restarts."""

    index: int
    sockets: list[socket.socket]
    proc: asyncio.subprocess.Process | None = None
    metrics_port: int | None = None  # this run's, once it serves
    served: bool = False  # this run has served
    terminated: bool = False  # this run was sent the stop's SIGTERM
    last_exit: int | None = None


class _Parent:
    def __init__(self, config: FrontendConfig, settings: ParentSettings) -> None:
        self.config = config
        self.settings = settings
        self.stop = asyncio.Event()
        self.signals = 0
        self.gave_up = False
        self.slots: list[_Slot] = []
        # The membership API's registrations, the one list every process follows.
        self.book = RelayBook()
        # The bare engines' sidecars (set by supervise), and for each one removed, the
        # processes that still hold its worker (the sidecar stops once none does).
        self.bare: BareSidecars | None = None
        self.leaving: dict[str, set[int]] = {}
        self.all_served = False
        self.port = 0
        disable_created_metrics()  # type: ignore[no-untyped-call]  # as the processes' own (metrics.py)
        self.registry = CollectorRegistry()
        self.up = Gauge(
            "frontend_process_up",
            "1 for each frontend process (--processes) that answered this scrape, 0 otherwise",
            [PROCESS_LABEL],
            registry=self.registry,
        )
        self.restarts = Counter(
            "frontend_process_restarts",
            "Frontend processes (--processes) restarted after they ended or stopped answering",
            [PROCESS_LABEL],
            registry=self.registry,
        )

    # ------------------------------------------------------------------ start-up

    def bind(self) -> str | None:
        """Every process's sockets; why they cannot be bound (naming the flag), or None."""
        host, port = _split_listen(self.config.listen)
        problem = bind_problem(host, port)
        if problem is not None:
            return f"{problem} ({self.config.sources.naming('listen')})"
        if self.config.metrics_port is not None:
            problem = bind_problem(
                self.config.metrics_host or host, self.config.metrics_port, serving="serve metrics on"
            )
            if problem is not None:
                return f"{problem} ({metrics_address_flags(self.config.sources)})"
        try:
            infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            for index in range(self.config.processes):
                sockets: list[socket.socket] = []
                self.slots.append(_Slot(index, sockets))
                for family, kind, proto, _, address in infos:
                    sockets.append(self._bound(family, kind, proto, address))
        except OSError as err:
            self.close_sockets()
            return f"cannot listen on {format_host_port(host, port)}: {err.strerror or err}"
        return None

    def _bound(self, family: int, kind: int, proto: int, address: tuple[object, ...]) -> socket.socket:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio's servers
            # Port 0: the first socket's port for every other, so they share one.
            sock.bind((address[0], self.port or address[1], *address[2:]))
            if not self.port:
                self.port = int(sock.getsockname()[1])
        except BaseException:
            sock.close()
            raise
        return sock

    def close_sockets(self) -> None:
        for slot in self.slots:
            for sock in slot.sockets:
                sock.close()

    # ------------------------------------------------------------------ one process

    async def keep(self, slot: _Slot) -> None:
        """Run ``slot``'s process, and again after it ends, until the stop (or giving up)."""
        try:
            await self._keep(slot)
        except Exception:  # a bug here must stop the frontend, not leave a process unwatched
            log.exception("process supervision failed", process=slot.index)
            self.gave_up = True
            self.stop.set()

    async def _keep(self, slot: _Slot) -> None:
        loop = asyncio.get_running_loop()
        failures = 0
        while not self.stop.is_set():
            began = loop.time()
            code = await self._run_once(slot)
            slot.last_exit = code
            self._gone(slot.index)  # its next run starts from the list, without what left
            if self.stop.is_set():
                return
            verdict = after_exit(
                self.settings.restart,
                exit_code=code,
                served=slot.served,
                ran=loop.time() - began,
                failures=failures,
                jitter=random.random(),
            )
            failures = verdict.failures
            log.error(
                "process ended",
                process=slot.index,
                status=describe_exit(code),
                served=slot.served,
                failures_in_a_row=failures,
                restart_in_secs=round(verdict.pause, 2) if verdict.next is Next.RESTART else None,
                action=verdict.why,
            )
            if verdict.next is Next.GIVE_UP:
                self.gave_up = True
                self.stop.set()
                return
            self.restarts.labels(str(slot.index)).inc()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), verdict.pause)

    async def _run_once(self, slot: _Slot) -> int:
        """One run of ``slot``'s process, to its exit status (negative: the signal that ended it)."""
        slot.served = False
        read_end, write_end = os.pipe()
        fds = tuple(sock.fileno() for sock in slot.sockets)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                CHILD_MODULE,
                stdin=asyncio.subprocess.PIPE,
                pass_fds=(*fds, write_end),
                process_group=0,
            )
        except OSError as err:
            os.close(read_end)
            log.error("process could not be started", process=slot.index, error=str(err))
            return EXIT_STARTUP_FAILED  # as a process that failed to start: the parent gives up
        finally:
            os.close(write_end)
        slot.proc, slot.terminated, slot.metrics_port = proc, False, None
        log.info("process started", process=slot.index, pid=proc.pid)
        status = asyncio.create_task(self._follow_status(slot, read_end))
        watch = asyncio.create_task(self._watch_liveness(slot, proc))
        try:
            assert proc.stdin is not None
            spec = ChildSpec(
                self.config, slot.index, fds, write_end, self.book.registrations(), self.book.weight_version
            )
            with contextlib.suppress(ConnectionError):
                proc.stdin.write(spec_bytes(spec))
                await proc.stdin.drain()
            if self.stop.is_set():
                self.terminate(slot)
            code = await proc.wait()
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            await status
            if proc.stdin is not None:
                proc.stdin.close()
            slot.proc, slot.metrics_port = None, None
        return code

    async def _follow_status(self, slot: _Slot, read_end: int) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        pipe = os.fdopen(read_end, "rb", buffering=0)
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
        try:
            async for line in reader:
                port = parse_status(line)
                if port is not None:
                    slot.metrics_port, slot.served = port, True
                    self._served()
                    continue
                request = parse_request(line)
                if request is not None:
                    self._relay(slot, request)
                    continue
                version = parse_version_request(line)
                if version is not None:
                    self._relay_version(slot, version)
                    continue
                left = parse_left(line)
                if left is not None:
                    self._left(left, slot.index)
                    continue
                serving = parse_serving(line)
                if serving is not None:
                    self._serving(serving, slot.index)
                    continue
                applied = parse_version_applied(line)
                if applied is not None:
                    self._answer_version(self.book.applied(slot.index, applied))
        finally:
            transport.close()

    def _relay(self, asking: _Slot, request: RelayRequest) -> None:
        """A membership change ``asking`` was asked for: to every process in one order (each
        write is synchronous, so no other change comes between), or refused to it alone. A
        process being restarted gets the list in its spec instead."""
        sidecar_address: str | None = None
        registration = request.registration
        if request.op == "register" and registration is not None and registration.bare:
            refusal = self._bare_refusal(request)
            if refusal is not None:
                _write(asking, refused_line(Refused(request.id, refusal)))
                return
            if self.bare is not None and self.book.refusal(request) is None:
                sidecar_address = self.bare.pick_address()
        decision = self.book.decide(asking.index, request, sidecar_address)
        if isinstance(decision, Apply) and self.bare is not None:
            if decision.registration is not None and decision.registration.bare:
                self.bare.start(decision.registration)
            elif decision.op == "unregister" and decision.address in self.bare.children():
                self.leaving[decision.address] = {slot.index for slot in self.slots if slot.proc is not None}
        if isinstance(decision, Apply):
            log.info(
                "membership change relayed",
                op=decision.op,
                worker=decision.address,
                asked_by=asking.index,
                registered=len(self.book.registrations()),
            )
            line = apply_line(decision)
            for slot in self.slots:
                _write(slot, line)
            if decision.address in self.leaving:
                self._left(decision.address, None)  # no process held it: stop it now
        else:
            _write(asking, refused_line(decision))

    def _relay_version(self, asking: _Slot, request: VersionRequest) -> None:
        """The fleet's weight version ``asking`` was asked to set: to every process, in the
        same order as the membership changes (a process being restarted gets it in its spec)."""
        # The call is answered once every serving process applied the version; one still
        # starting reads it (its spec, or this line) while it starts.
        serving = [slot.index for slot in self.slots if slot.proc is not None and slot.served]
        change, done = self.book.set_version(asking.index, request, serving)
        log.info("fleet weight version relayed", weight_version=change.weight_version, asked_by=asking.index)
        line = set_version_line(change)
        for slot in self.slots:
            _write(slot, line)
        if done is not None:
            _write(asking, version_done_line(done))

    def _bare_refusal(self, request: RelayRequest) -> AdminError | None:
        registration = request.registration
        assert registration is not None
        if self.bare is None:
            return AdminError(501, "NOT_IMPLEMENTED", "this frontend runs no sidecar for bare engines here")
        return self.bare.refusal(registration)

    def _left(self, address: str, index: int | None) -> None:
        """Process ``index`` no longer holds the removed worker at ``address``: its sidecar
        stops once no process does."""
        holding = self.leaving.get(address)
        if holding is None:
            return
        if index is not None:
            holding.discard(index)
        if not holding:
            del self.leaving[address]
            if self.bare is not None:
                log.info("a removed bare engine left every process: stopping its sidecar", sidecar=address)
                self.bare.stop_soon(address)

    def _serving(self, address: str, index: int) -> None:
        """Process ``index`` serves the registered worker at ``address``: once every process
        does, every process is told (the legacy /add_worker waits for that)."""
        everywhere = self.book.serving(index, address, len(self.slots))
        if everywhere is None:
            return
        log.info("a registered worker serves in every process", worker=address, processes=len(self.slots))
        line = everywhere_line(everywhere)
        for slot in self.slots:
            _write(slot, line)

    def _answer_version(self, due: tuple[int, VersionDone] | None) -> None:
        """Tell the asking process its version call is done (every process applied it)."""
        if due is not None:
            origin, done = due
            _write(self.slots[origin], version_done_line(done))

    def _gone(self, index: int) -> None:
        """Process ``index`` ended: it holds no worker any more."""
        for due in self.book.gone(index):
            self._answer_version(due)
        for address in list(self.leaving):
            self._left(address, index)

    def _served(self) -> None:
        if self.all_served or not all(slot.served for slot in self.slots):
            return
        self.all_served = True
        log.info("serving", port=self.port, processes=len(self.slots), version=package_version())

    async def _watch_liveness(self, slot: _Slot, proc: asyncio.subprocess.Process) -> None:
        """Kill ``proc`` once its metrics endpoint left ``failures`` questions unanswered in a row."""
        policy = self.settings.liveness
        unanswered = 0
        async with aiohttp.ClientSession() as http:
            while True:
                await asyncio.sleep(policy.interval)
                if self.stop.is_set() or slot.metrics_port is None:
                    continue
                if await _scrape(http, slot.metrics_port, policy.timeout) is not None:
                    unanswered = 0
                    continue
                unanswered += 1
                if unanswered >= policy.failures:
                    log.error(
                        "process not answering: killing it",
                        process=slot.index,
                        pid=proc.pid,
                        unanswered=unanswered,
                        interval_secs=policy.interval,
                    )
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    return

    def terminate(self, slot: _Slot) -> None:
        """The stop's SIGTERM to ``slot``'s process, once per run (a second one would skip its drain)."""
        if slot.proc is not None and not slot.terminated:
            slot.terminated = True
            with contextlib.suppress(ProcessLookupError):
                slot.proc.send_signal(signal.SIGTERM)

    # ------------------------------------------------------------------ signals and the stop

    def on_signal(self, signum: signal.Signals) -> None:
        self.signals += 1
        if self.signals == 1:
            log.info("stop requested", signal=signum.name, processes=len(self.slots))
            self.stop.set()
            return
        log.warning("second stop signal: every process ends its requests now", signal=signum.name)
        for slot in self.slots:
            if slot.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.send_signal(signal.SIGTERM)

    async def stop_all(self, keepers: Sequence[asyncio.Task[None]]) -> None:
        await self.stop.wait()
        # Once each process stops listening, its socket closes with it: new connections are
        # refused at once (as one frontend's are), not queued for nobody.
        self.close_sockets()
        for slot in self.slots:
            self.terminate(slot)
        bound = self.config.drain_timeout + _STOP_MARGIN
        _, pending = await asyncio.wait(keepers, timeout=bound)
        if pending:
            for slot in self.slots:
                if slot.proc is not None:
                    log.error(
                        "process did not stop in time: killing it", process=slot.index, pid=slot.proc.pid
                    )
                    with contextlib.suppress(ProcessLookupError):
                        slot.proc.kill()
            await asyncio.wait(pending)

    # ------------------------------------------------------------------ /metrics

    async def scrape(self, request: web.Request) -> web.Response:
        del request
        ports = [(slot.index, slot.metrics_port) for slot in self.slots]
        async with aiohttp.ClientSession() as http:
            answers = await asyncio.gather(
                *(_scrape(http, port, SCRAPE_TIMEOUT) if port else _nothing() for _, port in ports)
            )
        for (index, _), answer in zip(ports, answers, strict=True):
            self.up.labels(str(index)).set(1 if answer is not None else 0)
        texts: list[tuple[str | None, str]] = [(None, generate_latest(self.registry).decode())]
        texts += [(str(index), answer) for (index, _), answer in zip(ports, answers, strict=True) if answer]
        response = web.Response(body=merge_expositions(texts).encode())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def start_metrics(self) -> web.AppRunner | None:
        if self.config.metrics_port is None:
            return None
        for slot in self.slots:
            self.up.labels(str(slot.index)).set(0)
            self.restarts.labels(str(slot.index))
        app = web.Application()
        app.router.add_get("/metrics", self.scrape)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        host = self.config.metrics_host or _split_listen(self.config.listen)[0]
        try:
            await web.TCPSite(runner, host, self.config.metrics_port).start()
        except BaseException:
            await runner.cleanup()
            raise
        log.info("metrics endpoint up", host=host, port=self.config.metrics_port, merged=len(self.slots))
        return runner


def _write(slot: _Slot, line: bytes) -> None:
    """One line on ``slot``'s process's stdin (nothing when it is not running: a process
    started later gets the parent's list in its spec)."""
    proc = slot.proc
    if proc is None or proc.stdin is None or proc.stdin.is_closing():
        return
    with contextlib.suppress(ConnectionError, RuntimeError):
        proc.stdin.write(line)


async def _scrape(http: aiohttp.ClientSession, port: int, timeout: float) -> str | None:
    """One process's own /metrics (None: it did not answer in time)."""
    try:
        async with http.get(
            f"http://127.0.0.1:{port}/metrics", timeout=aiohttp.ClientTimeout(total=timeout)
        ) as response:
            if response.status != 200:
                return None
            return await response.text()
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None


def _split_listen(listen: str) -> tuple[str, int]:
    address = parse_host_port(listen, port_zero_allowed=True)
    return address.host, address.port


async def _nothing() -> None:
    return None


async def supervise(config: FrontendConfig, settings: ParentSettings | None = None) -> int:
    """The parent, to its exit code (the module's docstring)."""
    configure_logging(config.log_format, config.log_level)
    parent = _Parent(config, settings or ParentSettings())
    problem = connection_limits(config) or parent.bind()
    if problem is not None:
        log.error("start-up failed", error=problem)
        return EXIT_STARTUP_FAILED
    log.info(
        "starting processes",
        version=package_version(),
        processes=config.processes,
        listen=config.listen,
        port=parent.port,
    )
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, parent.on_signal, signum)
    metrics: web.AppRunner | None = None
    try:
        try:
            metrics = await parent.start_metrics()
        except OSError as err:
            log.error("start-up failed", error=f"cannot serve metrics: {err}")
            return EXIT_STARTUP_FAILED
        # The bare engines' sidecars outlive the processes' drain, and stop after it.
        async with BareSidecars(
            None,
            ChildSettings(sys.executable, config.log_format, config.log_level),
            worker_tls=config.worker_set.tls is not None,
            registry=parent.registry,
        ) as bare:
            parent.bare = bare
            keepers = [asyncio.create_task(parent.keep(slot)) for slot in parent.slots]
            await parent.stop_all(keepers)
    finally:
        parent.close_sockets()
        if metrics is not None:
            await metrics.cleanup()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    if parent.gave_up:
        code = EXIT_STARTUP_FAILED
    else:
        code = stopped_exit_code(slot.last_exit for slot in parent.slots if slot.last_exit is not None)
    log.info("stopped", exit_code=code, processes=len(parent.slots))
    return code


def liveness_from(value: str | None) -> Liveness:
    """:data:`LIVENESS_HOOK`'s value as the liveness bounds (the defaults when unset)."""
    if not value:
        return Liveness()
    interval, failures = value.split(",")
    return Liveness(interval=float(interval), timeout=float(interval), failures=int(failures))


def run_parent(config: FrontendConfig) -> int:
    """Synchronous entry (sidecar_frontend.server.run with --processes above 1)."""
    settings = ParentSettings(liveness=liveness_from(os.environ.get(LIVENESS_HOOK)))
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(supervise(config, settings))
    return EXIT_OK
