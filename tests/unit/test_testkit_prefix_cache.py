"""The testkit engines' paged prefix cache (pure): reuse by chains of full blocks, references,
LRU eviction of unreferenced leaves, capacity, and events that replay to the cache's blocks."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from testkit.kv_events import Flavor, block_hasher
from testkit.prefix_cache import NO_EXTRA, BlockExtra, CacheEvent, Cleared, PrefixCache, Removed, Stored


def cache(block_size: int = 4, capacity: int = 100, flavor: Flavor = "vllm") -> PrefixCache:
    return PrefixCache(block_size, capacity, block_hasher(flavor))


def run(
    c: PrefixCache, owner: str, tokens: Sequence[int], extra: BlockExtra = NO_EXTRA
) -> tuple[int, list[CacheEvent]]:
    """A whole request: begin, its prompt stored, end."""
    cached = c.begin(owner, tokens, extra)
    events = c.store(owner, tokens)
    c.end(owner)
    return cached, events


@pytest.mark.parametrize(
    ("block_size", "first", "second", "cached"),
    [
        (4, list(range(10)), list(range(10)), 8),  # two full blocks; the tail is never cached
        (4, list(range(8)), list(range(8)), 4),  # the last token is always computed
        (4, list(range(10)), [*range(5), 99, 98, 97, 96], 4),  # diverges inside block 2
        (4, list(range(10)), [99, *range(1, 10)], 0),  # diverges in block 1: nothing
        (1, list(range(10)), list(range(10)), 9),  # SGLang's default page of one token
        (1, list(range(10)), [*range(5), 99], 5),
        (16, list(range(40)), list(range(40)), 32),
        (4, list(range(3)), list(range(3)), 0),  # shorter than a block
    ],
)
def test_cached_tokens_are_the_shared_full_blocks(
    block_size: int, first: list[int], second: list[int], cached: int
) -> None:
    c = cache(block_size)
    assert run(c, "a", first)[0] == 0
    assert c.lookup(second) == cached
    assert run(c, "b", second)[0] == cached


def test_a_store_names_the_chain_parent_tokens_and_first_index() -> None:
    c = cache(4)
    _, (stored,) = run(c, "a", list(range(10)))
    assert isinstance(stored, Stored)
    assert stored.parent_hash is None
    assert stored.first_block_index == 0
    assert stored.token_ids == tuple(range(8))
    assert list(stored.block_hashes) == c.chain(list(range(10)))
    c.begin("b", list(range(14)))
    (more,) = c.store("b", list(range(14)))
    assert isinstance(more, Stored)
    assert more.parent_hash == stored.block_hashes[-1]
    assert more.first_block_index == 2
    assert more.token_ids == tuple(range(8, 12))


def test_lora_and_salt_make_blocks_distinct() -> None:
    c = cache(4)
    tokens = list(range(9))
    run(c, "plain", tokens)
    assert c.lookup(tokens, BlockExtra(lora_name="ad")) == 0
    assert c.lookup(tokens, BlockExtra(cache_salt="s")) == 0
    run(c, "lora", tokens, BlockExtra(lora_name="ad"))
    assert c.lookup(tokens, BlockExtra(lora_name="ad")) == 8
    assert c.lookup(tokens, BlockExtra(lora_name="other")) == 0


def test_lru_evicts_the_least_recently_used_unreferenced_leaf_tail_first() -> None:
    c = cache(4, capacity=4)
    a = list(range(9))
    run(c, "a", a)  # a1 a2
    run(c, "b", [100 + t for t in range(9)])  # b1 b2 (full now)
    a1, a2 = c.chain(a)
    run(c, "a-again", a)  # a used again: b is now the least recently used
    b1, b2 = c.chain([100 + t for t in range(9)])
    _, events = run(c, "d", [200 + t for t in range(5)])  # needs one block
    assert events[0] == Removed((b2,))  # b's tail goes before b's head
    _, events = run(c, "e", [300 + t for t in range(5)])
    assert events[0] == Removed((b1,))
    assert {a1, a2} <= c.cached_hashes()


def test_blocks_of_a_running_request_are_not_evicted() -> None:
    c = cache(4, capacity=2)
    running = list(range(9))
    c.begin("r", running)
    c.store("r", running)  # both blocks, referenced
    assert c.referenced_hashes() == frozenset(c.chain(running))
    other = [50 + t for t in range(9)]
    assert c.begin("o", other) == 0
    assert c.store("o", other) == []  # nothing evictable: o runs uncached
    c.end("o")
    assert c.cached_hashes() == frozenset(c.chain(running))
    c.end("r")
    assert c.referenced_hashes() == frozenset()
    run(c, "o2", other)
    assert c.cached_hashes() == frozenset(c.chain(other))


def test_a_parent_is_not_evicted_before_its_child() -> None:
    c = cache(4, capacity=3)
    long = list(range(13))  # three blocks
    run(c, "l", long)
    h1, h2, h3 = c.chain(long)
    # Reuse only the first block: it becomes the most recently used, yet its children are
    # evicted first when room is needed, since it is no leaf.
    run(c, "short", long[:5])
    _, events = run(c, "x", [500 + t for t in range(9)])
    assert events[0] == Removed((h3, h2))
    assert h1 in c.cached_hashes()


def test_a_block_stored_meanwhile_by_another_request_is_reused_not_stored_twice() -> None:
    c = cache(4)
    tokens = list(range(9))
    assert c.begin("a", tokens) == 0
    assert c.begin("b", tokens) == 0  # both arrive before either is computed
    (stored,) = c.store("a", tokens)
    assert c.store("b", tokens) == []
    assert c.referenced_hashes() == frozenset(stored.block_hashes if isinstance(stored, Stored) else ())
    c.end("a")
    assert c.referenced_hashes() == frozenset(c.chain(tokens))  # b still holds them
    c.end("b")
    assert c.referenced_hashes() == frozenset()


def test_reset_clears_and_running_requests_store_afresh() -> None:
    c = cache(4)
    tokens = list(range(9))
    c.begin("r", tokens)
    c.store("r", tokens)
    assert c.reset() == [Cleared()]
    assert len(c) == 0
    (stored,) = c.store("r", [*tokens, 9, 10, 11])
    assert isinstance(stored, Stored)
    assert stored.first_block_index == 0
    assert stored.token_ids == tuple(range(12))


def test_hash_types_differ_per_engine() -> None:
    tokens = list(range(4 * 64))
    vllm = cache(4, flavor="vllm").chain(tokens)
    sglang = cache(4, flavor="sglang").chain(tokens)
    assert all(0 <= h < 1 << 64 for h in vllm)
    assert all(-(1 << 63) <= h < 1 << 63 for h in sglang)
    assert any(h < 0 for h in sglang)
    assert not set(vllm) & set(sglang)


# -- laws -------------------------------------------------------------------------------
def replay(events: list[CacheEvent]) -> dict[int, int | None]:
    """A consumer's view: each block and its parent, from the events alone."""
    blocks: dict[int, int | None] = {}
    for event in events:
        if isinstance(event, Stored):
            parent = event.parent_hash
            for h in event.block_hashes:
                assert parent is None or parent in blocks, "a store extends a block not cached"
                blocks[h] = parent
                parent = h
        elif isinstance(event, Removed):
            for h in event.block_hashes:
                assert h in blocks, "a removal of a block not cached"
                del blocks[h]
        else:
            blocks.clear()
    return blocks


prompts = st.lists(st.integers(0, 3), min_size=0, max_size=14)
steps = st.lists(
    st.tuples(st.sampled_from(["begin", "store", "end", "reset"]), st.integers(0, 3), prompts, st.booleans()),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(steps=steps, block_size=st.sampled_from([1, 2, 4]), capacity=st.integers(0, 8))
def test_replaying_the_events_reproduces_the_cache(
    steps: list[tuple[str, int, list[int], bool]], block_size: int, capacity: int
) -> None:
    c = cache(block_size, capacity)
    events: list[CacheEvent] = []
    held: dict[str, list[int]] = {}
    for op, who, tokens, salted in steps:
        owner = f"r{who}"
        if op == "begin" and owner not in held:
            cached = c.begin(owner, tokens, BlockExtra(cache_salt="s") if salted else NO_EXTRA)
            assert cached % block_size == 0
            assert cached <= max(0, len(tokens) - 1)
            held[owner] = tokens
        elif op == "store" and owner in held:
            held[owner] = held[owner] + tokens  # the request computed more (its output)
            events += c.store(owner, held[owner])
        elif op == "end":
            c.end(owner)
            held.pop(owner, None)
        elif op == "reset":
            events += c.reset()
        assert len(c) <= capacity
        blocks = replay(events)
        assert set(blocks) == c.cached_hashes()
        assert all(blocks[h] == c.parent_of(h) for h in blocks)
        # Closed under prefixes: every cached block's parent is cached.
        assert all(p is None or p in blocks for p in blocks.values())


@settings(max_examples=200, deadline=None)
@given(tokens=prompts, other=prompts, block_size=st.sampled_from([1, 2, 4]))
def test_a_hit_is_the_longest_shared_run_of_full_blocks(
    tokens: list[int], other: list[int], block_size: int
) -> None:
    c = cache(block_size)
    run(c, "a", tokens)
    shared = 0
    for x, y in zip(tokens, other, strict=False):
        if x != y:
            break
        shared += 1
    expected = min(shared // block_size, max(0, len(other) - 1) // block_size, len(tokens) // block_size)
    assert c.lookup(other) == expected * block_size


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 40000), max_size=40),
    block_size=st.sampled_from([1, 3, 16]),
    cut=st.integers(0, 40),
    flavor=st.sampled_from(["vllm", "sglang"]),
    salt=st.sampled_from([None, "s"]),
)
def test_a_chain_extended_later_equals_the_chain_hashed_at_once(
    tokens: list[int], block_size: int, cut: int, flavor: Flavor, salt: str | None
) -> None:
    hasher = block_hasher(flavor)
    extra = BlockExtra(cache_salt=salt)
    whole = hasher(None, tokens, block_size, extra)
    split = min(cut, len(whole)) * block_size
    head = hasher(None, tokens[:split], block_size, extra)
    tail = hasher(head[-1] if head else None, tokens[split:], block_size, extra)
    assert head + tail == whole
    assert len(whole) == len(tokens) // block_size
