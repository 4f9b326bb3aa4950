"""Admission's metrics: on the frontend's own registry, beside ``sidecar_frontend/metrics.py``.

What an operator asks of them: how long the queues are and who waits (``frontend_admission_
queued`` by model, band and tenant, read at each scrape), how long requests wait
(``frontend_admission_wait_seconds`` by model and band; ``frontend_admission_tenant_wait_
seconds_total`` summed by model and tenant), what was decided and why
(``frontend_admission_decisions_total`` by model, outcome and reason: admitted, refused with
queue_full, queue_timeout, no_capacity or rate_limited, cancelled while queued), how many running
requests were preempted for more urgent ones (``frontend_admission_preemptions_total`` by model),
and how full each worker is seen (``frontend_worker_saturation``: the sequences running there,
ours and others', over its running limit; read at each scrape).

Tenants are a label only where a bound holds: the queue gauge shows the tenants waiting now (at
most the queue's depth), and the decisions counter names at most ``MAX_TENANT_LABELS`` tenants,
then counts the others as ``other``, so a client that invents a tenant per request cannot grow
the scrape without bound.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from sidecar_frontend.admission.capacity import WorkerLoad
from sidecar_frontend.admission.gate import AdmissionObserver
from sidecar_frontend.admission.state import Refused
from sidecar_frontend.admission.who import Who
from sidecar_frontend.metrics import buckets_up_to

__all__ = ["MAX_TENANT_LABELS", "AdmissionMetrics"]

MAX_TENANT_LABELS: Final = 64
_OTHER: Final = "other"


class AdmissionMetrics(AdmissionObserver):
    def __init__(self, registry: CollectorRegistry, *, max_wait: float | None = None) -> None:
        """``max_wait``: the longest a request may wait (--max-queue-wait-secs), the wait
        histogram's last finite bucket (a preempted request, which waits without that bound,
        lands in +Inf past it)."""
        self._decisions = Counter(
            "frontend_admission_decisions",
            "Admission's decisions, by model, tenant (the first 64 seen, then 'other'), outcome "
            "(admitted, refused, cancelled: the client left while queued) and reason",
            ["model", "tenant", "outcome", "reason"],
            registry=registry,
        )
        self._wait = Histogram(
            "frontend_admission_wait_seconds",
            "How long admitted requests waited in the queue, by model and band (urgency)",
            ["model", "band"],
            buckets=buckets_up_to(max_wait),
            registry=registry,
        )
        self._preemptions = Counter(
            "frontend_admission_preemptions",
            "Running requests paused (their engine requests aborted) to make room for a more "
            "urgent request that waited --preempt-after-secs; each resumes once admitted again",
            ["model"],
            registry=registry,
        )
        self._preempted_models: set[str] = set()
        self._tenant_wait = Counter(
            "frontend_admission_tenant_wait_seconds",
            "Seconds admitted requests waited in the queue, summed by model and tenant (the first 64 "
            "seen, then 'other'): over frontend_admission_decisions_total{outcome=\"admitted\"}, "
            "each tenant's mean wait",
            ["model", "tenant"],
            registry=registry,
        )
        self._tenants: set[str] = set()
        self._registry = registry
        # The label sets each model's series were made with, to remove them when it goes.
        self._decision_labels: dict[str, set[tuple[str, str, str]]] = {}
        self._bands: dict[str, set[str]] = {}

    def watch(
        self,
        queued: Callable[[], dict[str, dict[tuple[int, str], int]]],
        loads: Callable[[], Iterable[tuple[WorkerLoad, int]]],
    ) -> None:
        """Export the queues' depth and each worker's saturation, read at each scrape from
        ``queued`` (the gate's) and ``loads`` (each worker's load with its running limit)."""
        self._registry.register(_Scraped(queued, loads))

    def _tenant(self, tenant: str) -> str:
        if tenant in self._tenants:
            return tenant
        if len(self._tenants) < MAX_TENANT_LABELS:
            self._tenants.add(tenant)
            return tenant
        return _OTHER

    def _decided(self, model: str, tenant: str, outcome: str, reason: str) -> None:
        labels = (self._tenant(tenant), outcome, reason)
        self._decision_labels.setdefault(model, set()).add(labels)
        self._decisions.labels(model, *labels).inc()

    def admitted(self, model: str, who: Who, waited: float) -> None:
        self._decided(model, who.tenant, "admitted", "NONE")
        self._tenant_wait.labels(model, self._tenant(who.tenant)).inc(waited)
        band = str(who.urgency)
        self._bands.setdefault(model, set()).add(band)
        self._wait.labels(model, band).observe(waited)

    def cancelled(self, model: str, who: Who) -> None:
        self._decided(model, who.tenant, "cancelled", "CLIENT_GONE")

    def refused(self, model: str, who: Who, refused: Refused) -> None:
        self._decided(model, who.tenant, "refused", refused.reason.value)

    def preempted(self, model: str, who: Who) -> None:
        self._preempted_models.add(model)
        self._preemptions.labels(model).inc()

    def forget_model(self, model: str) -> None:
        if model in self._preempted_models:
            self._preempted_models.discard(model)
            with contextlib.suppress(KeyError):
                self._preemptions.remove(model)
        forgotten = self._decision_labels.pop(model, set())
        for labels in forgotten:
            with contextlib.suppress(KeyError):
                self._decisions.remove(model, *labels)
        for tenant in {labels[0] for labels in forgotten}:
            with contextlib.suppress(KeyError):
                self._tenant_wait.remove(model, tenant)
        for band in self._bands.pop(model, set()):
            with contextlib.suppress(KeyError):
                self._wait.remove(model, band)


class _Scraped(Collector):
    def __init__(
        self,
        queued: Callable[[], dict[str, dict[tuple[int, str], int]]],
        loads: Callable[[], Iterable[tuple[WorkerLoad, int]]],
    ) -> None:
        self._queued = queued
        self._loads = loads

    def collect(self) -> Iterator[GaugeMetricFamily]:
        depth = GaugeMetricFamily(
            "frontend_admission_queued",
            "Requests waiting for admission, by model, band (urgency) and tenant",
            labels=["model", "band", "tenant"],
        )
        for model, by_key in sorted(self._queued().items()):
            for (urgency, tenant), count in sorted(by_key.items()):
                if count:
                    depth.add_metric([model, str(urgency), tenant], count)
        yield depth
        saturation = GaugeMetricFamily(
            "frontend_worker_saturation",
            "Sequences running on each worker (this frontend's and others') over its running limit",
            labels=["worker"],
        )
        for load, limit in sorted(self._loads(), key=lambda pair: pair[0].address):
            if limit > 0:
                saturation.add_metric([load.address], (load.own_requests + load.others_requests) / limit)
        yield saturation

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())
