"""Subscribing to the engine's KV events over ZeroMQ (the I/O around kv_state's feeds).

One task per data-parallel rank reads the rank's PUB socket with a SUB socket; a second task
per rank answers the feed's replay requests, each over a fresh DEALER socket to the rank's
replay ROUTER (the engines send one answer per batch and an end marker, so a REQ would not
do), given up when nothing arrives for ``replay_timeout`` seconds. ZeroMQ reconnects a SUB
on its own, so a publisher that restarts is heard again; its sequence numbers starting over
is what tells the feed to resync. Every task lives in :meth:`KvSubscriber.run`'s task group,
owned by the daemon and cancelled when it stops.

The clock is read here, when a live batch arrives: its lag (the arrival minus the engine's
``ts``) goes to the hub's lag subscribers. Replayed batches are old by design (the replay
buffer's age, not the wire's delay) and are not counted there.
"""

from __future__ import annotations

import math
import time

import anyio
import anyio.lowlevel
import msgspec
import structlog
import zmq
import zmq.asyncio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from sidecar_common.kv_lag import events_lag
from sidecar_server.kv_config import KvEventsConfig, rank_endpoint
from sidecar_server.kv_events import (
    END_OF_REPLAY,
    DecodedBatch,
    decode_batch,
    decode_sequence,
    encode_sequence,
)
from sidecar_server.kv_hub import KvCacheHub
from sidecar_server.kv_state import RankFeed, Step

__all__ = ["KvSubscriber"]

_log = structlog.get_logger(__name__)


async def _let_others_run() -> None:
    # pyzmq's asyncio receive returns an already finished future when a message is queued,
    # and awaiting it does not yield: without this, a backlog of batches (a replay answer, or
    # live batches queued while the process was descheduled) is decoded and applied in one
    # turn of the event loop, holding up every request the sidecar relays meanwhile.
    await anyio.lowlevel.checkpoint()


class KvSubscriber:
    def __init__(self, config: KvEventsConfig, hub: KvCacheHub, *, ranks: int) -> None:
        if ranks < 1:
            raise ValueError("ranks must be at least 1")
        self._config = config
        self._hub = hub
        self._feeds = [RankFeed(replay=config.replay_endpoint is not None) for _ in range(ranks)]
        hub.feeds = self._feeds
        self._replays: list[MemoryObjectSendStream[int]] = []

    @property
    def feeds(self) -> list[RankFeed]:
        return self._feeds

    async def run(self) -> None:
        context = zmq.asyncio.Context()
        # Listening to the engine's health as long as the feeds run: a bad verdict resyncs
        # them, and once they are gone there is nothing to resync.
        try:
            with self._hub.subscribe_engine_health(self._engine_health):
                await self._run_feeds(context)
        finally:
            context.destroy(linger=0)

    async def _run_feeds(self, context: zmq.asyncio.Context) -> None:
        async with anyio.create_task_group() as tg:
            for rank in range(len(self._feeds)):
                send, receive = anyio.create_memory_object_stream[int](max_buffer_size=math.inf)
                self._replays.append(send)
                if self._config.replay_endpoint is not None:
                    replay_at = rank_endpoint(self._config.replay_endpoint, rank)
                    tg.start_soon(self._replay_loop, context, rank, replay_at, receive)
                tg.start_soon(self._live_loop, context, rank, rank_endpoint(self._config.endpoint, rank))

    def _engine_health(self, healthy: bool) -> None:
        if healthy or not self._replays:
            return
        for rank, feed in enumerate(self._feeds):
            self._deliver(rank, feed.on_engine_unhealthy())

    def _deliver(self, rank: int, step: Step) -> None:
        feed = self._feeds[rank]
        for delta in step.deltas:
            self._hub.apply(rank, delta, feed.map.block_size)
        if step.replay_from is not None:
            self._replays[rank].send_nowait(step.replay_from)

    def _decode(self, rank: int, payload: bytes) -> DecodedBatch | None:
        try:
            return decode_batch(payload)
        except (msgspec.DecodeError, ValueError) as exc:
            _log.warning("undecodable KV event batch", rank=rank, error=str(exc))
            return None

    async def _live_loop(self, context: zmq.asyncio.Context, rank: int, endpoint: str) -> None:
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, self._config.topic.encode())
        socket.connect(endpoint)
        _log.info(
            "subscribed to KV events", rank=rank, endpoint=endpoint, replay=self._config.replay_endpoint
        )
        try:
            self._deliver(rank, self._feeds[rank].start())
            while True:
                # The idle wait of a subscription: it lasts as long as the daemon runs.
                frames = await socket.recv_multipart()
                received = time.time()  # the engines stamp their batches with time.time()
                if len(frames) != 3:
                    _log.warning("KV event message of unexpected shape", rank=rank, frames=len(frames))
                    continue
                try:
                    sequence = decode_sequence(frames[1])
                except ValueError as exc:
                    _log.warning("KV event message of unexpected shape", rank=rank, error=str(exc))
                    continue
                self._hub.batches_received += 1
                batch = self._decode(rank, frames[2])
                if batch is not None and batch.ts is not None:
                    self._hub.batch_lag(events_lag(received, batch.ts))
                self._deliver(rank, self._feeds[rank].on_live(sequence, batch))
                await _let_others_run()
        finally:
            socket.close(linger=0)

    async def _replay_loop(
        self, context: zmq.asyncio.Context, rank: int, endpoint: str, starts: MemoryObjectReceiveStream[int]
    ) -> None:
        feed = self._feeds[rank]
        async for start in starts:
            socket = context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(endpoint)
            ended = False
            replayed = 0
            try:
                await socket.send_multipart([b"", encode_sequence(start)])
                while True:
                    frames: list[bytes] = []
                    with anyio.move_on_after(self._config.replay_timeout):
                        frames = await socket.recv_multipart()
                    if not frames or len(frames) != 4:
                        break  # no answer in time, or not the engines' answer shape
                    sequence = decode_sequence(frames[2])
                    if sequence == END_OF_REPLAY:
                        ended = True
                        self._deliver(rank, feed.on_replay_end())
                        break
                    replayed += 1
                    self._hub.batches_received += 1
                    self._deliver(rank, feed.on_replay(sequence, self._decode(rank, frames[3])))
                    await _let_others_run()
            except ValueError as exc:
                _log.warning("KV event replay answer of unexpected shape", rank=rank, error=str(exc))
            finally:
                socket.close(linger=0)
            if not ended:
                _log.warning(
                    "KV event replay gave no complete answer", rank=rank, start=start, replayed=replayed
                )
                self._deliver(rank, feed.on_replay_failed())
            else:
                _log.info("KV event replay", rank=rank, start=start, replayed=replayed)
