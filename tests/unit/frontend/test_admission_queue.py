"""The admission queue's laws: bands in strict order (or with a guaranteed lower band share),
fair share by tokens between tenants within a band, depth per band, deadlines, removal."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_frontend.admission.queue import AdmissionQueue, Ticket, TicketState


def ticket(
    tenant: str = "a", urgency: int = 0, cost: int = 100, *, at: float = 0.0, wait: float = 60.0
) -> Ticket:
    return Ticket(tenant=tenant, urgency=urgency, cost=cost, slots=1, enqueued_at=at, deadline=at + wait)


def push_all(queue: AdmissionQueue, tickets: list[Ticket]) -> None:
    for each in tickets:
        assert queue.push(each)


def tokens_by_tenant(popped: list[Ticket]) -> dict[str, int]:
    served: dict[str, int] = {}
    for each in popped:
        served[each.tenant] = served.get(each.tenant, 0) + each.cost
    return served


def pop_while_both_wait(queue: AdmissionQueue, first: str, second: str) -> list[dict[str, int]]:
    """Pop while both tenants have tickets queued; the tokens served to each after every pop."""
    served = {first: 0, second: 0}
    history = []
    while all(queue.depth().get((0, tenant), 0) for tenant in (first, second)):
        popped = queue.pop()
        assert popped is not None
        served[popped.tenant] += popped.cost
        history.append(dict(served))
    return history


# ---------------------------------------------------------------------------- fair share


def test_unequal_demand_gets_equal_tokens_while_both_wait() -> None:
    queue = AdmissionQueue(max_depth=10_000)
    push_all(queue, [ticket("heavy") for _ in range(100)])
    push_all(queue, [ticket("light") for _ in range(10)])
    history = pop_while_both_wait(queue, "heavy", "light")
    assert len(history) >= 19
    for served in history:
        assert abs(served["heavy"] - served["light"]) <= 100


def test_fair_share_is_by_tokens_not_by_count() -> None:
    queue = AdmissionQueue(max_depth=10_000)
    push_all(queue, [ticket("small", cost=10) for _ in range(300)])
    push_all(queue, [ticket("large", cost=300) for _ in range(10)])
    history = pop_while_both_wait(queue, "small", "large")
    for served in history:
        assert abs(served["small"] - served["large"]) <= 300
    # By count the small tickets' tenant was served many times more often.
    assert history[-1]["small"] >= 9 * 300 - 300


@given(
    costs_a=st.lists(st.integers(1, 500), min_size=1, max_size=40),
    costs_b=st.lists(st.integers(1, 500), min_size=1, max_size=40),
)
def test_fair_share_law_for_any_costs(costs_a: list[int], costs_b: list[int]) -> None:
    queue = AdmissionQueue(max_depth=10_000)
    for cost_a, cost_b in itertools.zip_longest(costs_a, costs_b):
        if cost_a is not None:
            assert queue.push(ticket("a", cost=cost_a))
        if cost_b is not None:
            assert queue.push(ticket("b", cost=cost_b))
    largest = max(costs_a + costs_b)
    for served in pop_while_both_wait(queue, "a", "b"):
        assert abs(served["a"] - served["b"]) <= largest


def test_a_tenant_alone_gets_everything_in_arrival_order() -> None:
    queue = AdmissionQueue(max_depth=100)
    tickets = [ticket("only", cost=cost) for cost in (5, 500, 50, 1)]
    push_all(queue, tickets)
    assert [queue.pop() for _ in tickets] == tickets
    assert queue.pop() is None


def test_a_returning_tenant_gets_its_share_at_once_and_no_burst() -> None:
    queue = AdmissionQueue(max_depth=10_000)
    push_all(queue, [ticket("steady") for _ in range(200)])
    push_all(queue, [ticket("returning") for _ in range(5)])
    pop_while_both_wait(queue, "steady", "returning")  # both waited; then "returning" idled
    for _ in range(100):
        popped = queue.pop()
        assert popped is not None
        assert popped.tenant == "steady"
    push_all(queue, [ticket("returning") for _ in range(50)])
    history = pop_while_both_wait(queue, "steady", "returning")
    assert history[0]["returning"] == 100 or history[1]["returning"] == 100  # served at once
    for served in history:
        # Neither starved by its past usage nor paid back for its idle time.
        assert abs(served["steady"] - served["returning"]) <= 100


def test_charge_makes_later_tickets_pay_the_real_usage() -> None:
    queue = AdmissionQueue(max_depth=1000)
    push_all(queue, [ticket("a"), ticket("b")])
    first = queue.pop()
    assert first is not None
    assert first.tenant == "a"
    queue.charge(first, 1000)  # it used ten times its estimate
    push_all(queue, [ticket("a") for _ in range(20)])
    push_all(queue, [ticket("b") for _ in range(20)])
    order = [popped.tenant for popped in iter(queue.pop, None)]
    # b is served its 900 tokens of difference (plus its ticket already queued) before a again.
    assert order[:10] == ["b"] * 10


def test_charge_below_the_estimate_gives_the_difference_back() -> None:
    queue = AdmissionQueue(max_depth=1000)
    push_all(queue, [ticket("a", cost=1000), ticket("b", cost=100)])
    first = queue.pop()
    assert first is not None
    assert first.tenant == "a"
    queue.charge(first, 100)
    push_all(queue, [ticket("a", cost=100), ticket("b", cost=100)])
    # Without the charge, b would have had 1000 tokens' worth before a's next ticket.
    order = [popped.tenant for popped in iter(queue.pop, None)]
    assert order == ["b", "a", "b"]


def test_a_ticket_never_served_is_not_charged() -> None:
    queue = AdmissionQueue(max_depth=10)
    waiting = ticket("a")
    push_all(queue, [waiting, ticket("b")])
    queue.charge(waiting, 10_000)
    assert [popped.tenant for popped in iter(queue.pop, None)] == ["a", "b"]


def test_a_removed_ticket_leaves_no_cost_behind() -> None:
    queue = AdmissionQueue(max_depth=1000)
    tickets_a = [ticket("a") for _ in range(10)]
    push_all(queue, tickets_a)
    push_all(queue, [ticket("b") for _ in range(10)])
    for removed in tickets_a[:9]:
        assert queue.remove(removed)
    # a's last ticket starts where its first would have: served right after b's first.
    order = [popped.tenant for popped in iter(queue.pop, None)]
    assert order[:3] in (["a", "b", "b"], ["b", "a", "b"])


# ---------------------------------------------------------------------------- bands


@given(
    st.lists(
        st.one_of(st.tuples(st.sampled_from("ab"), st.integers(-2, 2), st.integers(1, 50)), st.none()),
        max_size=80,
    )
)
def test_strict_priority_pops_the_most_urgent_band_first(steps: list[tuple[str, int, int] | None]) -> None:
    queue = AdmissionQueue(max_depth=1000)
    queued: list[Ticket] = []
    for step in steps:
        if step is None:
            popped = queue.pop()
            if popped is None:
                assert not queued
                continue
            assert popped.urgency == max(each.urgency for each in queued)
            queued.remove(popped)
        else:
            tenant, urgency, cost = step
            new = ticket(tenant, urgency, cost)
            assert queue.push(new)
            queued.append(new)


@given(
    share=st.floats(0.05, 0.95),
    costs_high=st.lists(st.integers(1, 200), min_size=20, max_size=60),
    costs_low=st.lists(st.integers(1, 200), min_size=20, max_size=60),
)
def test_lower_bands_get_their_share_of_tokens_within_one_ticket(
    share: float, costs_high: list[int], costs_low: list[int]
) -> None:
    queue = AdmissionQueue(max_depth=1000, lower_band_share=share)
    push_all(queue, [ticket("h", 1, cost) for cost in costs_high])
    push_all(queue, [ticket("l", 0, cost) for cost in costs_low])
    largest = max(costs_high + costs_low)
    high = low = 0
    while queue.band_depth(1) and queue.band_depth(0):
        popped = queue.pop()
        assert popped is not None
        if popped.urgency == 1:
            high += popped.cost
        else:
            low += popped.cost
        assert low >= share * (high + low) - largest
        assert low <= share * (high + low) + largest


def test_lower_band_share_is_counted_only_while_a_lower_band_waits() -> None:
    queue = AdmissionQueue(max_depth=1000, lower_band_share=0.5)
    push_all(queue, [ticket("h", 1) for _ in range(10)])
    for _ in range(10):
        popped = queue.pop()
        assert popped is not None
        assert popped.urgency == 1
    # The higher band's service alone owes the lower band nothing: no burst for it now.
    push_all(queue, [ticket("h", 1) for _ in range(4)])
    push_all(queue, [ticket("l", 0) for _ in range(4)])
    assert [popped.urgency for popped in iter(queue.pop, None)] == [1, 0, 1, 0, 1, 0, 1, 0]


def test_lower_band_share_serves_the_highest_lower_band() -> None:
    queue = AdmissionQueue(max_depth=1000, lower_band_share=0.5)
    push_all(queue, [ticket("x", urgency) for urgency in (2, 2, 1, 1, 0, 0)])
    assert [popped.urgency for popped in iter(queue.pop, None)][:3] == [2, 1, 2]


# ---------------------------------------------------------------------------- depth, deadlines, removal


def test_a_band_refuses_at_exactly_max_depth_and_other_bands_do_not() -> None:
    queue = AdmissionQueue(max_depth=3)
    push_all(queue, [ticket("a", 0) for _ in range(3)])
    refused = ticket("b", 0)
    assert not queue.push(refused)
    assert refused.state is TicketState.NEW
    assert queue.push(ticket("a", 1))
    assert queue.depth() == {(0, "a"): 3, (1, "a"): 1}
    assert queue.pop() is not None  # band 1
    assert not queue.push(ticket("b", 0))
    assert queue.pop() is not None  # band 0 now holds 2
    assert queue.push(ticket("b", 0))
    assert len(queue) == 3


@pytest.mark.parametrize(
    ("now", "expired_waits"),
    [(0.0, []), (9.99, []), (10.0, [10.0]), (25.0, [10.0, 20.0]), (100.0, [10.0, 20.0, 30.0])],
)
def test_expired_returns_exactly_the_tickets_past_their_deadline(
    now: float, expired_waits: list[float]
) -> None:
    queue = AdmissionQueue(max_depth=10)
    tickets = {wait: ticket(str(wait), wait=wait) for wait in (30.0, 10.0, 20.0)}
    push_all(queue, list(tickets.values()))
    gone = queue.expired(now)
    assert gone == [tickets[wait] for wait in expired_waits]
    assert all(each.state is TicketState.EXPIRED for each in gone)
    assert len(queue) == 3 - len(gone)
    left = sorted(set(tickets) - set(expired_waits))
    assert queue.next_deadline() == (left[0] if left else None)
    assert {popped.tenant for popped in iter(queue.pop, None)} == {str(wait) for wait in left}


def test_a_removed_ticket_is_never_popped() -> None:
    queue = AdmissionQueue(max_depth=10)
    tickets = [ticket(tenant) for tenant in "abcab"]
    push_all(queue, tickets)
    assert queue.remove(tickets[0])
    assert queue.remove(tickets[4])
    assert not queue.remove(tickets[0])
    assert tickets[0].state is TicketState.CANCELLED
    assert list(iter(queue.pop, None)) == [tickets[1], tickets[2], tickets[3]]
    assert not queue.remove(tickets[1])  # popped: not queued any more


def test_take_serves_a_head_out_of_turn_and_only_a_head() -> None:
    queue = AdmissionQueue(max_depth=10)
    a1, a2, b1 = ticket("a"), ticket("a"), ticket("b")
    push_all(queue, [a1, a2, b1])
    assert queue.heads() == [a1, b1]
    assert not queue.take(a2)  # FIFO within a tenant
    assert queue.take(b1)
    assert b1.admitted
    assert queue.heads() == [a1]
    assert list(iter(queue.pop, None)) == [a1, a2]


def test_a_ticket_is_pushed_once() -> None:
    queue = AdmissionQueue(max_depth=10)
    once = ticket()
    assert queue.push(once)
    with pytest.raises(ValueError, match="only a new ticket"):
        queue.push(once)


@pytest.mark.parametrize(("cost", "slots"), [(0, 1), (1, 0)])
def test_a_ticket_costs_and_runs_at_least_one(cost: int, slots: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Ticket(tenant="a", urgency=0, cost=cost, slots=slots, enqueued_at=0.0, deadline=1.0)


# ---------------------------------------------------------------------------- every ticket comes out once

operation = st.one_of(
    st.tuples(
        st.just("push"), st.sampled_from("abc"), st.integers(0, 2), st.integers(1, 100), st.floats(0, 20)
    ),
    st.tuples(st.just("pop")),
    st.tuples(st.just("take"), st.integers(0, 50)),
    st.tuples(st.just("remove"), st.integers(0, 200)),
    st.tuples(st.just("expire"), st.floats(0, 5)),
    st.tuples(st.just("charge"), st.integers(0, 200), st.integers(1, 300)),
)


@given(st.lists(operation, max_size=120), st.sampled_from([0.0, 0.3]))
def test_every_pushed_ticket_comes_out_exactly_once(
    operations: list[tuple[object, ...]], share: float
) -> None:
    queue = AdmissionQueue(max_depth=8, lower_band_share=share)
    pushed: list[Ticket] = []
    out: list[Ticket] = []
    now = 0.0
    for op in operations:
        match op:
            case ("push", str(tenant), int(urgency), int(cost), float(wait)):
                new = ticket(tenant, urgency, cost, at=now, wait=wait)
                full = queue.band_depth(urgency) >= 8
                assert queue.push(new) is not full
                if not full:
                    pushed.append(new)
            case ("pop",):
                expected = queue.peek()
                popped = queue.pop()
                assert popped is expected
                if popped is not None:
                    out.append(popped)
            case ("take", int(index)):
                heads = queue.heads()
                if heads:
                    head = heads[index % len(heads)]
                    assert queue.take(head)
                    out.append(head)
            case ("remove", int(index)):
                if pushed:
                    chosen = pushed[index % len(pushed)]
                    was_queued = chosen.state is TicketState.QUEUED
                    assert queue.remove(chosen) is was_queued
                    if was_queued:
                        out.append(chosen)
            case ("expire", float(step)):
                now += step
                out.extend(queue.expired(now))
            case ("charge", int(index), int(actual)):
                if pushed:
                    queue.charge(pushed[index % len(pushed)], actual)
        queued = [each for each in pushed if each.state is TicketState.QUEUED]
        assert len(queue) == len(queued)
        assert sum(queue.depth().values()) == len(queued)
        assert queue.next_deadline() == min((each.deadline for each in queued), default=None)
        assert len(out) == len({id(each) for each in out})
        assert len(out) + len(queued) == len(pushed)
    out.extend(iter(queue.pop, None))
    assert sorted(map(id, out)) == sorted(map(id, pushed))
    assert len(queue) == 0


def test_a_held_fleets_wait_does_not_count_against_a_queued_tickets_deadline() -> None:
    """Held from 10 to 100 s: a ticket queued at 0 gets those 90 s back, one queued at 40 the 60
    it spent held, one queued after the release nothing."""
    queue = AdmissionQueue(max_depth=10_000)
    early, during, late = ticket(at=0.0, wait=30.0), ticket("b", at=40.0, wait=30.0), ticket("c", at=100.0)
    push_all(queue, [early, during, late])
    queue.postpone(10.0, 100.0)
    assert (early.deadline, during.deadline, late.deadline) == (120.0, 130.0, 160.0)
    assert queue.expired(119.0) == []
    assert queue.expired(120.0) == [early]
    assert queue.next_deadline() == 130.0


def test_lane_from_is_a_head_then_its_tenants_later_tickets_of_its_band() -> None:
    queue = AdmissionQueue(max_depth=8)
    a1, a2, a3, a4 = (ticket("a", at=float(i)) for i in range(4))
    b1 = ticket("b")
    urgent = ticket("a", urgency=1)
    push_all(queue, [a1, b1, a2, urgent, a3, a4])
    assert queue.remove(a3)
    assert list(queue.lane_from(a1)) == [a1, a2, a4]
    assert list(queue.lane_from(b1)) == [b1]
    assert list(queue.lane_from(urgent)) == [urgent]
    # From the middle of the lane, as well (the head left).
    assert queue.pop() is urgent
    assert queue.take(a1)
    assert list(queue.lane_from(a2)) == [a2, a4]
    # A preempted ticket waiting again has no lane: itself only.
    queue.requeue(a1, 5.0)
    assert list(queue.lane_from(a1)) == [a1]
