"""Engine health verdicts, pure: what one probe said, the failure threshold of the background
watch, what each probe's outcome says to the operator, and whether an engine fault is the
engine going away.

The monitor (``engine_health.py``) runs the probes and feeds their outcomes here, with the
time; nothing in this module awaits, reads a clock or logs (docs/common.md, "Engine health").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from sidecar_common.errors import SidecarError, engine_went_away, is_engine_fault
from sidecar_common.pool import ReportSchedule

__all__ = [
    "FAILURE_THRESHOLD",
    "EngineVerdict",
    "FailedProbe",
    "HealthNote",
    "HealthStreak",
    "Probe",
    "StillDown",
    "Verdict",
    "after_engine_fault",
]

# Consecutive failed probes before the engine is called unhealthy (Kubernetes' default
# failureThreshold). With the watch's 1 s period a dead engine is noticed within about 3 s
# (its streams fail at once on their own, whatever the watch says), while a probe answered late
# by an engine on a saturated CPU, or even two in a row, never turns new requests away.
FAILURE_THRESHOLD: Final = 3


class Probe(enum.Enum):
    """What one health probe found."""

    HEALTHY = "healthy"
    # The engine answered that it is not healthy, or could not be reached at all (refused or
    # reset connection, an error status): a definite answer.
    UNHEALTHY = "unhealthy"
    # No answer within the probe's timeout: a busy engine answers late, a dead one never. Not a
    # definite answer, but it counts towards the threshold (a black-holed engine is only late).
    LATE = "late"


@dataclass
class HealthStreak:
    """The watch's verdict: unhealthy after ``threshold`` failed probes in a row, healthy again
    after one probe that succeeds (Kubernetes' default successThreshold)."""

    threshold: int = FAILURE_THRESHOLD
    healthy: bool = True
    failures: int = 0  # failed probes in a row

    def __post_init__(self) -> None:
        if self.threshold < 1:
            raise ValueError("the failure threshold must be at least 1")

    def observe(self, probe: Probe) -> bool | None:
        """Count one probe; the new verdict when it changed, else None."""
        if probe is Probe.HEALTHY:
            self.failures = 0
            if self.healthy:
                return None
            self.healthy = True
            return True
        self.failures += 1
        if self.healthy and self.failures >= self.threshold:
            self.healthy = False
            return False
        return None

    def reset(self, healthy: bool) -> None:
        """Start over with a known verdict (the engine was just discovered, or is gone)."""
        self.healthy = healthy
        self.failures = 0 if healthy else self.threshold


@dataclass(frozen=True)
class Verdict:
    """The verdict changed: the engine is ``healthy`` again, or not, and why (the reason of the
    probe that decided it)."""

    healthy: bool
    reason: str


@dataclass(frozen=True)
class FailedProbe:
    """A probe failed (late or unhealthy) while the verdict is still healthy: worth saying each
    time, so a busy engine's late answers are visible before (and without) any verdict."""

    probe: Probe
    reason: str
    failures: int  # failed probes in a row, this one included
    threshold: int


@dataclass(frozen=True)
class StillDown:
    """The engine is still unhealthy and a report is due (at a growing interval: never silence
    for minutes while the channels reconnect)."""

    reason: str  # the latest probe's
    down_secs: float  # since the verdict
    next_report_secs: float


HealthNote = Verdict | FailedProbe | StillDown


class EngineVerdict:
    """The engine's health as the server acts on it: the watch's streak, why the engine was last
    found unhealthy, and when to say again that it still is. Each probe's outcome comes in
    with the time it was taken; what is worth acting on or saying comes out as a
    :data:`HealthNote`."""

    def __init__(self, threshold: int = FAILURE_THRESHOLD) -> None:
        self._streak = HealthStreak(threshold)
        self._problem = ""
        self._down_since = 0.0
        self._reports = ReportSchedule()

    @property
    def healthy(self) -> bool:
        return self._streak.healthy

    @property
    def problem(self) -> str:
        """Why the engine was last found unhealthy ("" before it ever was)."""
        return self._problem

    def discovered(self) -> None:
        """The engine was just discovered: healthy, with nobody to tell (it was never said
        otherwise to anyone who acts on it)."""
        self._streak.reset(True)

    def observe(self, probe: Probe, reason: str, now: float) -> HealthNote | None:
        """One probe of the watch: a changed verdict, a failed probe below the threshold, a
        due still-down report, or None (nothing to say)."""
        streak = self._streak
        change = streak.observe(probe)
        if change is not None:
            return self._changed(change, reason, now)
        if probe is Probe.HEALTHY:
            return None
        if streak.healthy:
            return FailedProbe(probe, reason, streak.failures, streak.threshold)
        interval = self._reports.due(now)
        if interval is None:
            return None
        return StillDown(reason, now - self._down_since, interval)

    def gone(self, reason: str, now: float) -> Verdict | None:
        """A probe after an engine fault found the engine unhealthy: that is the verdict at once,
        without waiting for the threshold (the failed streams already said it). None when the
        verdict already was unhealthy."""
        was_healthy = self._streak.healthy
        self._streak.reset(False)
        return self._changed(False, reason, now) if was_healthy else None

    def _changed(self, healthy: bool, reason: str, now: float) -> Verdict:
        if not healthy:
            # The verdict is the first report; the schedule spaces out the next ones.
            self._problem = reason
            self._down_since = now
            self._reports = ReportSchedule()
            self._reports.due(now)
        return Verdict(healthy, reason)


def after_engine_fault(error: SidecarError, probe: Probe, why: str) -> SidecarError | None:
    """A generation's engine failure, once a probe of the engine answered: the engine going
    away (migratable, in the engine's own words) when it reports itself unhealthy or cannot
    be reached; ``None`` while that is not known (a healthy or a late answer: probe again
    until the window closes, then the failure stands as it was)."""
    if not is_engine_fault(error) or probe is not Probe.UNHEALTHY:
        return None
    return engine_went_away(error, why)
