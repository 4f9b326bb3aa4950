"""One engine publisher's cache state, fed its KV-event batches (pure: no I/O, no clock).

:class:`CacheMap` holds the blocks one publisher (one data-parallel rank) has in its GPU
cache, keyed by :mod:`sidecar_common.kv_keys` keys, and turns each batch of events into a net
:class:`KvDelta`. :class:`RankFeed` puts batches in order by their sequence numbers: it finds
gaps and asks its I/O layer for a replay (:attr:`Step.replay_from`), checks that the replay
starts where it was asked to (the engines' replay socket answers a start older than its buffer
from the oldest batch it has, silently), and resyncs when the history cannot be made whole.

A resync clears the map (a ``cleared`` delta) and counts an epoch. It happens on
``AllBlocksCleared`` (SGLang publishes it when its cache starts), a sequence number going back
(a restarted publisher counts from 0 again: how a vLLM restart shows), a gap the replay
cannot fill, a batch that cannot be decoded, and the engine's health going bad. After a
resync the feed applies whatever contiguous history it still gets (the replay buffer's
oldest batches on), so the map holds a subset of what the engine holds: never a block the
engine removed, possibly fewer blocks than it has (a missed hit, never a phantom one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from sidecar_common.kv_keys import extend_keys, root_key
from sidecar_server.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    EngineHash,
    KvEvent,
    block_identity,
    is_tracked_tier,
)

__all__ = ["CacheMap", "KvDelta", "RankFeed", "ResyncReason", "Step"]


@dataclass(frozen=True)
class KvDelta:
    """A net change: apply ``cleared`` first, then ``removed``, then ``added``.

    ``added`` pairs each new key with its parent's key (the root key of its adapter and salt
    for a first block). A key is in at most one of ``removed`` and ``added``. ``engine_time``
    is the ``ts`` of the engine's batch the delta comes from (None: no batch made it, e.g. a
    resync); it is not a change, so a delta with nothing else is empty. ``announced`` are keys
    of blocks a request accepted here is about to prefill (``KvCacheDelta.announced_keys``):
    a notice, not a change of what is held.
    """

    added: tuple[tuple[int, int], ...] = ()
    removed: tuple[int, ...] = ()
    cleared: bool = False
    engine_time: float | None = None
    announced: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.cleared or self.announced)


class ResyncReason:
    CLEARED: Final = "all_blocks_cleared"
    SEQUENCE_RESET: Final = "sequence_reset"
    GAP: Final = "gap_not_replayed"
    UNDECODABLE: Final = "undecodable_batch"
    ENGINE_UNHEALTHY: Final = "engine_unhealthy"


class CacheMap:
    """The routable blocks of one publisher's GPU cache."""

    def __init__(self, block_size: int | None = None) -> None:
        self.block_size = block_size
        self._key_of: dict[EngineHash, int] = {}
        # Blocks present in the engine that no token-id key names (multimodal, prompt
        # embeddings, an unknown parent): kept so their children are known to be opaque too.
        self._opaque: set[EngineHash] = set()
        # Every key held, with its parent's key.
        self._parent: dict[int, int] = {}
        # How many engine hashes beyond the first name a held key (an engine may hash the same
        # tokens two ways, e.g. vLLM's LoRA path is in its hash but not in ours): the key
        # leaves with the last of them. Absent for the usual one hash, so a block costs one
        # dict entry here, not an object.
        self._more_hashes: dict[int, int] = {}
        self._touched: dict[int, bool] = {}
        self._cleared = False
        self.skipped_events = 0

    def __len__(self) -> int:
        return len(self._parent)

    def blocks(self) -> list[tuple[int, int]]:
        """Every key held, with its parent's key."""
        return list(self._parent.items())

    def key_of(self, engine_hash: EngineHash) -> int | None:
        return self._key_of.get(engine_hash)

    def apply(self, events: tuple[KvEvent, ...] | list[KvEvent]) -> KvDelta:
        """Apply one batch's events in order; the net change they made."""
        # vLLM sends one BlockRemoved per block: a run of them is forgotten in one loop.
        removed: list[EngineHash] = []
        for event in events:
            if isinstance(event, BlockRemoved):
                if is_tracked_tier(event.medium, event.group_idx):
                    removed += event.block_hashes
                continue
            if removed:
                self._forget_all(removed)
                removed = []
            if isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, AllBlocksCleared):
                self._clear()
        if removed:
            self._forget_all(removed)
        return self._take_delta()

    def clear(self) -> KvDelta:
        """Forget every block (a resync); the delta says ``cleared``."""
        self._clear()
        return self._take_delta()

    def _take_delta(self) -> KvDelta:
        if self._cleared:
            delta = KvDelta(added=tuple(self._parent.items()), cleared=True)
        else:
            parents = self._parent
            touched = self._touched.items()
            delta = KvDelta(
                added=tuple([(key, parents[key]) for key, was in touched if not was and key in parents]),
                removed=tuple([key for key, was in touched if was and key not in parents]),
            )
        self._touched.clear()
        self._cleared = False
        return delta

    def _clear(self) -> None:
        self._key_of.clear()
        self._opaque.clear()
        self._parent.clear()
        self._more_hashes.clear()
        self._touched.clear()
        self._cleared = True

    def _store(self, event: BlockStored) -> None:
        if not is_tracked_tier(event.medium, event.group_idx):
            return
        size = event.block_size
        hashes = event.block_hashes
        count = len(hashes)
        token_ids = event.token_ids
        if (
            size < 1
            or len(token_ids) != count * size
            or (self.block_size is not None and size != self.block_size)
        ):
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
            parent = self._key_of.get(event.parent_block_hash)
        # A chain is routable up to its first opaque block; everything after is opaque too.
        routable = 0
        if parent is not None:
            extra_keys = event.extra_keys
            if not extra_keys or not any(extra_keys[1:count]):
                # No block after the first has extra keys (vLLM's usual [None, ...]): all are
                # keyed by tokens, without asking block_identity block by block.
                routable = count
            else:
                routable = min(1, count)
                while routable < count and block_identity(event, routable) is not None:
                    routable += 1
        if parent is not None and routable:
            tokens = token_ids if routable == count else token_ids[: routable * size]
            self._add_chain(hashes, extend_keys(parent, tokens, size), parent)
        for engine_hash in hashes[routable:]:
            self._forget(engine_hash)
            self._opaque.add(engine_hash)

    def _add_chain(self, hashes: list[EngineHash], keys: list[int], parent: int) -> None:
        """Hold ``keys`` (each the child of the one before, the first of ``parent``)."""
        # The per-block loop of every store: attribute and method lookups hoisted.
        key_of = self._key_of
        opaque = self._opaque
        parents = self._parent
        touched = None if self._cleared else self._touched
        for engine_hash, key in zip(hashes, keys, strict=False):
            known = key_of.get(engine_hash)
            if known == key:
                parent = key
                continue  # a re-store of a cached block (vLLM reports prefix hits so)
            if known is not None or engine_hash in opaque:
                self._forget(engine_hash)
            if touched is not None and key not in touched:
                touched[key] = key in parents
            key_of[engine_hash] = key
            if key in parents:
                more = self._more_hashes
                more[key] = more.get(key, 0) + 1
            else:
                parents[key] = parent
            parent = key

    def _forget(self, engine_hash: EngineHash) -> None:
        self._forget_all((engine_hash,))

    def _release(self, key: int) -> None:
        more = self._more_hashes.get(key)
        if more is None:
            del self._parent[key]
        elif more == 1:
            del self._more_hashes[key]
        else:
            self._more_hashes[key] = more - 1

    def _forget_all(self, hashes: Sequence[EngineHash]) -> None:
        """_forget each of ``hashes``, in order (inlined: the per-block loop of removals)."""
        opaque = self._opaque
        pop = self._key_of.pop
        parents = self._parent
        touched = None if self._cleared else self._touched
        for engine_hash in hashes:
            if opaque:
                opaque.discard(engine_hash)
            key = pop(engine_hash, None)
            if key is None:
                continue
            if touched is not None and key not in touched:
                touched[key] = key in parents
            if key in self._more_hashes:
                self._release(key)
            else:
                del parents[key]


@dataclass(frozen=True)
class Step:
    """What one input produced: deltas in order, and a replay the I/O layer should ask for."""

    deltas: tuple[KvDelta, ...] = ()
    replay_from: int | None = None


@dataclass
class _Replay:
    start: int
    # Exact: the map has history the replay must continue without a hole. Not exact: the map
    # was just cleared, and any contiguous run of history it gets is worth applying.
    exact: bool
    answered: bool = False


@dataclass
class _Counters:
    gaps: int = 0
    replays: int = 0
    resyncs: dict[str, int] = field(default_factory=dict)


class RankFeed:
    """Sequencing for one publisher: live batches, replays, resyncs.

    Each ``on_*`` call returns a :class:`Step`. At most one replay is outstanding; while it
    is, live batches are held and applied after it ends. ``batch=None`` is a payload that did
    not decode.
    """

    def __init__(self, *, replay: bool, block_size: int | None = None) -> None:
        self.map = CacheMap(block_size)
        self.epoch = 0
        self.counters = _Counters()
        self._replay_available = replay
        self._expected: int | None = None
        self._replay: _Replay | None = None
        self._held: list[tuple[int, DecodedBatch | None]] = []
        self._out: list[KvDelta] = []

    @property
    def expected(self) -> int | None:
        """The next sequence number wanted; None until the first batch."""
        return self._expected

    @property
    def replaying(self) -> bool:
        return self._replay is not None

    def start(self) -> Step:
        """On subscribing: learn what the engine cached before we listened, if it can say."""
        return Step(replay_from=self._relearn())

    def on_live(self, sequence: int, batch: DecodedBatch | None) -> Step:
        if self._replay is not None:
            self._held.append((sequence, batch))
            return Step()
        return self._step(self._take(sequence, batch))

    def on_replay(self, sequence: int, batch: DecodedBatch | None) -> Step:
        replay = self._replay
        if replay is None:
            return Step()  # an answer to a replay already given up
        if not replay.answered:
            replay.answered = True
            if replay.exact and sequence != replay.start:
                # The buffer no longer holds the batches we missed: start over from what it has.
                self._resync(ResyncReason.GAP)
                self._expected = sequence
            elif not replay.exact:
                self._expected = sequence
        expected = self._expected
        if expected is not None and sequence < expected:
            return self._step()  # already applied
        if expected is not None and sequence > expected:
            self._resync(ResyncReason.GAP)
        self._apply(sequence, batch)
        return self._step()

    def on_replay_end(self) -> Step:
        """The replay's end marker arrived."""
        replay = self._replay
        if replay is None:
            return Step()
        if not replay.answered:
            if replay.exact:
                self._resync(ResyncReason.GAP)
                self._expected = None
            elif self._expected is None:
                # Nothing published yet (or nothing kept): the publisher's first batch is 0,
                # so a first live batch after it shows any batch we missed meanwhile.
                self._expected = replay.start
        return self._step(self._drain())

    def on_replay_failed(self) -> Step:
        """No answer within the deadline, or no replay socket answering."""
        return self.on_replay_end()

    def on_engine_unhealthy(self) -> Step:
        """The engine's health went bad: it may restart with an empty cache."""
        self._resync(ResyncReason.ENGINE_UNHEALTHY)
        self._expected = None
        if self._replay is not None:
            self._replay.exact = False
            return self._step()
        return self._step(self._relearn())

    def _step(self, replay_from: int | None = None) -> Step:
        deltas = tuple(delta for delta in self._out if delta)
        self._out.clear()
        return Step(deltas=deltas, replay_from=replay_from)

    def _take(self, sequence: int, batch: DecodedBatch | None) -> int | None:
        """One batch in arrival order; a replay start if one is needed."""
        expected = self._expected
        if expected is not None and sequence < expected:
            # A restarted publisher counts from 0 again; its replay buffer starts there too.
            self._resync(ResyncReason.SEQUENCE_RESET)
            expected = self._expected = None
            if sequence > 0 and self._replay_available:
                self._held.insert(0, (sequence, batch))
                return self._ask(0, exact=False)
        if expected is None:
            expected = self._expected = sequence
        if sequence > expected:
            self.counters.gaps += 1
            if self._replay_available:
                self._held.insert(0, (sequence, batch))
                return self._ask(expected, exact=True)
            self._resync(ResyncReason.GAP)
            self._expected = sequence
        self._apply(sequence, batch)
        return None

    def _apply(self, sequence: int, batch: DecodedBatch | None) -> None:
        self._expected = sequence + 1
        if batch is None:
            self._resync(ResyncReason.UNDECODABLE)
            return
        delta = self.map.apply(batch.events)
        # A map's delta says cleared exactly when the batch had an AllBlocksCleared.
        if delta.cleared:
            self._count_resync(ResyncReason.CLEARED)
        # One batch, one delta: the delta carries its batch's time.
        self._out.append(
            KvDelta(added=delta.added, removed=delta.removed, cleared=delta.cleared, engine_time=batch.ts)
        )

    def _drain(self) -> int | None:
        self._replay = None
        held, self._held = self._held, []
        for index, (sequence, batch) in enumerate(held):
            if self._expected is not None and sequence < self._expected:
                continue  # the replay brought it already
            replay_from = self._take(sequence, batch)
            if replay_from is not None:
                # _take put this batch back first; the rest wait behind it.
                self._held.extend(held[index + 1 :])
                return replay_from
        return None

    def _ask(self, start: int, *, exact: bool) -> int:
        self._replay = _Replay(start=start, exact=exact)
        self.counters.replays += 1
        return start

    def _relearn(self) -> int | None:
        return self._ask(0, exact=False) if self._replay_available else None

    def _resync(self, reason: str) -> None:
        self._count_resync(reason)
        self._out.append(self.map.clear())

    def _count_resync(self, reason: str) -> None:
        self.epoch += 1
        self.counters.resyncs[reason] = self.counters.resyncs.get(reason, 0) + 1
