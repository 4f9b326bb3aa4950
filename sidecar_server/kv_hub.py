"""The worker's KV-cache state served to frontends: the WatchKvCache stream (I/O side).

:class:`KvCacheHub` owns the merged :class:`~sidecar_server.kv_view.WorkerCacheView`, wakes
the streams when it changes, and answers ``GetLoad``'s :class:`KvCacheStatus`. A sidecar
without ``--kv-events-endpoint`` has a hub too, never fed: its stream is one empty snapshot
saying ``subscribed: false``, then nothing until the client leaves, so a frontend treats
every worker alike and routes such a worker by load.

Who wants to hear of the engine's health or of each live batch's lag subscribes
(:meth:`KvCacheHub.subscribe_engine_health`, :meth:`KvCacheHub.subscribe_lag`) and holds the
:class:`Subscription` for as long as it listens.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Final, Generic, TypeVar

import anyio

from sidecar_common.api import sidecar_pb2
from sidecar_common.kv_keys import KEY_SCHEME, block_key_chain
from sidecar_common.kv_request import cacheable, key_namespace
from sidecar_server.kv_state import KvDelta, RankFeed
from sidecar_server.kv_view import NumberedDelta, WorkerCacheView

__all__ = ["SNAPSHOT_CHUNK_BLOCKS", "KvCacheHub", "Subscription", "new_epoch"]

# 16 bytes a block (key and parent, packed): about 1 MiB a chunk.
SNAPSHOT_CHUNK_BLOCKS: Final = 65_536


T = TypeVar("T")


def new_epoch() -> int:
    """A fresh epoch for a new sidecar process: random, so no two processes share one."""
    return secrets.randbits(63) + 1


class Subscription:
    """One listener's hold on a notification: :meth:`close` (or leaving its ``with`` block)
    ends it; closing again does nothing."""

    def __init__(self, end: Callable[[], None]) -> None:
        self._end: Callable[[], None] | None = end

    def close(self) -> None:
        end, self._end = self._end, None
        if end is not None:
            end()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


class _Listeners(Generic[T]):
    """The listeners of one notification, told in the order they subscribed."""

    def __init__(self) -> None:
        self._listeners: list[Callable[[T], None]] = []

    def __len__(self) -> int:
        return len(self._listeners)

    def subscribe(self, listener: Callable[[T], None]) -> Subscription:
        # A wrapper per subscription: the same callable subscribed twice is two subscriptions,
        # and closing one leaves the other.
        def told(value: T) -> None:
            listener(value)

        self._listeners.append(told)
        return Subscription(lambda: self._listeners.remove(told))

    def tell(self, value: T) -> None:
        # A copy: a listener may unsubscribe (itself or another) while being told.
        for listener in tuple(self._listeners):
            listener(value)


class KvCacheHub:
    def __init__(
        self,
        *,
        subscribed: bool,
        epoch: int | None = None,
        kept_deltas: int = 4096,
        chunk_blocks: int = SNAPSHOT_CHUNK_BLOCKS,
    ) -> None:
        self.subscribed = subscribed
        self.view = WorkerCacheView(epoch=new_epoch() if epoch is None else epoch, kept_deltas=kept_deltas)
        self.model = ""
        self.batches_received = 0
        self._chunk_blocks = chunk_blocks
        self._changed = anyio.Event()
        self._engine_health = _Listeners[bool]()
        # One per data-parallel rank subscribed to (their counters are metrics).
        self.feeds: list[RankFeed] = []
        self._lag = _Listeners[float]()

    def set_model(self, model: str, block_size: int) -> None:
        """What discovery said: the served model, and the engine's block size if it gave one."""
        self.model = model
        if block_size > 0 and self.view.block_size is None:
            self.view.block_size = block_size

    def subscribe_engine_health(self, listener: Callable[[bool], None]) -> Subscription:
        """``listener(healthy)`` is told each change of the engine's health verdict (the KV
        subscriber resyncs on a bad one), until the subscription is closed."""
        return self._engine_health.subscribe(listener)

    def subscribe_lag(self, listener: Callable[[float], None]) -> Subscription:
        """``listener(seconds)`` is told each live batch's lag (sidecar_common.kv_lag: its
        arrival here minus the engine's time of the batch), until the subscription is closed."""
        return self._lag.subscribe(listener)

    @property
    def subscribers(self) -> tuple[int, int]:
        """How many listen to the engine's health, and to the lag."""
        return len(self._engine_health), len(self._lag)

    def engine_health(self, healthy: bool) -> None:
        """The engine's health verdict changed: tell its subscribers."""
        self._engine_health.tell(healthy)

    def batch_lag(self, seconds: float) -> None:
        """A live batch arrived ``seconds`` after the engine's time of it: tell the subscribers."""
        self._lag.tell(seconds)

    def apply(self, rank: int, delta: KvDelta, block_size: int | None) -> NumberedDelta | None:
        if block_size is not None:
            self.view.block_size = block_size
        numbered = self.view.apply(rank, delta)
        if numbered is not None:
            self._changed.set()
            self._changed = anyio.Event()
        return numbered

    def announce(self, request: sidecar_pb2.PreprocessedRequest) -> None:
        """Tell the watchers which blocks ``request``, just accepted, will have the engine
        prefill here (its prompt's full blocks after those already held), so a frontend that
        did not route it learns where its prefix goes before the engine's own event."""
        block_size = self.view.block_size
        # Only for an engine that publishes (a batch came): a frontend reads a worker's stream
        # as exact once its engine does, and routes any other worker on its own decisions.
        if not self.batches_received or not block_size or not cacheable(request):
            return
        lora_name, cache_salt = key_namespace(request)
        keys = block_key_chain(request.token_ids, block_size, lora_name=lora_name, cache_salt=cache_salt)
        if self.view.announce(keys) is not None:
            self._changed.set()
            self._changed = anyio.Event()

    def status(self) -> sidecar_pb2.KvCacheStatus:
        return sidecar_pb2.KvCacheStatus(
            subscribed=self.subscribed,
            batches_received=self.batches_received,
            blocks=len(self.view),
            block_size=self.view.block_size or 0,
        )

    async def watch(
        self,
        request: sidecar_pb2.WatchKvCacheRequest,
        write: Callable[[sidecar_pb2.KvCacheUpdate], Awaitable[None]],
    ) -> None:
        """Serve one WatchKvCache stream until the client leaves (or the server stops)."""
        view = self.view
        resumed: list[NumberedDelta] | None = None
        if request.HasField("epoch") and request.HasField("sequence"):
            resumed = view.deltas_after(request.epoch, request.sequence)
        if resumed is None:
            sent = await self._send_snapshot(write)
        else:
            sent = request.sequence
            for numbered in resumed:
                await write(self._delta_update(numbered))
                sent = numbered.sequence
        while True:
            changed = self._changed
            if view.sequence == sent:
                await changed.wait()
                continue
            pending = view.deltas_after(view.epoch, sent)
            if pending is None:
                # This client fell behind the deltas kept: start it over.
                sent = await self._send_snapshot(write)
                continue
            for numbered in pending:
                await write(self._delta_update(numbered))
                sent = numbered.sequence

    async def _send_snapshot(self, write: Callable[[sidecar_pb2.KvCacheUpdate], Awaitable[None]]) -> int:
        snapshot = self.view.snapshot()
        blocks = snapshot.blocks
        step = self._chunk_blocks
        starts = range(0, len(blocks), step) if blocks else range(1)
        for start in starts:
            chunk = blocks[start : start + step]
            await write(
                sidecar_pb2.KvCacheUpdate(
                    snapshot=sidecar_pb2.KvCacheSnapshot(
                        epoch=snapshot.epoch,
                        sequence=snapshot.sequence,
                        block_size=snapshot.block_size or 0,
                        model=self.model,
                        keys=[key for key, _ in chunk],
                        parents=[parent for _, parent in chunk],
                        last_chunk=start + step >= len(blocks),
                        status=self.status(),
                        # On every chunk: a client on another key layout can match none of them.
                        key_scheme=KEY_SCHEME,
                    )
                )
            )
        return snapshot.sequence

    def _delta_update(self, numbered: NumberedDelta) -> sidecar_pb2.KvCacheUpdate:
        delta = numbered.delta
        return sidecar_pb2.KvCacheUpdate(
            delta=sidecar_pb2.KvCacheDelta(
                epoch=self.view.epoch,
                sequence=numbered.sequence,
                cleared=delta.cleared,
                removed=delta.removed,
                added_keys=[key for key, _ in delta.added],
                added_parents=[parent for _, parent in delta.added],
                engine_time=delta.engine_time,
                announced_keys=delta.announced,
            )
        )
