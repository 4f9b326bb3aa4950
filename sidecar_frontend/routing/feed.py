"""One worker's cache stream applied to a block index (pure: a state machine fed one update at a
time; the I/O side reads ``WatchKvCache`` and acts on what each step returns).

The stream (docs/api.md, "WatchKvCache"): a snapshot, possibly in chunks sharing one (epoch,
sequence), whole after its last chunk; then deltas numbered sequence + 1, + 2, ... within the
epoch. The feed keeps the (epoch, sequence) it last applied, which is what a reconnect asks to
resume from. What each update does:

* a snapshot chunk: gathered; the last chunk replaces everything the index held for the worker
  (exact entries and approximate ones alike);
* a snapshot chunk whose keys follow another layout than this frontend's (its ``key_scheme``,
  0 read as 1: a sidecar older than the field): none of its keys could match a request's, so
  the feed stops as if the stream were gone (the worker's entries go, nothing is indexed,
  :attr:`CacheFeed.live` is false: the worker counts as publishing no cache state) and
  remembers the layout in :attr:`CacheFeed.foreign_scheme`; the I/O side stops watching;
* the next delta: applied in the stream's order (cleared, then removed, then added);
* a delta already applied (its sequence is not past the feed's): ignored;
* a delta past the next one, of another epoch, or before any snapshot: a gap. Nothing of it is
  applied; the I/O side reconnects from :attr:`CacheFeed.resume_from` and the sidecar either
  replays the missing deltas or sends a new snapshot.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from sidecar_common.kv_keys import KEY_SCHEME
from sidecar_frontend.routing.index import BlockIndex

__all__ = ["UNSTATED_KEY_SCHEME", "CacheFeed", "FeedCounts", "Step", "stated_key_scheme"]

# The layout of the keys of a sidecar older than KvCacheSnapshot.key_scheme (which reads 0).
UNSTATED_KEY_SCHEME: Final = 1


def stated_key_scheme(key_scheme: int) -> int:
    """The key layout a snapshot's ``key_scheme`` names (0: a sidecar older than the field)."""
    return key_scheme if key_scheme else UNSTATED_KEY_SCHEME


# How long an announced block counts as held without the engine's own event: a prefill queued
# behind others can take seconds; a request that fails before its prefill leaves an entry no
# longer than this.
ANNOUNCED_TTL: Final = 30.0


class Step(enum.Enum):
    GATHERED = "gathered"  # a snapshot chunk that is not the last
    SNAPSHOT = "snapshot"  # a whole snapshot replaced the worker's entries
    APPLIED = "applied"  # the next delta
    DUPLICATE = "duplicate"  # a delta already applied
    GAP = "gap"  # reconnect from resume_from
    FOREIGN = "foreign"  # keys of another layout: nothing indexed, the feed stopped


@dataclass
class FeedCounts:
    snapshots: int = 0
    deltas: int = 0
    gaps: int = 0

    @property
    def resyncs(self) -> int:
        """Snapshots after the first: each a state rebuilt from scratch."""
        return max(0, self.snapshots - 1)


class CacheFeed:
    """Applies one worker's ``WatchKvCache`` updates under ``worker`` to the index ``index_of``
    returns at each update.

    Asked each time rather than held: the router drops an index that holds no worker (at a
    scrape, or when its last worker leaves) and makes a new one on next use, so an index held
    from before the snapshot could be one the router no longer reads.
    """

    def __init__(
        self, worker: str, index_of: Callable[[], BlockIndex], *, key_scheme: int = KEY_SCHEME
    ) -> None:
        self.worker = worker
        self._index_of = index_of
        # This frontend's key layout: a snapshot in another one is not indexed.
        self.key_scheme = key_scheme
        # The layout of the last snapshot when it was another one (None: the same, or none yet).
        self.foreign_scheme: int | None = None
        self.counts = FeedCounts()
        self.epoch: int | None = None
        self.sequence: int | None = None
        self.block_size = 0
        # The engine has published at least once (its snapshot's status said so, or a delta came).
        self.engine_publishes = False
        self._pending_at: tuple[int, int] | None = None
        self._pending: list[int] = []

    @property
    def index(self) -> BlockIndex:
        return self._index_of()

    @property
    def live(self) -> bool:
        """A whole snapshot was applied: the index holds the worker's state."""
        return self.epoch is not None

    @property
    def resume_from(self) -> tuple[int, int] | None:
        """The (epoch, sequence) to reconnect with (None: ask for a snapshot)."""
        if self.epoch is None or self.sequence is None:
            return None
        return self.epoch, self.sequence

    def snapshot_chunk(
        self,
        epoch: int,
        sequence: int,
        block_size: int,
        keys: Sequence[int],
        *,
        last_chunk: bool,
        engine_published: bool,
        key_scheme: int,
    ) -> Step:
        """One chunk of a snapshot taken at (``epoch``, ``sequence``), its keys in layout
        ``key_scheme`` (the field as sent: 0 from a sidecar older than it)."""
        scheme = stated_key_scheme(key_scheme)
        if scheme != self.key_scheme:
            self.stop()
            self.foreign_scheme = scheme
            return Step.FOREIGN
        if self._pending_at != (epoch, sequence):
            self._pending_at = (epoch, sequence)
            self._pending = []
        self._pending.extend(keys)
        if not last_chunk:
            return Step.GATHERED
        self.index.replace(self.worker, self._pending)
        self._pending_at = None
        self._pending = []
        self.epoch, self.sequence = epoch, sequence
        self.block_size = block_size
        self.foreign_scheme = None
        self.engine_publishes = self.engine_publishes or engine_published
        self.counts.snapshots += 1
        return Step.SNAPSHOT

    def delta(
        self,
        epoch: int,
        sequence: int,
        *,
        cleared: bool,
        removed: Sequence[int],
        added: Sequence[int],
        announced: Sequence[int] = (),
        now: float = 0.0,
    ) -> Step:
        """One delta; applied only when it is the next one. ``announced`` keys (blocks a
        request accepted there is about to prefill) count as held there until ``now`` +
        :data:`ANNOUNCED_TTL`, unless the worker's own stored blocks make them exact first."""
        if self.epoch is None or self.sequence is None or epoch != self.epoch:
            self.counts.gaps += 1
            return Step.GAP
        if sequence <= self.sequence:
            return Step.DUPLICATE
        if sequence != self.sequence + 1:
            self.counts.gaps += 1
            return Step.GAP
        if cleared:
            self.index.clear(self.worker)
        if removed:
            self.index.remove(self.worker, removed)
        if added:
            self.index.store(self.worker, added)
        if announced:
            self.index.store(self.worker, announced, expires=now + ANNOUNCED_TTL)
        self.sequence = sequence
        if cleared or removed or added:  # the engine's own change, not a sidecar's notice
            self.engine_publishes = True
        self.counts.deltas += 1
        return Step.APPLIED

    def stop(self) -> None:
        """The stream is gone for good (the worker left or stopped publishing): its entries go."""
        self.index.forget(self.worker)
        self.epoch = self.sequence = None
        self._pending_at = None
        self._pending = []
