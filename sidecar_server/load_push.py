"""When a WatchLoad stream sends its client the worker's load (pure: the caller passes the time).

A stream sends a :class:`~sidecar_common.api.sidecar_pb2.LoadReport` at once, then whenever
the report differs from the last one it sent (at most one per push interval: changes within it
are coalesced, the client gets the latest figures), and at least once per heartbeat even when
nothing changed, so its client tells a worker whose load holds still from a stream gone silent.

Every push is of a sample the sidecar read after the stream's previous push: a stream never
says "still so" about figures nobody has read again (an engine whose load read hangs leaves
its streams silent, and their clients' views go stale, which is the truth).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from sidecar_common.api import sidecar_pb2

__all__ = [
    "DEFAULT_PUSH_INTERVAL_SECS",
    "HEARTBEAT_SECS",
    "PushTiming",
    "Pushed",
    "Sample",
    "wait_before_push",
]

# The API's promise (docs/api.md, "WatchLoad"): a report at least every second while the
# engine's load can be read.
HEARTBEAT_SECS: Final = 1.0
DEFAULT_PUSH_INTERVAL_SECS: Final = 0.1


@dataclass(frozen=True)
class PushTiming:
    # At most one report per interval (the sidecar's --load-push-interval-ms).
    interval: float = DEFAULT_PUSH_INTERVAL_SECS
    # At least one report per heartbeat, changed or not.
    heartbeat: float = HEARTBEAT_SECS


@dataclass(frozen=True)
class Sample:
    """One read of the worker's load: its report, and its number (one more for each read)."""

    report: sidecar_pb2.LoadReport
    number: int


@dataclass(frozen=True)
class Pushed:
    """What a stream last sent, and when (the caller's monotonic clock)."""

    sample: Sample
    at: float


def wait_before_push(
    last: Pushed | None, current: Sample | None, now: float, timing: PushTiming
) -> float | None:
    """How long a stream that last sent ``last`` (None: nothing yet) waits at ``now`` before it
    sends ``current``, the latest sample (None: the load could not be read): 0 to send it now;
    more to look again after that many seconds (or at the next sample, whichever is first);
    None to wait for the next sample (nothing to send: no sample, or none read since ``last``).
    """
    if current is None:
        return None
    if last is None:
        return 0.0
    if current.number <= last.sample.number:
        return None
    since = now - last.at
    changed = current.report != last.sample.report
    due = timing.interval if changed else timing.heartbeat
    return max(0.0, due - since)
