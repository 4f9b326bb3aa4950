"""One model's admission queue: priority bands, fair share by tokens between tenants (pure: no
I/O, no clock; a ticket carries its own times, given by the caller).

A :class:`Ticket` is one request waiting for room: its tenant, its urgency (larger is more
urgent; each format's priority converted by the caller), its cost in tokens (prompt plus the
``max_tokens`` estimate), the sequences it runs, and its deadline.

**Bands.** Each urgency value is a band, and bands are served in strict order, the larger
urgency first (but see the lower band share below). Each band holds at most ``max_depth``
tickets: :meth:`AdmissionQueue.push` refuses one more.

**Fair share within a band**, by tokens, between tenants, with start-time fair queueing. Each
band has a virtual time ``V`` (in tokens). A tenant's waiting tickets are kept in arrival order
(FIFO within a tenant); the first of them gets its start tag when it becomes first::

    start  = max(V, the tenant's last finish tag)
    finish = start + cost      (the tenant's last finish tag from then on)

and the band serves the smallest start tag (ties: the earlier push). Popping a ticket advances
``V`` to its start tag. While two tenants are both waiting, the tokens popped for each differ by
at most one ticket's cost, whatever the number of tickets each has waiting. A tenant that comes
back after idling starts at the current ``V``: its old usage never starves it, and its idle time
earns it no burst either. A ticket that leaves unserved (removed, expired) gives its cost back
to its tenant. Tagging a tenant's first ticket only (rather than every ticket when pushed) is
the same schedule, and lets a ticket leave from anywhere in the queue without leaving its cost
behind.

:meth:`AdmissionQueue.charge` settles a served ticket on its real usage: its tenant's last
finish tag moves by ``actual - cost`` (never below ``V``), so the tenant's later tickets pay what
it really used. A tenant that has nothing waiting and no finish tag ahead of ``V`` is forgotten
(its state is the same as a new tenant's); charged then, it is charged from ``V``.

**Lower band share** ``s`` (0 <= s < 1). With ``s = 0`` the bands are strict. With ``s > 0``,
while at least two bands wait, each pop is counted into a credit of the lower bands, ``D``
(tokens): serving the highest waiting band adds ``-s * cost``, serving any lower band adds
``(1 - s) * cost``. When ``D < 0`` (the lower bands' share of the tokens served while both waited
is below ``s``) the highest *lower* waiting band is served instead of the highest. So while both
wait, ``(1 - s) * lower - s * higher`` tokens stays within one ticket's cost of 0: the lower
bands get a fraction ``s`` of the tokens, give or take one ticket. ``D`` is clamped to
``[-s * cost, (1 - s) * cost]`` of the ticket just served (a bound the rule itself never
reaches): a ticket served out of turn (:meth:`AdmissionQueue.take`) shifts the balance by one
ticket at most, and the memory of the past is one ticket long. No clock and no decay: ``D`` is
bounded by construction. Pops while only one band waits do not count. ``D`` is one counter,
whichever band is the highest waiting one at the time (with three bands waiting, the middle one
is the "lower" band served; the lowest waits until it is the highest lower band).

**Out of turn.** :meth:`AdmissionQueue.heads` lists each (band, tenant)'s first ticket and
:meth:`AdmissionQueue.take` serves one of them before its turn (the admission state does that
for a ticket that may use the reserved headroom): it keeps its tag (its tenant pays for it) and
does not move ``V``.

**Preempted tickets.** :meth:`AdmissionQueue.requeue` puts an admitted ticket back (the admission
state preempted it to make room for a more urgent one; its client is mid-response). It waits
ahead of every queued ticket of its band, preempted ones in the order they came back, outside
fair queueing: its tenant already paid for it when it was first served, so it keeps no tag, moves
no virtual time and is charged nothing more (its eventual :meth:`AdmissionQueue.charge` settles
it once); served again, it counts in the lower band share as any ticket served. It has no
deadline, and the band's depth does not refuse it (it counts in the depth the band reports,
which new arrivals are refused on).

Removal is lazy where it has to be: a removed ticket is marked and skipped later, so
:meth:`AdmissionQueue.remove` and :meth:`AdmissionQueue.expired` cost O(log n) a ticket.
"""

from __future__ import annotations

import enum
import heapq
import math
from bisect import insort
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["AdmissionQueue", "Ticket", "TicketState"]


class TicketState(enum.Enum):
    NEW = "new"  # not pushed yet
    QUEUED = "queued"
    ADMITTED = "admitted"  # popped or taken: it holds its slots
    CANCELLED = "cancelled"  # removed while queued
    EXPIRED = "expired"  # its deadline passed while queued
    RELEASED = "released"  # admitted, then finished (set by the admission state)


# Tickets that were served (their cost counts for their tenant).
_SERVED = frozenset({TicketState.ADMITTED, TicketState.RELEASED})


@dataclass(eq=False)
class Ticket:
    tenant: str
    # Larger is more urgent.
    urgency: int
    # Tokens: prompt plus the max_tokens estimate (at least 1).
    cost: int
    # Sequences it will run (at least 1).
    slots: int
    # When it (last) started waiting: its arrival, or its preemption.
    enqueued_at: float
    # enqueued_at plus the longest it may wait (infinite once preempted).
    deadline: float
    # Whether its request may be preempted while admitted (the gate sets it: a request that
    # cannot resume where it stopped is never preempted).
    preemptible: bool = True
    state: TicketState = field(default=TicketState.NEW, init=False)
    # Queued again after a preemption (AdmissionQueue.requeue), until served again.
    _resuming: bool = field(default=False, init=False, repr=False)
    # Its fair-queueing start tag, given when it becomes its tenant's first waiting ticket.
    _start: int = field(default=-1, init=False, repr=False)
    # Push order: ties between equal tags go to the earlier push.
    _seq: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.cost < 1:
            raise ValueError(f"a ticket costs at least 1 token, got {self.cost}")
        if self.slots < 1:
            raise ValueError(f"a ticket runs at least 1 sequence, got {self.slots}")

    @property
    def admitted(self) -> bool:
        """It holds its slots now: admitted and not released yet."""
        return self.state is TicketState.ADMITTED

    @property
    def resuming(self) -> bool:
        """It waits again after a preemption (queued ahead of its band, no deadline)."""
        return self._resuming and self.state is TicketState.QUEUED


def _in_lane(ticket: Ticket) -> bool:
    """Queued in its tenant's lane (fair queueing, its deadline): not a preempted ticket, whose
    entries from its first wait are stale."""
    return ticket.state is TicketState.QUEUED and not ticket._resuming


@dataclass(eq=False)
class _Lane:
    """One tenant's tickets in one band. Its front ticket, when any, is queued: tickets removed
    from behind it stay in the deque, marked, until they reach the front."""

    waiting: deque[Ticket] = field(default_factory=deque)
    queued: int = 0
    last_finish: int = 0


@dataclass(eq=False)
class _Band:
    urgency: int
    virtual_time: int = 0
    lanes: dict[str, _Lane] = field(default_factory=dict)
    # (start tag, push order, ticket) of each lane's front ticket; entries of tickets that left
    # stay until they reach the top or the heap is compacted.
    heads: list[tuple[int, int, Ticket]] = field(default_factory=list)
    # Preempted tickets waiting again, served before the lanes, in the order they came back.
    resumed: deque[Ticket] = field(default_factory=deque)
    # Queued tickets, in the lanes and resumed.
    queued: int = 0
    # Lanes left by the last sweep: the next sweep waits until there are twice as many.
    lanes_kept: int = 0


class AdmissionQueue:
    """The waiting tickets of one model (the module docstring has the rules)."""

    def __init__(self, max_depth: int, lower_band_share: float = 0.0) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth is at least 1, got {max_depth}")
        if not 0.0 <= lower_band_share < 1.0:
            raise ValueError(f"lower_band_share is from 0 to below 1, got {lower_band_share}")
        self.max_depth = max_depth
        self.lower_band_share = lower_band_share
        self._bands: dict[int, _Band] = {}
        self._bands_kept = 0
        # Urgencies of the bands with queued tickets, ascending.
        self._backlogged: list[int] = []
        self._deadlines: list[tuple[float, int, Ticket]] = []
        self._length = 0
        self._pushes = 0
        self._lower_credit = 0.0

    # ------------------------------------------------------------------ the spec's operations

    def push(self, ticket: Ticket) -> bool:
        """Queue a new ticket; False (and the ticket stays new) when its band already holds
        ``max_depth`` tickets."""
        if ticket.state is not TicketState.NEW:
            raise ValueError(f"only a new ticket is pushed, this one is {ticket.state.value}")
        band = self._bands.get(ticket.urgency)
        if band is not None and band.queued >= self.max_depth:
            return False
        if band is None:
            band = self._new_band(ticket.urgency)
        lane = band.lanes.get(ticket.tenant)
        if lane is None:
            lane = self._new_lane(band, ticket.tenant)
        self._pushes += 1
        ticket._seq = self._pushes
        ticket.state = TicketState.QUEUED
        lane.waiting.append(ticket)
        lane.queued += 1
        if lane.queued == 1:
            self._tag_front(band, lane)
        band.queued += 1
        if band.queued == 1:
            insort(self._backlogged, band.urgency)
        self._length += 1
        heapq.heappush(self._deadlines, (ticket.deadline, ticket._seq, ticket))
        return True

    def push_out_for(self, ticket: Ticket) -> Ticket | None:
        """For a new ticket its band has no room for: the queued ticket to refuse in its stead,
        or None (the new ticket is refused). The band's space is shared like its service: when
        the tenant queueing the most there holds more than the newcomer's tenant would with it,
        that tenant's newest queued ticket makes room (longest queue drops), so a flood that
        fills a band cannot keep a quiet tenant out of it."""
        band = self._bands.get(ticket.urgency)
        if band is None or not band.lanes:
            return None
        own = band.lanes.get(ticket.tenant)
        own_queued = own.queued if own is not None else 0
        longest = max(band.lanes.values(), key=lambda lane: lane.queued)
        if longest.queued <= own_queued + 1:
            return None
        for candidate in reversed(longest.waiting):
            if _in_lane(candidate):
                return candidate
        return None

    def peek(self) -> Ticket | None:
        """The ticket :meth:`pop` would return, left in place."""
        band = self._chosen_band()
        return None if band is None else self._band_front(band)

    def pop(self) -> Ticket | None:
        """Serve the next ticket (now admitted): the highest band's smallest start tag, or the
        highest lower band's when the lower bands are owed their share."""
        band = self._chosen_band()
        if band is None:
            return None
        ticket = self._band_front(band)
        if not ticket._resuming:
            heapq.heappop(band.heads)
        self._serve(band, ticket, in_turn=True)
        return ticket

    def remove(self, ticket: Ticket) -> bool:
        """A queued ticket leaves unserved (cancelled); False when it is not queued."""
        if ticket.state is not TicketState.QUEUED:
            return False
        ticket.state = TicketState.CANCELLED
        if ticket._resuming:
            self._resumed_leaves(self._bands[ticket.urgency], ticket)
        else:
            self._drop(ticket)
        return True

    def requeue(self, ticket: Ticket, now: float) -> None:
        """An admitted ticket waits again, preempted (module docstring): ahead of every queued
        ticket of its band, with no deadline, never refused."""
        if ticket.state is not TicketState.ADMITTED:
            raise ValueError(f"only an admitted ticket is requeued, this one is {ticket.state.value}")
        band = self._bands.get(ticket.urgency)
        if band is None:
            band = self._new_band(ticket.urgency)
        ticket.state = TicketState.QUEUED
        ticket._resuming = True
        ticket.enqueued_at = now
        ticket.deadline = math.inf
        band.resumed.append(ticket)
        band.queued += 1
        if band.queued == 1:
            insort(self._backlogged, band.urgency)
        self._length += 1

    def expired(self, now: float) -> list[Ticket]:
        """Remove and return every queued ticket whose deadline is at or before ``now``,
        earliest deadline first."""
        gone: list[Ticket] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            ticket = heapq.heappop(self._deadlines)[2]
            if _in_lane(ticket):
                ticket.state = TicketState.EXPIRED
                self._drop(ticket)
                gone.append(ticket)
        return gone

    def postpone(self, since: float, until: float) -> None:
        """Each queued ticket's deadline later by the part of ``[since, until)`` it spent
        queued (a wait that does not count: its model's fleet was held by a pause)."""
        live = [entry[2] for entry in self._deadlines if _in_lane(entry[2])]
        for ticket in live:
            ticket.deadline += max(0.0, until - max(since, ticket.enqueued_at))
        self._deadlines = [(t.deadline, t._seq, t) for t in live]
        heapq.heapify(self._deadlines)

    def next_deadline(self) -> float | None:
        """The earliest deadline of a queued ticket."""
        while self._deadlines and not _in_lane(self._deadlines[0][2]):
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def charge(self, ticket: Ticket, actual_cost: int) -> None:
        """Settle a served ticket on the tokens it really used: its tenant's later tickets in its
        band start ``actual_cost - cost`` later (earlier when negative, never before the band's
        virtual time). A ticket that was never served is not charged."""
        if ticket.state not in _SERVED:
            return
        band = self._bands.get(ticket.urgency)
        if band is None:  # the band was forgotten (nothing of it waited): so is the usage
            return
        delta = actual_cost - ticket.cost
        lane = band.lanes.get(ticket.tenant)
        if lane is None:
            if delta <= 0:
                return
            lane = self._new_lane(band, ticket.tenant)
        lane.last_finish = max(band.virtual_time, lane.last_finish + delta)

    def __len__(self) -> int:
        return self._length

    def depth(self) -> dict[tuple[int, str], int]:
        """Queued tickets by (urgency, tenant), preempted ones included."""
        found = {
            (band.urgency, tenant): lane.queued
            for band in self._bands.values()
            for tenant, lane in band.lanes.items()
            if lane.queued
        }
        for band in self._bands.values():
            for ticket in band.resumed:
                key = (band.urgency, ticket.tenant)
                found[key] = found.get(key, 0) + 1
        return found

    # ------------------------------------------------------------------ for the admission state

    def band_depth(self, urgency: int) -> int:
        """Queued tickets of the band ``urgency``."""
        band = self._bands.get(urgency)
        return 0 if band is None else band.queued

    def queued_at_or_above(self, urgency: int) -> int:
        """Queued tickets of the band ``urgency`` and every more urgent band."""
        return sum(self._bands[u].queued for u in self._backlogged if u >= urgency)

    def lowest_urgency(self) -> int | None:
        """The least urgent band with a queued ticket."""
        return self._backlogged[0] if self._backlogged else None

    def heads(self) -> list[Ticket]:
        """Each band's preempted tickets and each (band, tenant)'s first queued ticket: the more
        urgent band first, then preempted ones, then by start tag (the order the band serves
        them in)."""
        found: list[Ticket] = []
        for urgency in reversed(self._backlogged):
            band = self._bands[urgency]
            found.extend(band.resumed)
            fronts = [lane.waiting[0] for lane in band.lanes.values() if lane.queued]
            fronts.sort(key=lambda ticket: (ticket._start, ticket._seq))
            found.extend(fronts)
        return found

    def lane_from(self, ticket: Ticket) -> Iterator[Ticket]:
        """``ticket`` (one of :meth:`heads`), then the queued tickets behind it in its tenant's
        lane of its band, in the order they came (a preempted ticket has no lane: itself only).
        Lazy: a caller that stops early pays for what it read."""
        yield ticket
        if ticket._resuming or ticket.state is not TicketState.QUEUED:
            return
        lane = self._bands[ticket.urgency].lanes[ticket.tenant]
        behind = iter(lane.waiting)
        for queued in behind:
            if queued is ticket:
                break
        else:
            return
        for queued in behind:
            if queued.state is TicketState.QUEUED:
                yield queued

    def take(self, ticket: Ticket) -> bool:
        """Serve one of :meth:`heads` now, in or out of its turn; False when ``ticket`` is not
        its tenant's first queued ticket of its band (FIFO within a tenant holds)."""
        if ticket.state is not TicketState.QUEUED:
            return False
        band = self._bands[ticket.urgency]
        if ticket._resuming:
            self._serve(band, ticket, in_turn=self._band_front(band) is ticket)
            return True
        lane = band.lanes[ticket.tenant]
        if lane.waiting[0] is not ticket:
            return False
        in_turn = self._band_front(band) is ticket
        if in_turn:
            heapq.heappop(band.heads)
        self._serve(band, ticket, in_turn=in_turn)
        return True

    # ------------------------------------------------------------------ inside

    def _chosen_band(self) -> _Band | None:
        if not self._backlogged:
            return None
        if self.lower_band_share > 0.0 and len(self._backlogged) >= 2 and self._lower_credit < 0.0:
            return self._bands[self._backlogged[-2]]
        return self._bands[self._backlogged[-1]]

    def _band_front(self, band: _Band) -> Ticket:
        """The band's first preempted ticket, else its smallest start tag (the band has a
        queued ticket)."""
        if band.resumed:
            return band.resumed[0]
        while not _in_lane(band.heads[0][2]):
            heapq.heappop(band.heads)
        return band.heads[0][2]

    def _serve(self, band: _Band, ticket: Ticket, *, in_turn: bool) -> None:
        self._count_share(band.urgency, ticket.cost)
        if ticket._resuming:
            # Served before, so its tenant paid: no tag, no virtual time.
            ticket.state = TicketState.ADMITTED
            self._resumed_leaves(band, ticket)
            return
        if in_turn:
            band.virtual_time = max(band.virtual_time, ticket._start)
        ticket.state = TicketState.ADMITTED
        self._front_leaves(band, band.lanes[ticket.tenant])

    def _count_share(self, urgency: int, cost: int) -> None:
        """The lower bands' credit, for a ticket of band ``urgency`` served (module docstring)."""
        share = self.lower_band_share
        if share == 0.0 or len(self._backlogged) < 2:
            return
        if urgency == self._backlogged[-1]:
            self._lower_credit = max(self._lower_credit - share * cost, -share * cost)
        else:
            self._lower_credit = min(self._lower_credit + (1.0 - share) * cost, (1.0 - share) * cost)

    def _drop(self, ticket: Ticket) -> None:
        """A queued ticket leaves unserved (its state already set): its cost is not counted."""
        band = self._bands[ticket.urgency]
        lane = band.lanes[ticket.tenant]
        if lane.waiting[0] is ticket:
            lane.last_finish -= ticket.cost
            self._front_leaves(band, lane)
            return
        # Behind the front: stays in the deque, marked, until it reaches the front.
        lane.queued -= 1
        band.queued -= 1
        self._length -= 1
        self._compact(band)

    def _resumed_leaves(self, band: _Band, ticket: Ticket) -> None:
        """A preempted ticket leaves the queue (its state already set)."""
        ticket._resuming = False
        band.resumed.remove(ticket)
        band.queued -= 1
        self._length -= 1
        if band.queued == 0:
            self._backlogged.remove(band.urgency)

    def _front_leaves(self, band: _Band, lane: _Lane) -> None:
        lane.waiting.popleft()
        lane.queued -= 1
        band.queued -= 1
        self._length -= 1
        if band.queued == 0:
            self._backlogged.remove(band.urgency)
        while lane.waiting and lane.waiting[0].state is not TicketState.QUEUED:
            lane.waiting.popleft()
        if lane.waiting:
            self._tag_front(band, lane)
        self._compact(band)

    def _tag_front(self, band: _Band, lane: _Lane) -> None:
        front = lane.waiting[0]
        front._start = max(band.virtual_time, lane.last_finish)
        lane.last_finish = front._start + front.cost
        heapq.heappush(band.heads, (front._start, front._seq, front))

    def _compact(self, band: _Band) -> None:
        """Drop the entries of tickets that left once they outnumber the queued ones (each
        compaction follows as many leaves as it costs)."""
        if len(band.heads) > 2 * band.queued + 16:
            band.heads = [entry for entry in band.heads if _in_lane(entry[2])]
            heapq.heapify(band.heads)
        if len(self._deadlines) > 2 * self._length + 64:
            self._deadlines = [entry for entry in self._deadlines if _in_lane(entry[2])]
            heapq.heapify(self._deadlines)

    def _new_band(self, urgency: int) -> _Band:
        if len(self._bands) >= 2 * self._bands_kept + 8:
            # Bands with nothing queued are forgotten (their tenants' tags with them: each is at
            # most one ticket ahead of its band's virtual time, bar a charge).
            self._bands = {u: band for u, band in self._bands.items() if band.queued}
            self._bands_kept = len(self._bands)
        band = self._bands[urgency] = _Band(urgency)
        return band

    def _new_lane(self, band: _Band, tenant: str) -> _Lane:
        if len(band.lanes) >= 2 * band.lanes_kept + 16:
            # A lane with nothing queued and no finish tag ahead of V is a new tenant's.
            band.lanes = {
                name: lane
                for name, lane in band.lanes.items()
                if lane.queued or lane.last_finish > band.virtual_time
            }
            band.lanes_kept = len(band.lanes)
        lane = band.lanes[tenant] = _Lane(last_finish=band.virtual_time)
        return lane
