"""The worker's merged cache view (sidecar_server.kv_view): ranks merged, deltas numbered,
snapshot plus resume giving a client exactly the view's state."""

from __future__ import annotations

from typing import Final

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar_server.kv_state import KvDelta
from sidecar_server.kv_view import NumberedDelta, WorkerCacheView

KEYS: Final = st.integers(1, 12)
rank_deltas = st.tuples(
    st.integers(0, 2),
    st.builds(
        KvDelta,
        added=st.lists(KEYS, max_size=4, unique=True).map(lambda keys: tuple((key, 0) for key in keys)),
        removed=st.lists(KEYS, max_size=4, unique=True).map(tuple),
        cleared=st.booleans().map(lambda b: b and False) | st.just(True),
    ),
)


def consistent(delta: KvDelta) -> KvDelta:
    added = {key for key, _ in delta.added}
    return KvDelta(
        added=delta.added, removed=tuple(k for k in delta.removed if k not in added), cleared=delta.cleared
    )


def apply(keys: set[int], delta: KvDelta) -> None:
    if delta.cleared:
        keys.clear()
    keys.difference_update(delta.removed)
    keys.update(key for key, _ in delta.added)


@settings(max_examples=200, deadline=None)
@given(st.lists(rank_deltas, max_size=30), st.integers(0, 30), st.integers(1, 8))
def test_a_snapshot_then_the_deltas_after_it_is_the_view(
    script: list[tuple[int, KvDelta]], snapshot_at: int, kept: int
) -> None:
    view = WorkerCacheView(epoch=7, kept_deltas=kept)
    per_rank: dict[int, set[int]] = {}
    client: set[int] | None = None
    last = 0
    for index, (rank, delta) in enumerate(script):
        if index == snapshot_at:
            snapshot = view.snapshot()
            client, last = {key for key, _ in snapshot.blocks}, snapshot.sequence
        delta = consistent(delta)
        apply(per_rank.setdefault(rank, set()), delta)
        view.apply(rank, delta)
        union = set().union(*per_rank.values())
        assert {key for key, _ in view.snapshot().blocks} == union
        if client is not None:
            pending = view.deltas_after(7, last)
            if pending is None:  # fell behind what is kept: a fresh snapshot
                snapshot = view.snapshot()
                client, last = {key for key, _ in snapshot.blocks}, snapshot.sequence
                continue
            for numbered in pending:
                apply(client, numbered.delta)
                last = numbered.sequence
            assert client == union


def test_a_key_stays_while_another_rank_holds_it() -> None:
    view = WorkerCacheView(epoch=1)
    assert view.apply(0, KvDelta(added=((5, 1),))) == NumberedDelta(1, KvDelta(added=((5, 1),)))
    assert view.apply(1, KvDelta(added=((5, 1), (6, 5)))) == NumberedDelta(2, KvDelta(added=((6, 5),)))
    # Rank 0 resyncs: its clear reaches clients as removals, since rank 1 still holds blocks.
    assert view.apply(0, KvDelta(cleared=True)) is None
    assert view.apply(1, KvDelta(removed=(6,))) == NumberedDelta(3, KvDelta(removed=(6,)))
    assert view.apply(1, KvDelta(cleared=True)) == NumberedDelta(4, KvDelta(cleared=True))
    assert len(view) == 0


def test_a_merged_delta_keeps_the_engine_time_of_the_ranks_delta() -> None:
    view = WorkerCacheView(epoch=1)
    assert view.apply(0, KvDelta(added=((5, 1),), engine_time=12.5)) == NumberedDelta(
        1, KvDelta(added=((5, 1),), engine_time=12.5)
    )
    numbered = view.apply(0, KvDelta(cleared=True, engine_time=13.0))
    assert numbered == NumberedDelta(2, KvDelta(cleared=True, engine_time=13.0))
    assert view.deltas_after(1, 0) == [
        NumberedDelta(1, KvDelta(added=((5, 1),), engine_time=12.5)),
        NumberedDelta(2, KvDelta(cleared=True, engine_time=13.0)),
    ]


def test_deltas_after_names_what_a_client_can_resume_from() -> None:
    view = WorkerCacheView(epoch=3, kept_deltas=2)
    for key in (1, 2, 3):
        view.apply(0, KvDelta(added=((key, 0),)))
    assert view.deltas_after(3, 3) == []
    assert [numbered.sequence for numbered in view.deltas_after(3, 1) or []] == [2, 3]
    assert view.deltas_after(3, 0) is None  # delta 1 is no longer kept
    assert view.deltas_after(4, 3) is None  # another process's epoch
    assert view.deltas_after(3, 9) is None  # a sequence this view never reached


def test_kept_deltas_must_be_positive() -> None:
    with pytest.raises(ValueError, match="kept_deltas"):
        WorkerCacheView(epoch=1, kept_deltas=0)


def test_an_announcement_names_the_blocks_after_those_held_and_changes_nothing_held() -> None:
    view = WorkerCacheView(epoch=1)
    view.apply(0, KvDelta(added=((10, 0), (11, 10))))
    before = view.snapshot().blocks
    numbered = view.announce([10, 11, 12, 13])
    assert numbered is not None
    assert (numbered.sequence, numbered.delta.announced) == (2, (12, 13))
    assert view.snapshot().blocks == before
    assert view.deltas_after(1, 1) == [numbered]  # a client resuming gets it too
    assert view.announce([10, 11]) is None  # all held already: nothing to say
    assert view.announce([]) is None


@pytest.mark.parametrize("held", [0, 1, 2, 5, 7, 8])
def test_an_announcement_starts_after_any_length_of_held_blocks(held: int) -> None:
    view = WorkerCacheView(epoch=1)
    chain = list(range(100, 108))
    if held:
        view.apply(0, KvDelta(added=tuple(zip(chain[:held], [0, *chain[: held - 1]], strict=True))))
    numbered = view.announce(chain)
    assert (numbered.delta.announced if numbered is not None else ()) == tuple(chain[held:])
