"""The per-publisher cache state (sidecar_server.kv_state) against a simulated engine cache
(tests/kv_sim.py): laws over random traffic, then the sequencing cases one by one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar_common.kv_keys import block_keys
from sidecar_server.kv_events import decode_batch
from sidecar_server.kv_state import CacheMap, KvDelta, RankFeed, ResyncReason, Step
from tests.kv_sim import SimCache, Style

STYLES: Final[list[Style]] = ["vllm", "vllm-bytes", "sglang"]


@dataclass(frozen=True)
class Request:
    base: int
    extra: tuple[int, ...]
    lora: str | None
    salt: str | None


@dataclass(frozen=True)
class Clear:
    pass


@dataclass(frozen=True)
class Restart:
    """The engine restarts: an empty cache, sequence numbers from 0, no AllBlocksCleared."""


BASES: Final = [list(range(100, 140)), list(range(200, 260)), [7] * 48]

requests = st.builds(
    Request,
    base=st.integers(0, len(BASES) - 1),
    extra=st.lists(st.integers(0, 5), max_size=40).map(tuple),
    lora=st.sampled_from([None, "adapter-a"]),
    salt=st.sampled_from([None, "", "tenant-1"]),
)
operations = st.lists(st.one_of(requests, requests, requests, st.just(Clear())), max_size=25)
block_sizes = st.sampled_from([1, 16])


def run_engine(sim: SimCache, ops: list[Any]) -> list[bytes]:
    """The payloads the engine publishes for ``ops`` (sequence number = index)."""
    payloads: list[bytes] = []
    for op in ops:
        if isinstance(op, Clear):
            events = sim.clear()
        else:
            events = sim.request(BASES[op.base] + list(op.extra), lora=op.lora, salt=op.salt)
        if events:
            payloads.append(sim.batch(events))
    return payloads


class Client:
    """Applies a feed's deltas as a frontend would, and serves its replays from a buffer."""

    def __init__(self, feed: RankFeed) -> None:
        self.feed = feed
        self.keys: set[int] = set()
        self.published: list[tuple[int, bytes]] = []
        self.buffer_size: int | None = None  # None: the replay buffer holds everything

    def apply(self, delta: KvDelta) -> None:
        if delta.cleared:
            self.keys.clear()
        self.keys.difference_update(delta.removed)
        self.keys.update(key for key, _ in delta.added)

    def run(self, step: Step) -> None:
        for delta in step.deltas:
            self.apply(delta)
        while step.replay_from is not None:
            start = step.replay_from
            buffer = self.published if self.buffer_size is None else self.published[-self.buffer_size :]
            for sequence, payload in buffer if self.buffer_size != 0 else []:
                if sequence >= start:
                    replayed = self.feed.on_replay(sequence, decode_batch(payload))
                    assert replayed.replay_from is None
                    for delta in replayed.deltas:
                        self.apply(delta)
            step = self.feed.on_replay_end()
            for delta in step.deltas:
                self.apply(delta)

    def publish(self, sequence: int, payload: bytes, *, deliver: bool = True) -> None:
        self.published.append((sequence, payload))
        if deliver:
            self.run(self.feed.on_live(sequence, decode_batch(payload)))


def held_keys(feed: RankFeed) -> set[int]:
    return {key for key, _ in feed.map.blocks()}


@settings(max_examples=60, deadline=None)
@given(operations, block_sizes, st.sampled_from(STYLES), st.integers(4, 40))
def test_the_state_is_the_engines_cache_in_routing_keys(
    ops: list[Any], size: int, style: Style, capacity: int
) -> None:
    # The law that makes routing work: the key a frontend computes for a request's prefix
    # (block_keys over its tokens, LoRA and salt) is the key the engine's stored event gives.
    sim = SimCache(block_size=size, style=style, capacity=capacity)
    client = Client(RankFeed(replay=False))
    for sequence, payload in enumerate(run_engine(sim, ops)):
        client.publish(sequence, payload)
    assert held_keys(client.feed) == sim.truth()
    assert client.keys == sim.truth()


@settings(max_examples=60, deadline=None)
@given(operations, block_sizes, st.sampled_from(STYLES))
def test_the_state_is_a_replay_of_the_events_fed(ops: list[Any], size: int, style: Style) -> None:
    payloads = run_engine(SimCache(block_size=size, style=style), ops)
    feed = RankFeed(replay=False)
    for sequence, payload in enumerate(payloads):
        feed.on_live(sequence, decode_batch(payload))
    direct = CacheMap()
    for payload in payloads:
        direct.apply(decode_batch(payload).events)
    assert feed.map.blocks() == direct.blocks()


@settings(max_examples=60, deadline=None)
@given(operations, block_sizes, st.sampled_from(STYLES), st.data())
def test_a_gap_filled_from_replay_gives_the_state_of_no_gap(
    ops: list[Any], size: int, style: Style, data: st.DataObject
) -> None:
    sim = SimCache(block_size=size, style=style, capacity=20)
    payloads = run_engine(sim, ops)
    dropped = data.draw(st.sets(st.integers(0, max(0, len(payloads) - 2))))
    client = Client(RankFeed(replay=True))
    client.run(client.feed.start())
    for sequence, payload in enumerate(payloads):
        client.publish(sequence, payload, deliver=sequence not in dropped or sequence == len(payloads) - 1)
    assert held_keys(client.feed) == sim.truth()
    assert client.keys == sim.truth()
    assert not client.feed.counters.resyncs.get(ResyncReason.GAP)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.one_of(operations, st.just([Restart()])), min_size=1, max_size=4),
    block_sizes,
    st.sampled_from(STYLES),
    st.integers(0, 4),
    st.booleans(),
    st.data(),
)
def test_after_a_resync_no_block_is_held_that_the_engine_removed(
    runs: list[list[Any]], size: int, style: Style, buffer_size: int, replay: bool, data: st.DataObject
) -> None:
    # Batches lost for good (a replay buffer of a few batches, or none), restarts: the state
    # may miss blocks, never hold one the engine does not. Checked whenever the feed could
    # know: after a batch that arrived (a loss shows only in the batch after it), and after
    # a restart (the engine's health goes bad while it restarts).
    sim = SimCache(block_size=size, style=style, capacity=20)
    client = Client(RankFeed(replay=replay))
    client.buffer_size = buffer_size
    client.run(client.feed.start())
    sequence = 0
    for ops in runs:
        if ops == [Restart()]:
            sim = SimCache(block_size=size, style=style, capacity=20)
            client.published.clear()
            sequence = 0
            client.run(client.feed.on_engine_unhealthy())
        payloads = run_engine(sim, ops) if ops != [Restart()] else []
        for index, payload in enumerate(payloads):
            client.publish(sequence, payload, deliver=index == len(payloads) - 1 or data.draw(st.booleans()))
            sequence += 1
        assert held_keys(client.feed) <= sim.truth()
        assert client.keys == held_keys(client.feed)


def _payload(sim: SimCache, tokens: list[int]) -> bytes:
    return sim.batch(sim.request(tokens))


def test_a_replay_that_starts_later_than_asked_resyncs_and_keeps_what_it_got() -> None:
    sim = SimCache(block_size=2)
    feed = RankFeed(replay=True)
    assert feed.start() == Step(replay_from=0)
    feed.on_replay_end()  # nothing published yet
    first = _payload(sim, [1, 2])
    feed.on_live(0, decode_batch(first))
    lost = _payload(sim, [3, 4])
    kept = _payload(sim, [5, 6])
    step = feed.on_live(2, decode_batch(kept))
    assert step.replay_from == 1
    # The buffer lost batch 1: its answer starts at 2.
    step = feed.on_replay(2, decode_batch(kept))
    assert step.deltas[0].cleared
    feed.on_replay_end()
    assert held_keys(feed) == set(block_keys([5, 6], 2))
    assert feed.counters.resyncs == {ResyncReason.GAP: 1}
    assert lost  # published, never received


def test_a_sequence_going_back_is_a_restart() -> None:
    sim = SimCache(block_size=2)
    feed = RankFeed(replay=False)
    feed.on_live(0, decode_batch(_payload(sim, [1, 2])))
    feed.on_live(1, decode_batch(_payload(sim, [3, 4])))
    restarted = SimCache(block_size=2)
    step = feed.on_live(0, decode_batch(_payload(restarted, [9, 9])))
    assert step.deltas[0].cleared
    assert held_keys(feed) == restarted.truth()
    assert feed.counters.resyncs == {ResyncReason.SEQUENCE_RESET: 1}


def test_a_restart_seen_late_relearns_from_the_new_publishers_start() -> None:
    sim = SimCache(block_size=2)
    feed = RankFeed(replay=True)
    feed.start()
    feed.on_replay_end()
    for sequence in range(5):
        feed.on_live(sequence, decode_batch(_payload(sim, [sequence, sequence])))
    restarted = SimCache(block_size=2)
    batches = [_payload(restarted, [1, 1]), _payload(restarted, [2, 2])]
    step = feed.on_live(1, decode_batch(batches[1]))  # batch 0 of the new publisher was missed
    assert step.replay_from == 0
    feed.on_replay(0, decode_batch(batches[0]))
    feed.on_replay(1, decode_batch(batches[1]))
    feed.on_replay_end()
    assert held_keys(feed) == restarted.truth()


def test_all_blocks_cleared_clears() -> None:
    sim = SimCache(block_size=2, style="sglang")
    feed = RankFeed(replay=False)
    feed.on_live(0, decode_batch(_payload(sim, [1, 2])))
    step = feed.on_live(1, decode_batch(sim.batch(sim.clear(), ts=7.5)))
    assert step.deltas == (KvDelta(cleared=True, engine_time=7.5),)
    assert len(feed.map) == 0
    assert feed.counters.resyncs == {ResyncReason.CLEARED: 1}


def test_each_delta_carries_the_time_of_the_engines_batch_it_came_from() -> None:
    sim = SimCache(block_size=2)
    feed = RankFeed(replay=True)
    feed.start()
    feed.on_replay_end()
    (live,) = feed.on_live(0, decode_batch(sim.batch(sim.request([1, 2]), ts=1000.25))).deltas
    assert live.engine_time == 1000.25
    lost = sim.batch(sim.request([3, 4]), ts=1001.0)
    assert feed.on_live(2, decode_batch(sim.batch(sim.request([5, 6]), ts=1002.0))).replay_from == 1
    (replayed,) = feed.on_replay(1, decode_batch(lost)).deltas
    assert replayed.engine_time == 1001.0  # a replayed batch keeps its own, older time
    (held,) = feed.on_replay_end().deltas
    assert held.engine_time == 1002.0
    # A resync no batch made has no time.
    (resync,) = feed.on_engine_unhealthy().deltas
    assert resync.cleared
    assert resync.engine_time is None


def test_a_batch_time_that_is_not_a_number_gives_a_delta_without_time() -> None:
    sim = SimCache(block_size=2)
    feed = RankFeed(replay=False)
    (delta,) = feed.on_live(0, decode_batch(sim.batch(sim.request([1, 2]), ts=float("nan")))).deltas
    assert delta.added
    assert delta.engine_time is None


def test_an_undecodable_batch_resyncs() -> None:
    sim = SimCache(block_size=2)
    feed = RankFeed(replay=False)
    feed.on_live(0, decode_batch(_payload(sim, [1, 2])))
    step = feed.on_live(1, None)
    assert step.deltas == (KvDelta(cleared=True),)
    feed.on_live(2, decode_batch(_payload(sim, [1, 2, 3, 4])))
    # The first block's parent was forgotten with the resync: nothing routable is claimed.
    assert len(feed.map) == 0
    assert feed.counters.resyncs == {ResyncReason.UNDECODABLE: 1}


def test_the_engine_going_unhealthy_resyncs_and_relearns_from_the_replay() -> None:
    sim = SimCache(block_size=2)
    feed = RankFeed(replay=True)
    feed.start()
    feed.on_replay_end()
    payload = _payload(sim, [1, 2])
    feed.on_live(0, decode_batch(payload))
    step = feed.on_engine_unhealthy()
    assert step.deltas == (KvDelta(cleared=True),)
    assert step.replay_from == 0
    feed.on_replay(0, decode_batch(payload))
    feed.on_replay_end()
    assert held_keys(feed) == sim.truth()


def test_a_replay_that_fails_resyncs_and_goes_on_with_the_live_batches() -> None:
    sim = SimCache(block_size=2)
    feed = RankFeed(replay=True)
    feed.start()
    feed.on_replay_end()
    feed.on_live(0, decode_batch(_payload(sim, [1, 2])))
    _payload(sim, [3, 4])  # lost
    assert feed.on_live(2, decode_batch(_payload(sim, [5, 6]))).replay_from == 1
    feed.on_live(3, decode_batch(_payload(sim, [5, 6, 7, 8])))  # held while the replay is out
    step = feed.on_replay_failed()
    assert step.deltas[0].cleared
    assert held_keys(feed) == set(block_keys([5, 6, 7, 8], 2))
    assert feed.expected == 4


def test_a_store_under_an_unknown_parent_is_not_routable() -> None:
    events = decode_batch(
        SimCache(block_size=2).batch(
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [11],
                    "parent_block_hash": 10,
                    "token_ids": [1, 2],
                    "block_size": 2,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                }
            ]
        )
    ).events
    cache = CacheMap()
    assert not cache.apply(events)
    assert len(cache) == 0


def test_multimodal_blocks_and_their_children_are_not_routable() -> None:
    stored = {
        "type": "BlockStored",
        "block_hashes": [1, 2, 3],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4, 5, 6],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None, [["image", 0]], None],
    }
    child = dict(stored, block_hashes=[4], parent_block_hash=3, token_ids=[7, 8], extra_keys=None)
    cache = CacheMap()
    cache.apply(decode_batch(SimCache(block_size=2).batch([stored, child])).events)
    assert [key for key, _ in cache.blocks()] == block_keys([1, 2], 2)


def test_a_block_size_other_than_the_first_is_skipped() -> None:
    cache = CacheMap()
    cache.apply(decode_batch(SimCache(block_size=2).batch(SimCache(block_size=2).request([1, 2]))).events)
    cache.apply(
        decode_batch(SimCache(block_size=4).batch(SimCache(block_size=4).request([1, 2, 3, 4]))).events
    )
    assert cache.block_size == 2
    assert len(cache) == 1
    assert cache.skipped_events == 1


def test_a_repeated_store_and_an_unknown_removal_change_nothing() -> None:
    sim = SimCache(block_size=2)
    events = decode_batch(sim.batch(sim.request([1, 2]))).events
    cache = CacheMap()
    first = cache.apply(events)
    assert first.added
    assert not cache.apply(events)
    assert not cache.apply(
        decode_batch(sim.batch([{"type": "BlockRemoved", "block_hashes": [12345]}])).events
    )
