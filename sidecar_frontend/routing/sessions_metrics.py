"""The sessions' metrics (docs/frontend.md, "Sessions"), on the frontend's registry:

* the sessions held, by worker, read at each scrape (a worker that left keeps its sessions
  until each one's next turn moves it, or it is forgotten);
* sessions started and moved (by reason: saturated, failover, unavailable), by role;
* sessions ended, by reason: finished (``/finish_session``), expired (idle), evicted (the
  table's bound);
* the cached prompt tokens the router predicted on the workers sessions moved away from (what
  the moves left behind).

Each process of ``--processes N`` holds its own sessions and counts its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["SessionMetrics"]


class _HeldCollector(Collector):
    def __init__(self, held: Callable[[], Mapping[str, int]]) -> None:
        self._held = held

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "frontend_sessions_held",
            "Sessions this process holds, by the worker their turns go to",
            labels=["worker"],
        )
        for worker, count in sorted(self._held().items()):
            family.add_metric([worker], count)
        yield family

    def describe(self) -> Iterator[Metric]:
        return iter(())


class SessionMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.started = Counter(
            "frontend_sessions_started",
            "Sessions started (a first turn, or the first after the session was forgotten), by role",
            ["role"],
            registry=registry,
        )
        self.moved = Counter(
            "frontend_sessions_moved",
            "Sessions moved to another worker, by role and reason: saturated (its worker ran at "
            "least --session-saturation times its running limit while another did not), failover "
            "(its worker failed the turn), unavailable (its worker no longer serves the model)",
            ["role", "reason"],
            registry=registry,
        )
        self.ended = Counter(
            "frontend_sessions_ended",
            "Sessions this process forgot, by reason: finished (/finish_session), expired (idle "
            "for --session-idle-secs), evicted (the least recently used, past --session-max)",
            ["reason"],
            registry=registry,
        )
        self.left_behind = Counter(
            "frontend_sessions_left_behind_tokens",
            "Prompt tokens the router predicted cached on the workers sessions moved away from",
            registry=registry,
        )

    def watch(self, held: Callable[[], Mapping[str, int]]) -> None:
        """Export the sessions held per worker, read at each scrape."""
        self.registry.register(_HeldCollector(held))
