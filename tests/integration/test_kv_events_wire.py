"""The KV-event subscriber on the real wire (pyzmq on loopback), and WatchKvCache over a real
grpc.aio server: a minimal publisher written here speaks the engines' protocol (PUB of
``(topic, 8-byte sequence, msgpack batch)``, a ROUTER answering a start sequence with the
buffered batches and an end marker), fed by the simulated cache of tests/kv_sim.py."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import grpc
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_common.kv_keys import block_keys
from sidecar_server.kv_config import KvEventsConfig
from sidecar_server.kv_events import decode_batch
from sidecar_server.kv_hub import KvCacheHub
from sidecar_server.kv_metrics import KvEventsCollector, register_kv_events_metrics
from sidecar_server.kv_state import RankFeed, ResyncReason, Step
from sidecar_server.kv_subscriber import KvSubscriber
from sidecar_server.server import ServerConfig, SidecarServer
from tests.fake_engine import FakeEngine
from tests.kv_sim import SimCache

pytestmark = pytest.mark.timeout(60)

WAIT = 20.0
END = (-1).to_bytes(8, "big", signed=True)


@dataclass
class Publisher:
    """The engines' publisher, minimal: PUB + replay ROUTER on fixed loopback ports."""

    pub_port: int = 0
    replay_port: int = 0
    sequence: int = 0
    buffer: list[tuple[int, bytes]] = field(default_factory=list)
    _context: zmq.asyncio.Context = field(default_factory=zmq.asyncio.Context)
    _pub: Any = None
    _router: Any = None
    _lock: anyio.Lock = field(default_factory=anyio.Lock)

    def bind(self) -> None:
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        if self.pub_port:
            self._pub.bind(f"tcp://127.0.0.1:{self.pub_port}")
            self._router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        else:
            self.pub_port = self._pub.bind_to_random_port("tcp://127.0.0.1")
            self.replay_port = self._router.bind_to_random_port("tcp://127.0.0.1")

    def close(self) -> None:
        self._pub.close(linger=0)
        self._router.close(linger=0)

    async def restart(self) -> None:
        """A new engine process on the same ports: sequence numbers and buffer start over."""
        async with self._lock:
            self.close()
        self.sequence = 0
        self.buffer = []
        # ZeroMQ releases a closed socket's port in its I/O thread, a moment later.
        with anyio.fail_after(WAIT):
            while True:
                async with self._lock:
                    try:
                        self.bind()
                        return
                    except zmq.ZMQError:
                        self.close()
                await anyio.sleep(0.05)

    async def publish(self, payload: bytes, *, drop: bool = False) -> None:
        """Publish one batch (``drop``: buffered for replay but never sent, a lost message)."""
        sequence_bytes = self.sequence.to_bytes(8, "big")
        self.buffer.append((self.sequence, payload))
        self.sequence += 1
        if not drop:
            await self._pub.send_multipart([b"", sequence_bytes, payload])

    async def serve_replays(self) -> None:
        while True:
            # Polled in short turns under the lock, so that a restart never closes the socket
            # while a receive is pending on it.
            async with self._lock:
                if not self._router.closed and await self._router.poll(50):
                    client, _, start = await self._router.recv_multipart()
                    first = int.from_bytes(start, "big")
                    for sequence, payload in self.buffer:
                        if sequence >= first:
                            await self._router.send_multipart(
                                [client, b"", b"", sequence.to_bytes(8, "big"), payload]
                            )
                    await self._router.send_multipart([client, b"", b"", END, b""])
            await anyio.sleep(0.001)


@dataclass
class Running:
    publisher: Publisher
    hub: KvCacheHub
    subscriber: KvSubscriber

    def held(self) -> set[int]:
        return {key for key, _ in self.hub.view.snapshot().blocks}

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        with anyio.fail_after(WAIT):
            while not condition():  # noqa: ASYNC110 - a condition on state another task changes
                await anyio.sleep(0.01)

    async def publish_until_heard(self, sim: SimCache, first: list[int]) -> None:
        """A SUB hears only what is published after it has connected (ZeroMQ's slow joiner):
        publish requests until the subscriber has heard one, as a live engine would."""
        with anyio.fail_after(WAIT):
            while self.hub.batches_received == 0:
                await self.publisher.publish(sim.batch(sim.request([*first, self.publisher.sequence])))
                await anyio.sleep(0.05)


@asynccontextmanager
async def subscribed(*, replay: bool = True, publisher: Publisher | None = None) -> AsyncIterator[Running]:
    publisher = publisher if publisher is not None else Publisher()
    publisher.bind()
    hub = KvCacheHub(subscribed=True)
    config = KvEventsConfig(
        endpoint=f"tcp://127.0.0.1:{publisher.pub_port}",
        replay_endpoint=f"tcp://127.0.0.1:{publisher.replay_port}" if replay else None,
        replay_timeout=5.0,
    )
    subscriber = KvSubscriber(config, hub, ranks=1)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(publisher.serve_replays)
            tg.start_soon(subscriber.run)
            yield Running(publisher, hub, subscriber)
            tg.cancel_scope.cancel()
    finally:
        publisher.close()


async def test_the_cache_state_follows_the_engines_events() -> None:
    sim = SimCache(block_size=4)
    async with subscribed() as running:
        await running.publish_until_heard(sim, [1, 2, 3, 4, 5, 6, 7, 8])
        await running.publisher.publish(sim.batch(sim.request(list(range(100, 112)), salt="t")))
        await running.wait_for(lambda: running.held() == sim.truth())
        assert block_keys(list(range(100, 112)), 4, cache_salt="t")[-1] in running.held()


async def test_each_live_batchs_lag_is_observed() -> None:
    sim = SimCache(block_size=4)
    async with subscribed() as running:
        registry = CollectorRegistry()
        register_kv_events_metrics(registry, running.hub, "vllm")
        under_30_s = {"engine": "vllm", "le": "30.0"}
        # Batches stamped with this host's clock, as an engine beside its sidecar stamps them,
        # until one is heard live (a SUB hears nothing before it has joined).
        with anyio.fail_after(WAIT):
            while not registry.get_sample_value("sidecar_kv_events_lag_seconds_bucket", under_30_s):
                batch = sim.batch(sim.request([1, 2, 3, running.publisher.sequence]), ts=time.time())
                await running.publisher.publish(batch)
                await anyio.sleep(0.05)


async def test_a_dropped_batch_is_replayed() -> None:
    sim = SimCache(block_size=4)
    async with subscribed() as running:
        await running.publish_until_heard(sim, [1, 2, 3, 4])
        await running.publisher.publish(sim.batch(sim.request(list(range(10, 18)))), drop=True)
        await running.publisher.publish(sim.batch(sim.request(list(range(20, 28)))))
        await running.wait_for(lambda: running.held() == sim.truth())
        feed = running.subscriber.feeds[0]
        assert feed.counters.gaps == 1
        assert feed.counters.resyncs == {}
        registry = CollectorRegistry()
        registry.register(KvEventsCollector(running.hub, "vllm"))
        rank = {"engine": "vllm", "rank": "0"}
        assert registry.get_sample_value("sidecar_kv_event_gaps_total", rank) == 1
        assert registry.get_sample_value("sidecar_kv_event_replays_total", rank) == 2  # at start, and the gap
        assert registry.get_sample_value("sidecar_kv_blocks", {"engine": "vllm"}) == len(sim.truth())


async def test_a_publisher_that_restarts_is_heard_again_and_its_old_blocks_are_gone() -> None:
    sim = SimCache(block_size=4, capacity=400)
    async with subscribed() as running:
        await running.publish_until_heard(sim, [1, 2, 3, 4])
        # Many batches before the restart: the new publisher's numbers (from 0 again) are
        # then below the next one expected however many the reconnecting SUB misses.
        for index in range(200):
            await running.publisher.publish(sim.batch(sim.request([5, 5, 5, index])))
        await running.wait_for(lambda: running.held() == sim.truth())
        await running.publisher.restart()
        restarted = SimCache(block_size=4)
        # A vLLM restart: no AllBlocksCleared, just sequence numbers from 0 again.
        with anyio.fail_after(WAIT):
            while running.held() != restarted.truth() or not restarted.blocks:
                await running.publisher.publish(
                    restarted.batch(restarted.request([9, 9, 9, running.publisher.sequence]))
                )
                await anyio.sleep(0.05)
        assert running.subscriber.feeds[0].counters.resyncs.get(ResyncReason.SEQUENCE_RESET) == 1


async def test_an_engine_restart_seen_by_the_health_watch_relearns_from_the_new_replay_buffer() -> None:
    sim = SimCache(block_size=4)
    async with subscribed() as running:
        await running.publish_until_heard(sim, [1, 2, 3, 4])
        await running.wait_for(lambda: running.held() == sim.truth())
        await running.publisher.restart()
        restarted = SimCache(block_size=4)
        # Published while the sidecar's SUB may not hear it yet; the replay buffer keeps it.
        await running.publisher.publish(restarted.batch(restarted.request([9, 9, 9, 9])))
        running.hub.engine_health(False)  # what the daemon's health watch says meanwhile
        await running.wait_for(lambda: running.held() == restarted.truth())
        assert running.subscriber.feeds[0].counters.resyncs.get(ResyncReason.ENGINE_UNHEALTHY) == 1


async def test_without_a_replay_socket_a_gap_resyncs_and_never_keeps_a_removed_block() -> None:
    sim = SimCache(block_size=4, capacity=2)
    async with subscribed(replay=False) as running:
        await running.publish_until_heard(sim, [1, 2, 3, 4])
        await running.publisher.publish(sim.batch(sim.request(list(range(10, 18)))), drop=True)
        await running.publisher.publish(sim.batch(sim.request(list(range(20, 28)))))
        await running.wait_for(
            lambda: running.subscriber.feeds[0].counters.resyncs.get(ResyncReason.GAP) == 1
        )
        assert running.held() <= sim.truth()


async def _batches_per_turn_while(running: Running, until: Callable[[], bool]) -> list[int]:
    """How many batches the subscriber took in each turn another task got, until ``until``."""
    per_turn: list[int] = []
    with anyio.fail_after(WAIT):
        while not until():
            before = running.hub.batches_received
            await anyio.lowlevel.checkpoint()
            per_turn.append(running.hub.batches_received - before)
    return per_turn


async def test_a_backlog_of_live_batches_never_holds_the_event_loop() -> None:
    # Requests share the sidecar's event loop with the subscriber: a backlog of queued batches
    # must be taken one batch a turn, not all in one (pyzmq answers a receive from its queue
    # without yielding), or every request relayed meanwhile waits for the whole backlog.
    sim = SimCache(block_size=4, capacity=10_000)
    async with subscribed(replay=False) as running:
        await running.publish_until_heard(sim, [1, 2, 3, 4])
        heard = running.hub.batches_received
        backlog = 200
        for index in range(backlog):  # sent without a turn in between: they queue up
            await running.publisher.publish(sim.batch(sim.request([7, 7, 7, index])))
        per_turn = await _batches_per_turn_while(
            running, lambda: running.hub.batches_received >= heard + backlog
        )
        assert max(per_turn) == 1
        assert {block_keys([7, 7, 7, index], 4)[0] for index in range(backlog)} <= running.held()


async def test_a_replay_answer_never_holds_the_event_loop() -> None:
    sim = SimCache(block_size=4, capacity=10_000)
    async with subscribed() as running:
        await running.publish_until_heard(sim, [1, 2, 3, 4])
        heard = running.hub.batches_received
        missed = 200
        for index in range(missed):  # lost on the way: the replay answers them in one burst
            await running.publisher.publish(sim.batch(sim.request([7, 7, 7, index])), drop=True)
        await running.publisher.publish(sim.batch(sim.request([8, 8, 8, 8])))
        per_turn = await _batches_per_turn_while(
            running, lambda: running.hub.batches_received >= heard + missed + 1
        )
        assert max(per_turn) == 1
        assert running.subscriber.feeds[0].counters.gaps == 1
        await running.wait_for(lambda: running.held() == sim.truth())


async def test_an_engine_that_publishes_nothing_breaks_nothing() -> None:
    async with serving_with_kv(subscribed=True) as (stub, _):
        report = await stub.GetLoad(sidecar_pb2.GetLoadRequest(), timeout=WAIT)
        assert report.kv_cache == sidecar_pb2.KvCacheStatus(subscribed=True)
        stream = stub.WatchKvCache(sidecar_pb2.WatchKvCacheRequest(), timeout=WAIT)
        first = await stream.read()
        assert first.snapshot.last_chunk
        assert first.snapshot.status.batches_received == 0
        assert list(first.snapshot.keys) == []
        stream.cancel()


async def test_a_sidecar_without_kv_events_says_so() -> None:
    async with serving_with_kv(subscribed=False) as (stub, _):
        report = await stub.GetLoad(sidecar_pb2.GetLoadRequest(), timeout=WAIT)
        assert not report.HasField("kv_cache")
        stream = stub.WatchKvCache(sidecar_pb2.WatchKvCacheRequest(), timeout=WAIT)
        first = await stream.read()
        assert not first.snapshot.status.subscribed
        stream.cancel()


@asynccontextmanager
async def serving_with_kv(
    *, subscribed: bool, hub: KvCacheHub | None = None
) -> AsyncIterator[tuple[Any, KvCacheHub]]:
    hub = hub if hub is not None else KvCacheHub(subscribed=subscribed, kept_deltas=4, chunk_blocks=3)
    server = SidecarServer(FakeEngine(), ServerConfig(listen="127.0.0.1:0"), kv_cache=hub)
    await server.start()
    server.set_serving()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield sidecar_pb2_grpc.WorkerStub(channel), hub
    finally:
        await channel.close(None)
        await server.stop()


class Mirror:
    """What a frontend keeps from one WatchKvCache stream."""

    def __init__(self) -> None:
        self.keys: set[int] = set()
        self.epoch = 0
        self.sequence = 0
        self.snapshots = 0
        self._pending: set[int] = set()

    def apply(self, update: sidecar_pb2.KvCacheUpdate) -> None:
        if update.HasField("snapshot"):
            snapshot = update.snapshot
            self._pending.update(snapshot.keys)
            if snapshot.last_chunk:
                self.keys, self._pending = self._pending, set()
                self.epoch, self.sequence = snapshot.epoch, snapshot.sequence
                self.snapshots += 1
            return
        delta = update.delta
        assert delta.sequence == self.sequence + 1
        if delta.cleared:
            self.keys.clear()
        self.keys.difference_update(delta.removed)
        self.keys.update(delta.added_keys)
        self.sequence = delta.sequence


async def test_watch_starts_with_a_chunked_snapshot_then_deltas_and_resumes() -> None:
    sim = SimCache(block_size=2)
    async with serving_with_kv(subscribed=True) as (stub, hub):
        feed_state = KvSubscriberless(hub)
        feed_state.publish(sim, list(range(10)))  # 5 blocks: two chunks of 3
        mirror = Mirror()
        stream = stub.WatchKvCache(sidecar_pb2.WatchKvCacheRequest(), timeout=WAIT)
        with anyio.fail_after(WAIT):
            while mirror.snapshots == 0:
                mirror.apply(await stream.read())
        assert mirror.keys == sim.truth()
        feed_state.publish(sim, [*range(10), 50, 51])
        with anyio.fail_after(WAIT):
            while mirror.keys != sim.truth():
                mirror.apply(await stream.read())
        stream.cancel()
        # Gone for a while; two deltas later it resumes where it left off, with no snapshot.
        feed_state.publish(sim, [60, 61])
        feed_state.publish(sim, [70, 71])
        resumed = stub.WatchKvCache(
            sidecar_pb2.WatchKvCacheRequest(epoch=mirror.epoch, sequence=mirror.sequence), timeout=WAIT
        )
        with anyio.fail_after(WAIT):
            while mirror.keys != sim.truth():
                update = await resumed.read()
                assert update.HasField("delta")
                mirror.apply(update)
        resumed.cancel()
        # Away for longer than the kept deltas (4): a fresh snapshot.
        for index in range(6):
            feed_state.publish(sim, [80 + index, 90])
        again = stub.WatchKvCache(
            sidecar_pb2.WatchKvCacheRequest(epoch=mirror.epoch, sequence=mirror.sequence), timeout=WAIT
        )
        fresh = Mirror()
        with anyio.fail_after(WAIT):
            while fresh.snapshots == 0:
                fresh.apply(await again.read())
        assert fresh.keys == sim.truth()
        again.cancel()


class KvSubscriberless:
    """Feeds a hub as the subscriber does, without sockets (the wire is tested above)."""

    def __init__(self, hub: KvCacheHub) -> None:
        self.hub = hub
        self.feed = RankFeed(replay=False)
        self.sequence = 0

    def publish(self, sim: SimCache, tokens: list[int], ts: float = 0.0) -> None:
        step = self.feed.on_live(self.sequence, decode_batch(sim.batch(sim.request(tokens), ts=ts)))
        self.sequence += 1
        self.run(step)

    def run(self, step: Step) -> None:
        for delta in step.deltas:
            self.hub.apply(0, delta, self.feed.map.block_size)


async def test_a_delta_carries_the_engine_time_of_its_batch() -> None:
    sim = SimCache(block_size=2)
    async with serving_with_kv(subscribed=True) as (stub, hub):
        feed_state = KvSubscriberless(hub)
        stream = stub.WatchKvCache(sidecar_pb2.WatchKvCacheRequest(), timeout=WAIT)
        assert (await stream.read()).snapshot.last_chunk
        feed_state.publish(sim, [1, 2], ts=1_700_000_000.5)
        stored = (await stream.read()).delta
        assert list(stored.added_keys) == block_keys([1, 2], 2)
        assert stored.engine_time == 1_700_000_000.5
        # A resync no batch made: no time.
        feed_state.run(feed_state.feed.on_engine_unhealthy())
        cleared = (await stream.read()).delta
        assert cleared.cleared
        assert not cleared.HasField("engine_time")
        stream.cancel()
