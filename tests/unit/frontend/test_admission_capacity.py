"""How much a model's fleet can take now: every rule of admission/capacity.py, as tables."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_frontend.admission.capacity import (
    CapacitySettings,
    Room,
    WorkerLoad,
    fleet_room,
    worker_has_room,
    workers_with_free_slots,
    workers_with_room,
)

NOW = 100.0
SETTINGS = CapacitySettings(stale_after=2.0, kv_saturated=0.95, default_running_limit=64)


def load(
    address: str = "w",
    *,
    limit: int = 8,
    own: int = 0,
    others: int = 0,
    waiting: int | None = 0,
    kv: float | None = 0.1,
    reported_at: float | None = NOW - 0.5,
) -> WorkerLoad:
    return WorkerLoad(
        address=address,
        running_limit=limit,
        own_requests=own,
        others_requests=others,
        engine_waiting=waiting,
        kv_usage=kv,
        reported_at=reported_at,
    )


@pytest.mark.parametrize(
    ("loads", "room"),
    [
        pytest.param([], Room(0, 0, 0, 0), id="no worker"),
        pytest.param([load(own=3, others=2)], Room(8, 2, 1, 0), id="fresh: limit, others foreign"),
        pytest.param(
            [load("a", own=1, others=2), load("b", limit=16, others=5)],
            Room(24, 7, 2, 0),
            id="fresh workers add up",
        ),
        pytest.param([load(limit=0, others=3)], Room(64, 3, 1, 0), id="unknown limit: the default"),
        pytest.param(
            [load(own=2, others=1, waiting=3)], Room(8, 6, 1, 0), id="engine waiting: full (limit - own)"
        ),
        pytest.param(
            [load(own=1, others=7, waiting=1)],
            Room(8, 7, 1, 0),
            id="engine waiting, others above limit - own: others",
        ),
        pytest.param([load(own=2, kv=0.95)], Room(8, 6, 1, 0), id="kv at the saturation mark: full"),
        pytest.param([load(own=2, kv=0.94)], Room(8, 0, 1, 0), id="kv under the mark: counted"),
        pytest.param(
            [load(own=2, others=1, waiting=None, kv=None)], Room(8, 1, 1, 0), id="engine state unknown"
        ),
        pytest.param(
            [load(own=9, waiting=2)], Room(8, 0, 1, 0), id="engine full with own above limit: no negative"
        ),
        pytest.param(
            [load("a", others=1), load("b", own=3, others=4, reported_at=NOW - 2.5)],
            Room(16, 1 + 5, 2, 1),
            id="stale beside a fresh one: full, own sequences still covered",
        ),
        pytest.param(
            [load("a"), load("b", own=2, reported_at=None)],
            Room(16, 6, 2, 1),
            id="never reported beside a fresh one: full",
        ),
        pytest.param(
            [load("a"), load("b", own=2, reported_at=NOW - 2.0)],
            Room(16, 0, 2, 0),
            id="exactly stale_after old: still fresh",
        ),
        pytest.param(
            [load("a", own=3, others=4, reported_at=NOW - 10), load("b", others=6, reported_at=None)],
            Room(16, 0, 2, 2),
            id="every worker stale: own count only",
        ),
        pytest.param(
            [load("a", own=3, others=4, waiting=9, kv=1.0, reported_at=NOW - 10)],
            Room(8, 0, 1, 1),
            id="the only worker, stale and reported full: own count only",
        ),
    ],
)
def test_fleet_room(loads: list[WorkerLoad], room: Room) -> None:
    assert fleet_room(loads, NOW, SETTINGS) == room


@pytest.mark.parametrize(
    ("worker", "has_room"),
    [
        pytest.param(load(own=3, others=4), True, id="one slot left"),
        pytest.param(load(own=4, others=4), False, id="at the limit"),
        pytest.param(load(limit=0, own=63), True, id="unknown limit: the default's"),
        pytest.param(load(limit=0, own=64), False, id="unknown limit: at the default"),
        pytest.param(load(waiting=1), False, id="engine waiting"),
        pytest.param(load(kv=0.95), False, id="kv saturated"),
        pytest.param(load(waiting=None, kv=None), True, id="engine state unknown"),
        pytest.param(load(reported_at=NOW - 2.01), False, id="stale"),
        pytest.param(load(reported_at=None), False, id="never reported"),
    ],
)
def test_worker_has_room(worker: WorkerLoad, has_room: bool) -> None:
    assert worker_has_room(worker, NOW, SETTINGS) is has_room


def test_workers_with_room_leaves_out_stale_workers_beside_fresh_ones() -> None:
    fresh = load("a", own=1)
    full = load("b", own=8)
    stale = load("c", reported_at=None)
    assert workers_with_room([fresh, full, stale], NOW, SETTINGS) == [fresh]


def test_workers_with_room_serves_a_fleet_whose_reports_stopped_on_its_own_count() -> None:
    under = load("a", own=7, others=5, waiting=3, reported_at=NOW - 60)
    at_limit = load("b", own=8, reported_at=None)
    assert workers_with_room([under, at_limit], NOW, SETTINGS) == [under]


loads_strategy = st.lists(
    st.builds(
        load,
        limit=st.integers(0, 32),
        own=st.integers(0, 40),
        others=st.integers(0, 40),
        waiting=st.none() | st.integers(0, 3),
        kv=st.none() | st.floats(0.0, 1.0),
        reported_at=st.none() | st.floats(NOW - 5, NOW),
    ),
    max_size=6,
)


@given(loads_strategy)
def test_a_stale_or_full_worker_adds_no_room_beyond_its_own_sequences(loads: list[WorkerLoad]) -> None:
    """Net room of the fleet (total - foreign - own sequences) counts only the workers that
    have room by worker_has_room, unless every report is stale."""
    room = fleet_room(loads, NOW, SETTINGS)
    assert room.workers == len(loads)
    assert room.foreign_slots >= 0
    with_room = workers_with_room(loads, NOW, SETTINGS)
    if room.stale == len(loads):
        assert room.foreign_slots == 0
    else:
        assert all(worker_has_room(worker, NOW, SETTINGS) for worker in with_room)
        for worker in loads:
            if worker not in with_room:
                alone_with_a_fresh_one = fleet_room([worker, load("fresh", limit=1)], NOW, SETTINGS)
                net = alone_with_a_fresh_one.total_slots - alone_with_a_fresh_one.foreign_slots - 1
                assert net <= worker.own_requests


@pytest.mark.parametrize(
    ("worker", "free"),
    [
        (load(own=7), True),
        (load(own=8), False),
        (load(own=4, others=4), False),
        (load(own=4, others=3), True),
        (load(waiting=1), False),  # its engine queues: full whatever the counts say
        (load(kv=0.95), False),
        (load(own=7, reported_at=NOW - 60), True),  # a late report: the counts decide
        (load(own=7, reported_at=None), True),
        (load(limit=0, own=63), True),  # not known yet: the default limit
        (load(limit=0, own=64), False),
    ],
)
def test_where_routing_finds_a_free_slot(worker: WorkerLoad, free: bool) -> None:
    assert (workers_with_free_slots([worker], SETTINGS) == [worker]) is free


def test_with_processes_each_counts_its_share_of_a_worker_for_routing_too() -> None:
    # Two processes over a worker of 8: each has 4 slots, of which the other's sequences take
    # only what overflows the other half.
    two = CapacitySettings(processes=2)
    assert workers_with_free_slots([load(own=3, others=4)], two) != []
    assert workers_with_free_slots([load(own=4, others=0)], two) == []
    assert workers_with_free_slots([load(own=3, others=5)], two) == []
