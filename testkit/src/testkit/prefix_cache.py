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
memory). Blocks freed by a request are queued tail first, so a prefix outlives its extensions
(vLLM frees a request's blocks in reverse order for the same reason).

Events are engine-neutral here (``Stored``, ``Removed``, ``Cleared``); ``kv_events`` renders
them as each engine's structs. Replaying them reproduces ``cached_hashes()``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "NO_EXTRA",
    "BlockExtra",
    "BlockHasher",
    "CacheEvent",
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

# (parent block hash or None for a first block, the block's tokens, extra) -> the block's hash
BlockHasher = Callable[[int | None, Sequence[int], BlockExtra], int]


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


@dataclass
class _Holding:
    """One request's blocks, in prompt order, and what names them."""

    extra: BlockExtra
    hashes: list[int] = field(default_factory=list)
    # The blocks of the prompt past the cached ones that could not be cached (cache full of
    # referenced blocks): nothing after them is cached for this request either.
    stopped: bool = False


class PrefixCache:
    def __init__(self, block_size: int, capacity_blocks: int, hasher: BlockHasher) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._hasher = hasher
        self._blocks: dict[int, _Block] = {}
        # Unreferenced blocks, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
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
        bs, parent, out = self.block_size, None, []
        for start in range(0, len(tokens) - bs + 1, bs):
            parent = self._hasher(parent, tokens[start : start + bs], extra)
            out.append(parent)
        return out

    def lookup(self, tokens: Sequence[int], extra: BlockExtra = NO_EXTRA) -> int:
        """The tokens ``begin`` would report cached, changing nothing."""
        return len(self._match(tokens, extra)) * self.block_size

    def _match(self, tokens: Sequence[int], extra: BlockExtra) -> list[int]:
        bs = self.block_size
        usable = max(0, len(tokens) - 1) // bs  # the last token is always computed
        parent: int | None = None
        matched: list[int] = []
        for i in range(usable):
            h = self._hasher(parent, tokens[i * bs : (i + 1) * bs], extra)
            if h not in self._blocks:
                break
            matched.append(h)
            parent = h
        return matched

    # -- a request's life -----------------------------------------------------------------
    def begin(self, owner: str, tokens: Sequence[int], extra: BlockExtra = NO_EXTRA) -> int:
        """Reference the cached prefix of ``tokens`` for ``owner``; its length in tokens."""
        if owner in self._owners:
            raise ValueError(f"{owner!r} already holds blocks")
        matched = self._match(tokens, extra)
        for h in matched:
            self._ref(h)
        self._owners[owner] = _Holding(extra, matched)
        return len(matched) * self.block_size

    def store(self, owner: str, tokens: Sequence[int]) -> list[CacheEvent]:
        """Cache ``owner``'s full blocks of ``tokens`` (computed now) past those it holds."""
        holding = self._owners[owner]
        bs = self.block_size
        total = len(tokens) // bs
        held = len(holding.hashes)
        if holding.stopped or total <= held:
            return []
        parent = holding.hashes[-1] if holding.hashes else None
        new: list[tuple[int, tuple[int, ...]]] = []
        for i in range(held, total):
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            parent = self._hasher(parent, block_tokens, holding.extra)
            new.append((parent, block_tokens))
        events: list[CacheEvent] = []
        # A block another request stored meanwhile is reused, not stored again.
        reused = 0
        while reused < len(new) and new[reused][0] in self._blocks:
            self._ref(new[reused][0])
            holding.hashes.append(new[reused][0])
            reused += 1
        new = new[reused:]
        room = self.capacity_blocks - len(self._blocks)
        evicted = self._evict(len(new) - room) if len(new) > room else []
        if evicted:
            events.append(Removed(tuple(evicted)))
        room = self.capacity_blocks - len(self._blocks)
        if room < len(new):
            holding.stopped = True
            new = new[: max(0, room)]
        if new:
            first_index = len(holding.hashes)
            parent_hash = holding.hashes[-1] if holding.hashes else None
            for h, _ in new:
                parent_of_h = holding.hashes[-1] if holding.hashes else None
                if parent_of_h is not None:
                    self._blocks[parent_of_h].children += 1
                self._blocks[h] = _Block(parent=parent_of_h, refs=1)
                holding.hashes.append(h)
            events.append(
                Stored(
                    block_hashes=tuple(h for h, _ in new),
                    parent_hash=parent_hash,
                    token_ids=tuple(t for _, toks in new for t in toks),
                    block_size=bs,
                    extra=holding.extra,
                    first_block_index=first_index,
                )
            )
        return events

    def end(self, owner: str) -> None:
        """Drop ``owner``'s references (tail first: its last block is evicted first)."""
        holding = self._owners.pop(owner, None)
        if holding is None:
            return
        for h in reversed(holding.hashes):
            block = self._blocks.get(h)
            if block is None:
                continue
            block.refs -= 1
            if block.refs == 0:
                self._evictable[h] = None
                self._evictable.move_to_end(h)

    def reset(self) -> list[CacheEvent]:
        """Forget every block (an engine restart or a cache reset). Requests still running
        keep running; their later ``store`` caches their blocks afresh from the first."""
        self._blocks.clear()
        self._evictable.clear()
        for holding in self._owners.values():
            holding.hashes.clear()
            holding.stopped = False
        return [Cleared()]

    # -- internals ------------------------------------------------------------------------
    def _ref(self, h: int) -> None:
        block = self._blocks[h]
        if block.refs == 0:
            self._evictable.pop(h, None)
        block.refs += 1

    def _evict(self, count: int) -> list[int]:
        """Evict up to ``count`` unreferenced leaves, least recently used first."""
        evicted: list[int] = []
        while len(evicted) < count:
            victim = next((h for h in self._evictable if self._blocks[h].children == 0), None)
            if victim is None:
                break
            del self._evictable[victim]
            block = self._blocks.pop(victim)
            if block.parent is not None:
                self._blocks[block.parent].children -= 1
            evicted.append(victim)
        return evicted
