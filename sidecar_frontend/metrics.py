"""Prometheus metrics of the frontend. Each :class:`Metrics` owns its registry, so tests never
share counters and the process exposes exactly ``metrics.registry``."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["OUTCOMES", "Metrics"]

# How an HTTP generate request ended (the ``outcome`` label).
OUTCOMES = (
    "ok",  # every sub-request ended with its terminals
    "invalid",  # refused by the format before any worker was used
    "error",  # a worker failure was reported to the client
    "aborted",  # aborted by id
    "timeout",  # --request-timeout-secs ran out
    "disconnected",  # the client went away
    "unavailable",  # no worker was serving
    "shutdown",  # the frontend stopped before it finished
)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "frontend_requests",
            "HTTP generate requests, by format and outcome",
            ["format", "outcome"],
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
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.duration = Histogram(
            "frontend_request_duration_seconds",
            "From the request's arrival to its last byte",
            ["format"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.retries = Counter(
            "frontend_retries",
            "Sub-requests run again on another worker after a failure before the first token",
            ["format"],
            registry=self.registry,
        )
        self.migrations = Counter(
            "frontend_migrations",
            "Sub-requests whose worker failed after tokens were delivered, by format and outcome: "
            "migrated (continued on another worker), length (its budget was already spent: ended) or "
            "why not (not_migratable, guided_decoding, multiple_choices, finished, limit)",
            ["format", "outcome"],
            registry=self.registry,
        )
        self.worker_inflight = Gauge(
            "frontend_worker_inflight",
            "Generations this frontend has in flight on each worker",
            ["worker"],
            registry=self.registry,
        )

    def request(
        self,
        fmt: str,
        outcome: str,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        ttft: float | None,
        duration: float,
    ) -> None:
        self.requests.labels(fmt, outcome).inc()
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

    def forget_worker(self, worker: str) -> None:
        with contextlib.suppress(KeyError):
            self.worker_inflight.remove(worker)
