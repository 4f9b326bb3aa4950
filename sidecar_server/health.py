"""Engine health verdicts, pure: what one probe said, the failure threshold of the background
watch, and whether an engine fault is the engine going away.

The server (``server.py``) runs the probes and feeds their outcomes here; nothing in this module
awaits, reads a clock or logs (docs/common.md, "Engine health").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from sidecar_common.errors import SidecarError, engine_went_away, is_engine_fault

__all__ = ["FAILURE_THRESHOLD", "HealthStreak", "Probe", "after_engine_fault"]

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


def after_engine_fault(error: SidecarError, probe: Probe, why: str) -> SidecarError | None:
    """A generation's engine failure, once a probe of the engine answered: the engine going
    away (migratable, in the engine's own words) when it reports itself unhealthy or cannot
    be reached; ``None`` while that is not known (a healthy or a late answer: probe again
    until the window closes, then the failure stands as it was)."""
    if not is_engine_fault(error) or probe is not Probe.UNHEALTHY:
        return None
    return engine_went_away(error, why)
