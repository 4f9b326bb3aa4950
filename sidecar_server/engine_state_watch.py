"""The watch over the engine's own state (I/O; what a reading means is
:mod:`sidecar_server.engine_state`'s, pure).

One loop reads the engine's pause state and weight version every ``interval`` (the health
watch's), each read bounded by ``timeout``, from the moment the engine is discovered until the
server stops. Each change is said once, in a log line (paused, continued, weight version
old -> new), and handed to ``on_change`` (the server: its metrics, a WatchLoad report at once).
A read that fails leaves the last reading standing (the health watch speaks for an engine that
does not answer) and is said at a doubling interval, then once when reads succeed again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Final

import structlog

from sidecar_common.errors import SidecarError
from sidecar_common.pool import ReportSchedule
from sidecar_server.background import BackgroundTasks
from sidecar_server.engine_state import (
    UNKNOWN_STATUS,
    Change,
    Continued,
    EngineStatus,
    Paused,
    WeightVersionChanged,
    changes,
    last_known,
)

__all__ = ["EngineStateWatch"]

_log = structlog.get_logger(__name__)

_FIRST_REPORT_SECS: Final = 2.0
_MAX_REPORT_SECS: Final = 300.0


class EngineStateWatch:
    """``read()`` reads the engine's state once (a SidecarError is a failed read, anything
    else a bug, logged with its traceback); ``on_change(status, changes)`` is told each reading
    that changed something worth saying; ``clock`` is monotonic."""

    def __init__(
        self,
        read: Callable[[], Awaitable[EngineStatus]],
        *,
        interval: float,
        timeout: float,
        on_change: Callable[[EngineStatus, tuple[Change, ...]], None],
        owner: str = "sidecar server",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._interval = interval
        self._timeout = timeout
        self._on_change = on_change
        self._clock = clock
        self._status = UNKNOWN_STATUS
        # What the readings said so far, field by field: the changes are said against it.
        self._known = UNKNOWN_STATUS
        self._background = BackgroundTasks(owner)
        self._loop: asyncio.Task[None] | None = None
        self._failures = ReportSchedule(_FIRST_REPORT_SECS, _MAX_REPORT_SECS)
        self._failing = False

    @property
    def status(self) -> EngineStatus:
        """The last reading (nothing known before the first)."""
        return self._status

    @property
    def paused(self) -> bool:
        """The engine said, at the last reading, that it is paused."""
        return self._status.paused is True

    def start(self) -> None:
        """Read now and at every interval from now on (started once; never once closed)."""
        if self._loop is None:
            self._loop = self._background.spawn(self._run, "engine state watch")

    async def close(self, timeout: float) -> None:
        await self._background.close(timeout)
        self._loop = None

    async def poll(self) -> EngineStatus:
        """One bounded reading, and what it changed said and handed on."""
        try:
            # asyncio's own timeout: this runs in a plain asyncio task (engine_health.py says why).
            async with asyncio.timeout(self._timeout):
                status = await self._read()
        except TimeoutError:
            self._failed(f"no answer within {self._timeout:g}s", None)
            return self._status
        except SidecarError as err:
            self._failed(err.message, None)
            return self._status
        except Exception as exc:
            self._failed(f"{type(exc).__name__}: {exc}", exc)
            return self._status
        if self._failing:
            self._failing = False
            self._failures = ReportSchedule(_FIRST_REPORT_SECS, _MAX_REPORT_SECS)
            _log.info("engine state readable again")
        found = changes(self._known, status)
        self._known = last_known(self._known, status)
        self._status = status
        if found:
            for change in found:
                _say(change)
            self._on_change(status, found)
        return status

    async def _run(self) -> None:
        while True:
            began = self._clock()
            await self.poll()
            await asyncio.sleep(max(0.0, self._interval - (self._clock() - began)))

    def _failed(self, why: str, exc: Exception | None) -> None:
        self._failing = True
        next_report = self._failures.due(self._clock())
        if next_report is None:
            return
        event = "engine state not read: the last reading stands"
        if exc is not None:
            _log.error(event, error=why, next_report_secs=next_report, exc_info=exc)
        else:
            _log.warning(event, error=why, next_report_secs=next_report)


def _say(change: Change) -> None:
    match change:
        case Paused():
            _log.info("engine paused: its health is not probed until it continues")
        case Continued():
            _log.info("engine continued")
        case WeightVersionChanged(old=old, new=new):
            _log.info("engine weight version changed", old=old, new=new)
