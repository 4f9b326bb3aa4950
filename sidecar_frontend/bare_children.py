"""The sidecars the frontend runs for bare engines registered through the membership API (the
processes; the decisions are :mod:`sidecar_frontend.bare_sidecars`').

Each registered bare engine gets one child: ``python -m sidecar_sglang`` (or
``sidecar_vllm``) of the frontend's own installation, listening on a loopback port picked when
the engine is registered and kept for the child's life, restarts included (so the worker set
keeps one address for it). The child belongs to the frontend:

- a child that exits is started again after a backoff (:class:`RestartPolicy`), logged with
  its engine, exit code and run time, and counted in ``frontend_bare_sidecar_restarts_total``;
  meanwhile its worker is not routable, as for any sidecar that stopped answering (the worker
  set's health and connection checks see it gone);
- :meth:`BareSidecars.stop_after_leaving` (``DELETE /workers/{id}``, ``/remove_worker``) waits
  until the worker set let go of the worker (its in-flight requests finished), then stops the
  child: SIGTERM, then SIGKILL after ``stop_grace`` seconds (with ``--processes N`` the parent
  runs the children, with no worker set: it stops one with :meth:`BareSidecars.stop_soon` once
  every process reported the worker gone, sidecar_frontend/processes/parent.py);
- leaving the :class:`BareSidecars` block (the frontend's shutdown, after its drain) stops every
  child the same way;
- if the frontend dies without stopping them (SIGKILL, a crash), Linux sends each child SIGTERM:
  the child asks for it at its start with ``prctl(PR_SET_PDEATHSIG)``, and exits at once if the
  frontend was already gone by then (``sidecar_common.parent_death``: the frontend names itself
  in the child's environment). Elsewhere than Linux this guard is absent. Each child runs
  in its own session (so its own process group), so a terminal's Ctrl-C reaches the
  frontend, which stops the child after its drain, and not the child at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Final, Self

import anyio
import structlog
from anyio.abc import TaskGroup
from prometheus_client import CollectorRegistry, Counter

from sidecar_common.endpoint import parse_host_port
from sidecar_common.parent_death import PARENT_PID_VARIABLE
from sidecar_common.ports import bind_problem
from sidecar_frontend.bare_sidecars import (
    ChildSettings,
    RestartPolicy,
    bare_refusal,
    child_environment,
    sidecar_argv,
)
from sidecar_frontend.membership import AdminError, Registration
from sidecar_frontend.workers import WorkerSet

__all__ = ["STOP_GRACE", "BareSidecars", "ManagedSidecar"]

log = structlog.get_logger("sidecar_frontend.bare_children")

# After SIGTERM, how long a managed sidecar has to exit before SIGKILL. It is stopped once its
# worker drained (or at the frontend's shutdown, after the frontend's drain), so it holds no
# generation: its own drain is short.
STOP_GRACE: Final = 10.0


def _loopback_port(host: str) -> int:
    """A port free on ``host`` now (the OS's pick); the child binds it a moment later."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class ManagedSidecar:
    """One bare engine's sidecar: its registration (with the sidecar's address), the running
    child if any, and how often it was started again."""

    registration: Registration
    argv: list[str]
    environment: dict[str, str]
    port: int
    policy: RestartPolicy
    restarts: Counter
    stop_grace: float
    process: asyncio.subprocess.Process | None = None
    restarted: int = 0
    stopping: anyio.Event = field(default_factory=anyio.Event)
    stopped: anyio.Event = field(default_factory=anyio.Event)

    @property
    def pid(self) -> int | None:
        process = self.process
        return process.pid if process is not None and process.returncode is None else None

    async def run(self) -> None:
        """Start the child and start it again each time it exits, until :meth:`stop`."""
        registration = self.registration
        exits_in_a_row = 0
        try:
            while not self.stopping.is_set():
                started = time.monotonic()
                code = await self._run_once()
                if self.stopping.is_set():
                    break
                ran_for = time.monotonic() - started
                exits_in_a_row = self.policy.exits_in_a_row(exits_in_a_row, ran_for)
                delay = self.policy.delay(exits_in_a_row)
                self.restarted += 1
                self.restarts.labels(url=registration.url).inc()
                log.warning(
                    "a bare engine's sidecar exited; starting it again",
                    url=registration.url,
                    sidecar=registration.sidecar_address,
                    exit_code=code,
                    ran_secs=round(ran_for, 3),
                    restart_in_secs=delay,
                    exits_in_a_row=exits_in_a_row,
                )
                with anyio.move_on_after(delay):
                    await self.stopping.wait()
        finally:
            self.stopped.set()

    async def _run_once(self) -> int | None:
        """Start the child once and wait for its exit: its exit code (None: it did not start)."""
        registration = self.registration
        taken = bind_problem("127.0.0.1", self.port, serving="start the sidecar on")
        if taken is not None:
            log.error(
                "a bare engine's sidecar cannot take its port back; trying again later",
                url=registration.url,
                problem=taken,
            )
        try:
            process = await asyncio.create_subprocess_exec(
                *self.argv,
                env={**self.environment, PARENT_PID_VARIABLE: str(os.getpid())},
                stdin=asyncio.subprocess.DEVNULL,
                # Its own session, so its own process group: a terminal's Ctrl-C reaches the
                # frontend, which stops the child after its drain, not the child at once. Set
                # between fork and exec by the event loop's C side (uvloop's too, which takes
                # no process_group): no Python runs in the forked child.
                start_new_session=True,
            )
        except Exception as err:
            # Whatever the spawn raised costs this engine's sidecar, never the frontend. OSError
            # is the usual (no executable, no memory); anything else is an event loop refusing
            # an argument, which would repeat: logged each time, backed off.
            log.error("a bare engine's sidecar did not start", url=registration.url, error=repr(err))
            return None
        self.process = process
        if self.stopping.is_set():  # stop() came while it started
            await self._terminate(process)
        log.info(
            "bare engine's sidecar started",
            url=registration.url,
            sidecar=registration.sidecar_address,
            pid=process.pid,
            argv=self.argv[1:],
        )
        return await process.wait()

    async def stop(self) -> None:
        """Stop the child (SIGTERM, then SIGKILL after the grace) and its restarts; returns
        once it exited."""
        self.stopping.set()
        if self.process is not None:
            await self._terminate(self.process)
        await self.stopped.wait()
        process = self.process
        log.info(
            "bare engine's sidecar stopped",
            url=self.registration.url,
            exit_code=process.returncode if process is not None else None,
        )

    async def _terminate(self, process: asyncio.subprocess.Process) -> None:
        if process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        with anyio.move_on_after(self.stop_grace):
            await process.wait()
        if process.returncode is None:
            log.warning(
                "a bare engine's sidecar did not stop in time; killing it",
                url=self.registration.url,
                pid=process.pid,
                grace_secs=self.stop_grace,
            )
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()


class BareSidecars:
    """The frontend's managed sidecars, one per registered bare engine, by worker address.
    Used as ``async with``: leaving the block stops every child."""

    def __init__(
        self,
        workers: WorkerSet | None,
        settings: ChildSettings,
        *,
        worker_tls: bool = False,
        policy: RestartPolicy | None = None,
        stop_grace: float = STOP_GRACE,
        registry: CollectorRegistry | None = None,
        environ: dict[str, str] | None = None,
    ) -> None:
        self.workers = workers  # None: the parent of --processes N, told when workers left
        self.settings = settings
        self._worker_tls = worker_tls
        self._policy = policy if policy is not None else RestartPolicy()
        self._stop_grace = stop_grace
        self._environment = child_environment(environ if environ is not None else os.environ)
        self._children: dict[str, ManagedSidecar] = {}
        self._group: TaskGroup | None = None
        self.restarts = Counter(
            "frontend_bare_sidecar_restarts",
            "Sidecars the frontend runs for bare engines (POST /workers with an http:// URL, or "
            "an engine) that exited and were started again, by the engine's registered URL",
            ["url"],
            registry=registry,
        )

    async def __aenter__(self) -> Self:
        group = anyio.create_task_group()
        await group.__aenter__()
        self._group = group
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool | None:
        group = self._group
        assert group is not None
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as stopping:
                for child in list(self._children.values()):
                    stopping.start_soon(child.stop)
        group.cancel_scope.cancel()
        return await group.__aexit__(kind, error, traceback)

    def children(self) -> dict[str, ManagedSidecar]:
        """The managed sidecars, by the worker set's address."""
        return dict(self._children)

    def refusal(self, registration: Registration) -> AdminError | None:
        """Why this frontend cannot run a sidecar for ``registration`` (501), or None."""
        return bare_refusal(registration, worker_tls=self._worker_tls)

    def pick_address(self) -> str:
        """A free loopback address for a new sidecar (``host:port``)."""
        host = self.settings.host
        port = _loopback_port(host)
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def start(self, registration: Registration) -> Registration:
        """Start the sidecar of ``registration`` (in the background; the worker connects once
        it serves) at its ``sidecar_address``, picked here when it has none: the registration
        with it."""
        group = self._group
        if group is None:
            raise RuntimeError("BareSidecars.start outside its async with block")
        if registration.sidecar_address is None:
            registration = replace(registration, sidecar_address=self.pick_address())
        started = registration
        port = parse_host_port(started.worker_address, port_zero_allowed=False).port
        child = ManagedSidecar(
            started,
            sidecar_argv(started, port, self.settings),
            self._environment,
            port,
            self._policy,
            self.restarts,
            self._stop_grace,
        )
        self._children[started.worker_address] = child
        group.start_soon(child.run)
        return started

    async def stop(self, address: str) -> None:
        """Stop the sidecar at ``address`` now (a registration refused after it started)."""
        child = self._children.pop(address, None)
        if child is not None:
            await child.stop()

    def stop_after_leaving(self, address: str) -> None:
        """Stop the sidecar at ``address`` once the worker set no longer holds its worker
        (it drained); in the background."""
        group = self._group
        if group is None or address not in self._children:
            return
        group.start_soon(self._stop_when_gone, address)

    def stop_soon(self, address: str) -> None:
        """Stop the sidecar at ``address`` in the background."""
        group = self._group
        if group is not None and address in self._children:
            group.start_soon(self.stop, address)

    async def _stop_when_gone(self, address: str) -> None:
        assert self.workers is not None
        while True:
            changed = self.workers.next_change()
            if self.workers.get(address) is None:
                break
            await changed.wait()
        await self.stop(address)
