"""The KV-event sockets and the engine's cache: I/O around ``prefix_cache`` and ``kv_events``.

``KvEventPublisher`` is one data-parallel rank's PUB socket (bound or connected as the engine
would) and, when configured, its replay ROUTER; batches are numbered from 0 from each start,
so a restart is a sequence reset, as an engine restart is. ``EngineKvCache`` is what an
engine holds: one prefix cache and one publisher per data-parallel rank, publishing each
change of a cache as one batch.

Faults for the consumers' tests: ``drop_next_batch`` sends the next batch nowhere on the PUB
socket (it is still numbered and kept for replay: a gap a subscriber must fill by replay);
``restart`` forgets every block and restarts the publishers (sequence numbers start again at
0; SGLang then publishes ``AllBlocksCleared`` as its first batch, vLLM publishes nothing).

The testkit publishes from the event loop (the engines use a thread): a PUB send never blocks
(ZMQ drops at the high-water mark), so nothing waits on a subscriber.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from testkit.kv_events import (
    Flavor,
    KvEventsConfig,
    ReplayBuffer,
    binds,
    block_hasher,
    encode_batch,
    offset_endpoint,
    seq_bytes,
    sglang_kv_events_descriptor,
)
from testkit.prefix_cache import NO_EXTRA, BlockExtra, CacheEvent, PrefixCache

__all__ = ["EngineKvCache", "KvEventPublisher"]

log = logging.getLogger("testkit.kv_events")


def _local(endpoint: str) -> str:
    """A bound wildcard endpoint as a local subscriber reaches it."""
    for wildcard in ("0.0.0.0", "*"):
        endpoint = endpoint.replace(f"//{wildcard}:", "//127.0.0.1:")
    return endpoint.replace("//[::]:", "//[::1]:")


def _same_port(asked: str, bound: str) -> str:
    """``asked`` with the port the OS chose for it, when it asked for port 0."""
    if asked.startswith("tcp://") and asked.endswith(":0"):
        return asked[:-1] + bound.rpartition(":")[2]
    return asked


class KvEventPublisher:
    """One rank's publisher. ``start`` binds or connects; ``publish`` is synchronous."""

    def __init__(self, config: KvEventsConfig, flavor: Flavor, rank: int = 0) -> None:
        self.config = config
        self.flavor = flavor
        self.rank = rank
        endpoint = offset_endpoint(config.endpoint, rank, flavor)
        assert endpoint is not None
        self.endpoint = endpoint
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, rank, flavor)
        self.binds = binds(endpoint, flavor, config.bind)
        self._topic = config.topic.encode()
        self._buffer = ReplayBuffer(config.buffer_steps)
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._next_seq = 0
        self._drop = 0
        self.local_endpoint = endpoint
        self.local_replay_endpoint = self.replay_endpoint

    @property
    def next_seq(self) -> int:
        return self._next_seq

    async def start(self) -> None:
        """Open the sockets; numbering starts at 0."""
        ctx = self._ctx = zmq.asyncio.Context()
        pub: zmq.Socket[bytes] = zmq.Socket(ctx, zmq.PUB)  # a plain socket: sends never wait
        pub.set_hwm(self.config.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        self._pub = pub
        if self.binds:
            pub.bind(self.endpoint)
            # A port 0 is chosen once: a restarted publisher binds the same one again.
            self.endpoint = _same_port(self.endpoint, pub.getsockopt_string(zmq.LAST_ENDPOINT))
            self.local_endpoint = _local(pub.getsockopt_string(zmq.LAST_ENDPOINT))
        else:
            pub.connect(self.endpoint)
            self.local_endpoint = self.endpoint
        if self.replay_endpoint is not None:
            replay = ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            # A full replay and its end marker must fit in the send queue.
            replay.setsockopt(zmq.SNDHWM, 2 * (self.config.buffer_steps + 1))
            replay.bind(self.replay_endpoint)
            bound = replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint = _same_port(self.replay_endpoint, bound)
            self.local_replay_endpoint = _local(bound)
            self._replay = replay
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay(replay))
        self._next_seq = 0
        self._buffer.clear()
        log.info(
            "KV events (rank %d) on %s, replay %s", self.rank, self.local_endpoint, self.local_replay_endpoint
        )

    async def stop(self) -> None:
        task, self._replay_task = self._replay_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    def drop_next_batch(self, count: int = 1) -> None:
        """The next ``count`` batches are numbered and kept for replay but not sent."""
        self._drop += count

    def publish(self, events: Sequence[CacheEvent], ts: float | None = None) -> int | None:
        """Send one batch; its sequence number (None when there is nothing to send)."""
        if not events or self._pub is None:
            return None
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_batch(self.flavor, time.time() if ts is None else ts, events, self.rank)
        self._buffer.append(seq, payload)
        if self._drop > 0:
            self._drop -= 1
            log.info("KV events (rank %d): batch %d dropped (fault)", self.rank, seq)
            return seq
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart([self._topic, seq_bytes(seq), payload], flags=zmq.NOBLOCK)
        return seq

    async def _serve_replay(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            replies = self._buffer.answer(frames[0], frames[1:], self._topic) if frames else None
            if replies is None:
                log.warning("KV events (rank %d): malformed replay request ignored", self.rank)
                continue
            for reply in replies:
                await sock.send_multipart(reply)


@dataclass
class _Request:
    rank: int


class EngineKvCache:
    """An engine's prefix caches (one per data-parallel rank) and their publishers."""

    def __init__(
        self,
        flavor: Flavor,
        *,
        block_size: int,
        capacity_blocks: int,
        data_parallel_size: int = 1,
        events: KvEventsConfig | None = None,
    ) -> None:
        self.flavor = flavor
        hasher = block_hasher(flavor)
        self.caches = [PrefixCache(block_size, capacity_blocks, hasher) for _ in range(data_parallel_size)]
        enabled = events is not None and events.enabled
        self.publishers = (
            [KvEventPublisher(events, flavor, rank) for rank in range(data_parallel_size)]
            if enabled and events is not None
            else []
        )
        self._requests: dict[str, _Request] = {}

    async def start(self) -> None:
        """A starting engine has a cold cache; SGLang says so on the wire, vLLM does not."""
        started: list[KvEventPublisher] = []
        try:
            for pub in self.publishers:
                await pub.start()
                started.append(pub)
        except BaseException:
            for pub in started:
                await pub.stop()
            raise
        for rank, cache in enumerate(self.caches):
            cleared = cache.reset()
            if self.flavor == "sglang":
                self._publish(rank, cleared)

    async def stop(self) -> None:
        for pub in self.publishers:
            await pub.stop()

    async def restart(self) -> None:
        """A fault: the engine's cache is lost and its publishers restart (sequence reset)."""
        await self.stop()
        await self.start()

    def sglang_descriptor(self) -> dict[str, Any] | None:
        """What SGLang's server info says of its publishers (None: none)."""
        if not self.publishers:
            return None
        first = self.publishers[0]
        return sglang_kv_events_descriptor(
            first.config, first.endpoint, first.replay_endpoint, self.caches[0].block_size, len(self.caches)
        )

    def flush(self) -> bool:
        """The engines' cache reset (vLLM's FlushCache, SGLang's /flush_cache): refused (False)
        while a request holds blocks; else every block goes and each rank publishes
        ``AllBlocksCleared``."""
        if self._requests:
            return False
        for rank, cache in enumerate(self.caches):
            self._publish(rank, cache.reset())
        return True

    def drop_next_batch(self, rank: int = 0) -> None:
        if self.publishers:
            self.publishers[rank].drop_next_batch()

    def _publish(self, rank: int, events: Sequence[CacheEvent]) -> None:
        if self.publishers and events:
            self.publishers[rank].publish(events)

    # -- a request's life (see PrefixCache) ------------------------------------------------
    def begin(self, rid: str, tokens: Sequence[int], extra: BlockExtra = NO_EXTRA, rank: int = 0) -> int:
        """Reference the cached prefix; the cached token count the engine reports."""
        self._requests[rid] = _Request(rank)
        return self.caches[rank].begin(rid, tokens, extra)

    def store(self, rid: str, tokens: Sequence[int]) -> None:
        """``tokens`` are computed: cache their full blocks and publish the change."""
        request = self._requests.get(rid)
        if request is not None:
            self._publish(request.rank, self.caches[request.rank].store(rid, tokens))

    def end(self, rid: str) -> None:
        request = self._requests.pop(rid, None)
        if request is not None:
            self.caches[request.rank].end(rid)
