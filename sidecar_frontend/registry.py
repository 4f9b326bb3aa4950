"""The worker registry: what the frontend knows of each worker and which may take a generation.
Pure: no I/O, no clock, no logging (times are passed in; every change is told through
:class:`~sidecar_frontend.worker_events.WorkerEvents`, whose listeners log and count).

A worker is eligible while its health says SERVING, it is not refused (its role or model
cannot be used) and not ejected (it misbehaved, or failed too often: out of routing until a
time the caller set). Back from an ejection for failures it is on probation: one call at a
time until one succeeds (:attr:`Worker.available`).
An eligible worker takes new requests unless its engine is paused or, with the fleet routing
by weight version, it is not at the newest one (:mod:`sidecar_frontend.fleet`): such a worker
still serves its model (the model stays listed, admission counts its room, it is never ejected
for it), and while no worker of a model takes new requests its fleet is *held*
(:meth:`Registry.held`): new requests wait for one.
Choice is the power of two choices over a load score (:meth:`Worker.score`) among the workers
of one role and one model that take new requests, O(1) whatever the size of the fleet: the
lists are rebuilt at each change (rare), not at each choice.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Final

import anyio

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_common.disaggregation import Role
from sidecar_common.pool import ChannelPool
from sidecar_common.rpc import StubCache
from sidecar_frontend.fleet import (
    EngineState,
    FleetSettings,
    VersionNews,
    WeightVersions,
    held,
    held_reason,
    listed_state,
    takes_new,
)
from sidecar_frontend.worker_events import WorkerEvents

__all__ = ["Refusal", "Registry", "Worker", "WorkerState", "available_first", "role_mismatch"]


class WorkerState(enum.Enum):
    CONNECTING = "connecting"
    NOT_SERVING = "not_serving"
    SERVING = "serving"
    REFUSED = "refused"  # see Worker.refusal
    DRAINING = "draining"


class Refusal(enum.Enum):
    """Why a worker is not used although it answers."""

    MODEL = "model"  # it serves a model this frontend was told not to serve
    ROLE = "role"  # its sidecar's disaggregation mode contradicts the role it was given


_HOW_TO_LIST: Final[Mapping[str, str]] = {
    "agg": "--worker {address}",
    "prefill": "--prefill-worker {address} (or --worker prefill={address})",
    "decode": "--worker decode={address}",
}


def role_mismatch(address: str, role: str, mode: str) -> str | None:
    """Why a worker given ``role`` cannot serve it when its sidecar reports ``mode`` (the
    ``ModelInfo.disaggregation_mode``), or None when they agree. An empty mode is a sidecar
    that does not say: aggregated, as the field's default means."""
    actual = mode or "agg"
    # A worker given a role needs its sidecar started with --disaggregation-mode <that role>.
    if role == actual:
        return None
    given = "an aggregated worker" if role == "agg" else f"a {role} worker"
    runs = "runs aggregated" if actual == "agg" else f"runs --disaggregation-mode {actual}"
    fix = _HOW_TO_LIST.get(actual)
    hint = (
        f"list it as {fix.format(address=address)}, or start its sidecar with --disaggregation-mode {role}"
        if fix is not None
        else f"start its sidecar with --disaggregation-mode {role}"
    )
    return f"worker {address} was given as {given} but its sidecar {runs}: {hint}"


@dataclass(eq=False)
class Worker:
    address: str
    role: Role
    pool: ChannelPool
    stubs: StubCache[sidecar_pb2_grpc.WorkerAsyncStub]
    state: WorkerState = WorkerState.CONNECTING
    model: sidecar_pb2.ModelInfo | None = None
    refusal: Refusal | None = None
    refusal_message: str = ""
    # Out of routing until this time (the registry's clock) because it misbehaved; None: not.
    ejected_until: float | None = None
    ejected_why: str = ""
    # Back from an outlier ejection (outliers.py): it takes one call at a time until one
    # succeeds (see ``available``).
    probation: bool = False
    # The frontend's own generations on this worker (exact, updated per call).
    inflight: int = 0
    # The worker's last load report (every frontend's generations) and our own count at that time.
    reported_inflight: int = 0
    own_at_report: int = 0
    # The engine's figures in that report (None: never reported, or the engine does not say):
    # requests running (summed over its ranks), waiting in its queue (summed), its KV-cache use
    # (the fullest rank's, 0 to 1); and when the report arrived (the frontend's monotonic
    # clock; None: never). Pushed by WatchLoad, or polled from a sidecar without it.
    running_requests: int | None = None
    waiting_requests: int | None = None
    kv_usage: float | None = None
    load_reported_at: float | None = None
    # The prompt tokens this frontend's generations here still have to prefill (each counted
    # from its call to its first output): what a new request would queue behind.
    queued_prefill_tokens: int = 0
    # Its sidecar subscribes to its engine's KV events and serves them on WatchKvCache (the
    # last GetLoad's kv_cache.subscribed).
    publishes_cache: bool = False
    # Its engine's state and weight version as its sidecar last reported them (unknown and None
    # until it reports, and again once it stops serving: a recovered engine reports anew).
    engine_state: EngineState = EngineState.UNKNOWN
    weight_version: str | None = None
    # At the fleet's newest weight version, as far as routing goes (the registry's to set:
    # always True unless the fleet routes by version).
    current: bool = True
    idle: anyio.Event = field(default_factory=anyio.Event)
    # The calls this frontend left waiting at its server to be taken up (start_gate).
    _start_slots: anyio.Semaphore | None = None
    # The TLS files' version the pool's connections were made with (0: plaintext or none yet).
    tls_version: int = 0
    # The scopes of the long-lived calls on the current connections (health Watch, KV stream):
    # cancelled when the connections are replaced, so each call moves to the new ones.
    _on_connections: set[anyio.CancelScope] = field(default_factory=set)

    @property
    def eligible(self) -> bool:
        return self.state is WorkerState.SERVING and self.ejected_until is None

    @property
    def paused(self) -> bool:
        return self.engine_state is EngineState.PAUSED

    @property
    def takes_new(self) -> bool:
        """Eligible, its engine not paused, and at the fleet's newest version when that matters."""
        return takes_new(eligible=self.eligible, paused=self.paused, current=self.current)

    @property
    def available(self) -> bool:
        """Takes new requests, and not on probation with its probe call in flight."""
        return self.takes_new and not (self.probation and self.inflight > 0)

    @property
    def listed_state(self) -> str:
        """Its state as GET /workers lists it: ``paused`` or ``pending`` for a serving worker
        whose engine is paused or behind the newest version, else its state."""
        return listed_state(self.state.value, paused=self.paused, current=self.current)

    @property
    def served_model(self) -> str:
        """The model it serves ("" until its ModelInfo is known)."""
        return self.model.served_model_name if self.model is not None else ""

    def score(self) -> int:
        """Our exact in-flight count plus what other frontends had there at the last poll
        (the report includes ours as they were then, so those are taken off)."""
        others = max(0, self.reported_inflight - self.own_at_report)
        return self.inflight + others

    def stub(self) -> sidecar_pb2_grpc.WorkerAsyncStub:
        """A ``sidecar.v1.Worker`` stub on the pool's next channel."""
        return self.stubs.next()

    @contextmanager
    def lease(self, on_change: Callable[[Worker], None] | None = None) -> Iterator[None]:
        """Counts one generation as in flight on this worker for the ``with`` block."""
        if self.inflight == 0:
            self.idle = anyio.Event()
        self.inflight += 1
        if on_change is not None:
            on_change(self)
        try:
            yield
        finally:
            self.inflight -= 1
            if on_change is not None:
                on_change(self)
            if self.inflight == 0:
                self.idle.set()

    @property
    def failures_typed(self) -> bool:
        """Its sidecar types every failure of the Generate calls it takes up
        (``ModelInfo.generate_failures_typed``): a bare status before any output is gRPC
        core's, for a call the sidecar never took (sidecar_common.errors.never_started)."""
        return self.model is not None and self.model.generate_failures_typed

    def start_gate(self, slots: int) -> anyio.Semaphore | None:
        """What a Generate call holds from its sending until its first output (or its end):
        ``slots`` such calls at most (FIFO beyond). None for an older sidecar, read as before."""
        if not self.failures_typed:
            return None
        if self._start_slots is None:
            self._start_slots = anyio.Semaphore(slots)
        return self._start_slots

    @contextmanager
    def on_current_connections(self) -> Iterator[anyio.CancelScope]:
        """A scope for one long-lived call on the current connections: cancelled when they are
        replaced (:meth:`replace_connections`); the caller sees ``cancelled_caught`` and calls
        again, on the new ones."""
        with anyio.CancelScope() as scope:
            self._on_connections.add(scope)
            try:
                yield scope
            finally:
                self._on_connections.discard(scope)

    def replace_connections(
        self, pool: ChannelPool, stubs: StubCache[sidecar_pb2_grpc.WorkerAsyncStub], tls_version: int
    ) -> ChannelPool:
        """New calls go to ``pool``; the long-lived calls move there; the old pool is returned
        (the caller closes it once the calls still in flight there had their grace)."""
        old, self.pool, self.stubs, self.tls_version = self.pool, pool, stubs, tls_version
        for scope in tuple(self._on_connections):
            scope.cancel()
        return old


class Registry:
    """The workers by address, their eligibility, and the models they make servable."""

    def __init__(
        self,
        events: WorkerEvents[Worker],
        *,
        allowed_models: frozenset[str] = frozenset(),
        rand: random.Random | None = None,
        fleet: FleetSettings | None = None,
    ) -> None:
        self.events = events
        self._allowed = allowed_models
        self._rand = rand if rand is not None else random.Random()
        self.fleet = fleet if fleet is not None else FleetSettings()
        self.versions = WeightVersions(route_latest_weights=self.fleet.route_latest_weights)
        self._workers: dict[str, Worker] = {}
        # Eligible workers (serving, not ejected), by role and model: they serve the model.
        self._eligible_by_model: dict[tuple[str, str], list[Worker]] = {}
        # Those of them that take new requests now: choice picks among these.
        self._open: dict[str, list[Worker]] = {}
        self._open_by_model: dict[tuple[str, str], list[Worker]] = {}
        # Models that can take a generation now, each with the ModelInfo the formats read.
        self._models: dict[str, sidecar_pb2.ModelInfo] = {}
        # Models whose workers take new requests now (the others of _models are held).
        self._open_models: frozenset[str] = frozenset()
        # Requests waiting now for a worker of their held model to take new requests (kept by
        # WorkerSet.hold; read by the metrics).
        self.holding = 0
        # When each model was first seen serving (a tie-break: the newer model wins).
        self._first_seen: dict[str, int] = {}
        self._seen = 0

    # ---------------------------------------------------------------- membership

    def add(self, worker: Worker) -> None:
        self._workers[worker.address] = worker
        self.rebuild()
        self.events.joined(worker)

    def remove(self, worker: Worker) -> VersionNews:
        """Forget ``worker``; what that did to the fleet's versions."""
        news = VersionNews()
        if self._workers.get(worker.address) is worker:
            del self._workers[worker.address]
            news = self.versions.forget(worker.address)
        self.rebuild()
        self.events.left(worker)
        if news.newest_changed:
            self._changed_all()
        return news

    def get(self, address: str) -> Worker | None:
        return self._workers.get(address)

    def holds(self, worker: Worker) -> bool:
        return self._workers.get(worker.address) is worker

    def addresses(self) -> frozenset[str]:
        return frozenset(self._workers)

    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    # ---------------------------------------------------------------- changes

    def set_state(self, worker: Worker, state: WorkerState) -> bool:
        """Whether the state changed (a draining worker stays draining). A worker that stops
        serving forgets its engine's state and version: back, it reports them anew."""
        if worker.state is WorkerState.DRAINING or worker.state is state:
            return False
        if worker.state is WorkerState.SERVING:
            self._forget_engine(worker)
        worker.state = state
        if state is not WorkerState.REFUSED:
            worker.refusal = None
            worker.refusal_message = ""
        if (
            state is WorkerState.SERVING
            and self.versions.report(worker.address, worker.weight_version).newest_changed
        ):
            self._changed_all()
        else:
            self.changed(worker)
        return True

    def report_engine(self, worker: Worker, state: EngineState, version: str | None) -> VersionNews:
        """``worker``'s sidecar reported its engine's ``state`` and weight ``version``: what that
        did to the fleet's versions. Told as a change only when something changed."""
        if not self.holds(worker) or (worker.engine_state is state and worker.weight_version == version):
            return VersionNews()
        worker.engine_state = state
        worker.weight_version = version
        if worker.state is not WorkerState.SERVING:
            return VersionNews()  # its version counts once it serves
        news = self.versions.report(worker.address, version)
        if news.newest_changed:
            self._changed_all()
        else:
            self.changed(worker)
        return news

    def note_paused(self, worker: Worker) -> bool:
        """A call on ``worker`` was refused because its engine is paused: it is taken as paused
        until its sidecar's next report says otherwise. Whether that changed anything."""
        if not self.holds(worker) or worker.paused:
            return False
        worker.engine_state = EngineState.PAUSED
        self.changed(worker)
        return True

    def set_weight_version(self, version: str | None) -> VersionNews:
        """An admin call set the fleet's newest version (None: back to the reported one). Every
        worker is looked at again: routing by version starts or stops with it."""
        news = self.versions.set_admin(version)
        self._changed_all()
        return news

    def _forget_engine(self, worker: Worker) -> None:
        worker.engine_state = EngineState.UNKNOWN
        worker.weight_version = None
        self.versions.forget(worker.address)

    def _changed_all(self) -> None:
        """Something every worker's choice reads changed (the newest version): rebuild once,
        then tell each worker's change."""
        self.rebuild()
        for worker in list(self._workers.values()):
            self.events.changed(worker)

    def drain(self, worker: Worker) -> bool:
        if worker.state is WorkerState.DRAINING:
            return False
        worker.state = WorkerState.DRAINING
        self.changed(worker)
        return True

    def refuse(self, worker: Worker, refusal: Refusal, message: str) -> bool:
        if worker.state is WorkerState.DRAINING:
            return False
        worker.state = WorkerState.REFUSED
        worker.refusal = refusal
        worker.refusal_message = message
        self.changed(worker)
        return True

    def forget_model(self, worker: Worker) -> None:
        """Its sidecar went away: checked again (model, role) once it serves. A refused
        worker becomes NOT_SERVING: the restarted sidecar may have been fixed."""
        worker.model = None
        if worker.state is WorkerState.REFUSED:
            worker.state = WorkerState.NOT_SERVING
            worker.refusal = None
            worker.refusal_message = ""
            self.changed(worker)

    def refusal_for(self, worker: Worker, model: sidecar_pb2.ModelInfo) -> tuple[Refusal, str] | None:
        """Why ``worker`` cannot be used with ``model`` (its role, or a model this frontend
        was told not to serve), or None."""
        mismatch = role_mismatch(worker.address, worker.role, model.disaggregation_mode)
        if mismatch is not None:
            return Refusal.ROLE, mismatch
        if self._allowed and model.served_model_name not in self._allowed:
            return Refusal.MODEL, (
                f"worker {worker.address} serves {model.served_model_name!r}, not one of the models "
                f"this frontend serves ({', '.join(sorted(self._allowed))})"
            )
        return None

    def eject(self, worker: Worker, until: float, why: str) -> bool:
        """Out of routing until ``until``; whether it was in (a later ejection extends it)."""
        was_in = worker.ejected_until is None
        worker.ejected_until = until if was_in else max(until, worker.ejected_until or until)
        worker.ejected_why = why
        if was_in:
            self.changed(worker)
        return was_in

    def readmit(self, worker: Worker, now: float) -> bool:
        """Back in routing when its ejection ran out by ``now``; whether it came back."""
        if worker.ejected_until is None or worker.ejected_until > now:
            return False
        worker.ejected_until = None
        worker.ejected_why = ""
        self.changed(worker)
        return True

    def changed(self, worker: Worker) -> None:
        """Something choice reads changed on ``worker``: rebuild, then tell."""
        self.rebuild()
        self.events.changed(worker)

    # ---------------------------------------------------------------- what is served

    def models(self) -> Mapping[str, sidecar_pb2.ModelInfo]:
        """Every model a generation can be placed on now, by name (sorted)."""
        return self._models

    def default_model(self) -> str | None:
        """For a request that names no model: the one the most serving workers place
        generations for (aggregated or decode), the newer one on a tie. During a rollout
        from A to B the traffic follows the fleet as B's workers outnumber A's."""
        if not self._models:
            return None
        if len(self._models) == 1:
            return next(iter(self._models))

        def weight(name: str) -> tuple[int, int]:
            placing = len(self._eligible_by_model.get(("agg", name), ())) + len(
                self._eligible_by_model.get(("decode", name), ())
            )
            return placing, self._first_seen.get(name, 0)

        return max(self._models, key=weight)

    def misconfiguration(self) -> str | None:
        """Why the fleet cannot serve, when workers were refused for their role (the first
        such worker's reason), else None."""
        refused = sorted(
            (w for w in self._workers.values() if w.refusal is Refusal.ROLE), key=lambda w: w.address
        )
        return refused[0].refusal_message if refused else None

    def idle_prefill_models(self) -> frozenset[str]:
        """Models whose prefill workers serve while no decode worker does (never used)."""
        by_model = self._eligible_by_model
        return frozenset(
            name for role, name in by_model if role == "prefill" and ("decode", name) not in by_model
        )

    def eligible_of(self, role: str, model: str) -> list[Worker]:
        return list(self._eligible_by_model.get((role, model), ()))

    def models_in_use(self) -> dict[str, str | None]:
        """Each worker's address -> the model it serves (None while unknown)."""
        return {w.address: w.served_model or None for w in self._workers.values()}

    # ---------------------------------------------------------------- choice

    def serving(self, role: str = "agg", model: str | None = None) -> list[Worker]:
        """The workers of ``role`` (serving ``model``, when given) that take new requests."""
        return [
            w
            for w in self._workers.values()
            if w.takes_new and w.role == role and (model is None or w.served_model == model)
        ]

    def has_serving(self, role: str, model: str) -> bool:
        """Whether a worker of ``role`` serves ``model`` now (paused or pending ones included:
        they are not down): O(1), from the kept lists."""
        return any(w.eligible for w in self._eligible_by_model.get((role, model), ()))

    def routable(self, model: str | None = None) -> bool:
        """A generation (of ``model``, or of any model) can be placed: an aggregated worker,
        or a prefill and a decode one (their fleet may be held: the request then waits)."""
        if model is None:
            return bool(self._models)
        return model in self._models

    def held(self, model: str) -> bool:
        """Whether ``model``'s workers serve but none takes new requests (every one paused, or
        none at the newest version): its new requests wait."""
        return held(eligible=int(model in self._models), taking_new=int(model in self._open_models))

    def held_reason(self, model: str) -> str:
        """Why ``model``'s requests wait (for the log line and the 503 past the hold)."""
        placing = [
            w for role in ("agg", "prefill", "decode") for w in self._eligible_by_model.get((role, model), ())
        ]
        paused = sum(1 for w in placing if w.paused)
        pending = sum(1 for w in placing if not w.paused and not w.current)
        return held_reason(model, paused=paused, pending=pending, newest=self.versions.newest)

    def pick(
        self, role: str = "agg", exclude: frozenset[str] = frozenset(), model: str | None = None
    ) -> Worker | None:
        """The less loaded of two workers that take new requests drawn at random (power of two
        choices); never one that does not, never one in ``exclude``, only one serving ``model``
        when it is given. O(1) without exclusions (the first attempt of every request); a
        retry's exclusions may cost a scan of the role."""
        pool = self._open.get(role, []) if model is None else self._open_by_model.get((role, model), [])
        if not exclude and len(pool) >= 2:
            size = len(pool)
            first_at = self._rand.randrange(size)
            second_at = self._rand.randrange(size - 1)
            if second_at >= first_at:
                second_at += 1
            first, second = pool[first_at], pool[second_at]
            if first.available and second.available:
                return second if second.score() < first.score() else first
        candidates = self.serving(role, model)
        if exclude:
            candidates = [w for w in candidates if w.address not in exclude]
        candidates = available_first(candidates)
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        first, second = self._rand.sample(candidates, 2)
        return second if second.score() < first.score() else first

    # ---------------------------------------------------------------- the kept lists

    def rebuild(self) -> None:
        """The lists and the models, anew from every worker's state and the fleet's newest
        version."""
        versions = self.versions
        by_model: dict[tuple[str, str], list[Worker]] = {}
        open_: dict[str, list[Worker]] = {}
        open_by_model: dict[tuple[str, str], list[Worker]] = {}
        for worker in self._workers.values():
            worker.current = versions.current(worker.weight_version)
            if worker.eligible:
                by_model.setdefault((worker.role, worker.served_model), []).append(worker)
                if worker.takes_new:
                    open_.setdefault(worker.role, []).append(worker)
                    open_by_model.setdefault((worker.role, worker.served_model), []).append(worker)
        self._eligible_by_model = by_model
        self._open = open_
        self._open_by_model = open_by_model
        self._models = _placeable(by_model)
        self._open_models = frozenset(_placeable(open_by_model))
        for name in self._models:
            if name not in self._first_seen:
                self._seen += 1
                self._first_seen[name] = self._seen


def available_first(candidates: list[Worker]) -> list[Worker]:
    """The ``available`` candidates; all of them when none is (a worker on probation is the
    only one left: it takes more than its probe rather than the model going unserved)."""
    available = [w for w in candidates if w.available]
    return available if available else candidates


def _placeable(by_model: dict[tuple[str, str], list[Worker]]) -> dict[str, sidecar_pb2.ModelInfo]:
    """Each model with an aggregated worker or a prefill and a decode one, with the ModelInfo
    of a worker whose outputs the client sees (aggregated first, else decode)."""
    models: dict[str, sidecar_pb2.ModelInfo] = {}
    for name in sorted({name for _, name in by_model}):
        agg = by_model.get(("agg", name))
        decode = by_model.get(("decode", name))
        shown = agg[0] if agg else decode[0] if decode and by_model.get(("prefill", name)) else None
        if shown is not None and shown.model is not None:
            models[name] = shown.model
    return models
