"""Which workers hold which KV-cache blocks, for one model (pure: no I/O, no clock).

A block is named by its routing key (``sidecar_common.kv_keys.block_keys``: chained over the
token ids of the blocks before it, so a key names a whole prefix, not one block's tokens). The
index maps each key to the set of workers holding it (a bitmask of small worker slots), and
each worker to the keys it holds. For a request, :meth:`BlockIndex.match` gives each worker the
number of leading blocks of the request's keys it holds: an engine's prefix cache stops at the
first block it lacks.

A worker's holdings are prefix-closed: a block is held only with every block before it. The
engines store a block only after its parent and evict a block only after its descendants (vLLM
frees a finished request's blocks tail first, and a block's reference count is never below its
descendants'; SGLang's radix cache evicts leaves); the index's own cap evicts a chain's tail
before its head, and an approximate chain's head expires no earlier than its tail. So
:meth:`BlockIndex.match` bisects each worker's count instead of walking every block.

Two sources feed it, per worker:

* exact: the worker's cache stream (a snapshot, then stored / removed / cleared deltas); these
  entries never expire;
* approximate: the frontend's own routing decisions (a request sent to a worker is assumed
  cached there), each entry with an expiry time; :meth:`expire` removes those whose time has
  come (the caller passes the time in). An entry keeps its latest expiry, and an exact entry
  never turns into an expiring one.

Approximate entries expire through records: each approximate store keeps the keys it stored (8
bytes a key) in a queue ordered by expiry, and each entry names the record of its latest store;
at its time a record removes the entries still its own. A record whose entries are all gone
before then (stored again later, removed, or evicted) lets go of its keys at once, and its place
in the queue when such places are half the queue; so a prompt sent again and again keeps one
record, not one per decision.

Memory: the index estimates its own size (:attr:`BlockIndex.bytes`, from the count of keys, of
(key, worker) entries and of the records' keys, at per-item costs measured with ``tracemalloc``;
the real use moves between about 65 % and 105 % of the estimate as the tables grow in powers of
two, which tests/unit/frontend/test_routing_index.py checks) and, over ``max_bytes``, evicts the
least recently used keys (a record goes with its last entry): a key is used when it is stored,
or matched while the index holds more than half its cap. Below half, nothing can be evicted
until at least as much again is stored, so every key that stays in use is matched, and touched,
in between; keys left untouched since are evicted in the order they were stored. (Touching a
match costs about 35 ns a block, 17 µs for an 8k-token prompt: a sixth of a decision.) Within
one store or match the keys are touched from the last block to the first, so a prefix's first
blocks are the more recent and eviction takes a chain's tail before its head (dropping a head
would make every block after it unmatchable).
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

__all__ = [
    "BYTES_PER_ENTRY",
    "BYTES_PER_KEY",
    "BYTES_PER_RECORD",
    "BYTES_PER_RECORD_KEY",
    "BlockIndex",
    "IndexStats",
    "as_mapping",
]

# Measured (tests/unit/frontend/test_routing_index.py::test_size_estimate_tracks_measured_memory):
# a key costs its OrderedDict slot and node, its int object and its holders' mask; an entry
# (one worker holding one key) costs a slot in that worker's dict.
BYTES_PER_KEY: Final = 140
BYTES_PER_ENTRY: Final = 56
# An approximate store's record (module docstring): its place in the expiry queue, and its keys
# as 8-byte numbers while any entry it made is left (measured by the same test, approximate).
BYTES_PER_RECORD: Final = 240
BYTES_PER_RECORD_KEY: Final = 8

# Evicting down to this fraction of the cap, not just below it, so a full index does not
# evict on every store.
_EVICT_TO: Final = 0.95

_NO_KEYS: Final[array[int]] = array("Q")


class _Record:
    """What expires one approximate store's entries: its expiry, the slot's entries, the keys it
    stored, and how many of the slot's entries are still its own (each entry names the record
    of its latest store)."""

    __slots__ = ("expiry", "held", "keys", "live", "slot")

    def __init__(self, expiry: float, slot: int, held: dict[int, _Record], keys: array[int]) -> None:
        self.expiry = expiry
        self.slot = slot
        self.held = held
        self.keys = keys
        self.live = 0


# The record of every exact entry (never expires, never queued).
_EXACT: Final = _Record(math.inf, -1, {}, _NO_KEYS)


@dataclass(frozen=True)
class IndexStats:
    keys: int  # distinct blocks indexed
    entries: int  # (block, worker) pairs
    bytes: int  # the estimate the cap applies to
    evicted: int  # keys evicted for the cap since the index was made


class BlockIndex:
    """Block key -> workers holding it, for one model. Workers are named by strings (their
    addresses); slots are an internal detail."""

    def __init__(self, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self._max_bytes = max_bytes
        # key -> bitmask of the slots holding it; iteration order is least recently used first.
        self._holders: OrderedDict[int, int] = OrderedDict()
        self._slot_of: dict[str, int] = {}
        self._bit_of: dict[str, int] = {}  # 1 << its slot
        self._name_of: dict[int, str] = {}
        self._free_slots: list[int] = []
        # Per slot: key -> the record of its latest store (_EXACT: never expires).
        self._held: dict[int, dict[int, _Record]] = {}
        self._entries = 0
        self._evicted = 0
        # (expiry, order, record) of each approximate store that took an entry: a heap (records
        # with no entry left stay in it until they are half of it).
        self._expiries: list[tuple[float, int, _Record]] = []
        self._stores = 0
        self._spent = 0  # records in the heap with no entry left
        self._record_bytes = 0

    # ---------------------------------------------------------------- reading

    def workers(self) -> frozenset[str]:
        """Workers with a slot (holding blocks, or known and empty)."""
        return frozenset(self._slot_of)

    def held(self, worker: str) -> frozenset[int]:
        """The keys ``worker`` holds (for tests and diagnostics: O(its blocks))."""
        slot = self._slot_of.get(worker)
        return frozenset() if slot is None else frozenset(self._held[slot])

    def blocks_of(self, worker: str) -> int:
        slot = self._slot_of.get(worker)
        return 0 if slot is None else len(self._held[slot])

    def holders(self, key: int) -> frozenset[str]:
        mask = self._holders.get(key, 0)
        return frozenset(self._name_of[slot] for slot in _bits(mask))

    def __contains__(self, key: object) -> bool:
        return key in self._holders

    def __len__(self) -> int:
        return len(self._holders)

    @property
    def entries(self) -> int:
        return self._entries

    @property
    def bytes(self) -> int:
        return len(self._holders) * BYTES_PER_KEY + self._entries * BYTES_PER_ENTRY + self._record_bytes

    def stats(self) -> IndexStats:
        return IndexStats(len(self._holders), self._entries, self.bytes, self._evicted)

    def match(self, keys: Sequence[int], among: Iterable[str]) -> dict[str, int]:
        """For each worker of ``among`` holding the first block of ``keys``: how many leading
        blocks of ``keys`` it holds (workers holding none are left out). Touches the matched
        keys (they become the most recently used).

        A worker's holdings are read as prefix-closed: holding a block means holding every
        block before it, which is how they come (module docstring). So each worker's count is
        found by bisection, about log2(len(keys)) lookups per distinct count, instead of one
        lookup per block (512 blocks: 93 µs walked, a few µs bisected). Were a worker to hold
        a block without one before it, its count would be the end of some run of blocks it
        holds, not necessarily the first."""
        candidates = 0
        for worker in among:
            candidates |= self._bit_of.get(worker, 0)
        found: dict[str, int] = {}
        if not candidates or not keys:
            return found
        holders = self._holders
        # A KeyChain (sidecar_common.kv_keys) reads one key through its `at`, a C function,
        # where its indexing is a Python call: 5 % of an 8k-token decision over 16 workers.
        key_at: Callable[[int], int] = getattr(keys, "at", keys.__getitem__)
        # (lo, hi, workers): each of these workers holds between lo and hi leading blocks.
        pending = [(0, len(keys), candidates)]
        while pending:
            lo, hi, workers = pending.pop()
            if lo == hi:
                while lo and workers:  # each set bit: a worker holding lo blocks
                    low = workers & -workers
                    found[self._name_of[low.bit_length() - 1]] = lo
                    workers ^= low
                continue
            mid = (lo + hi + 1) // 2
            holding = holders.get(key_at(mid - 1), 0) & workers
            if holding:
                pending.append((mid, hi, holding))
            if holding != workers:
                pending.append((lo, mid - 1, workers & ~holding))
        # The longest matched prefix, touched from its last block to its first.
        longest = max(found.values(), default=0)
        if longest and self._max_bytes is not None and 2 * self.bytes > self._max_bytes:
            # Without asking first whether each key is there (that lookup made an 8k-token
            # match 50 % dearer): only past a hole (see above) is one missing.
            touch = holders.move_to_end
            try:
                for key in reversed(keys[:longest]):
                    touch(key)
            except KeyError:
                for key in reversed(keys[:longest]):
                    if key in holders:
                        touch(key)
        return found

    # ---------------------------------------------------------------- writing

    def add_worker(self, worker: str) -> None:
        """Give ``worker`` a slot (idempotent); it holds nothing yet."""
        self._slot(worker)

    def store(self, worker: str, keys: Sequence[int], *, expires: float = math.inf) -> None:
        """``worker`` holds ``keys`` (a chain, first block first; each 0 to 2**64 - 1), until
        ``expires`` (default: exact, until removed). Over the cap, the least recently used keys
        are evicted."""
        if not keys:
            return
        slot = self._slot(worker)
        held = self._held[slot]
        if expires == math.inf:
            record = _EXACT
        else:
            keys = list(keys)  # read once (a KeyChain makes its ints on each read)
            # Made first: a key out of range fails before anything changed.
            record = _Record(expires, slot, held, array("Q", keys))
        bit = 1 << slot
        holders = self._holders
        added = taken = 0
        for key in reversed(keys):
            mask = holders.get(key)
            if mask is None:
                holders[key] = bit
            else:
                holders[key] = mask | bit
                holders.move_to_end(key)
            before = held.get(key)
            if before is None:
                held[key] = record
                added += 1
                taken += 1
            elif expires > before.expiry:  # so before is an approximate store's
                held[key] = record
                taken += 1
                before.live -= 1  # _entry_left, inlined: once per block of a store
                if not before.live:
                    self._record_spent(before)
        self._entries += added
        if record is not _EXACT and taken:
            record.live = taken
            self._stores += 1
            heapq.heappush(self._expiries, (expires, self._stores, record))
            self._record_bytes += BYTES_PER_RECORD + BYTES_PER_RECORD_KEY * len(record.keys)
        self._enforce_cap()

    def remove(self, worker: str, keys: Iterable[int]) -> None:
        """``worker`` no longer holds ``keys`` (unknown keys are ignored)."""
        slot = self._slot_of.get(worker)
        if slot is None:
            return
        held = self._held[slot]
        for key in keys:
            record = held.pop(key, None)
            if record is not None:
                self._drop_holder(key, slot)
                self._entry_left(record)

    def clear(self, worker: str) -> None:
        """``worker`` holds nothing (its cache was reset, or a snapshot replaces it)."""
        slot = self._slot_of.get(worker)
        if slot is None:
            return
        held = self._held[slot]
        for key, record in held.items():
            self._drop_holder(key, slot)
            self._entry_left(record)
        held.clear()

    def replace(self, worker: str, keys: Iterable[int]) -> None:
        """``worker`` holds exactly ``keys`` (a snapshot), exact."""
        self.clear(worker)
        ordered = list(keys)
        if ordered:
            self.store(worker, ordered)
        else:
            self._slot(worker)

    def forget(self, worker: str) -> None:
        """``worker`` left: its entries and its slot go."""
        slot = self._slot_of.get(worker)
        if slot is None:
            return
        self.clear(worker)
        del self._slot_of[worker]
        del self._bit_of[worker]
        del self._name_of[slot]
        del self._held[slot]
        self._free_slots.append(slot)

    def expire(self, now: float) -> int:
        """Remove the approximate entries whose expiry is ``now`` or earlier; how many."""
        removed = 0
        queue = self._expiries
        while queue and queue[0][0] <= now:
            _, _, record = heapq.heappop(queue)
            self._record_bytes -= BYTES_PER_RECORD
            if not record.live:
                self._spent -= 1
                continue
            held = record.held
            for key in record.keys:
                if held.get(key) is record:  # not stored again since, nor removed
                    del held[key]
                    self._drop_holder(key, record.slot)
                    removed += 1
            self._record_bytes -= BYTES_PER_RECORD_KEY * len(record.keys)
            record.keys = _NO_KEYS
            record.live = 0
        return removed

    # ---------------------------------------------------------------- internals

    def _slot(self, worker: str) -> int:
        slot = self._slot_of.get(worker)
        if slot is not None:
            return slot
        if self._free_slots:
            slot = min(self._free_slots)
            self._free_slots.remove(slot)
        else:
            slot = len(self._slot_of)
        self._slot_of[worker] = slot
        self._bit_of[worker] = 1 << slot
        self._name_of[slot] = worker
        self._held[slot] = {}
        return slot

    def _entry_left(self, record: _Record) -> None:
        """One of ``record``'s entries is gone (removed, evicted, or stored again later). A
        record with none left lets go of its keys at once; its place in the queue goes when
        such places are half the queue (the queue is rebuilt: O(records), once per as many
        records spent)."""
        if record is _EXACT:
            return
        record.live -= 1
        if not record.live:
            self._record_spent(record)

    def _record_spent(self, record: _Record) -> None:
        self._record_bytes -= BYTES_PER_RECORD_KEY * len(record.keys)
        record.keys = _NO_KEYS
        self._spent += 1
        if 2 * self._spent > len(self._expiries):
            kept = [item for item in self._expiries if item[2].live]
            self._record_bytes -= BYTES_PER_RECORD * (len(self._expiries) - len(kept))
            heapq.heapify(kept)
            self._expiries = kept
            self._spent = 0

    def _drop_holder(self, key: int, slot: int) -> None:
        """Take ``slot`` out of ``key``'s holders (its per-worker entry is already gone)."""
        self._entries -= 1
        mask = self._holders.get(key, 0) & ~(1 << slot)
        if mask:
            self._holders[key] = mask
        else:
            self._holders.pop(key, None)

    def _enforce_cap(self) -> None:
        cap = self._max_bytes
        if cap is None or self.bytes <= cap:
            return
        target = int(cap * _EVICT_TO)
        holders = self._holders
        # A record goes with its last entry, so this ends: with no key left, no record is.
        while holders and self.bytes > target:
            key, mask = holders.popitem(last=False)
            for slot in _bits(mask):
                self._entry_left(self._held[slot].pop(key))
                self._entries -= 1
            self._evicted += 1


def _bits(mask: int) -> Iterator[int]:
    """The set bits of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def as_mapping(index: BlockIndex) -> Mapping[str, frozenset[int]]:
    """Each worker's keys (for tests: the index as a plain value)."""
    return {worker: index.held(worker) for worker in index.workers()}
