"""A paged prefix cache, as a testkit engine's KV cache behaves: pure (no I/O, no clock).

The prompt is cut into blocks of ``block_size`` tokens; only *full* blocks are cached, each
named by a hash chained over its parent's hash, its tokens and the request's extra key (LoRA
name, cache salt), so a block is reusable only after the very same prefix. The engine supplies
the hash function (each real engine has its own, and neither is the sidecar's routing key).

A request's life, as the engine drives it:

* ``begin(owner, tokens, extra)``: the longest chain of cached blocks that starts the prompt
  is reused and *referenced* (not evictable while the request runs); the answer is the cached
  token count the engine reports, capped as the engines cap it: the last prompt token is
  always computed (its logits make the first output token), so at most ``len - 1`` tokens,
  rounded down to whole blocks.
* ``store(owner, tokens)``: once computed (after the prefill; at the end with the output too),
  the owner's new full blocks are cached and referenced; the events say what changed.
* ``end(owner)``: the references go; the blocks stay cached and become evictable.

Capacity is a number of blocks. A block to store when the cache is full evicts the least
recently used unreferenced block that no cached block extends (a leaf: the cached set stays
closed under prefixes, as a radix tree's is); with nothing evictable the remaining blocks of
that request are not cached (the request still runs: the testkit simulates the cache, not the
memory). A request's blocks are released tail first (its last block becomes the least
recently used), so a prefix outlives its extensions (vLLM frees a request's blocks in reverse
order for the same reason).

Events are engine-neutral here (``Stored``, ``Removed``, ``Cleared``); ``kv_events`` renders
them as each engine's structs. Replaying them reproduces ``cached_hashes()``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "NO_EXTRA",
    "BlockExtra",
    "CacheEvent",
    "ChainHasher",
    "Cleared",
    "PrefixCache",
    "Removed",
    "Stored",
]


@dataclass(frozen=True)
class BlockExtra:
    """What besides the tokens makes blocks distinct: the LoRA adapter and the cache salt."""

    lora_name: str | None = None
    cache_salt: str | None = None


NO_EXTRA = BlockExtra()

# (parent block hash or None, tokens, block size, extra) -> the hashes of the tokens' full
# blocks, the first extending the parent, each next one the one before.
ChainHasher = Callable[[int | None, Sequence[int], int, BlockExtra], list[int]]


@dataclass(frozen=True)
class Stored:
    """A chain of blocks newly cached: ``block_hashes[0]`` extends ``parent_hash`` (None: the
    first block of a prompt), each next one extends the one before; ``token_ids`` are theirs,
    concatenated; ``first_block_index`` is the first one's position in its prompt."""

    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    extra: BlockExtra
    first_block_index: int


@dataclass(frozen=True)
class Removed:
    """Blocks evicted (children before their parents)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class Cleared:
    """Every block is gone."""


CacheEvent = Stored | Removed | Cleared


@dataclass
class _Block:
    parent: int | None
    refs: int = 0
    children: int = 0
    last_use: int = 0  # when its last reference went (the LRU order)


@dataclass
class _Holding:
    """One request: the hashes of its tokens' full blocks so far (``chain``, cached or not)
    and the cached ones it references (a prefix of the chain)."""

    extra: BlockExtra
    chain: list[int]
    held: int = 0
    # Set when a block could not be cached (the cache full of referenced blocks): nothing
    # after it is cached for this request either.
    stopped: bool = False


class PrefixCache:
    def __init__(self, block_size: int, capacity_blocks: int, hasher: ChainHasher) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._hasher = hasher
        self._blocks: dict[int, _Block] = {}
        # Unreferenced leaves by (last use, hash), least recent first; entries whose block has
        # changed since are skipped when popped.
        self._leaves: list[tuple[int, int]] = []
        self._clock = 0
        self._owners: dict[str, _Holding] = {}

    # -- reading --------------------------------------------------------------------------
    def cached_hashes(self) -> frozenset[int]:
        return frozenset(self._blocks)

    def referenced_hashes(self) -> frozenset[int]:
        return frozenset(h for h, b in self._blocks.items() if b.refs > 0)

    def parent_of(self, block_hash: int) -> int | None:
        return self._blocks[block_hash].parent

    def __len__(self) -> int:
        return len(self._blocks)

    def chain(self, tokens: Sequence[int], extra: BlockExtra = NO_EXTRA) -> list[int]:
        """The hashes of ``tokens``' full blocks, cached or not."""
        return self._hasher(None, tokens, self.block_size, extra)

    def lookup(self, tokens: Sequence[int], extra: BlockExtra = NO_EXTRA) -> int:
        """The tokens ``begin`` would report cached, changing nothing."""
        return self._matched(tokens, self.chain(tokens, extra)) * self.block_size

    def _matched(self, tokens: Sequence[int], chain: list[int]) -> int:
        """How many blocks of ``chain`` are cached, from the first on (the last token of
        ``tokens`` always computed)."""
        usable = min(len(chain), max(0, len(tokens) - 1) // self.block_size)
        n = 0
        while n < usable and chain[n] in self._blocks:
            n += 1
        return n

    # -- a request's life -----------------------------------------------------------------
    def begin(self, owner: str, tokens: Sequence[int], extra: BlockExtra = NO_EXTRA) -> int:
        """Reference the cached prefix of ``tokens`` for ``owner``; its length in tokens."""
        if owner in self._owners:
            raise ValueError(f"{owner!r} already holds blocks")
        chain = self.chain(tokens, extra)
        matched = self._matched(tokens, chain)
        for h in chain[:matched]:
            self._blocks[h].refs += 1
        self._owners[owner] = _Holding(extra, chain, matched)
        return matched * self.block_size

    def store(self, owner: str, tokens: Sequence[int]) -> list[CacheEvent]:
        """Cache ``owner``'s full blocks of ``tokens`` (computed now; they extend the tokens it
        began with) past those it holds."""
        holding = self._owners[owner]
        bs = self.block_size
        total = len(tokens) // bs
        if total > len(holding.chain):
            known = len(holding.chain)
            parent = holding.chain[-1] if holding.chain else None
            holding.chain += self._hasher(parent, tokens[known * bs : total * bs], bs, holding.extra)
        if holding.stopped or total <= holding.held:
            return []
        wanted = holding.chain[holding.held : total]
        # A block another request stored meanwhile is reused, not stored again.
        reused = 0
        while reused < len(wanted) and wanted[reused] in self._blocks:
            self._blocks[wanted[reused]].refs += 1
            reused += 1
        holding.held += reused
        new = wanted[reused:]
        events: list[CacheEvent] = []
        room = self.capacity_blocks - len(self._blocks)
        evicted = self._evict(len(new) - room) if len(new) > room else []
        if evicted:
            events.append(Removed(tuple(evicted)))
        room = self.capacity_blocks - len(self._blocks)
        if room < len(new):
            holding.stopped = True
            new = new[: max(0, room)]
        if new:
            first = holding.held
            parent_hash = holding.chain[first - 1] if first else None
            parent = parent_hash
            for h in new:
                if parent is not None:
                    self._blocks[parent].children += 1
                self._blocks[h] = _Block(parent=parent, refs=1)
                parent = h
            holding.held += len(new)
            events.append(
                Stored(
                    block_hashes=tuple(new),
                    parent_hash=parent_hash,
                    token_ids=tuple(tokens[first * bs : holding.held * bs]),
                    block_size=bs,
                    extra=holding.extra,
                    first_block_index=first,
                )
            )
        return events

    def end(self, owner: str) -> None:
        """Drop ``owner``'s references, tail first (its last block is the least recently used)."""
        holding = self._owners.pop(owner, None)
        if holding is None:
            return
        for h in reversed(holding.chain[: holding.held]):
            block = self._blocks.get(h)
            if block is None:
                continue
            block.refs -= 1
            if block.refs == 0:
                self._clock += 1
                block.last_use = self._clock
                if block.children == 0:
                    heapq.heappush(self._leaves, (block.last_use, h))

    def reset(self) -> list[CacheEvent]:
        """Forget every block (an engine restart or a cache reset). Requests still running
        keep running; their later ``store`` caches their blocks afresh from the first."""
        self._blocks.clear()
        self._leaves.clear()
        for holding in self._owners.values():
            holding.held = 0
            holding.stopped = False
        return [Cleared()]

    # -- internals ------------------------------------------------------------------------
    def _evict(self, count: int) -> list[int]:
        """Evict up to ``count`` unreferenced leaves, least recently used first."""
        evicted: list[int] = []
        while len(evicted) < count and self._leaves:
            last_use, victim = heapq.heappop(self._leaves)
            block = self._blocks.get(victim)
            if block is None or block.refs or block.children or block.last_use != last_use:
                continue  # changed since it was queued
            del self._blocks[victim]
            evicted.append(victim)
            if block.parent is not None:
                parent = self._blocks[block.parent]
                parent.children -= 1
                if parent.children == 0 and parent.refs == 0:
                    heapq.heappush(self._leaves, (parent.last_use, block.parent))
        if len(self._leaves) > 2 * len(self._blocks) + 64:
            self._leaves = [(b.last_use, h) for h, b in self._blocks.items() if not b.refs and not b.children]
            heapq.heapify(self._leaves)
        return evicted
