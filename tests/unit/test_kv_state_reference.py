"""CacheMap's per-block loops (hoisted, inlined, removals run together) against a plain
reference: the same deltas, blocks and engine hashes on random batches over a few hashes and
tokens, so re-stores under another key, one key named by several hashes, opaque blocks,
removals between stores and clears all happen."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from sidecar_common.kv_keys import extend_keys, root_key
from sidecar_server.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    KvEvent,
    block_identity,
    is_tracked_tier,
)
from sidecar_server.kv_state import CacheMap, KvDelta


@dataclass
class _Held:
    parent: int
    hashes: int


class ReferenceMap:
    """The map written one block at a time, with no shortcuts (CacheMap before it had any)."""

    def __init__(self) -> None:
        self.block_size: int | None = None
        self.key_of: dict[EngineHash, int] = {}
        self.opaque: set[EngineHash] = set()
        self.blocks: dict[int, _Held] = {}
        self.touched: dict[int, bool] = {}
        self.cleared = False
        self.skipped_events = 0

    def apply(self, events: list[KvEvent]) -> KvDelta:
        for event in events:
            if isinstance(event, BlockStored):
                self.store(event)
            elif isinstance(event, BlockRemoved):
                if is_tracked_tier(event.medium, event.group_idx):
                    for engine_hash in event.block_hashes:
                        self.forget(engine_hash)
            else:
                self.key_of.clear()
                self.opaque.clear()
                self.blocks.clear()
                self.touched.clear()
                self.cleared = True
        if self.cleared:
            delta = KvDelta(added=tuple((k, h.parent) for k, h in self.blocks.items()), cleared=True)
        else:
            added = [
                (k, self.blocks[k].parent) for k, was in self.touched.items() if k in self.blocks and not was
            ]
            removed = [k for k, was in self.touched.items() if k not in self.blocks and was]
            delta = KvDelta(added=tuple(added), removed=tuple(removed))
        self.touched.clear()
        self.cleared = False
        return delta

    def touch(self, key: int) -> None:
        if not self.cleared and key not in self.touched:
            self.touched[key] = key in self.blocks

    def store(self, event: BlockStored) -> None:
        if not is_tracked_tier(event.medium, event.group_idx):
            return
        size, count = event.block_size, len(event.block_hashes)
        if size < 1 or len(event.token_ids) != count * size or self.block_size not in (None, size):
            self.skipped_events += 1
            return
        self.block_size = size
        parent: int | None
        if event.parent_block_hash is None:
            identity = block_identity(event, 0)
            parent = (
                None
                if identity is None
                else root_key(lora_name=identity.lora_name, cache_salt=identity.cache_salt)
            )
        else:
            parent = self.key_of.get(event.parent_block_hash)
        for index, engine_hash in enumerate(event.block_hashes):
            if parent is None or (index > 0 and block_identity(event, index) is None):
                parent = None
                self.forget(engine_hash)
                self.opaque.add(engine_hash)
                continue
            key = extend_keys(parent, event.token_ids[index * size : (index + 1) * size], size)[0]
            known = self.key_of.get(engine_hash)
            if known != key:
                if known is not None or engine_hash in self.opaque:
                    self.forget(engine_hash)
                self.touch(key)
                self.key_of[engine_hash] = key
                if key in self.blocks:
                    self.blocks[key].hashes += 1
                else:
                    self.blocks[key] = _Held(parent=parent, hashes=1)
            parent = key

    def forget(self, engine_hash: EngineHash) -> None:
        self.opaque.discard(engine_hash)
        key = self.key_of.pop(engine_hash, None)
        if key is not None:
            self.touch(key)
            self.blocks[key].hashes -= 1
            if self.blocks[key].hashes == 0:
                del self.blocks[key]


HASHES = st.integers(0, 7)
_OPAQUE_PART: list[Any] = [["image", 0]]
stores = st.integers(1, 3).flatmap(
    lambda count: st.builds(
        BlockStored,
        block_hashes=st.lists(HASHES, min_size=count, max_size=count),
        parent_block_hash=st.one_of(st.none(), HASHES),
        # Tokens from a tiny alphabet: different hashes often name the same key.
        token_ids=st.lists(st.sampled_from([0, 0, 0, 1]), min_size=count, max_size=count),
        block_size=st.just(1),
        lora_name=st.sampled_from([None, "a"]),
        extra_keys=st.one_of(
            st.none(),
            st.lists(st.sampled_from([None, ["salt"], _OPAQUE_PART, []]), max_size=count + 1),
        ),
        medium=st.sampled_from(["GPU", "GPU", "CPU"]),
    )
)
removals = st.builds(
    BlockRemoved, block_hashes=st.lists(HASHES, max_size=3), medium=st.sampled_from(["GPU", "CPU"])
)
events = st.one_of(stores, stores, removals, removals, st.just(AllBlocksCleared()))


def _first_block(engine_hash: int) -> BlockStored:
    return BlockStored(block_hashes=[engine_hash], parent_block_hash=None, token_ids=[0], block_size=1)


@settings(max_examples=300, deadline=None)
# Three hashes name one key; it stays until the last of them leaves.
@example([[_first_block(1), _first_block(2), _first_block(3)], [BlockRemoved([1])], [BlockRemoved([2, 3])]])
@given(st.lists(st.lists(events, max_size=8), max_size=6))
def test_the_map_gives_the_deltas_of_the_plain_reference(batches: list[list[KvEvent]]) -> None:
    cache, reference = CacheMap(), ReferenceMap()
    for batch in batches:
        assert cache.apply(batch) == reference.apply(batch)
        assert cache.blocks() == [(key, held.parent) for key, held in reference.blocks.items()]
        assert {h: cache.key_of(h) for h in range(8)} == {h: reference.key_of.get(h) for h in range(8)}
        assert cache.skipped_events == reference.skipped_events
