"""Prometheus metrics of one sidecar (spec/COMMON.md, "Metrics").

Each :class:`Metrics` owns its registry, so tests never share counters and the daemon
exposes exactly ``metrics.registry``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self, engine: str = "", registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.engine = engine
        labels = ["engine"]
        self.requests_started = Counter(
            "sidecar_requests_started", "Generate calls accepted", labels, registry=self.registry
        )
        self.requests_finished = Counter(
            "sidecar_requests_finished",
            "Generate calls that ended with every terminal, by the last finish reason",
            [*labels, "finish_reason"],
            registry=self.registry,
        )
        self.requests_failed = Counter(
            "sidecar_requests_failed",
            "Generate calls that ended with an error status, by error reason",
            [*labels, "reason"],
            registry=self.registry,
        )
        self.inflight = Gauge(
            "sidecar_inflight_requests", "Generations in flight", labels, registry=self.registry
        )
        self.time_to_first_token = Histogram(
            "sidecar_time_to_first_token_seconds",
            "From the Generate call to the first chunk sent",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_chunk_latency = Histogram(
            "sidecar_inter_chunk_latency_seconds",
            "Between consecutive chunks sent to the frontend",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.engine_connected = Gauge(
            "sidecar_engine_connected",
            "1 while the engine is connected and healthy, else 0",
            labels,
            registry=self.registry,
        )
        self.coalesced_merges = Counter(
            "sidecar_coalesced_merges",
            "Engine chunks merged into another message instead of sent alone",
            labels,
            registry=self.registry,
        )
        self.engine_aborts = Counter(
            "sidecar_engine_aborts", "Abort calls sent to the engine", labels, registry=self.registry
        )

        # Children bound once: labels() on every chunk would cost more than the update.
        self._started = self.requests_started.labels(engine)
        self._inflight = self.inflight.labels(engine)
        self._ttft = self.time_to_first_token.labels(engine)
        self._gap = self.inter_chunk_latency.labels(engine)
        self._merges = self.coalesced_merges.labels(engine)
        self._aborts = self.engine_aborts.labels(engine)
        self._connected = self.engine_connected.labels(engine)

    def started(self) -> None:
        self._started.inc()
        self._inflight.inc()

    def finished(self, finish_reason: str) -> None:
        self.requests_finished.labels(self.engine, finish_reason).inc()

    def failed(self, reason: str) -> None:
        self.requests_failed.labels(self.engine, reason).inc()

    def ended(self) -> None:
        self._inflight.dec()

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def inter_chunk(self, seconds: float) -> None:
        self._gap.observe(seconds)

    def merged(self, count: int) -> None:
        if count > 0:
            self._merges.inc(count)

    def aborted(self) -> None:
        self._aborts.inc()

    def set_engine_connected(self, connected: bool) -> None:
        self._connected.set(1 if connected else 0)
