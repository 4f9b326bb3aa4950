"""One model's admission: who runs now, who waits, who is refused, and the headroom that keeps
a quiet tenant's request from waiting behind another tenant's flood."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.errors import RefusalReason
from sidecar_frontend.admission.capacity import Room
from sidecar_frontend.admission.queue import Ticket, TicketState
from sidecar_frontend.admission.state import AdmissionSettings, ModelAdmission, Refused


def room(total: int, foreign: int = 0) -> Room:
    return Room(total_slots=total, foreign_slots=foreign, workers=1 if total else 0, stale=0)


def admitted(outcome: Ticket | Refused) -> Ticket:
    assert isinstance(outcome, Ticket)
    assert outcome.admitted
    return outcome


def queued(outcome: Ticket | Refused) -> Ticket:
    assert isinstance(outcome, Ticket)
    assert outcome.state is TicketState.QUEUED
    return outcome


def refused(outcome: Ticket | Refused) -> Refused:
    assert isinstance(outcome, Refused)
    return outcome


def test_a_request_with_room_is_admitted_at_once() -> None:
    state = ModelAdmission(AdmissionSettings())
    ticket = admitted(state.arrive("a", 0, 100, 2, 0.0, room(8, foreign=3)))
    assert (ticket.tenant, ticket.cost, ticket.slots, ticket.deadline) == ("a", 100, 2, 60.0)
    assert state.held_slots == 2
    assert state.held_by_tenant() == {"a": 2}
    assert state.queued() == {}


@pytest.mark.parametrize(
    ("total", "slots", "words"),
    [
        (0, 1, "no worker of the model can run a request: 0 workers, 0 running slots"),
        (4, 5, "the request runs 5 sequences at once; the 1 workers of the model run 4 at most"),
    ],
)
def test_no_capacity_when_no_worker_can_run_it(total: int, slots: int, words: str) -> None:
    state = ModelAdmission(AdmissionSettings())
    refusal = refused(state.arrive("a", 0, 10, slots, 0.0, room(total)))
    assert refusal == Refused(RefusalReason.NO_CAPACITY, 1, words)
    assert state.queued() == {}


def test_a_full_band_refuses_and_another_band_still_queues() -> None:
    state = ModelAdmission(AdmissionSettings(max_queue_depth=2, headroom=0.0))
    full = room(1)
    admitted(state.arrive("a", 0, 10, 1, 0.0, full))
    queued(state.arrive("a", 0, 10, 1, 0.0, full))
    queued(state.arrive("b", 0, 10, 1, 0.0, full))
    refusal = refused(state.arrive("c", 0, 10, 1, 0.0, full))
    assert refusal.reason is RefusalReason.QUEUE_FULL
    assert refusal.detail == "the queue of band 0 holds 2 requests (the most --max-queue-depth allows)"
    queued(state.arrive("c", 1, 10, 1, 0.0, full))
    assert state.queued() == {(0, "a"): 1, (0, "b"): 1, (1, "c"): 1}


def test_a_queued_request_is_admitted_by_pump_after_a_release() -> None:
    state = ModelAdmission(AdmissionSettings(headroom=0.0))
    first = admitted(state.arrive("a", 0, 10, 2, 0.0, room(2)))
    waiting = queued(state.arrive("b", 0, 10, 1, 0.5, room(2)))
    assert state.pump(1.0, room(2)) == []
    state.release(first, 8, 2.0)
    assert state.held_slots == 0
    assert state.pump(2.0, room(2)) == [waiting]
    assert waiting.admitted
    assert state.held_by_tenant() == {"b": 1}


def test_pump_admits_in_queue_order_while_there_is_room() -> None:
    state = ModelAdmission(AdmissionSettings(headroom=0.0))
    admitted(state.arrive("x", 0, 10, 1, 0.0, room(1)))
    low = queued(state.arrive("a", 0, 10, 1, 0.0, room(1)))
    high = queued(state.arrive("b", 1, 10, 1, 0.0, room(1)))
    low_again = queued(state.arrive("a", 0, 10, 1, 0.0, room(1)))
    assert state.pump(0.0, room(3)) == [high, low]
    assert low_again.state is TicketState.QUEUED


def flood(state: ModelAdmission, tenant: str, count: int, fleet: Room) -> list[Ticket]:
    return [
        outcome
        for _ in range(count)
        if isinstance(outcome := state.arrive(tenant, 0, 1, 1, 0.0, fleet), Ticket)
    ]


@pytest.mark.parametrize(("headroom", "quiet_admitted"), [(0.2, True), (0.0, False)])
def test_the_headroom_lets_a_quiet_tenant_in_during_a_flood(headroom: float, quiet_admitted: bool) -> None:
    state = ModelAdmission(AdmissionSettings(headroom=headroom))
    fleet = room(10)
    admitted(state.arrive("steady", 0, 1, 1, 0.0, fleet))
    flooded = flood(state, "flood", 20, fleet)
    # The flood runs up to the reserve with headroom (2 of 10 slots, beyond the one "steady",
    # under its share, holds), to the last slot without.
    assert state.held_by_tenant() == {"steady": 1, "flood": 6 if headroom else 9}
    assert sum(ticket.admitted for ticket in flooded) == (6 if headroom else 9)
    quiet = state.arrive("quiet", 0, 1, 1, 0.0, fleet)
    assert isinstance(quiet, Ticket)
    assert quiet.admitted is quiet_admitted


def test_a_tenant_under_its_share_passes_the_queue_of_a_tenant_over_its_share() -> None:
    state = ModelAdmission(AdmissionSettings(headroom=0.2))
    fleet = room(10)
    # "quiet" ran one large request earlier: its next ticket's fair-queueing tag is far behind.
    large = admitted(state.arrive("quiet", 0, 1000, 1, 0.0, fleet))
    state.release(large, None, 1.0)
    admitted(state.arrive("steady", 0, 1, 1, 1.0, fleet))
    flood(state, "flood", 20, fleet)
    assert state.held_by_tenant() == {"steady": 1, "flood": 6}
    # In fair-queueing order the flood's next ticket goes first, but it may not take the
    # reserve; "quiet" holds nothing, under its share of 10 / 3: it passes into the reserve.
    quiet = admitted(state.arrive("quiet", 0, 1, 1, 2.0, fleet))
    assert state.held_by_tenant() == {"steady": 1, "flood": 6, "quiet": 1}
    # And pump, later, does the same for a queued ticket of a tenant under its share.
    state.release(quiet, None, 3.0)
    assert state.pump(3.0, room(10, foreign=2)) == []
    again = queued(state.arrive("quiet", 0, 1, 1, 3.0, room(10, foreign=3)))
    assert state.pump(3.0, room(10, foreign=2)) == [again]


def test_urgency_goes_first_but_does_not_open_the_reserve() -> None:
    state = ModelAdmission(AdmissionSettings(headroom=0.2))  # 2 of 10, beyond the small tenants' own
    fleet = room(10)
    admitted(state.arrive("steady", 0, 1, 1, 0.0, fleet))
    running = [t for t in flood(state, "flood", 20, fleet) if t.admitted]
    # The flood's own urgent request waits: its tenant is over its share...
    urgent = queued(state.arrive("flood", 5, 1, 1, 0.0, fleet))
    assert state.held_slots == 7
    # ...while a quiet tenant's request (under its share) takes the reserve at once...
    admitted(state.arrive("quiet", 0, 1, 1, 0.0, fleet))
    # ...and once room outside the reserve frees (2 slots beyond what "steady" and "quiet"
    # hold), it goes to the urgent one, before the flood's others (which were there first).
    for ticket in running[:3]:
        state.release(ticket, 1, 1.0)
    assert state.pump(1.0, fleet) == [urgent]
    assert state.held_slots == 6


def test_a_tenant_holding_exactly_its_fair_share_may_not_take_the_reserve() -> None:
    state = ModelAdmission(AdmissionSettings(headroom=0.5))  # 2 of 4 slots reserved
    fleet = room(4)
    admitted(state.arrive("steady", 0, 1, 1, 0.0, fleet))
    admitted(state.arrive("a", 0, 1, 1, 0.0, fleet))  # under its share of 4 / 2, into the reserve
    admitted(state.arrive("a", 0, 1, 1, 0.0, fleet))
    queued(state.arrive("a", 0, 1, 1, 0.0, fleet))  # it holds its share: 2
    assert state.held_by_tenant() == {"steady": 1, "a": 2}


@pytest.mark.parametrize("leaves", ["expire", "cancel"])
def test_a_request_that_left_no_longer_counts_among_the_tenants_sharing(leaves: str) -> None:
    # 11 of 12 reserved: past the first slot, only a tenant under its share gets in.
    state = ModelAdmission(AdmissionSettings(max_queue_wait=5.0, headroom=0.9))
    fleet = room(12)
    admitted(state.arrive("steady", 0, 1, 1, 0.0, fleet))
    gone = queued(state.arrive("gone", 0, 1, 1, 0.0, room(12, foreign=11)))
    if leaves == "expire":
        assert [ticket for ticket, _ in state.expire(5.0)] == [gone]
    else:
        assert state.cancel(gone)
    # Two tenants here, and room kept for one more: "a"'s share is 12 / 3 = 4, so four of its
    # requests get in; counting "gone" still, its share would be 12 / 4 = 3.
    outcomes = [state.arrive("a", 0, 1, 1, 5.0, fleet) for _ in range(5)]
    assert [isinstance(outcome, Ticket) and outcome.admitted for outcome in outcomes] == [True] * 4 + [False]


def test_a_tenant_never_overtakes_its_own_queued_request() -> None:
    state = ModelAdmission(AdmissionSettings(headroom=0.0))
    admitted(state.arrive("a", 0, 10, 3, 0.0, room(4)))
    large = queued(state.arrive("a", 0, 10, 3, 0.0, room(4)))
    small = queued(state.arrive("a", 0, 10, 1, 0.0, room(4)))  # would fit, but comes after
    assert state.pump(0.0, room(4)) == []
    assert (large.state, small.state) == (TicketState.QUEUED, TicketState.QUEUED)


def test_never_admitted_beyond_the_free_slots() -> None:
    state = ModelAdmission(AdmissionSettings(headroom=0.0))
    waiting = queued(state.arrive("a", 0, 10, 3, 0.0, room(4, foreign=2)))
    assert state.pump(0.0, room(4, foreign=2)) == []
    assert state.pump(0.0, room(4, foreign=1)) == [waiting]


def test_cancel_takes_a_waiting_request_out_for_good() -> None:
    state = ModelAdmission(AdmissionSettings(headroom=0.0))
    running = admitted(state.arrive("a", 0, 10, 1, 0.0, room(1)))
    waiting = queued(state.arrive("b", 0, 10, 1, 0.0, room(1)))
    assert state.cancel(waiting)
    assert not state.cancel(waiting)
    assert not state.cancel(running)  # admitted: released, not cancelled
    assert waiting.state is TicketState.CANCELLED
    assert state.queued() == {}
    state.release(running, None, 1.0)
    assert state.pump(1.0, room(1)) == []
    assert state.next_deadline() is None


def test_expire_refuses_exactly_the_requests_past_their_deadline() -> None:
    state = ModelAdmission(AdmissionSettings(max_queue_wait=30.0, headroom=0.0))
    admitted(state.arrive("a", 0, 10, 1, 0.0, room(1)))
    early = queued(state.arrive("b", 0, 10, 1, 0.0, room(1)))
    late = queued(state.arrive("c", 0, 10, 1, 10.0, room(1)))
    assert state.next_deadline() == 30.0
    assert state.expire(29.9) == []
    [(gone, refusal)] = state.expire(30.0)
    assert gone is early
    assert gone.state is TicketState.EXPIRED
    assert refusal.reason is RefusalReason.QUEUE_TIMEOUT
    assert refusal.retry_after == 1  # no release seen yet
    assert refusal.detail == (
        "waited 30.0 s in the queue of band 0 without room (the most --max-queue-wait-secs "
        "allows); 1 requests still wait at its priority or above, 1 admitted sequences are running"
    )
    assert state.queued() == {(0, "c"): 1}
    assert state.next_deadline() == 40.0
    assert late.state is TicketState.QUEUED


def test_release_is_for_admitted_tickets_once() -> None:
    state = ModelAdmission(AdmissionSettings(headroom=0.0))
    running = admitted(state.arrive("a", 0, 10, 2, 0.0, room(2)))
    waiting = queued(state.arrive("b", 0, 10, 1, 0.0, room(2)))
    state.release(waiting, 5, 1.0)  # not admitted: nothing happens
    assert state.held_slots == 2
    state.release(running, 5, 1.0)
    state.release(running, 5, 1.0)
    assert running.state is TicketState.RELEASED
    assert state.held_slots == 0
    assert state.held_by_tenant() == {}


def releases_then_full(releases_per_second: float, seconds: float, ahead: int) -> Refused:
    """A fleet of one slot whose requests end at a steady rate, then a full band."""
    state = ModelAdmission(AdmissionSettings(max_queue_depth=ahead, headroom=0.0))
    count = round(releases_per_second * seconds)
    for index in range(count):
        now = index / releases_per_second
        state.release(admitted(state.arrive("a", 0, 1, 1, now, room(1))), None, now)
    full = room(1)
    now = seconds
    admitted(state.arrive("a", 0, 1, 1, now, full))
    for _ in range(ahead):
        queued(state.arrive("a", 0, 1, 1, now, full))
    return refused(state.arrive("a", 0, 1, 1, now, full))


@pytest.mark.parametrize(
    ("rate", "seconds", "ahead", "retry_after"),
    [
        (0.0, 1.0, 5, 1),  # no release seen: 1 s
        (10.0, 60.0, 45, 5),  # 4.5 s
        (10.0, 60.0, 1, 1),  # 0.1 s
        (2.0, 60.0, 37, 19),  # 18.5 s
        (0.5, 60.0, 100, 60),  # 200 s, clamped
    ],
)
def test_retry_after_follows_the_recent_release_rate(
    rate: float, seconds: float, ahead: int, retry_after: int
) -> None:
    refusal = releases_then_full(rate, seconds, ahead)
    assert refusal.reason is RefusalReason.QUEUE_FULL
    assert refusal.retry_after == retry_after


@pytest.mark.parametrize(
    "settings",
    [
        {"max_queue_depth": 0},
        {"max_queue_wait": -1.0},
        {"headroom": 1.0},
        {"headroom": -0.1},
        {"lower_band_share": 1.0},
    ],
)
def test_settings_out_of_range_are_refused(settings: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="is "):
        AdmissionSettings(**settings)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- random sequences

HEADROOM = 0.25

rooms = st.builds(
    lambda total, foreign: room(total, min(foreign, total)), st.integers(0, 12), st.integers(0, 6)
)
operation = st.one_of(
    st.tuples(
        st.just("arrive"),
        st.sampled_from("abc"),
        st.integers(0, 2),
        st.integers(1, 50),
        st.integers(1, 3),
        rooms,
    ),
    st.tuples(st.just("pump"), rooms),
    st.tuples(st.just("release"), st.integers(0, 100), st.none() | st.integers(0, 100)),
    st.tuples(st.just("cancel"), st.integers(0, 100)),
    st.tuples(st.just("expire"), st.floats(0.0, 4.0)),
)


def reserve(total: int) -> int:
    return min(math.ceil(HEADROOM * total), total - 1) if total > 1 else 0


@given(st.lists(operation, max_size=80), st.sampled_from([0.0, 0.5]))
def test_any_sequence_keeps_the_books_and_never_overfills(
    operations: list[tuple[object, ...]], share: float
) -> None:
    settings = AdmissionSettings(
        max_queue_depth=4, max_queue_wait=5.0, headroom=HEADROOM, lower_band_share=share
    )
    state = ModelAdmission(settings)
    tickets: list[Ticket] = []
    now = 0.0
    for op in operations:
        match op:
            case ("arrive", str(tenant), int(urgency), int(cost), int(slots), Room() as fleet):
                before = state.held_slots
                depth = sum(n for (u, _), n in state.queued().items() if u == urgency)
                outcome = state.arrive(tenant, urgency, cost, slots, now, fleet)
                if isinstance(outcome, Refused):
                    assert 1 <= outcome.retry_after <= 60
                    if outcome.reason is RefusalReason.NO_CAPACITY:
                        assert fleet.total_slots < slots
                    else:
                        assert outcome.reason is RefusalReason.QUEUE_FULL
                        assert depth == 4
                else:
                    tickets.append(outcome)
                    if outcome.admitted:
                        assert state.held_slots == before + slots <= fleet.total_slots - fleet.foreign_slots
            case ("pump", Room() as fleet):
                admitted_now = state.pump(now, fleet)
                assert all(ticket.admitted for ticket in admitted_now)
                if admitted_now:
                    assert state.held_slots <= fleet.total_slots - fleet.foreign_slots
                assert state.pump(now, fleet) == []  # pump admits all it may at once
                # The queue never waits while any request (3 sequences at most) would fit
                # beyond the reserve: the next one in line would have been admitted.
                free = fleet.total_slots - fleet.foreign_slots - state.held_slots
                if state.queued():
                    assert free - 3 < reserve(fleet.total_slots)
            case ("release", int(index), actual):
                if tickets:
                    chosen = tickets[index % len(tickets)]
                    before_release = chosen.state
                    state.release(chosen, actual if isinstance(actual, int) else None, now)
                    if before_release is TicketState.ADMITTED:
                        assert chosen.state is TicketState.RELEASED
                    else:
                        assert chosen.state is before_release
            case ("cancel", int(index)):
                if tickets:
                    chosen = tickets[index % len(tickets)]
                    was_queued = chosen.state is TicketState.QUEUED
                    assert state.cancel(chosen) is was_queued
            case ("expire", float(step)):
                now += step
                due = {id(t) for t in tickets if t.state is TicketState.QUEUED and t.deadline <= now}
                gone = state.expire(now)
                assert {id(ticket) for ticket, _ in gone} == due
                assert all(refusal.reason is RefusalReason.QUEUE_TIMEOUT for _, refusal in gone)
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


def test_a_lone_tenant_uses_the_whole_fleet_and_the_reserve_is_kept_once_another_comes() -> None:
    # 10 slots, 2 of them the reserve, which is kept only while more than one tenant is around.
    state = ModelAdmission(AdmissionSettings(headroom=0.2))
    fleet = room(10)
    flood = [state.arrive("flood", 0, 1, 1, 0.0, fleet) for _ in range(12)]
    assert [isinstance(t, Ticket) and t.admitted for t in flood] == [True] * 10 + [False] * 2
    running = [t for t in flood if isinstance(t, Ticket) and t.admitted]
    # A second tenant: its first request waits for the first slot that frees, and takes it
    # before the flood's waiting ones...
    quiet = queued(state.arrive("quiet", 0, 1, 1, 1.0, fleet))
    state.release(running[0], 1, 2.0)
    assert state.pump(2.0, fleet) == [quiet]
    # ...and from then on the flood is held out of the reserve.
    state.release(running[1], 1, 3.0)
    state.release(running[2], 1, 3.0)
    assert state.pump(3.0, fleet) == []
    assert state.held_slots == 8
    # A quiet request now finds the reserve at once.
    admitted(state.arrive("quiet", 0, 1, 1, 4.0, fleet))


def test_the_reserve_goes_a_minute_after_the_second_tenant_was_last_seen() -> None:
    state = ModelAdmission(AdmissionSettings(headroom=0.2))
    fleet = room(10)
    quiet = admitted(state.arrive("quiet", 0, 1, 1, 0.0, fleet))
    state.release(quiet, 1, 1.0)
    flood = [state.arrive("flood", 0, 1, 1, 2.0, fleet) for _ in range(12)]
    assert [isinstance(t, Ticket) and t.admitted for t in flood] == [True] * 8 + [False] * 4
    assert state.pump(59.0, fleet) == []
    assert len(state.pump(61.0, fleet)) == 2  # the flood alone: the reserve is its too
    assert state.held_slots == 10


def test_the_reserve_stays_free_beyond_what_the_tenants_under_their_share_hold() -> None:
    # 20 slots, headroom 2: a tenant over its share leaves 2 free beyond what "quiet" holds.
    state = ModelAdmission(AdmissionSettings(headroom=0.1))
    fleet = room(20)
    admitted(state.arrive("quiet", 0, 1, 1, 0.0, fleet))
    running = [t for t in flood(state, "flood", 30, fleet) if t.admitted]
    assert len(running) == 16  # 2 kept free beyond the one "quiet" holds
    # "quiet" runs more and more at once: each of its requests still finds room at once...
    for _ in range(2):
        admitted(state.arrive("quiet", 0, 1, 1, 1.0, fleet))
    # ...and a slot the flood frees is not the flood's again while "quiet" holds more.
    state.release(running[0], 1, 2.0)
    assert state.pump(2.0, fleet) == []
    admitted(state.arrive("quiet", 0, 1, 1, 2.0, fleet))
    assert state.held_by_tenant() == {"quiet": 4, "flood": 15}


def test_the_reserve_grows_by_every_slot_the_tenants_under_their_share_hold() -> None:
    # 20 slots, headroom 2. "quiet" runs three requests: the flood leaves the headroom and
    # three slots more, one for each of quiet's (docs/decisions.md: the headroom alone, or one
    # slot per tenant, let a quiet request wait for a flood request to end).
    state = ModelAdmission(AdmissionSettings(headroom=0.1))
    fleet = room(20)
    for _ in range(3):
        admitted(state.arrive("quiet", 0, 1, 1, 0.0, fleet))
    running = [t for t in flood(state, "flood", 30, fleet) if t.admitted]
    assert len(running) == 12  # 20 - quiet's 3 - (2 + 3) kept free
    assert state.reserve(20) == 5
    # Another tenant under its share starts running: one slot more is kept.
    admitted(state.arrive("other", 0, 1, 1, 1.0, fleet))
    assert state.reserve(20) == 6
    state.release(running[0], 1, 2.0)
    state.release(running[1], 1, 2.0)
    assert state.pump(2.0, fleet) == []  # 6 free: the flood's next would leave 5
    state.release(running[2], 1, 3.0)
    assert len(state.pump(3.0, fleet)) == 1
    assert state.held_by_tenant() == {"quiet": 3, "flood": 10, "other": 1}


def test_a_full_band_makes_room_for_another_tenant_by_refusing_the_longest_lanes_newest() -> None:
    state = ModelAdmission(AdmissionSettings(max_queue_depth=4, headroom=0.0))
    fleet = room(1)
    admitted(state.arrive("flood", 0, 1, 1, 0.0, fleet))
    waiting = [queued(state.arrive("flood", 0, 1, 1, float(n), fleet)) for n in range(4)]
    # The flood's own next request finds its band full: it is refused itself.
    refused = state.arrive("flood", 0, 1, 1, 5.0, fleet)
    assert isinstance(refused, Refused)
    assert refused.reason is RefusalReason.QUEUE_FULL
    assert state.pushed_out() == []
    # Another tenant's is queued, and the flood's newest waiting request is refused for it.
    quiet = queued(state.arrive("quiet", 0, 1, 1, 6.0, fleet))
    [(gone, why)] = state.pushed_out()
    assert gone is waiting[-1]
    assert why.reason is RefusalReason.QUEUE_PUSHED_OUT
    assert "'flood'" in why.detail
    assert state.queued() == {(0, "flood"): 3, (0, "quiet"): 1}
    # Two tenants queueing as much as each other: the band is full for both.
    second = state.arrive("quiet", 0, 1, 1, 7.0, fleet)
    assert isinstance(second, Ticket)
    assert len(state.pushed_out()) == 1  # flood 2, quiet 2
    third = state.arrive("quiet", 0, 1, 1, 8.0, fleet)
    assert isinstance(third, Refused)
    assert state.pushed_out() == []
    assert quiet.state.value == "queued"
