"""The server's engine-health monitor (I/O side; the verdicts are :mod:`sidecar_server.health`).

:class:`EngineHealthMonitor` runs the background watch (one bounded probe every
``watch_interval``), says what each probe's outcome is worth saying (a failed probe below the
threshold, the verdict, a still-down report), tells the server when the verdict changes, and
types a generation's engine fault: an untyped engine failure followed within ``fault_window``
by the engine reporting itself unhealthy is the engine going away (docs/common.md, "Engine
health"). It owns its tasks (:class:`~sidecar_server.background.BackgroundTasks`): none starts
once it is closed, and :meth:`EngineHealthMonitor.close` ends them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import anyio
import structlog

from sidecar_common.errors import SidecarError, engine_went_away, is_engine_fault
from sidecar_server.background import BackgroundTasks
from sidecar_server.engine import Engine
from sidecar_server.health import (
    EngineVerdict,
    FailedProbe,
    HealthNote,
    Probe,
    StillDown,
    Verdict,
    after_engine_fault,
)

__all__ = ["EngineHealthMonitor"]

_log = structlog.get_logger(__name__)


class EngineHealthMonitor:
    """One server's watch over its engine. ``on_change(healthy, why)`` is told each change of
    the verdict (after its log line); ``internal_error(where, exc)`` turns a bug in a probe into
    the error it reads as (logged and counted by the server). ``clock`` is the monotonic time
    the still-down reports are measured in."""

    def __init__(
        self,
        engine: Engine,
        *,
        watch_interval: float,
        probe_timeout: float,
        failure_threshold: int,
        fault_window: float,
        on_change: Callable[[bool, str], None],
        internal_error: Callable[[str, BaseException], SidecarError],
        owner: str = "sidecar server",
        clock: Callable[[], float] = time.monotonic,
        activity: Callable[[], int] | None = None,
        paused: Callable[[], bool] = lambda: False,
    ) -> None:
        self._engine = engine
        # Whether the engine says it is paused: a paused engine is not down, and its health
        # probe (SGLang's is a generation, held by the pause) is not run meanwhile.
        self._paused = paused
        # How many engine messages the sidecar has relayed so far (None: not known): a probe
        # that came late while this grew found a busy engine, not a dead one.
        self._activity = activity
        self._watch_interval = watch_interval
        self._probe_timeout = probe_timeout
        self._fault_window = fault_window
        self._on_change = on_change
        self._internal_error = internal_error
        self._clock = clock
        self._verdict = EngineVerdict(failure_threshold)
        self._background = BackgroundTasks(owner)
        self._watch: asyncio.Task[None] | None = None
        # The probes run after an engine fault; concurrent faults share them.
        self._fault_check: asyncio.Task[tuple[Probe, str]] | None = None

    @property
    def healthy(self) -> bool:
        """The watch's verdict (healthy until probes say otherwise)."""
        return self._verdict.healthy

    @property
    def problem(self) -> str:
        """Why the engine was last found unhealthy."""
        return self._verdict.problem

    def start(self) -> None:
        """The engine is discovered: healthy from now on (nobody is told: nobody was told
        otherwise), and the watch runs (started once; never once closed)."""
        self._verdict.discovered()
        if self._watch is None:
            self._watch = self._background.spawn(self._run_watch, "health watch")

    async def close(self) -> None:
        """Start no more probes; cancel the watch and the probes after a fault and wait for
        them, at most the probe timeout."""
        await self._background.close(self._probe_timeout)
        self._watch = self._fault_check = None

    async def check(self) -> None:
        """One probe of the watch, and what its outcome is worth saying or doing (none while
        the engine says it is paused: the verdict stands as it was)."""
        if self._paused():
            return
        probe, why = await self.probe()
        note = self._verdict.observe(probe, why, self._clock())
        if note is not None:
            self._act(note)

    async def probe(self) -> tuple[Probe, str]:
        """One bounded probe of the engine, and why it did not find it healthy."""
        timeout = self._probe_timeout
        activity = self._activity
        relayed = activity() if activity is not None else 0
        try:
            # asyncio's own timeout, not an anyio scope: these probes run in plain asyncio
            # tasks, where an anyio scope's repeated cancel delivery could outlive the scope
            # (seen under CPU starvation: a stray CancelledError ended the probing task).
            async with asyncio.timeout(timeout):
                answer = await self._engine.health()
        except TimeoutError as exc:
            if activity is not None and activity() > relayed:
                # The engine kept streaming while its health check waited: it is busy (a
                # grpc.aio server takes up one new call per loop turn, and a turn is long under
                # thousands of streams), not gone. Counting this as a failure took a busy
                # engine out of service: every new request then got 503 at once.
                _log.debug("engine health probe late while the engine streams", timeout=timeout)
                return Probe.HEALTHY, ""
            return Probe.LATE, str(exc) or f"no health check answer within {timeout:g}s"
        except SidecarError as err:
            return Probe.UNHEALTHY, f"health check failed: {err.message}"
        except Exception as exc:
            return Probe.UNHEALTHY, self._internal_error("health_watch", exc).message
        if answer.healthy:
            return Probe.HEALTHY, ""
        return Probe.UNHEALTHY, answer.problem or "the health check answered not serving"

    async def typed_fault(self, error: SidecarError) -> SidecarError:
        """An engine fault (an untyped engine error) that comes with, or is followed within
        ``fault_window`` by, the engine reporting itself unhealthy is the engine going away:
        migratable. Anything else stands as it was. Raises CancelledError only when the
        calling task itself is cancelled."""
        if not is_engine_fault(error):
            return error
        if self._paused():
            return error  # a paused engine is not going away: its failure stands as it is
        if not self._verdict.healthy:
            return engine_went_away(error, self._verdict.problem)
        check = self._fault_check
        if check is None or check.done():
            check = self._fault_check = self._background.spawn(
                self._probe_after_fault, "probe after engine fault"
            )
        if check is None:
            return error  # the monitor is closed: no verdict, the failure stands
        try:
            probe, why = await asyncio.shield(check)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this call is being cancelled (the client left, the server stops)
            # Only the shared probing was cut short: no verdict, the failure stands.
            return error
        return after_engine_fault(error, probe, why) or error

    async def _run_watch(self) -> None:
        while True:
            await anyio.sleep(self._watch_interval)
            await self.check()

    async def _probe_after_fault(self) -> tuple[Probe, str]:
        """Probe until the engine reports itself unhealthy or the window closes; the last
        probe's outcome. A confirmed departure is the verdict at once (health NOT_SERVING): no
        new request should follow the failed ones there."""
        window = self._fault_window
        deadline = asyncio.get_running_loop().time() + window
        probe, why = Probe.LATE, "no health check answer in time"
        try:
            async with asyncio.timeout_at(deadline):
                while True:
                    probe, why = await self.probe()
                    if probe is Probe.UNHEALTHY:
                        verdict = self._verdict.gone(why, self._clock())
                        if verdict is not None:
                            self._act(verdict)
                        break
                    await asyncio.sleep(window / 10)
        except TimeoutError:
            pass  # the window closed: the last probe's outcome stands
        return probe, why

    def _act(self, note: HealthNote) -> None:
        match note:
            case Verdict(healthy=True):
                _log.info("engine healthy again")
                self._on_change(True, note.reason)
            case Verdict(healthy=False):
                _log.warning("engine unhealthy: refusing new requests", reason=note.reason)
                self._on_change(False, note.reason)
            case FailedProbe():
                _log.warning(
                    "engine health probe late" if note.probe is Probe.LATE else "engine health probe failed",
                    reason=note.reason,
                    failures=note.failures,
                    threshold=note.threshold,
                )
            case StillDown():
                _log.warning(
                    "engine still unhealthy: refusing new requests",
                    reason=note.reason,
                    down_secs=round(note.down_secs, 1),
                    next_report_secs=note.next_report_secs,
                )
