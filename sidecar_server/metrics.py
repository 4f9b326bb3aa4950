"""Prometheus metrics of one sidecar: what an operator reads (docs: deploy/README.md, "Metrics").

Each :class:`Metrics` owns its registry, so tests never share counters and the daemon
exposes exactly ``metrics.registry``.

Request accounting, the invariant the dashboard and the tests rely on: every Generate call
that arrives is counted once in ``sidecar_requests_started_total`` (refusals included), and
ends exactly once, either in ``sidecar_requests_finished_total{finish_reason}`` or in
``sidecar_requests_failed_total{reason}``. Refusals (failed before any engine call) are also
counted in ``sidecar_requests_refused_total{reason}``. Hence at every scrape
refused <= failed <= started and finished + failed <= started; the difference is the
requests still running (``sidecar_inflight_requests``) plus those between arrival and refusal.

Hot path: the children of every fixed label set are bound here once; per request the
server calls a handful of methods, and per chunk only the two latency histograms move.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from sidecar_common.histograms import LATENCY_BUCKETS

__all__ = ["ABORT_OUTCOMES", "Metrics"]

# Whole requests: a long generation runs for minutes.
_DURATION_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# How an engine abort ended: answered, raised, or no answer within the abort timeout.
ABORT_OUTCOMES: Final = ("ok", "failed", "timed_out")


class Metrics:
    def __init__(
        self, engine: str = "", registry: CollectorRegistry | None = None, *, version: str = "unknown"
    ) -> None:
        # The `_created` series double the exposition and no dashboard reads them. The switch
        # is process-wide and applies to children created after it, hence before any below.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = registry if registry is not None else CollectorRegistry()
        self.engine = engine
        labels = ["engine"]
        reg = self.registry
        self.build_info = Gauge(
            "sidecar_build_info",
            "Always 1; the labels say which sidecar version serves which engine",
            ["version", "engine"],
            registry=reg,
        )
        self.requests_started = Counter(
            "sidecar_requests_started",
            "Generate calls that arrived, refusals included",
            labels,
            registry=reg,
        )
        self.requests_finished = Counter(
            "sidecar_requests_finished",
            "Generate calls that ended with every terminal, by the last finish reason",
            [*labels, "finish_reason"],
            registry=reg,
        )
        self.requests_failed = Counter(
            "sidecar_requests_failed",
            "Generate calls that ended with an error status (refusals included), by error reason",
            [*labels, "reason"],
            registry=reg,
        )
        self.requests_refused = Counter(
            "sidecar_requests_refused",
            "Generate calls refused before any engine call (also counted as failed), by error reason",
            [*labels, "reason"],
            registry=reg,
        )
        self.inflight = Gauge("sidecar_inflight_requests", "Generations in flight", labels, registry=reg)
        self.request_duration = Histogram(
            "sidecar_request_duration_seconds",
            "From the Generate call to its end, for generations the engine was asked for",
            labels,
            buckets=_DURATION_BUCKETS,
            registry=reg,
        )
        self.prompt_tokens = Counter(
            "sidecar_prompt_tokens",
            "Prompt tokens of the generations the engine was asked for, counted when each ends",
            labels,
            registry=reg,
        )
        self.completion_tokens = Counter(
            "sidecar_completion_tokens",
            "Tokens sent to the frontend (all choices), counted when each generation ends",
            labels,
            registry=reg,
        )
        self.time_to_first_token = Histogram(
            "sidecar_time_to_first_token_seconds",
            "From the Generate call to the first chunk sent",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.inter_chunk_latency = Histogram(
            "sidecar_inter_chunk_latency_seconds",
            "Between consecutive chunks sent to the frontend",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.engine_connected = Gauge(
            "sidecar_engine_connected",
            "1 while the engine is connected and healthy, else 0",
            labels,
            registry=reg,
        )
        self.coalesced_merges = Counter(
            "sidecar_coalesced_merges",
            "Engine chunks merged into another message instead of sent alone",
            labels,
            registry=reg,
        )
        self.engine_aborts = Counter(
            "sidecar_engine_aborts",
            "Abort calls sent to the engine, by outcome (ok, failed, timed_out)",
            [*labels, "outcome"],
            registry=reg,
        )
        self.engine_paused = Gauge(
            "sidecar_engine_paused",
            "1 while the engine says it is paused, 0 while it says it runs; absent while its "
            "wire does not say",
            labels,
            registry=reg,
        )
        self.engine_weight_version = Gauge(
            "sidecar_engine_weight_version",
            "Always 1, for the weight version the engine reports now (its label); absent while "
            "it reports none",
            [*labels, "version"],
            registry=reg,
        )

        self.internal_errors = Counter(
            "sidecar_internal_errors",
            "Untyped exceptions (bugs) caught in the sidecar, by where they were caught",
            [*labels, "where"],
            registry=reg,
        )

        self.build_info.labels(version, engine).set(1)
        # Children bound once: labels() on every chunk would cost more than the update.
        self._started = self.requests_started.labels(engine)
        self._inflight = self.inflight.labels(engine)
        self._duration = self.request_duration.labels(engine)
        self._prompt = self.prompt_tokens.labels(engine)
        self._completion = self.completion_tokens.labels(engine)
        self._ttft = self.time_to_first_token.labels(engine)
        self._gap = self.inter_chunk_latency.labels(engine)
        self._merges = self.coalesced_merges.labels(engine)
        self._aborts = {outcome: self.engine_aborts.labels(engine, outcome) for outcome in ABORT_OUTCOMES}
        self._connected = self.engine_connected.labels(engine)
        # Reasons are few and known only when they occur: bound on first use, then reused.
        self._finished: dict[str, Counter] = {}
        self._failed: dict[str, Counter] = {}
        self._refused: dict[str, Counter] = {}
        self._internal: dict[str, Counter] = {}
        # What set_engine_status last exported.
        self._paused_known = False
        self._weight_version: str | None = None

    def arrived(self) -> None:
        """A Generate call arrived (before any check)."""
        self._started.inc()

    def refused(self, reason: str) -> None:
        """It was refused before any engine call: it ends here."""
        self._child(self._refused, self.requests_refused, reason).inc()
        self._child(self._failed, self.requests_failed, reason).inc()

    def started(self) -> None:
        """It was accepted: the engine is being asked for a generation."""
        self._inflight.inc()

    def finished(self, finish_reason: str) -> None:
        self._child(self._finished, self.requests_finished, finish_reason).inc()

    def failed(self, reason: str) -> None:
        self._child(self._failed, self.requests_failed, reason).inc()

    def ended(self, seconds: float, prompt_tokens: int, completion_tokens: int) -> None:
        """An accepted generation is over (after ``finished`` or ``failed``)."""
        self._inflight.dec()
        self._duration.observe(seconds)
        self._prompt.inc(prompt_tokens)
        self._completion.inc(completion_tokens)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def inter_chunk(self, seconds: float) -> None:
        self._gap.observe(seconds)

    def merged(self, count: int) -> None:
        if count > 0:
            self._merges.inc(count)

    def aborted(self, outcome: str = "ok") -> None:
        """One engine abort call, by how it ended (one of :data:`ABORT_OUTCOMES`)."""
        self._aborts[outcome].inc()

    def internal_error(self, where: str) -> None:
        """A bug surfaced as an untyped exception (``where``: generate, validate, ...)."""
        self._child(self._internal, self.internal_errors, where).inc()

    def set_engine_connected(self, connected: bool) -> None:
        self._connected.set(1 if connected else 0)

    def set_engine_status(self, paused: bool | None, weight_version: str | None) -> None:
        """The engine's own state as it last said it (None: not said)."""
        if paused is None:
            if self._paused_known:
                self.engine_paused.remove(self.engine)
            self._paused_known = False
        else:
            self.engine_paused.labels(self.engine).set(1 if paused else 0)
            self._paused_known = True
        if weight_version != self._weight_version:
            if self._weight_version is not None:
                self.engine_weight_version.remove(self.engine, self._weight_version)
            if weight_version is not None:
                self.engine_weight_version.labels(self.engine, weight_version).set(1)
            self._weight_version = weight_version

    def _child(self, cache: dict[str, Counter], family: Counter, reason: str) -> Counter:
        child = cache.get(reason)
        if child is None:
            child = cache[reason] = family.labels(self.engine, reason)
        return child
