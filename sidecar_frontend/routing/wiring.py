"""The routing parts of one frontend process, made from ``--routing`` and its flags: the router
(none for ``load``), the cache streams (for ``kv`` and the default), their metrics, and the
worker choice the attempt runner asks. The server makes one :class:`RoutingParts`, then
attaches it to the running worker set (:meth:`RoutingParts.choice`): from then on it follows
the set's events. A worker that joins gets its cache stream (a supervised task of that worker);
a worker that leaves takes its entries and series with it, and an index no worker is left in
goes at once; a worker now serving another model (a rollout reusing its address) loses its
entries in its old model's index.

It also holds the process's sessions (``sessions_choice.py``): the choice it makes is sticky for
a request naming a session, and the server mounts :meth:`RoutingParts.http_routes`
(``/finish_session``) and :meth:`RoutingParts.middlewares` (the session header)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CollectorRegistry

from sidecar_common.kv_keys import block_key_chain
from sidecar_frontend.routing.choice import RoutedChoice
from sidecar_frontend.routing.index import BlockIndex
from sidecar_frontend.routing.metrics import RoutingMetrics
from sidecar_frontend.routing.router import Router, RouterConfig, Routing
from sidecar_frontend.routing.sessions_choice import SessionChoice, Sessions
from sidecar_frontend.routing.sessions_http import finish_session_routes, session_middleware
from sidecar_frontend.routing.streams import CacheStreams, StreamConfig
from sidecar_frontend.workers import Worker, WorkerSet

__all__ = ["RoutingParts"]


@dataclass
class RoutingParts:
    config: RouterConfig
    router: Router | None
    streams: CacheStreams | None
    metrics: RoutingMetrics
    sessions: Sessions
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
        parts = cls(config, router, followed, metrics, Sessions(config.sessions, registry))
        metrics.watch(
            parts._indexes,
            followed.rows if followed is not None else list,
            config.index_max_bytes if config.uses_index else None,
        )
        return parts

    def choice(
        self,
        workers: WorkerSet,
        clock: Callable[[], float] = time.monotonic,
        *,
        with_room: Callable[[Sequence[Worker]], list[Worker]] | None = None,
    ) -> SessionChoice:
        """The attempt runner's worker choice (and call watch) over ``workers`` (running),
        whose events routing follows from now on (the workers already there included); sticky
        for the requests naming a session. ``with_room``: admission's reading of which workers
        have a free slot, chosen first (None: admission is off)."""
        self._workers = workers
        if self.streams is not None:
            self.streams.watch_changes(workers.next_change, workers.misbehaviour)
        listener = _RoutingListener(self, workers)
        workers.events.subscribe(listener)
        for worker in workers.workers():
            listener.joined(worker)
        routed = RoutedChoice(
            workers, self.router, streams=self.streams, metrics=self.metrics, clock=clock, with_room=with_room
        )
        return SessionChoice(routed, workers, self.sessions)

    def http_routes(self) -> list[web.RouteDef]:
        """The routes routing serves beside the formats' (``/finish_session``, answered even
        with sessions off: a trainer's release of a session is then a no-op)."""
        return finish_session_routes(self.sessions)

    def middlewares(self) -> tuple[Middleware, ...]:
        """What every request goes through: the reading of its session header (none with
        sessions off)."""
        settings = self.config.sessions
        return (session_middleware(settings.headers),) if settings.enabled else ()

    def forget_worker(self, address: str) -> None:
        """``address`` left the set: its entries and series go."""
        if self.router is not None:
            self.router.forget_worker(address)
        self.metrics.forget_worker(address)

    def _indexes(self) -> Mapping[str, BlockIndex]:
        """The indexes, read at each scrape."""
        if self.router is None:
            return {}
        return self.router.indexes()


class _RoutingListener:
    """Routing's subscription to the worker set's events."""

    def __init__(self, parts: RoutingParts, workers: WorkerSet) -> None:
        self._parts = parts
        self._workers = workers
        # The model each worker was last seen serving ("" while unknown).
        self._model_of: dict[str, str] = {}

    def joined(self, worker: Worker) -> None:
        streams = self._parts.streams
        if streams is not None:
            self._workers.supervisor.start("kv_stream", lambda: streams.follow(worker), owner=worker.address)

    def changed(self, worker: Worker) -> None:
        model = worker.served_model
        if not model:
            return  # unknown for a while: its entries stay (router.retain)
        was = self._model_of.get(worker.address)
        self._model_of[worker.address] = model
        router = self._parts.router
        if was is not None and was != model and router is not None:
            router.retain(self._workers.registry.models_in_use())

    def left(self, worker: Worker) -> None:
        self._model_of.pop(worker.address, None)
        self._parts.forget_worker(worker.address)
