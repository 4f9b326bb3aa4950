"""Preemption in one model's admission: which admitted request is paused for a waiting one, and
how a paused request waits again (pure state: ModelAdmission.victim and requeue)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_frontend.admission.capacity import Room
from sidecar_frontend.admission.queue import Ticket, TicketState
from sidecar_frontend.admission.state import AdmissionSettings, ModelAdmission, Refused

AFTER = 1.0


def room(total: int, foreign: int = 0) -> Room:
    return Room(total_slots=total, foreign_slots=foreign, workers=1, stale=0)


def ticket_of(outcome: Ticket | Refused) -> Ticket:
    assert isinstance(outcome, Ticket)
    return outcome


def full_fleet(
    urgencies: list[int], *, preemptible: list[bool] | None = None, slots: int = 1, depth: int = 8
) -> tuple[ModelAdmission, list[Ticket]]:
    """A model whose slots are exactly filled by one admitted ticket per urgency given, in order
    (tenant "t<i>", one slot each)."""
    state = ModelAdmission(AdmissionSettings(max_queue_depth=depth, headroom=0.0))
    fleet = room(len(urgencies) * slots)
    held = []
    for index, urgency in enumerate(urgencies):
        ticket = ticket_of(state.arrive(f"t{index}", urgency, 10, slots, 0.0, fleet))
        assert ticket.admitted
        if preemptible is not None:
            ticket.preemptible = preemptible[index]
        held.append(ticket)
    return state, held


@pytest.mark.parametrize(
    ("held", "preemptible", "waiting", "chosen"),
    [
        # The least urgent; among equals, the most recently admitted (the least work lost).
        ([0, 1, 0], None, 2, 2),
        ([1, 0, 0, 1], None, 2, 2),
        ([0, 1], None, 1, 0),
        # Never one as urgent as the waiting request, or more.
        ([2, 3], None, 2, None),
        ([1], None, 1, None),
        # Never one its request cannot resume (the gate marks it).
        ([0, 0], [True, False], 1, 0),
        ([0, 1], [False, True], 2, 1),
        ([0], [False], 1, None),
    ],
)
def test_the_victim_is_the_least_urgent_preemptible_ticket_most_recently_admitted(
    held: list[int], preemptible: list[bool] | None, waiting: int, chosen: int | None
) -> None:
    state, tickets = full_fleet(held, preemptible=preemptible)
    fleet = room(len(held))
    waiter = ticket_of(state.arrive("w", waiting, 10, 1, 0.0, fleet))
    assert waiter.state is TicketState.QUEUED
    victim = state.victim(AFTER, fleet, AFTER)
    assert victim is (None if chosen is None else tickets[chosen])
    if victim is not None:
        assert state.making_room_for(victim) is waiter


def test_among_equally_urgent_victims_the_tenant_holding_the_most_pays_first() -> None:
    # A flood holding three slots, then a quiet tenant's request just admitted: the flood's
    # most recent request is paused, not the quiet one (its first token not even out yet).
    state = ModelAdmission(AdmissionSettings(max_queue_depth=8, headroom=0.0))
    fleet = room(4)
    flood = [ticket_of(state.arrive("flood", 0, 10, 1, 0.0, fleet)) for _ in range(3)]
    quiet = ticket_of(state.arrive("quiet", 0, 10, 1, 0.0, fleet))
    for ticket in [*flood, quiet]:
        assert ticket.admitted
        ticket.preemptible = True
    waiter = ticket_of(state.arrive("flood", 1, 10, 1, 0.0, fleet))
    assert state.victim(AFTER, fleet, AFTER) is flood[-1]
    # Still the least urgent first, whoever holds the most.
    state2 = ModelAdmission(AdmissionSettings(max_queue_depth=8, headroom=0.0))
    many = [ticket_of(state2.arrive("flood", 0, 10, 1, 0.0, fleet)) for _ in range(3)]
    low = ticket_of(state2.arrive("quiet", -1, 10, 1, 0.0, fleet))
    for ticket in [*many, low]:
        ticket.preemptible = True
    ticket_of(state2.arrive("urgent", 1, 10, 1, 0.0, fleet))
    assert state2.victim(AFTER, fleet, AFTER) is low
    assert waiter.state is TicketState.QUEUED


def test_no_victim_before_the_waiting_request_waited_long_enough() -> None:
    state, _ = full_fleet([0])
    fleet = room(1)
    state.arrive("w", 1, 10, 1, 10.0, fleet)
    assert state.victim(10.0 + AFTER - 0.01, fleet, AFTER) is None
    assert state.victim(10.0 + AFTER, fleet, AFTER) is not None


def test_no_victim_when_preemption_is_off_or_nobody_waits_for_room() -> None:
    state, _ = full_fleet([0, 0])
    fleet = room(2)
    assert state.victim(100.0, fleet, 0.0) is None  # nobody waits
    state.arrive("w", 1, 10, 1, 0.0, fleet)
    assert state.victim(1e9, fleet, math.inf) is None  # off: no wait is long enough
    # A request the room fits is not waiting for a preemption.
    assert state.victim(100.0, room(3), 0.0) is None


def test_one_preemption_in_flight_per_waiting_request_of_one_sequence() -> None:
    state, held = full_fleet([0, 0, 0])
    fleet = room(3)
    first = ticket_of(state.arrive("w1", 1, 10, 1, 0.0, fleet))
    victim = state.victim(5.0, fleet, AFTER)
    assert victim is held[2]
    # The ticker looks again before the victim's request stopped: nothing more for w1.
    assert state.victim(5.1, fleet, AFTER) is None
    assert state.victim(5.2, fleet, AFTER) is None
    # Another waiting request gets its own.
    second = ticket_of(state.arrive("w2", 1, 10, 1, 0.0, fleet))
    assert state.victim(5.3, fleet, AFTER) is held[1]
    assert state.victim(5.4, fleet, AFTER) is None
    assert {state.making_room_for(held[2]), state.making_room_for(held[1])} == {first, second}


def test_a_waiting_request_of_several_sequences_gets_as_many_victims_as_it_needs() -> None:
    state, held = full_fleet([0, 0, 0])
    fleet = room(3)
    ticket_of(state.arrive("w", 1, 10, 2, 0.0, fleet))
    assert state.victim(5.0, fleet, AFTER) is held[2]
    assert state.victim(5.0, fleet, AFTER) is held[1]
    assert state.victim(5.0, fleet, AFTER) is None


def test_a_preempted_request_gives_its_slots_to_the_waiting_one() -> None:
    state, held = full_fleet([0])
    fleet = room(1)
    waiter = ticket_of(state.arrive("w", 1, 10, 1, 0.0, fleet))
    victim = state.victim(5.0, fleet, AFTER)
    assert victim is held[0]
    state.requeue(victim, 5.5)
    assert victim.state is TicketState.QUEUED
    assert victim.resuming
    assert state.held_slots == 0
    assert state.held_by_tenant() == {}
    assert state.queued() == {(0, "t0"): 1, (1, "w"): 1}
    assert state.pump(5.5, fleet) == [waiter]
    assert victim.state is TicketState.QUEUED
    # The waiting request ends: the preempted one is admitted again.
    state.release(waiter, 20, 9.0)
    assert state.pump(9.0, fleet) == [victim]
    assert victim.admitted
    assert not victim.resuming
    assert state.held_slots == 1
    assert state.held_by_tenant() == {"t0": 1}


def test_a_preempted_request_goes_before_the_later_arrivals_of_its_band() -> None:
    # 3 slots, 1 of them the reserve. The preempted request's tenant is over its fair share
    # when its slot comes back; the later arrivals' tenants are under theirs.
    state = ModelAdmission(AdmissionSettings(max_queue_depth=8, headroom=0.3))
    roomy, fleet = room(10), room(3)
    held = [ticket_of(state.arrive(tenant, 0, 10, 1, 0.0, roomy)) for tenant in ("y", "x", "y")]
    assert all(ticket.admitted for ticket in held)
    urgent = ticket_of(state.arrive("w", 1, 10, 1, 0.0, fleet))
    assert state.victim(2.0, fleet, AFTER) is held[2]
    later = [ticket_of(state.arrive(tenant, 0, 10, 1, 2.5, fleet)) for tenant in ("a", "b")]
    state.requeue(held[2], 3.0)
    assert state.pump(3.0, fleet) == [urgent]
    state.release(urgent, 20, 4.0)
    # Its slot comes back, inside the reserve: the reserve is fairness's, for the tenants under
    # their share ("a"), not for the preempted request (its tenant "y" is over its share)...
    assert state.pump(4.0, fleet) == [later[0]]
    # ...and the next slot goes to the preempted ticket, before the band's later arrival.
    state.release(held[0], 10, 5.0)
    assert state.pump(5.0, fleet) == [held[2]]
    assert later[1].state is TicketState.QUEUED


def test_a_preempted_request_never_expires_and_is_never_refused_for_depth() -> None:
    state = ModelAdmission(AdmissionSettings(max_queue_depth=1, max_queue_wait=2.0, headroom=0.0))
    fleet = room(1)
    held = ticket_of(state.arrive("a", 0, 10, 1, 0.0, fleet))
    waiter = ticket_of(state.arrive("w", 1, 10, 1, 0.0, fleet))
    queued = ticket_of(state.arrive("b", 0, 10, 1, 0.0, fleet))  # band 0 is full now
    assert state.victim(1.0, fleet, AFTER) is held
    state.requeue(held, 1.0)  # band 0 holds two now
    assert state.queued() == {(0, "a"): 1, (0, "b"): 1, (1, "w"): 1}
    assert state.next_deadline() == 2.0
    gone = state.expire(1e6)
    assert {ticket for ticket, _ in gone} == {waiter, queued}
    assert held.state is TicketState.QUEUED
    assert state.next_deadline() is None
    assert state.pump(1e6, fleet) == [held]


def test_a_preempted_request_whose_client_left_leaves_the_queue() -> None:
    state, _ = full_fleet([0])
    fleet = room(1)
    waiter = ticket_of(state.arrive("w", 1, 10, 1, 0.0, fleet))
    victim = state.victim(5.0, fleet, AFTER)
    assert victim is not None
    state.requeue(victim, 5.0)
    assert state.cancel(victim)
    assert victim.state is TicketState.CANCELLED
    assert state.queued() == {(1, "w"): 1}
    assert state.pump(5.0, fleet) == [waiter]
    assert state.held_slots == 1


def test_a_victim_that_ended_before_it_stopped_frees_the_waiting_request_for_another() -> None:
    state, held = full_fleet([0, 0])
    fleet = room(2)
    waiter = ticket_of(state.arrive("w", 1, 10, 2, 0.0, fleet))
    first = state.victim(5.0, fleet, AFTER)
    second = state.victim(5.0, fleet, AFTER)
    assert {first, second} == set(held)
    assert first is not None
    assert second is not None
    state.release(first, 10, 5.1)  # it finished on its own meanwhile
    assert state.pump(5.1, fleet) == []
    state.requeue(second, 5.2)
    assert state.pump(5.2, fleet) == [waiter]
    assert state.held_slots == 2


def test_room_freed_for_a_larger_waiting_request_is_kept_for_it() -> None:
    # The waiting request needs both slots; the first victim's slot is free before the second
    # one's: nothing less urgent takes it meanwhile (the victim itself neither, so it is not
    # preempted again and again).
    state = ModelAdmission(AdmissionSettings(max_queue_depth=8, headroom=0.0))
    fleet = room(2)
    held = [ticket_of(state.arrive(tenant, 0, 10, 1, 0.0, fleet)) for tenant in ("a", "b")]
    waiter = ticket_of(state.arrive("w", 2, 10, 2, 0.0, fleet))
    quiet = ticket_of(state.arrive("q", 1, 10, 1, 0.0, fleet))
    victims = [state.victim(5.0, fleet, AFTER), state.victim(5.0, fleet, AFTER)]
    assert victims == [held[1], held[0]]
    state.requeue(held[1], 5.1)
    assert state.pump(5.1, fleet) == []
    assert quiet.state is TicketState.QUEUED
    assert held[1].state is TicketState.QUEUED
    assert state.victim(5.1, fleet, AFTER) is None
    state.requeue(held[0], 5.2)
    assert state.pump(5.2, fleet) == [waiter]
    state.release(waiter, 10, 6.0)
    assert state.pump(6.0, fleet) == [quiet, held[1]]


# ---------------------------------------------------------------------- any sequence

operation = st.one_of(
    st.tuples(
        st.just("arrive"),
        st.sampled_from("abc"),
        st.integers(0, 3),
        st.integers(1, 2),
        st.booleans(),
    ),
    st.tuples(st.just("pump")),
    st.tuples(st.just("victim"), st.sampled_from([0.0, 0.5, 2.0])),
    st.tuples(st.just("stop"), st.integers(0, 100)),
    st.tuples(st.just("release"), st.integers(0, 100)),
    st.tuples(st.just("cancel"), st.integers(0, 100)),
    st.tuples(st.just("tick"), st.floats(0.0, 1.0)),
    st.tuples(st.just("room"), st.integers(1, 6)),
)


@given(st.lists(operation, max_size=80))
def test_any_sequence_of_preemptions_keeps_the_books(operations: list[tuple[object, ...]]) -> None:
    state = ModelAdmission(AdmissionSettings(max_queue_depth=6, max_queue_wait=3.0, headroom=0.25))
    fleet = room(4)
    tickets: list[Ticket] = []
    # Victims named and not yet stopped, with whom they were named for.
    in_flight: dict[Ticket, Ticket] = {}
    # Each preempted ticket, with the tickets there were when it last stopped.
    there_before: dict[Ticket, set[int]] = {}
    now = 0.0
    for op in operations:
        match op:
            case ("arrive", str(tenant), int(urgency), int(slots), bool(preemptible)):
                outcome = state.arrive(tenant, urgency, 10, slots, now, fleet)
                if isinstance(outcome, Ticket):
                    outcome.preemptible = preemptible
                    tickets.append(outcome)
            case ("pump",):
                for admitted in state.pump(now, fleet):
                    for resumed, before in there_before.items():
                        if (
                            resumed.state is TicketState.QUEUED
                            and resumed.urgency == admitted.urgency
                            and resumed.slots <= admitted.slots
                        ):
                            # A later arrival of its band never passes it (one that needs more
                            # room than is free may be passed by a smaller one, as any ticket).
                            assert id(admitted) in before
            case ("victim", float(after)):
                victim = state.victim(now, fleet, after)
                if victim is not None:
                    waiter = state.making_room_for(victim)
                    assert waiter is not None
                    assert waiter.state is TicketState.QUEUED
                    assert victim.admitted
                    assert victim.preemptible
                    assert victim.urgency < waiter.urgency
                    assert now - waiter.enqueued_at >= after
                    assert victim not in in_flight
                    in_flight[victim] = waiter
                    # Never more preemptions in flight for one waiting ticket than its slots.
                    assert sum(1 for w in in_flight.values() if w is waiter) <= waiter.slots
            case ("stop", int(index)):
                if in_flight:
                    victim = list(in_flight)[index % len(in_flight)]
                    del in_flight[victim]
                    state.requeue(victim, now)
                    assert victim.resuming
                    there_before[victim] = {id(ticket) for ticket in tickets}
            case ("release", int(index)):
                holding = [ticket for ticket in tickets if ticket.admitted]
                if holding:
                    chosen = holding[index % len(holding)]
                    state.release(chosen, 12, now)
                    in_flight.pop(chosen, None)
            case ("cancel", int(index)):
                if tickets:
                    chosen = tickets[index % len(tickets)]
                    was_queued = chosen.state is TicketState.QUEUED
                    assert state.cancel(chosen) is was_queued
            case ("tick", float(step)):
                now += step
                for ticket, _ in state.expire(now):
                    assert not ticket.resuming
            case ("room", int(total)):
                fleet = room(total)
        holding = [ticket for ticket in tickets if ticket.admitted]
        assert state.held_slots == sum(ticket.slots for ticket in holding)
        by_tenant: dict[str, int] = {}
        for ticket in holding:
            by_tenant[ticket.tenant] = by_tenant.get(ticket.tenant, 0) + ticket.slots
        assert state.held_by_tenant() == by_tenant
        waiting: dict[tuple[int, str], int] = {}
        for ticket in tickets:
            if ticket.state is TicketState.QUEUED:
                key = (ticket.urgency, ticket.tenant)
                waiting[key] = waiting.get(key, 0) + 1
        assert state.queued() == waiting
        for victim in in_flight:
            assert state.making_room_for(victim) is in_flight[victim]


def test_an_urgent_request_only_the_reserve_could_hold_gets_a_victim() -> None:
    # 4 slots, 2 of them the reserve: the flood fills the rest, then its own urgent request
    # waits (the reserve is for tenants under their share), and a victim is named for it rather
    # than the free reserve counting as room it could use.
    state = ModelAdmission(AdmissionSettings(headroom=0.5))
    fleet = room(4)
    other = ticket_of(state.arrive("other", 0, 10, 1, 0.0, fleet))  # a second tenant: the reserve is kept
    state.release(other, 10, 0.0)
    low = [ticket_of(state.arrive("flood", 0, 10, 1, 0.0, fleet)) for _ in range(2)]
    assert all(ticket.admitted for ticket in low)
    urgent = ticket_of(state.arrive("flood", 1, 10, 1, 0.0, fleet))
    assert not urgent.admitted
    assert state.victim(1.0, fleet, AFTER) in low


def test_a_second_waiting_request_of_the_same_tenant_gets_its_own_victim_at_once() -> None:
    # Two urgent requests of one tenant wait (only the first is its lane's head); the first has
    # a preemption in flight. The second, once it waited as long, gets its own victim rather
    # than waiting for the first to be admitted and the ticker's next look (bench.overload's
    # priority scenario: an urgent request queued 99 ms, about one tick, past its 5 ms).
    state, held = full_fleet([0, 0, 0])
    fleet = room(3)
    first = ticket_of(state.arrive("urgent", 1, 10, 1, 0.0, fleet))
    second = ticket_of(state.arrive("urgent", 1, 10, 1, 0.5, fleet))
    assert state.victim(AFTER, fleet, AFTER) is held[2]
    assert state.making_room_for(held[2]) is first
    # The second has not waited long enough yet.
    assert state.victim(0.5 + AFTER - 0.01, fleet, AFTER) is None
    assert state.victim(0.5 + AFTER, fleet, AFTER) is held[1]
    assert state.making_room_for(held[1]) is second
    assert state.victim(0.5 + AFTER, fleet, AFTER) is None
    # Both stop: both urgent requests are admitted, in their order.
    state.requeue(held[2], 2.0)
    state.requeue(held[1], 2.0)
    assert state.pump(2.0, fleet) == [first, second]


def test_an_urgent_request_of_a_tenant_over_its_share_needs_one_victim_whatever_the_reserve_lacks() -> None:
    # 20 slots, headroom 2. "quiet" (under its share) runs 5 requests, so the reserve is 7, and
    # only 3 slots are free: the flood, over its share, is 4 short of room outside the reserve.
    # Its urgent request takes one victim's slot, not the 5 that would restore the reserve
    # first (bench.overload: 2-6 victims for a third of its preemptions).
    state = ModelAdmission(AdmissionSettings(headroom=0.1))
    fleet = room(20)
    for _ in range(3):
        assert ticket_of(state.arrive("quiet", 0, 10, 1, 0.0, fleet)).admitted
    flooded = [ticket_of(state.arrive("flood", 0, 10, 1, 0.0, fleet)) for _ in range(14)]
    running = [ticket for ticket in flooded if ticket.admitted]
    assert len(running) == 12
    for _ in range(2):
        assert ticket_of(state.arrive("quiet", 0, 10, 1, 0.0, fleet)).admitted
    assert (state.reserve(20), state.held_slots) == (7, 17)
    urgent = ticket_of(state.arrive("flood", 1, 10, 1, 0.0, fleet))
    assert not urgent.admitted
    victim = state.victim(AFTER, fleet, AFTER)
    assert victim in running
    assert state.victim(AFTER, fleet, AFTER) is None  # one is enough
    state.requeue(victim, 2.0)
    # Its slot goes to the urgent request, though 3 free slots are fewer than the reserve...
    assert state.pump(2.0, fleet) == [urgent]
    # ...and the free slots are as they were: the quiet tenant's room is untouched.
    assert state.held_slots == 17
    assert state.pump(2.0, fleet) == []
    assert victim.state is TicketState.QUEUED
