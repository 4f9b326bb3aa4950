"""Every long-lived task of the frontend, supervised: a failure is heard, counted and recovered
from, and never stops anything else.

A :class:`Supervisor` is entered with ``async with`` by the task that owns the frontend's
background work (the server's main task; a test's body). Each task it starts
(:meth:`Supervisor.start`) has a name (``health``, ``load_poll``, ``kv_stream``, ``redial``,
``tls_files``, ``discovery`` …) and an owner (a worker's address, or "" for the frontend's
own). When a task ends with an exception, or with a ``CancelledError`` that nobody asked for
(grpc.aio raises one out of a call whose channel was closed under it; a task group would take
it for a request to stop), the supervisor:

- logs it once at error level, with the task's name, its owner and the error;
- counts it in ``frontend_background_failures_total{task}``;
- runs the task again after a pause from the project's backoff (``sidecar_common.retry``),
  which starts over once the task has run for a while without failing.

A task that returns has finished its work and is not run again. A real cancel (the owner's
scope, :meth:`stop_owner`, the supervisor's exit) ends the task as asked. So one worker's fault
costs that worker's task a restart, never another worker's tasks or an HTTP request.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Final

import anyio
import structlog
from anyio.abc import TaskGroup
from prometheus_client import CollectorRegistry, Counter

from sidecar_common.retry import Backoff
from sidecar_common.rpc import cancel_is_ours

__all__ = ["FAILURE_HOOK", "TASK_NAMES", "Supervisor", "SupervisorConfig", "TaskFailure"]

log = structlog.get_logger("sidecar_frontend.supervisor")

# Tests of a real frontend process make its tasks fail while it serves through this variable:
# the path of a file that the supervisor reads every FAULT_FILE_POLL_SECS; each line appended
# names a task, and every running task of that name fails once (its run is interrupted and
# counts as a failure, then the task restarts as after any other). Unset in production.
FAILURE_HOOK: Final = "SIDECAR_TEST_FAULT_FILE"
FAULT_FILE_POLL_SECS: Final = 0.1


# The frontend's background tasks by name: their failure series exist from the start (at 0),
# so a dashboard's rate over them is 0 rather than empty before the first failure.
TASK_NAMES: Final = (
    "health",
    "load_poll",
    "kv_stream",
    "redial",
    "readmit",
    "retire",
    "drain",
    "discovery",
    "tls_files",
    "admission",
    "rate_limits",
)


class TaskFailure(RuntimeError):
    """The failure a test asked for through :data:`FAILURE_HOOK`."""


@dataclass(frozen=True)
class SupervisorConfig:
    # Pause before a failed task runs again: doubling from the first up to the cap (jittered).
    restart_first_secs: float = 0.5
    restart_max_secs: float = 30.0
    # A task that ran this long before failing fails as if for the first time.
    healthy_after_secs: float = 60.0
    # The fault file of FAILURE_HOOK (tests only).
    fault_file: Path | None = None


@dataclass
class _Owned:
    """The cancel scopes of one owner's running tasks."""

    scopes: set[anyio.CancelScope] = field(default_factory=set)
    ended: anyio.Event = field(default_factory=anyio.Event)


class Supervisor:
    """``async with Supervisor(...) as supervisor:`` owns the task group of every background
    task; leaving the block cancels them all."""

    def __init__(
        self,
        config: SupervisorConfig | None = None,
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config if config is not None else SupervisorConfig()
        self._clock = clock
        self._group: TaskGroup | None = None
        self._owners: dict[str, _Owned] = {}
        # Each run in progress: its scope -> its task's name (for the fault file).
        self._runs: dict[anyio.CancelScope, str] = {}
        self.failures = Counter(
            "frontend_background_failures",
            "Background tasks (per-worker health, load poll, KV stream, redial; TLS files, "
            "discovery) that ended with an error or an unasked-for cancel and were run again, "
            "by task",
            ["task"],
            registry=registry,
        )
        for task in TASK_NAMES:
            self.failures.labels(task)

    async def __aenter__(self) -> Supervisor:
        group = anyio.create_task_group()
        await group.__aenter__()
        self._group = group
        if self._config.fault_file is not None:
            self.start("fault_file", functools.partial(self._follow_fault_file, self._config.fault_file))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        group, self._group = self._group, None
        if group is None:
            return None
        # Background tasks run until cancelled: the body's end is the end of all of them. The
        # body's own exception passes through the group as it would through `async with`.
        group.cancel_scope.cancel()
        return await group.__aexit__(exc_type, exc, tb)

    @property
    def running(self) -> bool:
        return self._group is not None

    def start(
        self,
        name: str,
        run: Callable[[], Awaitable[None]],
        *,
        owner: str = "",
        worker: str | None = None,
        restart: bool = True,
    ) -> None:
        """Run ``run()`` as the task ``name`` of ``owner``; run it again after a failure
        (``restart``), else log and count the failure and leave it ended. Its log lines name
        ``worker`` (by default the owner)."""
        if self._group is None:
            raise RuntimeError("Supervisor is not running (use `async with`)")
        scope = anyio.CancelScope()
        self._owners.setdefault(owner, _Owned()).scopes.add(scope)
        label = owner if worker is None else worker
        self._group.start_soon(
            self._supervise, name, owner, label, run, scope, restart, name=f"{name}:{label}"
        )

    def stop_owner(self, owner: str) -> None:
        """Cancel every task of ``owner`` (a worker leaving the set)."""
        owned = self._owners.get(owner)
        if owned is not None:
            for scope in owned.scopes:
                scope.cancel()

    async def until_ended(self, owner: str) -> None:
        """Until every task of ``owner`` has ended (at once when it has none)."""
        owned = self._owners.get(owner)
        if owned is not None:
            await owned.ended.wait()

    def tasks_of(self, owner: str) -> int:
        """How many tasks ``owner`` has running (for tests and the debug log)."""
        owned = self._owners.get(owner)
        return 0 if owned is None else len(owned.scopes)

    async def _supervise(
        self,
        name: str,
        owner: str,
        label: str,
        run: Callable[[], Awaitable[None]],
        scope: anyio.CancelScope,
        restart: bool,
    ) -> None:
        try:
            with scope:
                await self._run_and_restart(name, label, run, restart)
        except asyncio.CancelledError:
            if not scope.cancel_called:
                raise
            # Asked to stop (stop_owner), the task ended with a CancelledError that is not
            # the scope's own, so the scope let it through: grpc.aio makes its own when a
            # closing channel cancels a call the task was awaiting. The task ended as asked;
            # raised further, the group would take it for a cancel of its host (the server's
            # main task) and the whole frontend would stop without a word.
            log.debug("task stopped", task=name, worker=label or None)
        finally:
            owned = self._owners.get(owner)
            if owned is not None:
                owned.scopes.discard(scope)
                if not owned.scopes:
                    del self._owners[owner]
                    owned.ended.set()

    async def _run_and_restart(
        self, name: str, label: str, run: Callable[[], Awaitable[None]], restart: bool
    ) -> None:
        backoff = Backoff(self._config.restart_first_secs, self._config.restart_max_secs)
        failures = 0
        while True:
            began = self._clock()
            error = await self._run_once(name, label, run)
            if error is None:
                return
            ran = self._clock() - began
            failures = 1 if ran >= self._config.healthy_after_secs else failures + 1
            pause = backoff.pause(failures) if restart else math.inf
            self.failures.labels(name).inc()
            log.error(
                "background task failed",
                task=name,
                worker=label or None,
                error=_describe(error),
                failures_in_a_row=failures,
                restart_in_secs=round(pause, 2) if restart else None,
                exc_info=error,
            )
            if not restart:
                return
            await anyio.sleep(pause)

    async def _run_once(
        self, name: str, owner: str, run: Callable[[], Awaitable[None]]
    ) -> BaseException | None:
        """Run the task once; what it failed with, or None when it returned."""
        run_scope = anyio.CancelScope()
        self._runs[run_scope] = name
        try:
            with run_scope:
                await run()
        except asyncio.CancelledError:
            if cancel_is_ours():
                raise
            # Nobody cancelled this task: a CancelledError that escaped a call (its channel
            # closed under it). Taken here, the group never sees it as a request to stop.
            return _UnaskedCancel("CancelledError raised, not asked for (a call cancelled under the task)")
        except Exception as err:  # the point of a supervisor: any failure is recovered from
            return err
        finally:
            del self._runs[run_scope]
        if run_scope.cancelled_caught:  # only the fault file cancels a run's own scope
            return TaskFailure(f"{name} failed as {FAILURE_HOOK} asked")
        return None

    async def _follow_fault_file(self, path: Path) -> None:
        seen = 0
        while True:
            await anyio.sleep(FAULT_FILE_POLL_SECS)
            try:
                text = await anyio.Path(path).read_text()
            except FileNotFoundError:
                continue
            # Whole lines only, and never fewer than before: a writer that rewrites the file
            # (truncate, then write) can be read half way, and a name read again would fail
            # its tasks twice.
            names = [line.strip() for line in text.split("\n")[:-1]]
            for name in names[seen:]:
                for scope, running in tuple(self._runs.items()):
                    if running == name:
                        scope.cancel()
            seen = max(seen, len(names))


class _UnaskedCancel(Exception):
    """A task ended with a CancelledError nobody asked for."""


def _describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def fault_file_from(value: str | None) -> Path | None:
    """:data:`FAILURE_HOOK`'s value as the fault file (None when unset or empty)."""
    return Path(value) if value else None
