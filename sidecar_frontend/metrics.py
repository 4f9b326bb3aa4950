"""Prometheus metrics of the frontend. Each :class:`Metrics` owns its registry, so tests never
share counters and the process exposes exactly ``metrics.registry``.

What an operator asks of them: which worker is slow (``frontend_worker_*`` durations and time
to first output, by worker), which fails and why (``frontend_worker_failures_total`` by worker
and reason), why clients are refused (``frontend_requests_total`` by outcome and reason), which
workers are not used and why (``frontend_workers`` by role and state,
``frontend_worker_refused`` by worker and reason), what overload protection did
(``frontend_retries_refused_total``, ``frontend_worker_ejections_total``,
``frontend_worker_restorations_total``). The series of a worker that left the set are
removed with it, so a fleet whose pods come and go does not grow the scrape without bound.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from sidecar_common.histograms import LATENCY_BUCKETS

__all__ = ["EJECTED_FOR_CONSECUTIVE_FAILURES", "OUTCOMES", "Metrics", "WorkerRow", "buckets_up_to"]

# How an HTTP generate request ended (the ``outcome`` label); ``reason`` says why.
OUTCOMES = (
    "ok",  # every sub-request ended with its terminals (reason NONE)
    "invalid",  # refused before any worker was used (INVALID_REQUEST, MODEL_NOT_FOUND, BODY_TOO_LARGE)
    "error",  # a worker failure was reported to the client (the failure's reason)
    "aborted",  # aborted by id (CANCELLED)
    "timeout",  # --request-timeout-secs ran out (DEADLINE)
    "disconnected",  # the client went away (CLIENT_GONE)
    "unavailable",  # no worker could take it (NO_WORKER, MISCONFIGURED)
    "refused",  # admission refused it (QUEUE_FULL, QUEUE_PUSHED_OUT, QUEUE_TIMEOUT, NO_CAPACITY, ...)
    "shutdown",  # the frontend stopped before it finished (ENGINE_SHUTDOWN)
)

# The ``reason`` of an outlier ejection (``frontend_worker_ejections_total``).
EJECTED_FOR_CONSECUTIVE_FAILURES: Final = "consecutive_failures"

# Latencies from a millisecond to an hour (the sidecar's ladder, then on to an hour, since a
# frontend request can outlast a step of it); a histogram's buckets stop at the request timeout
# (nothing lasts longer), with the timeout itself as the last finite bucket.
_LATENCY_BUCKETS: Final = (*LATENCY_BUCKETS, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)


def buckets_up_to(limit: float | None) -> tuple[float, ...]:
    """The latency buckets below ``limit``, then ``limit`` (None: no limit, every bucket)."""
    if limit is None or limit <= 0:
        return _LATENCY_BUCKETS
    return (*(b for b in _LATENCY_BUCKETS if b < limit), float(limit))


@dataclass(frozen=True)
class WorkerRow:
    """One worker as the fleet gauges show it."""

    address: str
    role: str
    state: str
    model: str  # "" until known
    refusal: str  # "" unless refused


class _FleetCollector(Collector):
    """The worker set's state, read at scrape time: never stale, nothing left behind."""

    def __init__(self, rows: Callable[[], Iterable[WorkerRow]]) -> None:
        self._rows = rows

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rows = list(self._rows())
        workers = GaugeMetricFamily(
            "frontend_workers", "Workers in the set, by role and state", labels=["role", "state"]
        )
        counts: dict[tuple[str, str], int] = {}
        for row in rows:
            counts[(row.role, row.state)] = counts.get((row.role, row.state), 0) + 1
        for (role, state), count in sorted(counts.items()):
            workers.add_metric([role, state], count)
        yield workers
        refused = GaugeMetricFamily(
            "frontend_worker_refused",
            "1 for each worker that answers but is not used, by why: model (not a model this "
            "frontend serves) or role (its sidecar's disaggregation mode contradicts its role)",
            labels=["worker", "reason"],
        )
        for row in sorted(rows, key=lambda r: r.address):
            if row.refusal:
                refused.add_metric([row.address, row.refusal], 1)
        yield refused
        models = GaugeMetricFamily(
            "frontend_model_workers", "Serving workers of each model, by role", labels=["model", "role"]
        )
        serving: dict[tuple[str, str], int] = {}
        for row in rows:
            if row.state == "serving":
                serving[(row.model, row.role)] = serving.get((row.model, row.role), 0) + 1
        for (model, role), count in sorted(serving.items()):
            models.add_metric([model, role], count)
        yield models

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())


class Metrics:
    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        version: str = "",
        request_timeout: float | None = 3600.0,
    ) -> None:
        # The `_created` series double the exposition and no dashboard reads them. The switch
        # is process-wide and applies to metrics created after it, hence before any below.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = registry if registry is not None else CollectorRegistry()
        buckets = buckets_up_to(request_timeout)
        self.build_info = Gauge(
            "frontend_build_info",
            "1, labelled with the frontend's version",
            ["version"],
            registry=self.registry,
        )
        self.build_info.labels(version).set(1)
        self.requests = Counter(
            "frontend_requests",
            "HTTP generate requests, by format, outcome and reason",
            ["format", "outcome", "reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "frontend_prompt_tokens", "Prompt tokens sent to workers", ["format"], registry=self.registry
        )
        self.completion_tokens = Counter(
            "frontend_completion_tokens",
            "Completion tokens delivered to clients",
            ["format"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "frontend_time_to_first_token_seconds",
            "From the request's arrival to the first output of a worker",
            ["format"],
            buckets=buckets,
            registry=self.registry,
        )
        self.duration = Histogram(
            "frontend_request_duration_seconds",
            "From the request's arrival to its last byte",
            ["format"],
            buckets=buckets,
            registry=self.registry,
        )
        self.retries = Counter(
            "frontend_retries",
            "Sub-requests another worker took after a failure before the first token",
            ["format"],
            registry=self.registry,
        )
        self.migrations = Counter(
            "frontend_migrations",
            "Sub-requests whose worker failed after tokens were delivered, by format and outcome: "
            "migrated (another worker took the rest), length (its budget was already spent: ended), "
            "no_worker (none was left to take it) or why not (not_migratable, guided_decoding, "
            "multiple_choices, finished, limit)",
            ["format", "outcome"],
            registry=self.registry,
        )
        self.worker_inflight = Gauge(
            "frontend_worker_inflight",
            "Generations this frontend has in flight on each worker",
            ["worker"],
            registry=self.registry,
        )
        self.worker_duration = Histogram(
            "frontend_worker_request_duration_seconds",
            "Generate calls on each worker, from the call to its end (prefill steps included)",
            ["worker"],
            buckets=buckets,
            registry=self.registry,
        )
        self.worker_first_output_seconds = Histogram(
            "frontend_worker_time_to_first_token_seconds",
            "From a Generate call on each worker to its first output",
            ["worker"],
            buckets=buckets,
            registry=self.registry,
        )
        self.worker_failures = Counter(
            "frontend_worker_failures",
            "Generate calls that failed on each worker, by the failure's reason",
            ["worker", "reason"],
            registry=self.registry,
        )
        self.worker_refusals = Counter(
            "frontend_worker_refusals",
            "Workers refused (answering but not used), by why: model or role",
            ["reason"],
            registry=self.registry,
        )
        self._failure_reasons: dict[str, set[str]] = {}
        # ---- overload (issue 27): the retry budget and outlier ejection
        self.retries_refused = Counter(
            "frontend_retries_refused",
            "Retries on another worker the retry budget refused (the sub-request ended with its "
            "worker's failure), by format",
            ["format"],
            registry=self.registry,
        )
        self.worker_ejections = Counter(
            "frontend_worker_ejections",
            "Workers taken out of routing by outlier ejection, by why: consecutive_failures",
            ["reason"],
            registry=self.registry,
        )
        self.worker_ejections.labels(EJECTED_FOR_CONSECUTIVE_FAILURES)
        self.worker_restorations = Counter(
            "frontend_worker_restorations",
            "Workers back from an outlier ejection whose probe call succeeded",
            registry=self.registry,
        )

    def watch_fleet(self, rows: Callable[[], Iterable[WorkerRow]]) -> None:
        """Export the worker set's gauges from ``rows`` (read at each scrape)."""
        self.registry.register(_FleetCollector(rows))

    def request(
        self,
        fmt: str,
        outcome: str,
        reason: str,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        ttft: float | None,
        duration: float,
    ) -> None:
        self.requests.labels(fmt, outcome, reason).inc()
        if prompt_tokens:
            self.prompt_tokens.labels(fmt).inc(prompt_tokens)
        if completion_tokens:
            self.completion_tokens.labels(fmt).inc(completion_tokens)
        if ttft is not None:
            self.time_to_first_token.labels(fmt).observe(ttft)
        self.duration.labels(fmt).observe(duration)

    def retried(self, fmt: str) -> None:
        self.retries.labels(fmt).inc()

    def migrated(self, fmt: str, outcome: str) -> None:
        self.migrations.labels(fmt, outcome).inc()

    def set_worker_inflight(self, worker: str, inflight: int) -> None:
        self.worker_inflight.labels(worker).set(inflight)

    def worker_call(self, worker: str, seconds: float) -> None:
        self.worker_duration.labels(worker).observe(seconds)

    def worker_first_output(self, worker: str, seconds: float) -> None:
        self.worker_first_output_seconds.labels(worker).observe(seconds)

    def worker_failed(self, worker: str, reason: str) -> None:
        self._failure_reasons.setdefault(worker, set()).add(reason)
        self.worker_failures.labels(worker, reason).inc()

    def worker_refused(self, reason: str) -> None:
        self.worker_refusals.labels(reason).inc()

    # ---- overload (issue 27): the retry budget and outlier ejection

    def retry_refused(self, fmt: str) -> None:
        self.retries_refused.labels(fmt).inc()

    def worker_ejected(self, reason: str = EJECTED_FOR_CONSECUTIVE_FAILURES) -> None:
        self.worker_ejections.labels(reason).inc()

    def worker_restored(self) -> None:
        self.worker_restorations.inc()

    def forget_worker(self, worker: str) -> None:
        """Remove every series of ``worker`` (it left the set)."""
        per_worker: Sequence[Gauge | Histogram] = (
            self.worker_inflight,
            self.worker_duration,
            self.worker_first_output_seconds,
        )
        for metric in per_worker:
            with contextlib.suppress(KeyError):
                metric.remove(worker)
        for reason in self._failure_reasons.pop(worker, set()):
            with contextlib.suppress(KeyError):
                self.worker_failures.remove(worker, reason)
