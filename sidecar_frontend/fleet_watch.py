"""The fleet's pauses and weight versions made visible: metrics and log lines, from the worker
set's events (a :class:`~sidecar_frontend.worker_events.WorkerListener`; the decisions are
``fleet.py``'s, the state the registry's).

Metrics:

- ``frontend_worker_weight_version{worker, version}``: 1 for the version each worker reports
  (no series for a worker that reports none);
- ``frontend_fleet_weight_versions``: how many versions the workers report (above 1: mixed);
- ``frontend_workers_paused``, ``frontend_workers_pending``: serving workers whose engine is
  paused, and those not at the newest version while new requests go by version;
- ``frontend_models_held``: models whose workers serve but none takes new requests (their
  requests wait); ``frontend_requests_held``: the requests waiting so before their exchange.

Log lines, each at a change only: ``worker paused`` / ``worker continued``, ``worker pending``
/ ``worker at the newest weight version``, ``fleet newest weight version``, ``fleet weight
versions mixed`` / ``fleet weight versions uniform``, ``requests held`` / ``requests released``
per model.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
from prometheus_client import CollectorRegistry, Gauge

from sidecar_frontend.registry import Registry, Worker, WorkerState

__all__ = ["FleetWatch"]

log = structlog.get_logger("sidecar_frontend.workers")


@dataclass
class _Seen:
    """What was last told of one worker."""

    paused: bool = False
    pending: bool = False
    version: str | None = None


class FleetWatch:
    """Subscribed to the worker set's events (``workers.events.subscribe``)."""

    def __init__(self, metrics: CollectorRegistry, workers: Registry) -> None:
        self._workers = workers
        self._seen: dict[str, _Seen] = {}
        self._newest: str | None = None
        self._mixed = False
        self._held: frozenset[str] = frozenset()
        self._version = Gauge(
            "frontend_worker_weight_version",
            "1 for the weight version each worker's engine reports",
            ["worker", "version"],
            registry=metrics,
        )
        versions = Gauge(
            "frontend_fleet_weight_versions",
            "How many weight versions the workers report (above 1: a mixed fleet)",
            registry=metrics,
        )
        versions.set_function(lambda: len(workers.versions.counts()))
        paused = Gauge(
            "frontend_workers_paused",
            "Serving workers whose engine is paused by its operator",
            registry=metrics,
        )
        paused.set_function(lambda: sum(1 for w in workers.workers() if w.eligible and w.paused))
        pending = Gauge(
            "frontend_workers_pending",
            "Serving workers not at the newest weight version while new requests go by version",
            registry=metrics,
        )
        pending.set_function(lambda: sum(1 for w in workers.workers() if w.eligible and not w.current))
        held = Gauge(
            "frontend_models_held",
            "Models whose workers serve but none takes new requests (paused, or behind the newest version)",
            registry=metrics,
        )
        held.set_function(lambda: len(self._held))
        holding = Gauge(
            "frontend_requests_held",
            "Requests waiting for a worker of their model to take new requests (its fleet held)",
            registry=metrics,
        )
        holding.set_function(lambda: workers.holding)

    def joined(self, worker: Worker) -> None:
        self._seen[worker.address] = _Seen()

    def changed(self, worker: Worker) -> None:
        self._worker(worker)
        self._fleet()

    def left(self, worker: Worker) -> None:
        seen = self._seen.pop(worker.address, None)
        if seen is not None and seen.version is not None:
            self._version.remove(worker.address, seen.version)
        self._fleet()

    def _worker(self, worker: Worker) -> None:
        seen = self._seen.setdefault(worker.address, _Seen())
        address = worker.address
        serving = worker.state is WorkerState.SERVING
        paused = serving and worker.paused
        if paused != seen.paused:
            seen.paused = paused
            if paused:
                log.info("worker paused", worker=address, weight_version=worker.weight_version)
            elif serving:
                log.info("worker continued", worker=address, weight_version=worker.weight_version)
        pending = serving and not worker.current
        if pending != seen.pending:
            seen.pending = pending
            if pending:
                log.info(
                    "worker pending: not at the newest weight version",
                    worker=address,
                    weight_version=worker.weight_version,
                    newest=self._workers.versions.newest,
                )
            elif serving:
                log.info(
                    "worker at the newest weight version",
                    worker=address,
                    weight_version=worker.weight_version,
                )
        version = worker.weight_version
        if version != seen.version:
            if seen.version is not None:
                self._version.remove(address, seen.version)
            if version is not None:
                self._version.labels(address, version).set(1)
            seen.version = version

    def _fleet(self) -> None:
        versions = self._workers.versions
        newest = versions.newest
        if newest != self._newest:
            log.info(
                "fleet newest weight version",
                weight_version=newest,
                was=self._newest,
                set_by_admin=versions.set_by_admin,
            )
            self._newest = newest
        mixed = versions.mixed
        if mixed != self._mixed:
            self._mixed = mixed
            counts = dict(sorted(versions.counts().items()))
            if mixed:
                log.warning("fleet weight versions mixed", versions=counts, newest=newest)
            else:
                log.info("fleet weight versions uniform", versions=counts)
        held = frozenset(model for model in self._workers.models() if self._workers.held(model))
        for model in sorted(held - self._held):
            log.warning("requests held", model=model, why=self._workers.held_reason(model))
        models = self._workers.models()
        for model in sorted(self._held - held):
            log.info("requests released", model=model, serving=model in models)
        self._held = held
