"""One model's admission: which request runs now, which waits, which is refused (pure: no I/O,
no clock, no logging; the time is passed in as ``now`` and the fleet's room as a
:class:`~sidecar_frontend.admission.capacity.Room`).

A request arrives (:meth:`ModelAdmission.arrive`) with its tenant, urgency, cost in tokens and
sequences. It is refused at once when no worker can take anything (``NO_CAPACITY``: the room has
no slot, or fewer than the request's sequences) or when its band of the queue is full
(``QUEUE_FULL``). Otherwise it gets a :class:`~sidecar_frontend.admission.queue.Ticket`, pushed
into the model's :class:`~sidecar_frontend.admission.queue.AdmissionQueue`, and is admitted at
once (``ticket.admitted``) when the rule below picks it first; else it waits, and
:meth:`ModelAdmission.pump` admits the waiting tickets when room appears (the caller pumps after
every release and whenever the fleet's room may have grown). A ticket that waited until its
deadline leaves with ``QUEUE_TIMEOUT`` (:meth:`ModelAdmission.expire`); one whose client left
leaves at once (:meth:`ModelAdmission.cancel`). An admitted ticket holds its sequences until
:meth:`ModelAdmission.release`, which also settles fair share on the tokens it really used.

**The admission rule.** With the room passed in::

    free    = total_slots - foreign_slots - held slots (this model's admitted, unreleased)
    reserve = ceil(headroom * total_slots) + the slots held by tenants under their fair share,
              at most total_slots - 1 (0 when headroom is 0, and 0 while only one tenant is
              around: see below)

a ticket may be admitted when ``free >= slots`` and at least one of:

* ``free - slots >= reserve``: it leaves the reserve untouched;
* its tenant holds fewer slots than its fair share, ``total_slots / (n + 1)`` where ``n``
  counts the tenants holding or queueing a ticket (its own included), and the one more is
  whoever comes next: a lone tenant's flood fills the fleet up to the reserve and no further,
  so the next tenant to arrive finds room at once.

The reserve grows with what the tenants under their fair share hold: a tenant over its share
leaves ``ceil(headroom * total_slots)`` slots free *beyond* theirs, so a quiet tenant running
three requests still finds the headroom free for its fourth (with a fixed reserve, its fourth
waited for one of the flood's requests to end: bench.overload's quiet tenant, 2.6 requests
running on average, had a p99 time to first token of 105 ms against 57 ms idle).

The reserve is kept only while more than one tenant is around (sent a request in the last
:data:`RESERVE_TENANTS_WINDOW` seconds, or holds or waits for a slot): a lone tenant, such as
one trainer driving its own fleet, uses all of it. The first request of a second tenant then
waits for the first slot that frees (it goes before the lone tenant's waiting ones: it is under
its share), and from then on the reserve is kept.

That second rule is what *qualifies for the reserve*: the reserve is fairness's, not
priority's. A more urgent request of a tenant over its share goes first for every slot that
frees (its band is served first) and, with preemption on, takes a less urgent request's slot;
if urgency alone opened the reserve, a flood whose own requests carry a high priority would
fill it, and the next tenant would wait behind them (bench.overload's priority scenario: the
quiet tenant's p99 time to first token 1.7 s at 8 times the capacity). The next
ticket admitted is the queue's next one (:meth:`AdmissionQueue.peek`: bands, then fair share by
tokens) when it may be admitted; when it may not, the first of the (band, tenant) heads
(:meth:`AdmissionQueue.heads`) that fits in ``free`` and qualifies for the reserve. That search
is bounded by the number of (band, tenant) heads, not by the queue's length. So a tenant under
its fair share passes the queued tickets of tenants over theirs, into the reserve: under a flood
of one tenant the fleet fills to the reserve, and a quiet tenant's request is admitted at once
instead of waiting for the flood's requests to end. A new ticket is admitted at once only when
that same choice picks it: when no queued ticket would go before it, or when it qualifies for
the reserve and no head before it does. A request is never admitted into more than ``free``.

**Preemption** (off unless the caller asks: ``--preempt-after-secs``). :meth:`ModelAdmission.victim`
names an admitted ticket to pause for a waiting one. The waiting tickets are the queue's heads,
the most urgent first (:meth:`AdmissionQueue.heads`), each followed by the tickets behind it in
its tenant's lane (:meth:`AdmissionQueue.lane_from`: a second urgent request of one tenant is
not left to the ticker while the first one's victim stops); the room they will have counts the
slots preempted tickets gave back for each (its own), the slots of the preemptions in flight
(named, not yet requeued or released) and the free slots (outside the reserve for a ticket that
does not qualify for it), and a ticket that fits in it is taken to use it. The first ticket
that does not fit and has waited at least ``after`` seconds gets a victim: an admitted ticket
that is ``preemptible``, strictly less urgent, and not being preempted already; the least
urgent, then one of the tenant holding the most slots, then the most recently admitted (the
least work lost). The tenant comes before the work lost: the most recently admitted request is
often a tenant under its fair share just let into the reserve, before its first token
(bench.overload's quiet tenant, preempted so, had a time to first token of 103-120 ms against 60
ms idle at 4 and 8 times the capacity). So a waiting ticket has at most as many preemptions in
flight as it needs slots (one, for a request of one sequence), and none once the room coming
covers it. The caller
pauses the victim's request, then :meth:`ModelAdmission.requeue` gives back its slots and
queues it again (:meth:`AdmissionQueue.requeue`: ahead of its band, no deadline, never refused).
A preempted ticket goes first in its band but opens no reserve (the reserve is fairness's; a
preempted flood request must not take the next tenant's room). While a ticket that preempted
ones were requeued for still waits (it needs more slots than are free yet), nothing less urgent
than it is admitted, in turn (a lower band's share) or out of turn: the room freed for it is
kept for it (else a less urgent ticket would take it, to be preempted in turn). It takes that
room even when it does not qualify for the reserve and fewer slots than the reserve are free:
a victim's slot is the waiting request's whole, and the free slots stay as they were. So a
request of a tenant over its share needs one victim, not one more for each slot the reserve
lacks (bench.overload's flood, whose quiet neighbour's running requests grow the reserve:
2-6 victims for a third of its urgent requests before).

**Retry-After** of a refusal: the tickets queued in its band and above, divided by the recent
rate of releases of this model (releases per second, exponentially decayed over
:data:`RELEASE_RATE_WINDOW` seconds of the ``now`` values given), rounded up and clamped to
[1, 60] seconds; 1 second while no release has been seen, and for ``NO_CAPACITY`` (the workers
come back or they do not: waiting longer tells nothing).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final, TypeVar

from sidecar_common.reasons import RefusalReason
from sidecar_frontend.admission.capacity import Room
from sidecar_frontend.admission.queue import AdmissionQueue, Ticket, TicketState

__all__ = [
    "MAX_RETRY_AFTER",
    "RELEASE_RATE_WINDOW",
    "AdmissionSettings",
    "ModelAdmission",
    "Preemption",
    "Refused",
    "Ticket",
]

_Key = TypeVar("_Key", str, int)

# Seconds: the time constant of the decayed release rate behind Retry-After.
RELEASE_RATE_WINDOW: Final = 10.0
# The reserve is kept while more than one tenant sent a request within this many seconds (or
# holds or waits for a slot): a lone tenant uses the whole fleet.
RESERVE_TENANTS_WINDOW: Final = 60.0
# The longest Retry-After given (seconds).
MAX_RETRY_AFTER: Final = 60


@dataclass(frozen=True)
class Refused:
    reason: RefusalReason
    # Whole seconds, at least 1: the client's Retry-After.
    retry_after: int
    # Human words naming the measured values.
    detail: str


@dataclass(frozen=True)
class Preemption:
    """Why an admitted request is paused: its urgency, and the waiting request's it makes room
    for, which has waited ``waited`` seconds."""

    urgency: int
    waiting_urgency: int
    waited: float


@dataclass(frozen=True)
class AdmissionSettings:
    # Waiting tickets per band.
    max_queue_depth: int = 1024
    # Seconds a request may wait (TTL).
    max_queue_wait: float = 60.0
    # The fraction of the total slots kept for tenants under their fair share and for urgent
    # requests.
    headroom: float = 0.1
    # The least fraction of the tokens served that lower bands get while they wait (queue.py).
    lower_band_share: float = 0.0

    def __post_init__(self) -> None:
        if self.max_queue_depth < 1:
            raise ValueError(f"max_queue_depth is at least 1, got {self.max_queue_depth}")
        if not self.max_queue_wait >= 0.0:
            raise ValueError(f"max_queue_wait is at least 0, got {self.max_queue_wait}")
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(f"headroom is from 0 to below 1, got {self.headroom}")
        if not 0.0 <= self.lower_band_share < 1.0:
            raise ValueError(f"lower_band_share is from 0 to below 1, got {self.lower_band_share}")


class ModelAdmission:
    """The admission of one model's requests (the module docstring has the rules)."""

    def __init__(self, settings: AdmissionSettings) -> None:
        self.settings = settings
        self._queue = AdmissionQueue(settings.max_queue_depth, settings.lower_band_share)
        self._held_slots = 0
        self._held_by_tenant: dict[str, int] = {}
        # Tickets queued or held, by tenant and by urgency (fair share's n, the lowest urgency).
        self._tickets_by_tenant: dict[str, int] = {}
        self._tickets_by_urgency: dict[int, int] = {}
        self._releases = _DecayedRate(RELEASE_RATE_WINDOW)
        # The admitted tickets, in the order they were admitted (the last is the most recent).
        self._holding: dict[Ticket, None] = {}
        # Preemptions in flight: each victim named and not yet requeued or released, with the
        # waiting ticket it was named for.
        self._preempting: dict[Ticket, Ticket] = {}
        # Preempted tickets waiting again, with the ticket they were preempted for.
        self._requeued_for: dict[Ticket, Ticket] = {}
        # Each tenant's last arrival, oldest first (the reserve is kept while two are recent).
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._reserve_kept = False
        # Queued tickets refused to make room in a full band (pushed_out), not yet told.
        self._pushed_out: list[tuple[Ticket, Refused]] = []

    def arrive(
        self, tenant: str, urgency: int, cost: int, slots: int, now: float, room: Room
    ) -> Ticket | Refused:
        """A new request: its ticket, admitted (``ticket.admitted``) or queued; or its refusal."""
        if room.total_slots < max(1, slots):
            return Refused(RefusalReason.NO_CAPACITY, 1, _no_capacity_words(room, slots))
        self._seen[tenant] = now
        self._seen.move_to_end(tenant)
        self._look_around(now)
        ticket = Ticket(tenant, urgency, cost, slots, now, now + self.settings.max_queue_wait)
        if not self._queue.push(ticket) and not self._push_out_for(ticket, now):
            depth = self._queue.band_depth(urgency)
            return Refused(
                RefusalReason.QUEUE_FULL,
                self._retry_after(self._queue.queued_at_or_above(urgency), now),
                f"the queue of band {urgency} holds {depth} requests (the most --max-queue-depth allows)",
            )
        self._count_in(ticket)
        if self._next_admitted(room) is ticket:
            self._admit(ticket)
        return ticket

    def _push_out_for(self, ticket: Ticket, now: float) -> bool:
        """Make room in a full band for ``ticket`` by refusing the newest ticket of the tenant
        queueing the most there (:meth:`AdmissionQueue.push_out_for`); whether it was queued."""
        victim = self._queue.push_out_for(ticket)
        if victim is None:
            return False
        self._queue.remove(victim)
        self._requeued_for.pop(victim, None)
        self._count_out(victim)
        queued = self._queue.push(ticket)
        assert queued, "a band with a ticket taken out has room for one"
        self._pushed_out.append(
            (
                victim,
                Refused(
                    RefusalReason.QUEUE_PUSHED_OUT,
                    self._retry_after(self._queue.queued_at_or_above(victim.urgency), now),
                    f"the queue of band {victim.urgency} is full (--max-queue-depth) and tenant "
                    f"{victim.tenant!r} held the most of it: its newest request made room for "
                    "another tenant's",
                ),
            )
        )
        return True

    def pushed_out(self) -> list[tuple[Ticket, Refused]]:
        """The queued tickets refused to make room for other tenants' since the last call, each
        with its refusal (the caller answers their requests)."""
        gone, self._pushed_out = self._pushed_out, []
        return gone

    def pump(self, now: float, room: Room) -> list[Ticket]:
        """Admit every queued ticket the rule lets in now, in order (the caller wakes them).
        Call :meth:`expire` first: a ticket past its deadline is still admitted here."""
        self._look_around(now)
        admitted: list[Ticket] = []
        while (ticket := self._next_admitted(room)) is not None:
            self._admit(ticket)
            admitted.append(ticket)
        return admitted

    def cancel(self, ticket: Ticket) -> bool:
        """A queued ticket leaves (its client left); False when it is not queued."""
        if not self._queue.remove(ticket):
            return False
        self._requeued_for.pop(ticket, None)
        self._count_out(ticket)
        return True

    def postpone(self, since: float, until: float) -> None:
        """The queued tickets' deadlines later by the part of ``[since, until)`` each spent
        queued (their model's fleet was held)."""
        self._queue.postpone(since, until)

    def expire(self, now: float) -> list[tuple[Ticket, Refused]]:
        """The queued tickets whose deadline is at or before ``now``, out of the queue, each with
        its ``QUEUE_TIMEOUT`` refusal."""
        gone = self._queue.expired(now)
        for ticket in gone:
            self._count_out(ticket)
        refusals: list[tuple[Ticket, Refused]] = []
        for ticket in gone:
            ahead = self._queue.queued_at_or_above(ticket.urgency)
            words = (
                f"waited {now - ticket.enqueued_at:.1f} s in the queue of band {ticket.urgency} without "
                f"room (the most --max-queue-wait-secs allows); {ahead} requests still wait at its "
                f"priority or above, {self._held_slots} admitted sequences are running"
            )
            refusals.append(
                (ticket, Refused(RefusalReason.QUEUE_TIMEOUT, self._retry_after(ahead, now), words))
            )
        return refusals

    def release(self, ticket: Ticket, actual_cost: int | None, now: float) -> None:
        """An admitted ticket finished, having used ``actual_cost`` tokens (None: not known, its
        estimate stands): its slots are free, and fair share is settled on that usage. Nothing
        happens for a ticket that is not admitted (never was, or already released)."""
        if ticket.state is not TicketState.ADMITTED:
            return
        ticket.state = TicketState.RELEASED
        self._give_back_slots(ticket)
        self._count_out(ticket)
        self._releases.record(now)
        if actual_cost is not None:
            self._queue.charge(ticket, actual_cost)

    def victim(self, now: float, room: Room, after: float) -> Ticket | None:
        """The admitted ticket to preempt now for a ticket that waited at least ``after``
        seconds without room, if any (module docstring); it counts as a preemption in flight
        until :meth:`requeue` or :meth:`release`. Call :meth:`pump` first: a ticket the room
        already fits is not waiting for a preemption."""
        self._look_around(now)
        owed = self._owed()
        # Free slots nobody is owed, and the slots of the preemptions in flight.
        free = room.total_slots - room.foreign_slots - self._held_slots - sum(owed.values())
        in_flight = sum(ticket.slots for ticket in self._preempting)
        reserve = self._reserve(room.total_slots)
        for head in self._queue.heads():
            # The head, then those behind it in its tenant's lane: a second urgent request of
            # one tenant gets its own victim while the first one's is still stopping.
            for waiting in self._queue.lane_from(head):
                # Its own (slots requeued for it), then the preemptions' (named for the more
                # urgent, who come first), then free room: all of it for a ticket that
                # qualifies for the reserve, what lies outside the reserve for the others. A
                # victim's slot is the waiting one's whole, so a request of a tenant over its
                # share needs one victim, not one more for each slot the reserve lacks.
                own = owed.get(waiting, 0)
                open_room = free if self._qualifies(waiting, room.total_slots, None) else free - reserve
                if waiting.slots <= own + in_flight + max(0, open_room):
                    need = max(0, waiting.slots - own)
                    from_flight = min(need, in_flight)
                    in_flight -= from_flight
                    free -= need - from_flight
                    continue
                if now - waiting.enqueued_at < after:
                    break  # the rest of its lane came later still
                chosen = self._least_valuable(below=waiting.urgency)
                if chosen is None:
                    # The heads come most urgent first: no later one has a less urgent ticket.
                    return None
                self._preempting[chosen] = waiting
                return chosen
        return None

    def making_room_for(self, victim: Ticket) -> Ticket | None:
        """The waiting ticket a preemption in flight was named for."""
        return self._preempting.get(victim)

    def requeue(self, ticket: Ticket, now: float) -> None:
        """A preempted ticket's request stopped: its slots are free and it waits again, ahead of
        its band, with no deadline (:meth:`AdmissionQueue.requeue`). Nothing happens for a ticket
        that is not admitted."""
        if ticket.state is not TicketState.ADMITTED:
            return
        waiter = self._preempting.get(ticket)
        if waiter is not None:
            self._requeued_for[ticket] = waiter
        self._give_back_slots(ticket)
        self._queue.requeue(ticket, now)

    def next_deadline(self) -> float | None:
        """The earliest deadline of a queued ticket."""
        return self._queue.next_deadline()

    @property
    def held_slots(self) -> int:
        """Sequences of the admitted, unreleased tickets."""
        return self._held_slots

    def reserve(self, total: int) -> int:
        """The free slots a ticket whose tenant is over its fair share must leave now, of
        ``total`` (module docstring)."""
        return self._reserve(total)

    def queued(self) -> dict[tuple[int, str], int]:
        """Queued tickets by (urgency, tenant)."""
        return self._queue.depth()

    def held_by_tenant(self) -> dict[str, int]:
        """Held sequences by tenant (tenants holding none are left out)."""
        return dict(self._held_by_tenant)

    # ------------------------------------------------------------------ inside

    def _next_admitted(self, room: Room) -> Ticket | None:
        """The ticket the rule admits next, if any (module docstring)."""
        free = room.total_slots - room.foreign_slots - self._held_slots
        head = self._queue.peek()
        if head is None or free < 1:
            return None
        total = room.total_slots
        lowest = min(self._tickets_by_urgency, default=None)
        # The room preemptions freed is kept for whom they were for (module docstring).
        owed = self._owed()
        kept_for = max((waiter.urgency for waiter in owed), default=None)
        reserve = self._reserve(total)
        # Outside the reserve, beyond the slots owed: what a ticket owed slots may add to them.
        beyond = max(0, free - sum(owed.values()) - reserve)
        if (
            head.slots <= free
            and (kept_for is None or head.urgency >= kept_for)
            and (
                free - head.slots >= reserve
                or self._qualifies(head, total, lowest)
                or head.slots <= owed.get(head, 0) + beyond
            )
        ):
            return head
        for candidate in self._queue.heads():
            if kept_for is not None and candidate.urgency < kept_for:
                break  # the heads come most urgent first: the rest are less urgent still
            if candidate.slots > free:
                continue
            owed_to_it = owed.get(candidate, 0)
            if self._qualifies(candidate, total, lowest) or candidate.slots <= owed_to_it + beyond:
                return candidate
        return None

    def _owed(self) -> dict[Ticket, int]:
        """The slots preempted tickets gave back for each ticket still waiting (free now, and
        kept for it: module docstring)."""
        owed: dict[Ticket, int] = {}
        for resumed, waiter in self._requeued_for.items():
            if waiter.state is TicketState.QUEUED:
                owed[waiter] = owed.get(waiter, 0) + resumed.slots
        return owed

    def _qualifies(self, ticket: Ticket, total: int, lowest: int | None) -> bool:
        """Whether ``ticket`` may take the reserve: its tenant is under its fair share (module
        docstring: the reserve is fairness's, not priority's). A preempted ticket coming back goes
        first in its band, but opens no reserve either: it would take the room kept for the next
        tenant, whose protection preemption must not undo."""
        # One more tenant than are here: the reserve is kept for whoever comes next, so a lone
        # flood (whose share of the tenants present would be everything) cannot take it.
        tenants = len(self._tickets_by_tenant) + 1
        del lowest  # urgency orders the queue; it does not open the reserve
        return self._held_by_tenant.get(ticket.tenant, 0) * tenants < total

    def _look_around(self, now: float) -> None:
        """Whether the reserve is kept now: while more than one tenant sent a request in the last
        :data:`RESERVE_TENANTS_WINDOW` seconds or holds or waits for a slot (module docstring)."""
        while self._seen:
            tenant, last = next(iter(self._seen.items()))
            if now - last < RESERVE_TENANTS_WINDOW:
                break
            del self._seen[tenant]
        present = len(self._seen) + sum(1 for tenant in self._tickets_by_tenant if tenant not in self._seen)
        self._reserve_kept = present >= 2

    def _reserve(self, total: int) -> int:
        """The free slots a ticket that does not qualify must leave (module docstring): the
        headroom, beyond what the tenants under their fair share hold."""
        if self.settings.headroom <= 0.0 or total <= 1 or not self._reserve_kept:
            return 0
        # Rounded first: 0.1 * 30 is 3.0000000000000004 in floating point, whose ceiling is 4.
        headroom = math.ceil(round(self.settings.headroom * total, 9))
        tenants = len(self._tickets_by_tenant) + 1
        under_share = sum(held for held in self._held_by_tenant.values() if held * tenants < total)
        return min(headroom + under_share, total - 1)

    def _admit(self, ticket: Ticket) -> None:
        taken = self._queue.take(ticket)
        assert taken, "the ticket admitted is one of the queue's heads"
        self._held_slots += ticket.slots
        self._held_by_tenant[ticket.tenant] = self._held_by_tenant.get(ticket.tenant, 0) + ticket.slots
        self._holding[ticket] = None
        self._requeued_for.pop(ticket, None)

    def _give_back_slots(self, ticket: Ticket) -> None:
        """An admitted ticket stops holding its slots (released, or preempted)."""
        self._held_slots -= ticket.slots
        _subtract(self._held_by_tenant, ticket.tenant, ticket.slots)
        del self._holding[ticket]
        self._preempting.pop(ticket, None)

    def _least_valuable(self, below: int) -> Ticket | None:
        """The preemptible admitted ticket less urgent than ``below`` and not being preempted
        already: the least urgent, then of the tenant holding the most slots, then the most
        recently admitted."""
        chosen: Ticket | None = None
        chosen_key = (0, 0)
        held = self._held_by_tenant
        for ticket in self._holding:  # admission order: a later one of an equal key wins
            if ticket.urgency >= below or not ticket.preemptible or ticket in self._preempting:
                continue
            key = (-ticket.urgency, held.get(ticket.tenant, 0))
            if chosen is None or key >= chosen_key:
                chosen, chosen_key = ticket, key
        return chosen

    def _count_in(self, ticket: Ticket) -> None:
        self._tickets_by_tenant[ticket.tenant] = self._tickets_by_tenant.get(ticket.tenant, 0) + 1
        self._tickets_by_urgency[ticket.urgency] = self._tickets_by_urgency.get(ticket.urgency, 0) + 1

    def _count_out(self, ticket: Ticket) -> None:
        _subtract(self._tickets_by_tenant, ticket.tenant, 1)
        _subtract(self._tickets_by_urgency, ticket.urgency, 1)

    def _retry_after(self, ahead: int, now: float) -> int:
        rate = self._releases.rate(now)
        if rate is None or ahead <= 0:
            return 1
        if rate <= 0.0:
            return MAX_RETRY_AFTER
        return max(1, min(MAX_RETRY_AFTER, math.ceil(ahead / rate)))


class _DecayedRate:
    """Events per second, each event's weight decaying as ``exp(-age / window)``: the decayed
    count over the decay kernel's integral since the first event (so a constant rate reads as
    itself from the start, not ramping up over the window). Times given out of order count as
    the latest one seen."""

    def __init__(self, window: float) -> None:
        self._window = window
        self._first: float | None = None
        self._last = 0.0
        self._weight = 0.0

    def record(self, now: float) -> None:
        if self._first is None:
            self._first = self._last = now
            self._weight = 1.0
            return
        now = max(now, self._last)
        self._weight = self._weight * math.exp(-(now - self._last) / self._window) + 1.0
        self._last = now

    def rate(self, now: float) -> float | None:
        """None until an event and some time after it."""
        if self._first is None:
            return None
        now = max(now, self._last)
        span = now - self._first
        if span <= 0.0:
            return None
        observed = self._window * -math.expm1(-span / self._window)
        return self._weight * math.exp(-(now - self._last) / self._window) / observed


def _subtract(counts: dict[_Key, int], key: _Key, amount: int) -> None:
    left = counts[key] - amount
    if left:
        counts[key] = left
    else:
        del counts[key]


def _no_capacity_words(room: Room, slots: int) -> str:
    if room.total_slots < 1:
        return f"no worker of the model can run a request: {room.workers} workers, 0 running slots"
    return (
        f"the request runs {slots} sequences at once; the {room.workers} workers of the model run "
        f"{room.total_slots} at most"
    )
