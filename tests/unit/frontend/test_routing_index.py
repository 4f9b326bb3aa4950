"""The block index: tables of what a router relies on, and laws against a plain model."""

from __future__ import annotations

import math
import random
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_frontend.routing.index import (
    BYTES_PER_ENTRY,
    BYTES_PER_KEY,
    BYTES_PER_RECORD,
    BYTES_PER_RECORD_KEY,
    BlockIndex,
    as_mapping,
)

WORKERS = ("a", "b", "c")


def test_match_counts_each_workers_leading_blocks() -> None:
    index = BlockIndex()
    index.store("a", [1, 2, 3, 4])
    index.store("b", [1, 2])
    index.store("c", [9])
    assert index.match([1, 2, 3, 4, 5], WORKERS) == {"a": 4, "b": 2}


def test_match_stops_where_a_workers_blocks_end() -> None:
    # An engine's prefix cache ends at its first miss; an engine evicts a chain from its tail.
    index = BlockIndex()
    index.store("a", [1, 2, 3, 4, 5])
    index.remove("a", [5, 4])
    assert index.match([1, 2, 3, 4, 5], WORKERS) == {"a": 3}


@pytest.mark.parametrize("length", [15, 16, 17, 48, 49, 300])
def test_a_long_walk_counts_every_workers_depth(length: int) -> None:
    # Walks longer than one stretch of the walk (16, 32, 64... blocks).
    keys = list(range(1_000, 1_000 + length))
    index = BlockIndex()
    index.store("whole", keys)
    index.store("half", keys[: length // 2])
    index.store("one", keys[:1])
    index.store("none", [5])
    expected = {"whole": length, "half": length // 2, "one": 1}
    assert index.match(keys, ["whole", "half", "one", "none"]) == {w: d for w, d in expected.items() if d}


def test_match_only_among_the_workers_asked() -> None:
    index = BlockIndex()
    index.store("a", [1, 2])
    index.store("b", [1, 2])
    assert index.match([1, 2], ["b"]) == {"b": 2}
    assert index.match([1, 2], ["unknown"]) == {}
    assert index.match([], WORKERS) == {}


def test_clear_and_replace_and_forget() -> None:
    index = BlockIndex()
    index.store("a", [1, 2])
    index.store("b", [1])
    index.clear("a")
    assert index.held("a") == frozenset()
    assert index.holders(1) == {"b"}
    assert 2 not in index
    index.replace("b", [7, 8])
    assert as_mapping(index) == {"a": frozenset(), "b": {7, 8}}
    index.forget("b")
    assert index.workers() == {"a"}
    assert len(index) == 0
    assert index.entries == 0


def test_a_forgotten_workers_slot_is_reused_without_its_expiries() -> None:
    index = BlockIndex()
    index.store("a", [1, 2], expires=10.0)
    index.forget("a")
    index.store("b", [1, 2], expires=10.0)  # same slot, same key, same expiry
    index.store("b", [1, 2], expires=20.0)
    assert index.expire(10.0) == 0
    assert index.held("b") == {1, 2}
    assert index.expire(20.0) == 2
    assert index.held("b") == frozenset()


def test_expire_removes_approximate_entries_at_their_time() -> None:
    index = BlockIndex()
    index.store("a", [1, 2], expires=10.0)
    index.store("a", [1], expires=20.0)  # refreshed: lives on
    index.store("b", [1, 2])  # exact: never expires
    index.store("b", [3], expires=5.0)
    assert index.expire(9.0) == 1  # b's 3
    assert index.expire(10.0) == 1  # a's 2
    assert as_mapping(index) == {"a": {1}, "b": {1, 2}}
    assert index.expire(math.inf) == 1
    assert as_mapping(index) == {"a": frozenset(), "b": {1, 2}}


def test_an_exact_entry_does_not_become_an_expiring_one() -> None:
    index = BlockIndex()
    index.store("a", [1])
    index.store("a", [1], expires=1.0)
    assert index.expire(2.0) == 0
    assert index.held("a") == {1}


def test_the_cap_evicts_least_recently_used_keys() -> None:
    per_key = BYTES_PER_KEY + BYTES_PER_ENTRY
    index = BlockIndex(max_bytes=10 * per_key)
    index.store("a", list(range(100, 105)))  # chain A
    index.store("a", list(range(200, 205)))  # chain B
    index.match([100, 101], WORKERS)  # A's head is the most recent now
    index.store("a", [300])
    assert index.bytes <= 10 * per_key
    assert index.stats().evicted >= 1
    assert 100 in index
    assert 101 in index
    assert 300 in index
    # B was the least recently used: its tail went first, its head last.
    left_of_b = [k for k in range(200, 205) if k in index]
    assert left_of_b == list(range(200, 200 + len(left_of_b)))


def test_a_match_below_half_the_cap_leaves_the_store_order() -> None:
    # Below half its cap the index cannot evict before as much again is stored, so a match
    # there does not pay to reorder: keys not used since are evicted in the order stored.
    per_key = BYTES_PER_KEY + BYTES_PER_ENTRY
    index = BlockIndex(max_bytes=10 * per_key)
    index.store("a", [100, 101])  # chain A, 2 of 10
    index.store("a", [200, 201])  # chain B, 4 of 10
    assert index.match([100, 101], WORKERS) == {"a": 2}  # below half: A stays the oldest
    index.store("a", list(range(300, 306)))  # 10 of 10
    assert index.match([300], WORKERS) == {"a": 1}  # over half: touched
    index.store("a", [400])  # over the cap: evicts down to 95 %
    assert 100 not in index
    assert 200 in index
    assert 300 in index


def test_a_match_over_half_the_cap_keeps_the_matched_prefix_from_eviction() -> None:
    per_key = BYTES_PER_KEY + BYTES_PER_ENTRY
    index = BlockIndex(max_bytes=10 * per_key)
    index.store("a", list(range(100, 105)))  # A, the oldest
    index.store("a", list(range(200, 205)))  # B
    assert index.match(list(range(100, 105)), WORKERS) == {"a": 5}  # A is the most recent now
    index.store("a", [300, 301, 302])  # over the cap: 4 keys go, B's tail
    assert index.match(list(range(100, 105)), WORKERS) == {"a": 5}
    assert [k for k in range(200, 205) if k in index] == [200]


def test_a_match_past_a_hole_touches_the_blocks_there_are() -> None:
    per_key = BYTES_PER_KEY + BYTES_PER_ENTRY
    index = BlockIndex(max_bytes=7 * per_key)
    index.store("a", [1, 2, 3, 4, 5, 6])
    index.remove("a", [2])  # a hole, which no engine makes: the bisection counts past it
    index.store("b", [9])  # the most recent, until the match
    assert index.match([1, 2, 3, 4, 5, 6], WORKERS) == {"a": 6}  # over half the cap: touched
    index.store("b", [10, 11, 12])  # over the cap: the 3 least recent go, 9 first
    assert 9 not in index
    assert all(k in index for k in (1, 3, 4))


def test_eviction_takes_a_chains_tail_before_its_head() -> None:
    per_key = BYTES_PER_KEY + BYTES_PER_ENTRY
    index = BlockIndex(max_bytes=20 * per_key)
    index.store("a", list(range(40)))
    assert list(index.held("a"))
    assert index.held("a") == set(range(len(index.held("a"))))
    assert index.match(list(range(40)), WORKERS) == {"a": len(index.held("a"))}


def test_size_estimate_tracks_measured_memory() -> None:
    """The estimate the cap applies to is never far below what tracemalloc measures (the cap
    holds) nor far above (the cap is not wasted)."""
    rand = random.Random(7)
    for workers, approximate in ((1, False), (8, False), (1, True), (8, True)):
        tracemalloc.start()
        try:
            index = BlockIndex()
            for i in range(300):
                keys = [rand.getrandbits(64) for _ in range(64)]
                for w in range(workers):
                    if w == 0 or rand.random() < 0.5:
                        # Approximate: each store's record held to its expiry with its blocks.
                        index.store(f"w{w}", keys, expires=1_000.0 + i if approximate else math.inf)
            del keys
            measured = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert 0.9 * measured <= index.bytes <= 1.6 * measured, (workers, approximate, measured, index.bytes)


def test_an_index_at_its_cap_evicts_when_approximate_entries_push_it_over() -> None:
    # An approximate store keeps its keys until it expires (to expire its entries then): that
    # memory counts in the cap, so blocks that would fit by themselves can push it over.
    per_key = BYTES_PER_KEY + BYTES_PER_ENTRY
    record = BYTES_PER_RECORD + 4 * BYTES_PER_RECORD_KEY
    index = BlockIndex(max_bytes=9 * per_key + record - 1)
    index.store("a", list(range(100, 105)))  # exact, the least recently used
    index.store("b", [200, 201, 202, 203], expires=100.0)  # 9 blocks and a record: over
    assert index.bytes <= 9 * per_key + record - 1
    assert index.stats().evicted >= 1
    assert 104 not in index  # a's tail went first
    assert index.held("b") == {200, 201, 202, 203}
    assert index.expire(100.0) == 4
    assert index.bytes == len(index) * per_key


def test_approximate_stores_keep_an_index_within_its_cap_in_memory() -> None:
    """However many approximate stores an index takes before they expire (a worker sent the
    same long prompt again and again), the memory it holds stays within its cap, and the
    latest store's blocks stay: a store's record lets go of its keys once every entry it made
    was stored again later (or removed, or evicted)."""
    rand = random.Random(3)
    exact = [rand.getrandbits(64) for _ in range(64)]
    sent = [rand.getrandbits(64) for _ in range(512)]
    cap = 200_000
    tracemalloc.start()
    try:
        index = BlockIndex(max_bytes=cap)
        index.store("a", exact)
        for i in range(200):  # 200 records of 512 keys: about 900 KB unchecked
            index.store("b", sent, expires=1_000.0 + i)
            assert index.bytes <= cap
        measured = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert measured <= 1.1 * cap, measured
    assert index.held("b") == set(sent)
    assert index.held("a") == set(exact)
    assert index.expire(1_000.0 + 198) == 0  # every block was stored again since
    assert index.expire(1_000.0 + 199) == len(sent)
    assert index.bytes == len(exact) * (BYTES_PER_KEY + BYTES_PER_ENTRY)


def test_max_bytes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        BlockIndex(max_bytes=0)


# ---------------------------------------------------------------- laws

_keys = st.lists(st.integers(min_value=0, max_value=30), max_size=8)
_worker = st.sampled_from(WORKERS)
_Op = tuple[str, str, list[int]]
_op: st.SearchStrategy[_Op] = st.one_of(
    st.tuples(st.just("store"), _worker, _keys),
    st.tuples(st.just("remove"), _worker, _keys),
    st.tuples(st.just("clear"), _worker, st.just([])),
    st.tuples(st.just("replace"), _worker, _keys),
    st.tuples(st.just("forget"), _worker, st.just([])),
)


def _replay(ops: list[tuple[str, str, list[int]]]) -> tuple[BlockIndex, dict[str, set[int]]]:
    index = BlockIndex()
    model: dict[str, set[int]] = {}
    for op, worker, keys in ops:
        if op == "store":
            index.store(worker, keys)
            if keys:
                model.setdefault(worker, set()).update(keys)
        elif op == "remove":
            index.remove(worker, keys)
            if worker in model:
                model[worker] -= set(keys)
        elif op == "clear":
            index.clear(worker)
            if worker in model:
                model[worker] = set()
        elif op == "replace":
            index.replace(worker, keys)
            model[worker] = set(keys)
        else:
            index.forget(worker)
            model.pop(worker, None)
    return index, model


@given(st.lists(_op, max_size=40))
def test_law_the_index_equals_a_replay_of_what_it_was_fed(ops: list[tuple[str, str, list[int]]]) -> None:
    index, model = _replay(ops)
    assert {w: set(k) for w, k in as_mapping(index).items()} == model
    every = set().union(*model.values()) if model else set()
    assert {k for k in range(31) if k in index} == every
    for key in every:
        assert index.holders(key) == {w for w, held in model.items() if key in held}
    assert index.entries == sum(len(held) for held in model.values())


@given(
    st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=300, unique=True),
    st.dictionaries(st.sampled_from(WORKERS), st.tuples(st.integers(min_value=0), st.integers(min_value=0))),
)
def test_law_match_is_the_longest_held_prefix(
    request: list[int], holdings: dict[str, tuple[int, int]]
) -> None:
    # Holdings as they come (prefix-closed): each worker holds a leading run of the request's
    # blocks, stored as a longer chain and cut back from its tail, as an engine evicts.
    index = BlockIndex()
    expected = {}
    for worker, (held, stored) in holdings.items():
        held %= len(request) + 1
        stored = held + stored % (len(request) + 1 - held)
        index.store(worker, request[:stored])
        index.remove(worker, request[held:stored])
        index.store(worker, [20_000 + held])  # a block of another prompt
        if held:
            expected[worker] = held
    assert index.match(request, WORKERS) == expected


@given(st.lists(_op, max_size=40), st.lists(st.integers(min_value=0, max_value=30), max_size=70))
def test_law_match_ends_each_count_at_the_end_of_a_held_run(
    ops: list[tuple[str, str, list[int]]], request: list[int]
) -> None:
    # Any holdings, holes included: a worker's count ends a run of blocks it holds.
    index, model = _replay(ops)
    found = index.match(request, WORKERS)
    for worker, depth in found.items():
        held = model.get(worker, set())
        assert 0 < depth <= len(request)
        assert request[depth - 1] in held
        assert depth == len(request) or request[depth] not in held
    for worker, held in model.items():
        if request and request[0] in held and worker not in found:
            raise AssertionError(f"{worker} holds the first block and was left out")


@given(
    st.lists(
        st.tuples(_worker, _keys, st.one_of(st.none(), st.floats(min_value=0, max_value=100))),
        max_size=30,
    ),
    st.floats(min_value=0, max_value=120),
)
def test_law_expiry_keeps_exactly_the_entries_whose_latest_expiry_is_later(
    stores: list[tuple[str, list[int], float | None]], now: float
) -> None:
    index = BlockIndex()
    latest: dict[tuple[str, int], float] = {}
    for worker, keys, expires in stores:
        when = math.inf if expires is None else expires
        index.store(worker, keys, expires=when)
        for key in keys:
            latest[(worker, key)] = max(latest.get((worker, key), -math.inf), when)
    index.expire(now)
    kept = {(w, k) for (w, k), when in latest.items() if when > now}
    assert {(w, k) for w, held in as_mapping(index).items() for k in held} == kept


@given(
    st.lists(
        st.tuples(
            _worker,
            st.lists(st.integers(0, 10_000), max_size=30),
            st.one_of(st.none(), st.floats(min_value=0, max_value=100)),
        ),
        max_size=30,
    ),
    st.integers(3, 40),
)
def test_law_under_a_cap_the_index_stays_under_it_and_within_what_it_was_fed(
    stores: list[tuple[str, list[int], float | None]], cap_keys: int
) -> None:
    cap = cap_keys * (BYTES_PER_KEY + BYTES_PER_ENTRY * len(WORKERS))
    index = BlockIndex(max_bytes=cap)
    fed: dict[str, set[int]] = {}
    for worker, keys, expires in stores:
        index.store(worker, keys, expires=math.inf if expires is None else expires)
        fed.setdefault(worker, set()).update(keys)
        assert index.bytes <= cap
    for worker, held in as_mapping(index).items():
        assert held <= fed.get(worker, set())


@given(
    st.lists(
        st.one_of(
            _op,
            st.tuples(st.just("approx"), _worker, _keys),
            st.tuples(st.just("expire"), _worker, st.just([])),
        ),
        max_size=40,
    ),
    st.one_of(st.none(), st.integers(1, 40)),
)
def test_law_an_emptied_index_counts_no_memory(
    ops: list[tuple[str, str, list[int]]], cap_keys: int | None
) -> None:
    # Whatever was stored, approximate or exact, and whatever removed, evicted or expired it,
    # nothing is left counted once every worker holds nothing: no record outlives its entries.
    index = BlockIndex(max_bytes=None if cap_keys is None else cap_keys * (BYTES_PER_KEY + BYTES_PER_ENTRY))
    clock = 0.0
    for op, worker, keys in ops:
        clock += 1.0
        if op == "store":
            index.store(worker, keys)
        elif op == "approx":
            index.store(worker, keys, expires=clock + 3.0)
        elif op == "expire":
            index.expire(clock)
        elif op == "remove":
            index.remove(worker, keys)
        elif op == "clear":
            index.clear(worker)
        elif op == "replace":
            index.replace(worker, keys)
        else:
            index.forget(worker)
    for worker in WORKERS:
        index.clear(worker)
    assert (len(index), index.entries, index.bytes) == (0, 0, 0)
    assert index.expire(math.inf) == 0


_TimedOp = tuple[str, str, list[int], float | None]
_timed_op: st.SearchStrategy[_TimedOp] = st.one_of(
    st.tuples(st.just("store"), _worker, _keys, st.one_of(st.none(), st.floats(0, 50))),
    st.tuples(st.just("remove"), _worker, _keys, st.none()),
    st.tuples(st.just("clear"), _worker, st.just([]), st.none()),
    st.tuples(st.just("forget"), _worker, st.just([]), st.none()),
    st.tuples(st.just("expire"), _worker, st.just([]), st.floats(0, 50)),
)


@given(st.lists(_timed_op, max_size=50))
def test_law_expiry_after_removals_and_forgetting_is_a_replay_of_the_latest_expiries(
    ops: list[tuple[str, str, list[int], float | None]],
) -> None:
    # Each entry holds the latest expiry stored for it (exact: never); whatever was removed,
    # cleared or forgotten in between, an expiry removes exactly the entries due, and says how many.
    index = BlockIndex()
    model: dict[tuple[str, int], float] = {}
    for op, worker, keys, when in ops:
        if op == "store":
            expires = math.inf if when is None else when
            index.store(worker, keys, expires=expires)
            for key in keys:
                model[(worker, key)] = max(model.get((worker, key), -math.inf), expires)
        elif op == "remove":
            index.remove(worker, keys)
            for key in keys:
                model.pop((worker, key), None)
        elif op in ("clear", "forget"):
            getattr(index, op)(worker)
            model = {(w, k): e for (w, k), e in model.items() if w != worker}
        else:
            assert when is not None
            due = {entry for entry, expiry in model.items() if expiry <= when}
            assert index.expire(when) == len(due)
            model = {entry: e for entry, e in model.items() if entry not in due}
        held = {(w, k) for w, keys_held in as_mapping(index).items() for k in keys_held}
        assert held == set(model)
