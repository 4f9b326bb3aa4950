"""A worker's cache stream applied to the index: snapshots, deltas, duplicates and gaps."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.kv_keys import KEY_SCHEME, block_keys
from sidecar_frontend.routing.feed import ANNOUNCED_TTL, CacheFeed, Step, stated_key_scheme
from sidecar_frontend.routing.index import BlockIndex
from sidecar_frontend.routing.router import Router, RouterConfig, Routing


def _feed() -> CacheFeed:
    index = BlockIndex()
    return CacheFeed("w", lambda: index)


def test_a_snapshot_in_chunks_is_whole_after_its_last_chunk() -> None:
    feed = _feed()
    feed.index.store("w", [99], expires=5.0)  # an approximate guess from before
    assert (
        feed.snapshot_chunk(7, 10, 16, [1, 2], last_chunk=False, engine_published=True, key_scheme=KEY_SCHEME)
        is Step.GATHERED
    )
    assert not feed.live
    assert feed.index.held("w") == {99}
    assert (
        feed.snapshot_chunk(7, 10, 16, [3], last_chunk=True, engine_published=True, key_scheme=KEY_SCHEME)
        is Step.SNAPSHOT
    )
    assert (feed.live, feed.resume_from, feed.block_size) == (True, (7, 10), 16)
    assert feed.index.held("w") == {1, 2, 3}


def test_a_new_snapshot_drops_the_chunks_of_an_unfinished_one() -> None:
    feed = _feed()
    feed.snapshot_chunk(1, 5, 16, [1, 2], last_chunk=False, engine_published=False, key_scheme=KEY_SCHEME)
    feed.snapshot_chunk(2, 0, 16, [8], last_chunk=True, engine_published=False, key_scheme=KEY_SCHEME)
    assert feed.index.held("w") == {8}
    assert feed.engine_publishes is False


def test_deltas_apply_in_order_cleared_removed_added() -> None:
    feed = _feed()
    feed.snapshot_chunk(1, 0, 16, [1, 2, 3], last_chunk=True, engine_published=True, key_scheme=KEY_SCHEME)
    assert feed.delta(1, 1, cleared=False, removed=[2], added=[4]) is Step.APPLIED
    assert feed.index.held("w") == {1, 3, 4}
    assert feed.delta(1, 2, cleared=True, removed=[5], added=[5, 6]) is Step.APPLIED
    assert feed.index.held("w") == {5, 6}
    assert feed.resume_from == (1, 2)


def test_a_delta_already_applied_is_ignored() -> None:
    feed = _feed()
    feed.snapshot_chunk(1, 3, 16, [1], last_chunk=True, engine_published=True, key_scheme=KEY_SCHEME)
    assert feed.delta(1, 3, cleared=True, removed=[], added=[]) is Step.DUPLICATE
    assert feed.index.held("w") == {1}


def test_gaps_apply_nothing() -> None:
    feed = _feed()
    assert feed.delta(1, 1, cleared=False, removed=[], added=[1]) is Step.GAP  # before any snapshot
    feed.snapshot_chunk(1, 0, 16, [1], last_chunk=True, engine_published=True, key_scheme=KEY_SCHEME)
    assert feed.delta(1, 2, cleared=False, removed=[1], added=[]) is Step.GAP  # skipped one
    assert feed.delta(2, 1, cleared=False, removed=[1], added=[]) is Step.GAP  # another epoch
    assert feed.index.held("w") == {1}
    assert feed.resume_from == (1, 0)
    assert feed.counts.gaps == 3


def test_a_delta_says_the_engine_publishes() -> None:
    feed = _feed()
    feed.snapshot_chunk(1, 0, 16, [], last_chunk=True, engine_published=False, key_scheme=KEY_SCHEME)
    assert not feed.engine_publishes
    feed.delta(1, 1, cleared=False, removed=[], added=[1])
    assert feed.engine_publishes


def test_resyncs_count_snapshots_after_the_first() -> None:
    feed = _feed()
    feed.snapshot_chunk(1, 0, 16, [1], last_chunk=True, engine_published=True, key_scheme=KEY_SCHEME)
    assert feed.counts.resyncs == 0
    feed.snapshot_chunk(2, 0, 16, [2], last_chunk=True, engine_published=True, key_scheme=KEY_SCHEME)
    assert feed.counts.resyncs == 1


def test_stop_forgets_the_worker() -> None:
    feed = _feed()
    feed.snapshot_chunk(1, 0, 16, [1], last_chunk=True, engine_published=True, key_scheme=KEY_SCHEME)
    feed.stop()
    assert feed.index.workers() == frozenset()
    assert feed.resume_from is None


def test_a_snapshot_in_this_frontends_key_layout_is_indexed() -> None:
    index = BlockIndex()
    feed = CacheFeed("w", lambda: index, key_scheme=2)
    assert (
        feed.snapshot_chunk(1, 0, 16, [1, 2], last_chunk=True, engine_published=True, key_scheme=2)
        is Step.SNAPSHOT
    )
    assert (feed.live, feed.foreign_scheme, index.held("w")) == (True, None, frozenset({1, 2}))


def test_a_snapshot_in_another_key_layout_indexes_nothing_and_the_worker_counts_as_not_live() -> None:
    """In a rolling upgrade of sidecar_common.kv_keys, a sidecar's keys can match none of a
    request's: they are not indexed, and what an earlier snapshot left goes too."""
    index = BlockIndex()
    feed = CacheFeed("w", lambda: index, key_scheme=2)
    feed.snapshot_chunk(1, 0, 16, [1, 2], last_chunk=True, engine_published=True, key_scheme=2)
    # The sidecar restarted on the other layout: its first chunk already says so.
    step = feed.snapshot_chunk(9, 0, 16, [5, 6], last_chunk=False, engine_published=True, key_scheme=3)
    assert step is Step.FOREIGN
    assert (feed.live, feed.resume_from, feed.foreign_scheme) == (False, None, 3)
    assert index.held("w") == set()
    assert index.workers() == frozenset()
    # Once it sends this frontend's layout again, it is indexed again.
    feed.snapshot_chunk(10, 0, 16, [7], last_chunk=True, engine_published=True, key_scheme=2)
    assert (feed.live, feed.foreign_scheme, index.held("w")) == (True, None, frozenset({7}))


def test_a_snapshot_without_a_key_layout_is_in_layout_1() -> None:
    """key_scheme 0: a sidecar older than the field, whose keys follow layout 1."""
    assert stated_key_scheme(0) == 1
    index = BlockIndex()
    on_1 = CacheFeed("w", lambda: index, key_scheme=1)
    assert (
        on_1.snapshot_chunk(1, 0, 16, [1], last_chunk=True, engine_published=True, key_scheme=0)
        is Step.SNAPSHOT
    )
    assert index.held("w") == {1}
    on_2 = CacheFeed("v", lambda: index, key_scheme=2)
    assert (
        on_2.snapshot_chunk(1, 0, 16, [1], last_chunk=True, engine_published=True, key_scheme=0)
        is Step.FOREIGN
    )
    assert (on_2.live, on_2.foreign_scheme, index.held("v")) == (False, 1, frozenset())


# ---------------------------------------------------------------- laws


@dataclass(frozen=True)
class _Delta:
    cleared: bool
    removed: tuple[int, ...]
    added: tuple[int, ...]


_deltas = st.lists(
    st.builds(
        _Delta,
        st.sampled_from([False, False, False, True]),
        st.lists(st.integers(0, 20), max_size=4).map(tuple),
        st.lists(st.integers(0, 20), max_size=4).map(tuple),
    ),
    max_size=25,
)


def _model(start: set[int], deltas: list[_Delta]) -> set[int]:
    held = set(start)
    for d in deltas:
        if d.cleared:
            held = set()
        held -= set(d.removed)
        held |= set(d.added)
    return held


@given(st.sets(st.integers(0, 20)), _deltas)
def test_law_the_index_equals_a_replay_of_the_stream(start: set[int], deltas: list[_Delta]) -> None:
    feed = _feed()
    feed.snapshot_chunk(
        3, 100, 16, sorted(start), last_chunk=True, engine_published=True, key_scheme=KEY_SCHEME
    )
    for n, d in enumerate(deltas, start=101):
        assert feed.delta(3, n, cleared=d.cleared, removed=d.removed, added=d.added) is Step.APPLIED
    assert feed.index.held("w") == _model(start, deltas)


@given(st.sets(st.integers(0, 20)), _deltas, st.data())
def test_law_a_gap_filled_by_resuming_gives_the_same_index_as_no_gap(
    start: set[int], deltas: list[_Delta], data: st.DataObject
) -> None:
    """Deltas lost in transit show as a gap; the stream resumed from the feed's point (the
    sidecar replays from there, duplicates included) ends where an unbroken stream would."""
    feed = _feed()
    feed.snapshot_chunk(
        3, 0, 16, sorted(start), last_chunk=True, engine_published=True, key_scheme=KEY_SCHEME
    )
    numbered = list(enumerate(deltas, start=1))
    delivered = 0
    for attempt in range(3 * len(numbered) + 1):
        if delivered >= len(numbered):
            break
        # Some attempts lose deltas in transit; the last ones lose none, so the stream ends.
        lost = data.draw(st.integers(0, 2)) if attempt < 2 * len(numbered) else 0
        sent = numbered[delivered + lost :]
        for n, d in sent:
            step = feed.delta(3, n, cleared=d.cleared, removed=d.removed, added=d.added)
            if step is Step.GAP:
                break
        resume = feed.resume_from
        assert resume is not None
        delivered = resume[1] - data.draw(st.integers(0, min(2, resume[1])))  # replays may repeat
    assert feed.index.held("w") == _model(start, deltas)


@given(st.sets(st.integers(0, 20)), _deltas, st.sets(st.integers(0, 20)))
def test_law_after_a_resync_nothing_the_snapshot_lacks_is_indexed(
    start: set[int], deltas: list[_Delta], fresh: set[int]
) -> None:
    feed = _feed()
    feed.snapshot_chunk(
        1, 0, 16, sorted(start), last_chunk=True, engine_published=True, key_scheme=KEY_SCHEME
    )
    for n, d in enumerate(deltas, start=1):
        feed.delta(1, n, cleared=d.cleared, removed=d.removed, added=d.added)
    feed.snapshot_chunk(
        2, 0, 16, sorted(fresh), last_chunk=True, engine_published=True, key_scheme=KEY_SCHEME
    )
    assert feed.index.held("w") == fresh


def test_a_snapshot_after_the_router_dropped_the_empty_index_lands_in_the_one_it_reads() -> None:
    """The router drops an index that holds no worker (at each scrape) and makes a new one on
    next use; a feed whose snapshot had not come yet must not fill the dropped one (the streams
    give it ``functools.partial(router.index, model)``). A feed that held the first index
    object left a frontend's index empty for good under load."""
    router = Router(RouterConfig(routing=Routing.KV), block_keys)
    feed = CacheFeed("w", functools.partial(router.index, "m"))
    assert feed.index is router.index("m")
    router.retain({"w": "m"})  # a scrape before the snapshot: no worker in the index yet
    assert "m" not in router.indexes()
    assert (
        feed.snapshot_chunk(1, 0, 16, [5, 6], last_chunk=True, engine_published=True, key_scheme=KEY_SCHEME)
        is Step.SNAPSHOT
    )
    assert router.index("m").holders(5) == frozenset({"w"})
    assert feed.delta(1, 1, cleared=False, removed=[], added=[7]) is Step.APPLIED
    assert router.index("m").holders(7) == frozenset({"w"})


def test_announced_blocks_count_as_held_until_the_engine_stores_them_or_they_expire() -> None:
    feed = _feed()
    feed.snapshot_chunk(1, 0, 16, [1], last_chunk=True, engine_published=True, key_scheme=KEY_SCHEME)
    assert (
        feed.delta(1, 1, cleared=False, removed=[], added=[], announced=[2, 3, 4], now=100.0) is Step.APPLIED
    )
    assert feed.index.match([1, 2, 3, 4], ["w"]) == {"w": 4}
    # The engine's stored blocks arrive for 2 and 3 (the prefill ended): those are exact now.
    feed.delta(1, 2, cleared=False, removed=[], added=[2, 3], now=100.5)
    feed.index.expire(100.0 + ANNOUNCED_TTL)
    assert feed.index.held("w") == {1, 2, 3}  # 4, never stored, went at its expiry


def test_an_announcement_changes_no_exact_entry() -> None:
    feed = _feed()
    feed.snapshot_chunk(1, 0, 16, [1, 2], last_chunk=True, engine_published=True, key_scheme=KEY_SCHEME)
    feed.delta(1, 1, cleared=False, removed=[], added=[], announced=[1, 2], now=0.0)
    feed.index.expire(ANNOUNCED_TTL + 1)
    assert feed.index.held("w") == {1, 2}


def test_an_announcement_does_not_say_the_engine_publishes() -> None:
    feed = _feed()
    feed.snapshot_chunk(1, 0, 16, [], last_chunk=True, engine_published=False, key_scheme=KEY_SCHEME)
    feed.delta(1, 1, cleared=False, removed=[], added=[], announced=[1, 2], now=0.0)
    assert feed.engine_publishes is False
