"""``--processes N``: each process counts its share of every worker (admission/capacity.py), so
N processes together admit no more than the worker's limit (give or take the rounding up)."""

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
    workers_with_room,
)

NOW = 100.0


def load(
    *, limit: int = 8, own: int = 0, others: int = 0, waiting: int = 0, reported_at: float | None = NOW
) -> WorkerLoad:
    return WorkerLoad(
        address="w",
        running_limit=limit,
        own_requests=own,
        others_requests=others,
        engine_waiting=waiting,
        kv_usage=0.1,
        reported_at=reported_at,
    )


def settings(processes: int) -> CapacitySettings:
    return CapacitySettings(processes=processes)


@pytest.mark.parametrize(
    ("processes", "worker", "room"),
    [
        pytest.param(2, load(limit=8), Room(4, 0, 1, 0), id="half of 8"),
        pytest.param(3, load(limit=8), Room(3, 0, 1, 0), id="a third of 8, rounded up"),
        pytest.param(16, load(limit=8), Room(1, 0, 1, 0), id="at least one slot"),
        pytest.param(2, load(limit=0), Room(32, 0, 1, 0), id="unknown limit: half the default"),
        pytest.param(2, load(limit=8, others=4), Room(4, 0, 1, 0), id="the sibling's half is not ours"),
        pytest.param(
            2, load(limit=8, others=6), Room(4, 2, 1, 0), id="what overflows the rest reaches our share"
        ),
        pytest.param(2, load(limit=8, own=1, waiting=1), Room(4, 3, 1, 0), id="engine full: share - own"),
        pytest.param(
            2, load(limit=8, own=1, reported_at=NOW - 10), Room(4, 0, 1, 1), id="every one stale: own only"
        ),
    ],
)
def test_a_process_counts_its_share(processes: int, worker: WorkerLoad, room: Room) -> None:
    assert fleet_room([worker], NOW, settings(processes)) == room


def test_a_stale_worker_among_fresh_ones_is_full_within_the_share() -> None:
    stale = load(limit=8, own=1, reported_at=NOW - 10)
    room = fleet_room([stale, load(limit=8)], NOW, settings(2))
    assert room == Room(8, 3, 2, 1)


@pytest.mark.parametrize(
    ("worker", "has_room"),
    [
        (load(limit=8, own=3), True),
        (load(limit=8, own=4), False),
        (load(limit=8, own=3, others=5), False),  # one of the others' overflows into our share
        (load(limit=8, own=3, others=4), True),  # the sibling's half: not ours to count
    ],
)
def test_worker_has_room_within_the_share(worker: WorkerLoad, has_room: bool) -> None:
    assert worker_has_room(worker, NOW, settings(2)) is has_room


def test_every_worker_stale_a_process_fills_its_share_only() -> None:
    stale = [load(limit=8, own=3, reported_at=None), load(limit=8, own=4, reported_at=None)]
    assert [w.own_requests for w in workers_with_room(stale, NOW, settings(2))] == [3]


@given(
    limit=st.integers(0, 300),
    own=st.integers(0, 300),
    others=st.integers(0, 300),
    waiting=st.integers(0, 2),
    stale=st.booleans(),
)
def test_one_process_counts_the_whole_worker_as_before(
    limit: int, own: int, others: int, waiting: int, stale: bool
) -> None:
    worker = load(
        limit=limit, own=own, others=others, waiting=waiting, reported_at=NOW - 10 if stale else NOW
    )
    room = fleet_room([worker], NOW, settings(1))
    whole = limit or CapacitySettings().default_running_limit
    assert room.total_slots == whole
    if not stale and not waiting:
        assert room.foreign_slots == others
        assert worker_has_room(worker, NOW, settings(1)) is (own + others < whole)


def _admit_all(limit: int, processes: int, reports: bool, order: list[int]) -> list[int]:
    """Processes admitting one sequence at a time, in ``order`` (indices, repeated), while their
    room says so. With ``reports`` each sees the others' sequences at once (a sidecar report
    after every admission); without, never (a burst before any report)."""
    held = [0] * processes
    config = settings(processes)
    for index in order:
        others = sum(held) - held[index] if reports else 0
        worker = load(limit=limit, own=held[index], others=others)
        room = fleet_room([worker], NOW, config)
        if room.total_slots - room.foreign_slots - held[index] > 0:
            held[index] += 1
    return held


@given(
    limit=st.integers(1, 64),
    processes=st.integers(1, 8),
    reports=st.booleans(),
    data=st.data(),
)
def test_processes_together_admit_at_most_the_worker_limit(
    limit: int, processes: int, reports: bool, data: st.DataObject
) -> None:
    order = data.draw(st.lists(st.integers(0, processes - 1), max_size=200))
    held = _admit_all(limit, processes, reports, order)
    share = -(-limit // processes)
    assert all(count <= share for count in held)
    # Rounding each share up lets the processes together pass the limit by less than N.
    assert sum(held) <= max(limit, share * processes)
    if reports:
        # Seeing each other's sequences, they never pass the worker's limit.
        assert sum(held) <= limit


@given(limit=st.integers(1, 64), processes=st.integers(1, 8))
def test_processes_together_can_fill_the_worker(limit: int, processes: int) -> None:
    # Taking turns with every report in place, they use every slot (none is lost to the shares).
    held = _admit_all(limit, processes, True, list(range(processes)) * (limit + 1))
    assert sum(held) == limit
