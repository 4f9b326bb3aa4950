"""The WatchLoad streams: the worker's load pushed to every client that watches (I/O; when a
stream sends is :mod:`sidecar_server.load_push`'s, pure).

One loop reads the load (the engine's figures and the sidecar's own count, as GetLoad answers)
for every stream together, once per push interval, and only while at least one client watches:
the first stream starts it, the last one to leave stops it. Each read replaces the previous
sample and wakes the streams; each stream decides on its own whether to send it. A client that
reads slowly holds up its own stream's write only: when that write returns, the stream looks at
the latest sample (the ones in between are gone: the latest wins), and the loop never waits
for any stream.

A read that fails (the engine is down, its answer late, a bug) clears the sample: no stream
sends anything until a read succeeds again, so every client's view goes stale. The loop keeps
reading at its interval and says so at a doubling interval (at once, then after 2 s, up to
every 5 minutes), then once when the load can be read again.

:meth:`LoadWatch.refresh` reads at once rather than at the next interval: the engine's state
changed (paused, continued, new weights), and every client should hear it now.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Final

import anyio
import structlog

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import SidecarError
from sidecar_common.pool import ReportSchedule
from sidecar_server.background import BackgroundTasks
from sidecar_server.load_push import Pushed, PushTiming, Sample, wait_before_push

__all__ = ["LoadWatch"]

_log = structlog.get_logger(__name__)

_FIRST_REPORT_SECS: Final = 2.0
_MAX_REPORT_SECS: Final = 300.0


class LoadWatch:
    """The WatchLoad streams of one server. ``read()`` reads the load once, bounded in time (a
    SidecarError is a failed read, any other exception a bug, logged with its traceback);
    ``clock`` is monotonic."""

    def __init__(
        self,
        read: Callable[[], Awaitable[sidecar_pb2.LoadReport]],
        timing: PushTiming,
        *,
        owner: str = "sidecar server",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._timing = timing
        self._clock = clock
        self._background = BackgroundTasks(owner)
        self._loop: asyncio.Task[None] | None = None
        self._watchers = 0
        self._latest: Sample | None = None
        self._reads = 0
        # Set (and replaced) at each read, failed or not: every stream looks again.
        self._sampled = anyio.Event()
        self._failures = ReportSchedule(_FIRST_REPORT_SECS, _MAX_REPORT_SECS)
        self._failing = False
        # Set by refresh(): the loop reads again now instead of at its interval.
        self._wake = asyncio.Event()

    @property
    def watchers(self) -> int:
        """WatchLoad streams open right now."""
        return self._watchers

    @property
    def reading(self) -> bool:
        """Whether the loop that reads the load runs (it does while a stream is open)."""
        return self._loop is not None

    async def watch(self, write: Callable[[sidecar_pb2.LoadReport], Awaitable[None]]) -> None:
        """Serve one WatchLoad stream until the client leaves (or the server stops)."""
        with self._watching():
            last: Pushed | None = None
            while True:
                # Taken before the sample is looked at: a read during the write below wakes
                # this stream rather than being missed.
                sampled = self._sampled
                current = self._latest
                now = self._clock()
                wait = wait_before_push(last, current, now, self._timing)
                if wait == 0.0 and current is not None:
                    await write(current.report)
                    last = Pushed(current, now)
                    continue
                with anyio.move_on_after(math.inf if wait is None else wait):
                    await sampled.wait()

    def refresh(self) -> None:
        """Read the load now (if any stream watches): what changed reaches every stream
        without waiting for the next interval."""
        self._wake.set()

    async def close(self, timeout: float) -> None:
        """Stop reading, at most ``timeout`` seconds; nothing starts the loop again."""
        await self._background.close(timeout)
        self._loop = None

    @contextmanager
    def _watching(self) -> Iterator[None]:
        self._watchers += 1
        if self._loop is None:
            self._loop = self._background.spawn(self._run, "load watch")
        try:
            yield
        finally:
            self._watchers -= 1
            if self._watchers == 0 and self._loop is not None:
                self._loop.cancel()
                self._loop = None
                # A stream that comes later must not be sent what was read before it came.
                self._latest = None

    async def _run(self) -> None:
        interval = self._timing.interval
        while True:
            began = self._clock()
            # Cleared before the read: a refresh during it is read again at once.
            self._wake.clear()
            self._sample(await self._read_once())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, interval - (self._clock() - began))):
                    await self._wake.wait()

    async def _read_once(self) -> sidecar_pb2.LoadReport | None:
        try:
            report = await self._read()
        except SidecarError as err:
            self._failed(err.message, None)
        except Exception as exc:
            self._failed(f"{type(exc).__name__}: {exc}", exc)
        else:
            if self._failing:
                self._failing = False
                self._failures = ReportSchedule(_FIRST_REPORT_SECS, _MAX_REPORT_SECS)
                _log.info("load readable again: WatchLoad reports resume")
            return report
        return None

    def _sample(self, report: sidecar_pb2.LoadReport | None) -> None:
        if report is None:
            self._latest = None
        else:
            self._reads += 1
            self._latest = Sample(report, self._reads)
        sampled, self._sampled = self._sampled, anyio.Event()
        sampled.set()

    def _failed(self, why: str, exc: Exception | None) -> None:
        self._failing = True
        next_report = self._failures.due(self._clock())
        if next_report is None:
            return
        event = "load not read: WatchLoad clients get no report until it is"
        if exc is not None:
            # Not a typed error: a bug; its traceback, at the same pace.
            _log.error(event, error=why, next_report_secs=next_report, exc_info=exc)
        else:
            _log.warning(event, error=why, next_report_secs=next_report)
