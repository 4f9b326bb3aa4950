"""Sticky sessions in the attempt runner's worker choice (docs/frontend.md, "Sessions").

:class:`SessionChoice` wraps the routing policy (:class:`~sidecar_frontend.routing.choice.RoutedChoice`)
as a ``placement.WorkerChoice``: a request naming a session (:data:`CURRENT_SESSION`, set from
its header by ``sessions_http.py``) has its worker decided by ``sessions.py``'s rules, and the
wrapped choice is then asked with every other candidate excluded, so that its own bookkeeping
(the decision's predicted cache, the prefill it queues there, its metrics, the approximate
index entry) is that of the worker the session takes. A request without a session, and a
disaggregated decode step, are the wrapped choice's alone. Retries and migrations ask again
with the failed worker excluded: the session moves with its turn (``failover``).

:class:`Sessions` is one process's table, settings and metrics; ``/finish_session`` and idle
expiry release sessions there. Each process of ``--processes N`` has its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from contextvars import ContextVar
from typing import Final

import anyio
import structlog
from prometheus_client import CollectorRegistry

from sidecar_common.api import sidecar_pb2
from sidecar_common.disaggregation import Role
from sidecar_frontend.placement import WAIT_FOR_OWN_WORKER
from sidecar_frontend.registry import available_first
from sidecar_frontend.routing.choice import RoutedChoice
from sidecar_frontend.routing.sessions import (
    MOVES,
    Candidate,
    Reason,
    SessionKey,
    SessionSettings,
    SessionTable,
    choose_worker,
    keep_or_move,
    running_limit,
    saturated,
)
from sidecar_frontend.routing.sessions_metrics import SessionMetrics
from sidecar_frontend.workers import Worker, WorkerSet

__all__ = ["CURRENT_SESSION", "SessionChoice", "Sessions"]

log = structlog.get_logger("sidecar_frontend.sessions")

# The session the request being served names (None: none). Set for the handling of one HTTP
# request (sessions_http.py); the tasks that request starts (its attempts) inherit it.
CURRENT_SESSION: ContextVar[str | None] = ContextVar("sidecar_frontend_session", default=None)

# The roles a session sticks to (sessions.SessionKey).
_STICKY_ROLES: Final = ("agg", "prefill")


class Sessions:
    """One process's sessions: the table, its settings and metrics, and the release of a
    session by its client or by idleness."""

    def __init__(
        self,
        settings: SessionSettings,
        registry: CollectorRegistry,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.table = SessionTable(settings.max_sessions, settings.idle)
        self.metrics = SessionMetrics(registry)
        self.clock = clock
        self.metrics.watch(self.held)

    def held(self) -> Mapping[str, int]:
        """The sessions held per worker, the idle ones forgotten first (read at each scrape)."""
        self.expire(self.clock())
        return dict(self.table.held_by_worker())

    def expire(self, now: float) -> None:
        expired = self.table.expire(now)
        if expired:
            self.metrics.ended.labels("expired").inc(len(expired))
            log.info("sessions expired", count=len(expired), idle_secs=self.settings.idle)

    def finish(self, session: str) -> int:
        """Release ``session`` (its client finished it): how many of its entries were held
        (one per role it stuck to; 0: unknown here)."""
        released = 0
        for role in _STICKY_ROLES:
            found = self.table.release((role, session))
            if found is None:
                continue
            released += 1
            log.debug("session finished", session=session, role=role, worker=found.worker, turns=found.turns)
        if released:
            self.metrics.ended.labels("finished").inc(released)
        self.expire(self.clock())
        return released

    def placed(
        self,
        key: SessionKey,
        worker: str,
        reason: Reason,
        *,
        held: str | None,
        left_behind_tokens: int,
        now: float,
    ) -> None:
        """A turn of ``key`` went to ``worker`` (for ``reason``): recorded, counted, logged."""
        role, session = key
        evicted = self.table.assign(key, worker, now)
        if reason is Reason.STARTED:
            self.metrics.started.labels(role).inc()
            log.debug("session started", session=session, role=role, worker=worker)
        elif reason in MOVES:
            found = self.table.get(key)
            self.metrics.moved.labels(role, reason.value).inc()
            self.metrics.left_behind.inc(left_behind_tokens)
            log.info(
                "session moved",
                session=session,
                role=role,
                worker=held,
                to=worker,
                reason=reason.value,
                left_behind_tokens=left_behind_tokens,
                turns=found.turns if found is not None else None,
            )
        if evicted:
            self.metrics.ended.labels("evicted").inc(len(evicted))
            log.info("sessions evicted", count=len(evicted), max_sessions=self.settings.max_sessions)


class SessionChoice:
    """The worker choice (and call watch) of the attempt runner, sticky for sessions."""

    def __init__(self, inner: RoutedChoice, workers: WorkerSet, sessions: Sessions) -> None:
        self.inner = inner
        self.workers = workers
        self.sessions = sessions

    def __call__(
        self,
        role: Role,
        model: str,
        request: sidecar_pb2.PreprocessedRequest,
        exclude: frozenset[str],
    ) -> Worker | None:
        """A serving worker of ``role`` serving ``model`` for ``request``, not in ``exclude``:
        the session's (sessions.py) when the request names one."""
        session = CURRENT_SESSION.get()
        if session is None or role not in _STICKY_ROLES:
            return self.inner(role, model, request, exclude)
        sessions, settings = self.sessions, self.sessions.settings
        now = sessions.clock()
        sessions.expire(now)
        key = (role, session)
        found = sessions.table.get(key)
        held = found.worker if found is not None else None
        # As the wrapped choice takes them: a worker on probation with its probe in flight is
        # no candidate unless it is the only one.
        workers = available_first([w for w in self.workers.serving(role, model) if w.address not in exclude])
        if not workers:
            return None
        own = next((w for w in workers if w.address == held), None) if held is not None else None
        if own is None and held is not None and held not in exclude and self._coming_back(held):
            return None  # placement waits for it (WAIT_FOR_OWN_WORKER), woken by its change
        if own is not None and not saturated(self._candidate(own), settings.saturation):
            # The common turn, decided without looking at every worker (keep_or_move's first rule).
            candidates: list[Candidate] = []
            reason = Reason.KEPT
        else:
            candidates = [self._candidate(w) for w in workers]
            reason = keep_or_move(held, candidates, exclude, settings.saturation)
        left_behind = 0
        chosen = held
        if reason is not Reason.KEPT:
            # Asked only when the session starts or moves: its worker's cache decides nothing else.
            looked_up = list(workers)
            held_worker = self.workers.registry.get(held) if held is not None else None
            if held_worker is not None and held_worker not in workers:
                looked_up.append(held_worker)
            cached = self.inner.predicted_cached(model, request, looked_up)
            left_behind = cached.get(held, 0) if held is not None else 0
            chosen = choose_worker(
                session,
                [c._replace(cached_tokens=cached.get(c.address, 0)) for c in candidates],
                saturation=settings.saturation,
                spread=settings.spread,
                avoid=held if reason is Reason.SATURATED else None,
            )
        others = frozenset(w.address for w in workers if w.address != chosen)
        worker = self.inner(role, model, request, exclude | others)
        if worker is None:
            return None
        sessions.placed(key, worker.address, reason, held=held, left_behind_tokens=left_behind, now=now)
        WAIT_FOR_OWN_WORKER.set(None)
        return worker

    def _coming_back(self, address: str) -> bool:
        """The session's worker serves but takes no new request for now (its engine paused by
        its trainer, or behind the newest weight version), and this request has not waited
        ``pause_wait`` for it yet: the turn waits for it rather than moving."""
        worker = self.workers.registry.get(address)
        if worker is None or not worker.eligible or worker.takes_new:
            return False
        now = anyio.current_time()
        until = WAIT_FOR_OWN_WORKER.get()
        if until is None:
            until = now + self.sessions.settings.pause_wait
            WAIT_FOR_OWN_WORKER.set(until)
        return now < until

    def _candidate(self, worker: Worker) -> Candidate:
        reported = worker.model.max_num_seqs if worker.model is not None else 0
        return Candidate(
            worker.address,
            self.sessions.table.held(worker.address),
            worker.score(),
            running_limit(worker.address, reported, self.sessions.settings),
        )

    def watch(
        self, worker: Worker, request: sidecar_pb2.PreprocessedRequest
    ) -> AbstractContextManager[Callable[[sidecar_pb2.LLMEngineOutput], None]]:
        """The wrapped choice's watch of the call (``placement.CallWatch``)."""
        return self.inner.watch(worker, request)
