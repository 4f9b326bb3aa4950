"""The admission gate: the I/O around each model's pure :class:`~.state.ModelAdmission`.

A generate request that the format parsed passes here before any worker is chosen
(``handler.py``): its tenant's rate limits first (``rates.py``), then its model's admission
queue. It is admitted at once when the fleet has room for it, else it waits in the queue until a
request ends, a worker joins or its load report frees room, or until ``--max-queue-wait-secs``
(then a 429); a full band is refused at once (429), as is a model no worker has room for at all
(503). A client that leaves while its request waits (aiohttp cancels the handler) takes the
request out of the queue at once: it never reaches an engine.

The fleet's room is read from the worker set each time it is needed (never cached): each
eligible worker of the model (aggregated, or decode when the model is disaggregated), its
running limit (its engine's ``max_num_seqs`` / ``max_running_requests`` from ``ModelInfo``, or
``--worker-capacity``), the frontend's exact in-flight count there, and the load its sidecar
last pushed (other frontends' requests, the engine's queue and KV use, and how fresh that is).

What wakes a waiting request: the release of an admitted one (the common case: immediate), a
worker event (joined, changed, left), a load report believed from a worker (its engine's queue
emptied, another frontend's requests ended: ``WorkerEvents.subscribe_load``), another request's
arrival (it pumps the queue it joins, so room that grew unannounced, such as a tenant ageing
out of the reserve's count, is used before the newcomer waits), and a ticker that looks again
every ``tick`` seconds while anything waits, for what nothing announces. The ticker is a
supervised task when the frontend runs one; a request's own deadline never depends on it.

Preemption (``--preempt-after-secs``; off by default). The ticker also asks each model's
admission for a victim (:meth:`~.state.ModelAdmission.victim`): an admitted request, less urgent
than one that has waited that long without room. A request may be a victim only once its
handler allowed it (:meth:`Pass.allow_preemption`, for a request that can resume where it
stopped); the gate calls its ``on_preempt`` with the :class:`~.state.Preemption` (the handler's
exchange stops its attempts, their engine requests aborted), counts it (the observer's
``preempted``), and the request's :meth:`Pass.readmit` then gives back its slots and waits in
the queue again, ahead of its band and with no deadline, until it is admitted again. A client
that leaves meanwhile takes it out of the queue (its :meth:`Pass.release`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

import anyio
import structlog

from sidecar_common.errors import RefusalReason
from sidecar_frontend.admission.capacity import Room, WorkerLoad, fleet_room, workers_with_free_slots
from sidecar_frontend.admission.queue import TicketState
from sidecar_frontend.admission.rates import Grant, RateLimiter, RateRefusal
from sidecar_frontend.admission.state import ModelAdmission, Preemption, Refused, Ticket
from sidecar_frontend.admission.who import Who
from sidecar_frontend.config import AdmissionConfig
from sidecar_frontend.registry import Worker

__all__ = [
    "REFUSAL_STATUS",
    "AdmissionConfig",
    "AdmissionObserver",
    "Gate",
    "Pass",
    "WakeOnWorkerEvents",
    "refusal_headers",
]

log = structlog.get_logger("sidecar_frontend.admission")

# The HTTP status of each admission refusal: the fleet is contended (429: this client, or this
# tenant, should slow down) or has no capacity at all (503: nothing to wait for here).
REFUSAL_STATUS: Final[Mapping[RefusalReason, int]] = {
    RefusalReason.QUEUE_FULL: 429,
    RefusalReason.QUEUE_TIMEOUT: 429,
    RefusalReason.QUEUE_PUSHED_OUT: 429,
    RefusalReason.RATE_LIMITED: 429,
    RefusalReason.NO_CAPACITY: 503,
}


class Pass:
    """An admitted request: hold it while the request runs, :meth:`release` it once it ended."""

    def __init__(self, gate: Gate, model: str, ticket: Ticket | None, grant: Grant | None, who: Who) -> None:
        self._gate = gate
        self._model = model
        self._ticket = ticket
        self._grant = grant
        self.who = who
        self._released = False
        self.waited = 0.0  # seconds it spent in the queue
        # Told when the request is preempted (allow_preemption).
        self.on_preempt: Callable[[Preemption], None] | None = None
        # Why its slots were taken back, from its preemption until it is admitted again.
        self.preemption: Preemption | None = None
        # When the gate preempted it last (its debug line says how long the request took to stop).
        self.preempted_at: float | None = None
        # Its wait to be admitted again, shared by whoever calls readmit.
        self._resume: _Waiter | None = None

    def allow_preemption(self, on_preempt: Callable[[Preemption], None]) -> None:
        """The request can resume where it stopped: it may be preempted, and ``on_preempt`` is
        then told (it must stop the request's generations; :meth:`readmit` waits for room)."""
        self.on_preempt = on_preempt
        if self._ticket is not None and not self._released:
            self._ticket.preemptible = True

    async def readmit(self) -> bool:
        """Wait until the request is admitted again after its preemption (at once when it was
        not preempted): the first call gives back its slots and queues it, every call waits for
        the same admission. False when it never will be (the frontend stops)."""
        return await self._gate._readmit(self)

    def release(self, actual_tokens: int | None) -> None:
        """The request ended having used ``actual_tokens`` (prompt plus completion; None: unknown,
        its estimate stands). Idempotent."""
        if self._released:
            return
        self._released = True
        # The callback is the request's bound method, which holds this pass: dropped here, the
        # request's objects are freed when it ends rather than left for the cyclic collector
        # (whose passes over them stalled every stream under load, bench.overload).
        self.on_preempt = None
        self._gate._release(self, self._grant, actual_tokens)


@dataclass(eq=False)
class _Waiter:
    ticket: Ticket
    admitted: anyio.Event = field(default_factory=anyio.Event)
    refused: Refused | None = None


class Gate:
    """Every model's admission, and the rate limits: one per frontend."""

    def __init__(
        self,
        workers: _WorkerView,
        config: AdmissionConfig,
        *,
        limiter: RateLimiter | None = None,
        clock: Callable[[], float] = time.monotonic,
        observer: AdmissionObserver | None = None,
        held: Callable[[str], bool] | None = None,
        on_backlog: Callable[[bool], None] | None = None,
    ) -> None:
        self._workers = workers
        # Told True when requests start waiting, False when none waits any more (the ticker's
        # view, within a tick): the frontend tightens its collector meanwhile (collector.py).
        self._on_backlog = on_backlog
        # Whether a model's fleet is held (every worker paused: WorkerSet.held). Its queued
        # requests' wait does not count meanwhile: a trainer's pause is no reason to refuse them
        # (the hold bounds it, --paused-hold-secs); their deadlines move on by the held time.
        self._held = held
        self._held_since: dict[str, float] = {}
        self.config = config
        self.limiter = limiter
        self._clock = clock
        self._observer = observer
        self._models: dict[str, ModelAdmission] = {}
        # Waiting tickets by model: new requests (enter) and preempted ones (readmit).
        self._waiters: dict[str, dict[Ticket, _Waiter]] = {}
        # The passes of the admitted requests, for their preemption.
        self._passes: dict[Ticket, Pass] = {}
        self._anything_waits = anyio.Event()
        self._closed: Refused | None = None

    # ---------------------------------------------------------------- the request's side

    async def enter(self, model: str, who: Who, cost: int, slots: int) -> Pass | Refused:
        """Admit one request of ``who`` for ``model`` (``cost`` tokens estimated, ``slots``
        sequences), waiting in the queue if it must; or why it is refused."""
        if self._closed is not None:
            return self._closed
        now = self._clock()
        grant: Grant | None = None
        if self.limiter is not None:
            taken = self.limiter.take(who.tenant, cost, now)
            if isinstance(taken, RateRefusal):
                refused = Refused(RefusalReason.RATE_LIMITED, taken.retry_after, taken.detail)
                self._tell_refused(model, who, refused)
                return refused
            grant = taken
        admission = self._admission(model)
        room = self._room(model, now)
        arrived = admission.arrive(who.tenant, who.urgency, cost, slots, now, room)
        self._refuse_pushed_out(model, admission)
        if isinstance(arrived, Refused):
            self._give_back(grant, now)
            self._tell_refused(model, who, arrived)
            return arrived
        # Not a victim before its handler allows it (Pass.allow_preemption).
        arrived.preemptible = False
        if arrived.admitted:
            self._tell_admitted(model, who, 0.0)
            return self._pass(model, arrived, grant, who)
        # Why it waits, for whoever reads a slow request's queued_ms (debug: one line a request
        # under a flood). Free slots are total - foreign - held; the reserve is kept for tenants
        # under their fair share (state.py).
        log.debug(
            "request queued",
            model=model,
            tenant=who.tenant,
            urgency=who.urgency,
            total_slots=room.total_slots,
            foreign_slots=room.foreign_slots,
            held_slots=admission.held_slots,
            reserve=admission.reserve(room.total_slots),
            stale_workers=room.stale,
        )
        waiter = _Waiter(arrived)
        waiting = self._waiters.setdefault(model, {})
        waiting[arrived] = waiter
        self._anything_waits.set()
        self._tell_queued(model)
        # The state admitted nothing because another ticket goes first: if the room grew with
        # no event (the reserve shrank as a tenant aged out of its count, or every worker's
        # report went stale and each counts on this frontend's own requests alone), that one
        # and maybe this one go now.
        self._pump(model)
        outcome: Pass | Refused | None = None
        try:
            with anyio.move_on_after(max(0.0, arrived.deadline - now)):
                after = self.config.preempt_after
                if after is not None:
                    # Its own moment to preempt for, rather than the ticker's next look (up to a
                    # tick later: half the time to first token of an urgent request at 4 times
                    # the capacity, in bench.overload).
                    with anyio.move_on_after(after):
                        await waiter.admitted.wait()
                    if not waiter.admitted.is_set():
                        # A millisecond's slack: the timer and the gate's clock are two clocks.
                        self._preempt(max(0.0, after - 0.001))
                await waiter.admitted.wait()
            if waiter.refused is None and not waiter.admitted.is_set():
                # Its deadline passed: every ticket past its own leaves with its refusal.
                self._expire(model)
            if waiter.refused is not None:
                outcome = waiter.refused
            elif waiter.admitted.is_set():
                passed = self._pass(model, arrived, grant, who)
                passed.waited = self._clock() - arrived.enqueued_at
                outcome = passed
            else:  # not past its deadline by the state's reckoning yet: it waits no longer
                admission.cancel(arrived)
                outcome = Refused(RefusalReason.QUEUE_TIMEOUT, 1, "waited the longest a request may wait")
        finally:
            waiting.pop(arrived, None)
            if outcome is None:
                # Cancelled while waiting (the client left, or the frontend stops): out of the
                # queue now; if it had just been admitted, its slots are given back.
                if admission.cancel(arrived):
                    self._tell_cancelled(model, who)
                elif waiter.admitted.is_set():
                    admission.release(arrived, 0, self._clock())
                    self._pump(model)
                self._give_back(grant, self._clock())
        if isinstance(outcome, Refused):
            self._give_back(grant, self._clock())
            self._tell_refused(model, who, outcome)
        else:
            self._tell_admitted(model, who, outcome.waited)
        return outcome

    def close(self, refused: Refused) -> None:
        """The frontend stops: every waiting request gets ``refused``, and so does every new one."""
        self._closed = refused
        for model, waiting in self._waiters.items():
            admission = self._models[model]
            for ticket, waiter in list(waiting.items()):
                if admission.cancel(ticket):
                    waiter.refused = refused
                    waiter.admitted.set()

    # ---------------------------------------------------------------- what wakes the queue

    def look_again(self) -> None:
        """The fleet's room may have grown: admit what fits in every queue that has waiters."""
        for model, waiting in list(self._waiters.items()):
            if waiting:
                self._pump(model)

    def poke(self) -> None:
        """The fleet may have room now (a worker event): look at every queue; and a model no
        worker serves any more, with nothing waiting or running, is forgotten (its state and
        its metrics' series), so a fleet whose models come and go keeps no trace of the old."""
        self.look_again()
        served = self._workers.models()
        for model, admission in list(self._models.items()):
            if model not in served and not self._waiters.get(model) and admission.held_slots == 0:
                del self._models[model]
                self._waiters.pop(model, None)
                if self._observer is not None:
                    self._observer.forget_model(model)

    async def run_ticker(self) -> None:
        """Looks at the waiting queues every ``tick`` while anything waits (a supervised task),
        and preempts for the requests that waited ``preempt_after`` when that is set."""
        while True:
            await self._anything_waits.wait()
            self._tell_backlog(True)
            while any(self._waiters.values()):
                self.poke()
                for model in list(self._waiters):
                    self._expire(model)
                if self.config.preempt_after is not None:
                    self._preempt(self.config.preempt_after)
                await anyio.sleep(self.config.tick)
            self._anything_waits = anyio.Event()
            self._tell_backlog(False)

    def _preempt(self, after: float) -> None:
        """Preempt every victim the admission names now for a request that waited ``after``."""
        for model, waiting in list(self._waiters.items()):
            admission = self._models.get(model)
            if admission is None or not waiting:
                continue
            now = self._clock()
            room = self._room(model, now)
            while (victim := admission.victim(now, room, after)) is not None:
                passed = self._passes[victim]  # a victim is preemptible: its pass allowed it
                waiter = admission.making_room_for(victim)
                assert waiter is not None, "a victim is named for a waiting ticket"
                cause = Preemption(victim.urgency, waiter.urgency, now - waiter.enqueued_at)
                log.debug(
                    "preempting",
                    model=model,
                    tenant=victim.tenant,
                    urgency=victim.urgency,
                    for_tenant=waiter.tenant,
                    for_urgency=waiter.urgency,
                    waited_ms=round(cause.waited * 1000, 3),
                )
                passed.preemption = cause
                passed.preempted_at = now
                if self._observer is not None:
                    self._observer.preempted(model, passed.who)
                if passed.on_preempt is not None:
                    passed.on_preempt(cause)

    async def _readmit(self, passed: Pass) -> bool:
        ticket = passed._ticket
        if passed.preemption is None or ticket is None or passed._released:
            return True
        model = passed._model
        waiter = passed._resume
        if waiter is None:
            if self._closed is not None:
                return False  # the frontend stops: nothing is admitted any more
            # The first of its sub-requests back: its slots go to the waiting request.
            waiter = passed._resume = _Waiter(ticket)
            now = self._clock()
            since = passed.preempted_at
            # How long the preempted request took to stop: the urgent one waits for it.
            log.debug(
                "preempted request stopped",
                model=model,
                tenant=ticket.tenant,
                after_ms=None if since is None else round((now - since) * 1000, 3),
            )
            self._models[model].requeue(ticket, now)
            self._waiters.setdefault(model, {})[ticket] = waiter
            self._anything_waits.set()
            self._tell_queued(model)
            self._pump(model)
        await waiter.admitted.wait()
        waiting = self._waiters.get(model, {})
        if waiting.get(ticket) is waiter:
            del waiting[ticket]
        if waiter.refused is not None:
            return False
        if passed._resume is waiter:
            passed._resume = None
            passed.preemption = None
        return True

    # ---------------------------------------------------------------- the fleet's room

    def worker_loads(self, model: str) -> list[WorkerLoad]:
        """Each eligible worker that places ``model``'s generations, as capacity reads it."""
        placing = self._workers.eligible_of("agg", model) or self._workers.eligible_of("decode", model)
        return [self._load(worker) for worker in placing]

    def with_room(self, workers: Sequence[Worker]) -> list[Worker]:
        """The workers of ``workers`` with a free slot, in their order
        (``capacity.workers_with_free_slots``: fewer sequences than the limit, an engine not
        full by its last report)."""
        if not workers:
            return []
        loads = [self._load(worker) for worker in workers]
        roomy = {load.address for load in workers_with_free_slots(loads, self.config.capacity)}
        return [worker for worker in workers if worker.address in roomy]

    def room(self, model: str) -> Room:
        return self._room(model, self._clock())

    def _room(self, model: str, now: float) -> Room:
        return fleet_room(self.worker_loads(model), now, self.config.capacity)

    def every_load(self) -> list[tuple[WorkerLoad, int]]:
        """Every worker's load and running limit (0: not known yet), for the saturation gauge."""
        loads = [self._load(worker) for worker in self._workers.workers()]
        return [(load, load.running_limit) for load in loads]

    def _limit(self, worker: Worker) -> int:
        limit = self.config.worker_capacity.get(worker.address)
        if limit is None:
            limit = worker.model.max_num_seqs if worker.model is not None else 0
        return limit

    def _load(self, worker: Worker) -> WorkerLoad:
        limit = self._limit(worker)
        others = max(0, worker.reported_inflight - worker.own_at_report)
        return WorkerLoad(
            address=worker.address,
            running_limit=limit,
            own_requests=worker.inflight,
            others_requests=others,
            engine_waiting=worker.waiting_requests,
            kv_usage=worker.kv_usage,
            reported_at=worker.load_reported_at,
        )

    # ---------------------------------------------------------------- the state's moves

    def _admission(self, model: str) -> ModelAdmission:
        admission = self._models.get(model)
        if admission is None:
            admission = self._models[model] = ModelAdmission(self.config.settings)
        return admission

    def _pump(self, model: str) -> None:
        admission = self._models.get(model)
        waiting = self._waiters.get(model)
        if admission is None or not waiting:
            return
        now = self._clock()
        for ticket in admission.pump(now, self._room(model, now)):
            waiter = waiting.get(ticket)
            if waiter is not None:
                waiter.admitted.set()
            else:  # its waiter is gone (cannot happen: a leaving waiter cancels its ticket)
                admission.release(ticket, 0, now)

    def _refuse_pushed_out(self, model: str, admission: ModelAdmission) -> None:
        """Wake the waiting requests the state refused to make room for another tenant's."""
        self._refuse_waiting(model, admission.pushed_out())

    def _expire(self, model: str) -> None:
        admission = self._models.get(model)
        if admission is None:
            return
        now = self._clock()
        if self._held is not None and self._held(model):
            self._held_since.setdefault(model, now)
            return
        since = self._held_since.pop(model, None)
        if since is not None:
            admission.postpone(since, now)
        self._refuse_waiting(model, admission.expire(now))

    def _refuse_waiting(self, model: str, refusals: list[tuple[Ticket, Refused]]) -> None:
        """Wake each waiting request of ``refusals`` with its refusal (the state already took
        its ticket out of the queue)."""
        waiting = self._waiters.get(model, {})
        for ticket, refused in refusals:
            waiter = waiting.get(ticket)
            if waiter is not None:
                waiter.refused = refused
                waiter.admitted.set()

    def _pass(self, model: str, ticket: Ticket, grant: Grant | None, who: Who) -> Pass:
        passed = self._passes[ticket] = Pass(self, model, ticket, grant, who)
        return passed

    def _release(self, passed: Pass, grant: Grant | None, actual: int | None) -> None:
        now = self._clock()
        model, ticket = passed._model, passed._ticket
        if ticket is not None:
            self._passes.pop(ticket, None)
            admission = self._models[model]
            if ticket.state is TicketState.QUEUED:
                # Preempted and waiting again: its client left, or its request ended otherwise.
                admission.cancel(ticket)
                self._waiters.get(model, {}).pop(ticket, None)
            admission.release(ticket, actual, now)
            self._pump(model)
        if grant is not None and self.limiter is not None and actual is not None:
            self.limiter.settle(grant, actual, now)

    def _give_back(self, grant: Grant | None, now: float) -> None:
        """A request refused or gone before it ran: its rate tokens are returned (its request
        still counts: a refused request was a request)."""
        if grant is not None and self.limiter is not None:
            self.limiter.settle(grant, 0, now)

    # ---------------------------------------------------------------- what is seen of it

    def queued(self) -> dict[str, dict[tuple[int, str], int]]:
        """Waiting requests by model, then by (urgency, tenant)."""
        return {model: admission.queued() for model, admission in self._models.items()}

    def held(self) -> dict[str, int]:
        """Admitted sequences still running, by model."""
        return {model: admission.held_slots for model, admission in self._models.items()}

    def _tell_backlog(self, waiting: bool) -> None:
        if self._on_backlog is not None:
            self._on_backlog(waiting)

    def _tell_admitted(self, model: str, who: Who, waited: float) -> None:
        if self._observer is not None:
            self._observer.admitted(model, who, waited)

    def _tell_queued(self, model: str) -> None:
        if self._observer is not None:
            self._observer.queued(model)

    def _tell_cancelled(self, model: str, who: Who) -> None:
        if self._observer is not None:
            self._observer.cancelled(model, who)

    def _tell_refused(self, model: str, who: Who, refused: Refused) -> None:
        if self._observer is not None:
            self._observer.refused(model, who, refused)


class _WorkerView(Protocol):
    """What the gate reads of the worker set (``WorkerSet``, or a test's stand-in)."""

    def eligible_of(self, role: str, model: str) -> list[Worker]: ...

    def workers(self) -> list[Worker]: ...

    def models(self) -> Mapping[str, object]: ...


class WakeOnWorkerEvents:
    """A worker-set listener: any worker event (joined, changed, left) may free room, so the
    waiting requests look again."""

    def __init__(self, gate: Gate) -> None:
        self._gate = gate

    def joined(self, worker: Worker) -> None:
        self._gate.poke()

    def changed(self, worker: Worker) -> None:
        self._gate.poke()

    def left(self, worker: Worker) -> None:
        self._gate.poke()

    def loaded(self, worker: Worker) -> None:
        """A load report (``WorkerEvents.subscribe_load``): the waiting requests look again, for
        the room it may have freed (the engine's queue emptied, the other frontends' requests
        ended), rather than at the ticker's next look."""
        self._gate.look_again()


class AdmissionObserver:
    """Told of every decision (metrics): no-ops here, overridden by ``admission/metrics.py``."""

    def admitted(self, model: str, who: Who, waited: float) -> None:
        pass

    def queued(self, model: str) -> None:
        pass

    def cancelled(self, model: str, who: Who) -> None:
        pass

    def refused(self, model: str, who: Who, refused: Refused) -> None:
        pass

    def forget_model(self, model: str) -> None:
        pass

    def preempted(self, model: str, who: Who) -> None:
        pass


def refusal_headers(refused: Refused) -> tuple[tuple[str, str], ...]:
    """``Retry-After`` (whole seconds) and the reason, as every refusal carries them."""
    return (
        ("Retry-After", str(max(1, math.ceil(refused.retry_after)))),
        ("x-sidecar-refused-reason", refused.reason.value.lower()),
    )
