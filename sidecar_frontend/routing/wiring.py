"""The routing parts of one frontend process, made from ``--routing`` and its flags: the router
(none for ``load``), the cache streams (for ``kv`` and the default), their metrics, and the
worker choice the attempt runner asks. The server makes one :class:`RoutingParts` before the worker set (whose
companion task follows each worker's stream) and attaches it to the set once it runs."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from sidecar_common.kv_keys import block_key_chain
from sidecar_frontend.routing.choice import RoutedChoice
from sidecar_frontend.routing.index import BlockIndex
from sidecar_frontend.routing.metrics import RoutingMetrics
from sidecar_frontend.routing.router import Router, RouterConfig, Routing
from sidecar_frontend.routing.streams import CacheStreams, StreamConfig
from sidecar_frontend.workers import Worker, WorkerSet

__all__ = ["RoutingParts"]


@dataclass
class RoutingParts:
    config: RouterConfig
    router: Router | None
    streams: CacheStreams | None
    metrics: RoutingMetrics
    # The worker set routing runs over, once choice() was asked (None before).
    _workers: WorkerSet | None = field(default=None, init=False)

    @classmethod
    def build(
        cls,
        config: RouterConfig,
        registry: CollectorRegistry,
        *,
        rand: random.Random | None = None,
        streams: StreamConfig | None = None,
    ) -> RoutingParts:
        metrics = RoutingMetrics(registry)
        router = Router(config, block_key_chain, rand) if config.routing is not Routing.LOAD else None
        followed = (
            CacheStreams(router, config=streams, metrics=metrics)
            if router is not None and config.follows_streams
            else None
        )
        parts = cls(config, router, followed, metrics)
        metrics.watch(
            parts._indexes,
            followed.rows if followed is not None else list,
            config.index_max_bytes if config.uses_index else None,
        )
        return parts

    def companions(self) -> tuple[Callable[[Worker], Coroutine[Any, Any, None]], ...]:
        """The worker set's per-worker tasks for routing (following each cache stream)."""
        return (self.streams.follow,) if self.streams is not None else ()

    def choice(self, workers: WorkerSet, clock: Callable[[], float] = time.monotonic) -> RoutedChoice:
        """The attempt runner's worker choice (and call watch) over ``workers`` (running)."""
        self._workers = workers
        if self.streams is not None:
            self.streams.watch_changes(workers.next_change)
        return RoutedChoice(workers, self.router, streams=self.streams, metrics=self.metrics, clock=clock)

    def forget_worker(self, address: str) -> None:
        """``address`` left the set: its entries and series go."""
        if self.router is not None:
            self.router.forget_worker(address)
        self.metrics.forget_worker(address)

    def _indexes(self) -> Mapping[str, BlockIndex]:
        """The indexes, read at each scrape; entries of workers that no longer serve an index's
        model are dropped first (what a rollout leaves behind)."""
        if self.router is None:
            return {}
        if self._workers is not None:
            self.router.retain({w.address: w.served_model or None for w in self._workers.workers()})
        return self.router.indexes()
