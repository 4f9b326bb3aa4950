"""The worker's cache state as frontends see it (pure: no I/O, no clock, no globals).

A worker's engine may run several data-parallel ranks, each with its own cache and its own
publisher (:class:`~sidecar_server.kv_state.RankFeed`). :class:`WorkerCacheView` merges them:
a key is held while any rank holds it. It numbers the merged deltas (1, 2, ... within an
epoch; each made from one rank's delta, whose ``engine_time`` it keeps), keeps the latest
ones so a frontend that reconnects can resume where it left off, and answers a snapshot
(every key held, with its parent) for a frontend that cannot resume.

The epoch names one view's history: it is chosen by the I/O layer when the view is made
(every sidecar process picks a new one) and never changes after, so an (epoch, sequence) pair
a frontend kept from another sidecar process, or from before the kept deltas, asks for a
snapshot, never for a wrong resume. A rank's resync reaches frontends as removals (or a
``cleared`` delta when nothing is left), not as a new epoch: the other ranks' blocks stay.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from sidecar_server.kv_state import KvDelta

__all__ = ["NumberedDelta", "Snapshot", "WorkerCacheView"]


@dataclass(frozen=True)
class NumberedDelta:
    sequence: int
    delta: KvDelta


@dataclass(frozen=True)
class Snapshot:
    epoch: int
    # The last delta the snapshot includes; the next delta a watcher gets is sequence + 1.
    sequence: int
    block_size: int | None
    blocks: tuple[tuple[int, int], ...]


class WorkerCacheView:
    def __init__(self, *, epoch: int, block_size: int | None = None, kept_deltas: int = 4096) -> None:
        if kept_deltas < 1:
            raise ValueError("kept_deltas must be at least 1")
        self.epoch = epoch
        self.block_size = block_size
        self.sequence = 0
        self._parent: dict[int, int] = {}
        self._ranks_holding: dict[int, int] = {}
        self._by_rank: dict[int, set[int]] = {}
        self._kept: deque[NumberedDelta] = deque(maxlen=kept_deltas)

    def __len__(self) -> int:
        return len(self._ranks_holding)

    def apply(self, rank: int, delta: KvDelta) -> NumberedDelta | None:
        """Merge one rank's delta; the numbered merged delta, or None if nothing changed."""
        held = self._by_rank.setdefault(rank, set())
        added: list[tuple[int, int]] = []
        removed: list[int] = []
        if delta.cleared:
            for key in held:
                if self._release(key):
                    removed.append(key)
            held.clear()
        # The per-key loops of every delta: _release inlined, lookups hoisted.
        ranks_holding = self._ranks_holding
        parents = self._parent
        for key in delta.removed:
            if key in held:
                held.remove(key)
                count = ranks_holding[key] - 1
                if count:
                    ranks_holding[key] = count
                else:
                    del ranks_holding[key]
                    del parents[key]
                    removed.append(key)
        for pair in delta.added:
            key = pair[0]
            if key in held:
                continue
            held.add(key)
            count = ranks_holding.get(key, 0)
            ranks_holding[key] = count + 1
            if count == 0:
                parents[key] = pair[1]
                added.append(pair)
        # A key removed and added again in the same delta is simply still there.
        if added and removed:
            again = {key for key, _ in added}.intersection(removed)
            if again:
                removed = [key for key in removed if key not in again]
                added = [(key, parent) for key, parent in added if key not in again]
        cleared = delta.cleared and not self._ranks_holding_before_add(added)
        if cleared:
            merged = KvDelta(added=tuple(added), cleared=True, engine_time=delta.engine_time)
        else:
            merged = KvDelta(added=tuple(added), removed=tuple(removed), engine_time=delta.engine_time)
        if not merged:
            return None
        self.sequence += 1
        numbered = NumberedDelta(self.sequence, merged)
        self._kept.append(numbered)
        return numbered

    def announce(self, keys: Sequence[int]) -> NumberedDelta | None:
        """Number a notice of blocks about to be prefilled here: the keys of ``keys`` (a chain,
        first block first) after the leading ones already held (None: all held)."""
        held = self._ranks_holding
        # Holdings are prefix-closed (the engines evict a block after its descendants), so
        # the first block not held is found by bisection.
        lo, hi = 0, len(keys)
        while lo < hi:
            mid = (lo + hi) // 2
            if keys[mid] in held:
                lo = mid + 1
            else:
                hi = mid
        if lo == len(keys):
            return None
        self.sequence += 1
        numbered = NumberedDelta(self.sequence, KvDelta(announced=tuple(keys[lo:])))
        self._kept.append(numbered)
        return numbered

    def _ranks_holding_before_add(self, added: list[tuple[int, int]]) -> bool:
        # Whether any key other than this delta's additions is still held (then a "cleared"
        # would wrongly drop it at the frontend, so removals are sent instead).
        return len(self._ranks_holding) > len(added)

    def _release(self, key: int) -> bool:
        count = self._ranks_holding[key] - 1
        if count:
            self._ranks_holding[key] = count
            return False
        del self._ranks_holding[key]
        del self._parent[key]
        return True

    def snapshot(self) -> Snapshot:
        return Snapshot(
            epoch=self.epoch,
            sequence=self.sequence,
            block_size=self.block_size,
            blocks=tuple(self._parent.items()),
        )

    def deltas_after(self, epoch: int, sequence: int) -> list[NumberedDelta] | None:
        """The deltas after ``sequence`` if this view still has all of them, else None."""
        if epoch != self.epoch or sequence > self.sequence:
            return None
        if sequence == self.sequence:
            return []
        if not self._kept or self._kept[0].sequence > sequence + 1:
            return None
        return [numbered for numbered in self._kept if numbered.sequence > sequence]
