"""The testkit SGLang engine's prefix cache and KV events, on the real wire: cached tokens in
both transports' responses, and what a pyzmq SUB + DEALER (tests/kv_events_mirror.py) decode
with structs that mirror SGLang's."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import grpc
import msgspec
import pytest
from testkit.faults import FaultKind, FaultPlan
from testkit.kv_events import parse_kv_events_config
from testkit.sglang_engine import SglangTestEngine
from testkit.sglang_info import SglangEngineConfig

from sidecar_common.api import sglang_pb2, sglang_pb2_grpc
from tests.kv_events_mirror import SglangBatch, SglangCleared, SglangRemoved, SglangStored, Subscriber

pytestmark = pytest.mark.timeout(60)

Factory = Callable[..., Awaitable[SglangTestEngine]]


def events_config(**extra: object) -> str:
    return json.dumps({"publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0", **extra})


@pytest.fixture
async def make_engine() -> AsyncIterator[Factory]:
    engines: list[SglangTestEngine] = []

    async def make(events: str | None = None, **overrides: Any) -> SglangTestEngine:
        kv_events = parse_kv_events_config(events or events_config(), "sglang")
        engine = SglangTestEngine(SglangEngineConfig(kv_events=kv_events, **overrides))
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.stop()


@pytest.fixture
async def subscribe() -> AsyncIterator[Callable[[SglangTestEngine, int], Subscriber]]:
    subs: list[Subscriber] = []

    def make(engine: SglangTestEngine, rank: int = 0) -> Subscriber:
        pub = engine.kv_cache.publishers[rank]
        sub = Subscriber(pub.local_endpoint, pub.local_replay_endpoint, "sglang", pub.config.topic.encode())
        subs.append(sub)
        return sub

    yield make
    for sub in subs:
        sub.close()


async def generate(engine: SglangTestEngine, wire: str, rid: str, prompt: list[int], **extra: Any) -> int:
    """One request of one output token (so its output caches no page: one batch at most) to its
    end; the cached_tokens its last response reported."""
    if wire == "grpc":
        async with grpc.aio.insecure_channel(f"127.0.0.1:{engine.grpc_port}") as channel:
            stub = sglang_pb2_grpc.SglangServiceStub(channel)
            sp = sglang_pb2.SamplingParams(max_new_tokens=1, ignore_eos=True)
            req = sglang_pb2.GenerateRequest(
                input_ids=prompt, sampling_params=sp, stream=True, rid=rid, **extra
            )
            msgs = [m async for m in stub.Generate(req, timeout=20)]
        return int(json.loads(msgs[-1].meta_info["cached_tokens"]))
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 1, "ignore_eos": True},
        "rid": rid,
        **extra,
    }
    url = f"http://127.0.0.1:{engine.http_port}/generate"
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session,
        session.post(url, json=body) as resp,
    ):
        assert resp.status == 200
        out = await resp.json()
    return int(out["meta_info"]["cached_tokens"])


async def joined(engine: SglangTestEngine, sub: Subscriber, wire: str = "grpc") -> int:
    async def warm(i: int) -> None:
        await generate(engine, wire, f"warm-{i}", [30000 + 10 * i, 30001 + 10 * i])

    return await sub.join(warm, lambda: engine.kv_cache.publishers[0].next_seq - 1)


@pytest.mark.parametrize("wire", ["grpc", "http"])
async def test_a_repeated_prompt_reports_cached_tokens(make_engine: Factory, wire: str) -> None:
    engine = await make_engine()  # page size 1, SGLang's default
    prompt = list(range(100, 110))
    assert await generate(engine, wire, "a", prompt) == 0
    assert await generate(engine, wire, "b", prompt) == 9  # the last token is always computed
    assert await generate(engine, wire, "c", [*prompt[:4], 7, 7]) == 4


async def test_start_publishes_all_blocks_cleared_then_page_stores(
    make_engine: Factory, subscribe: Callable[..., Subscriber]
) -> None:
    engine = await make_engine()
    sub = subscribe(engine)
    first = await joined(engine, sub)
    assert await sub.replay_from(0) == list(range(first + 1))
    start = sub.batches[0]
    assert isinstance(start, SglangBatch)
    assert start.events == [SglangCleared()]
    prompt = list(range(200, 205))
    await generate(engine, "http", "p", prompt)
    seq = await sub.recv_live()
    assert sub.batches[seq].attn_dp_rank == 0
    (event,) = sub.batches[seq].events
    assert isinstance(event, SglangStored)
    assert event.token_ids == prompt  # page size 1: every prompt token is a page
    assert event.block_size == 1
    assert len(event.block_hashes) == 5
    assert all(-(1 << 63) <= h < 1 << 63 for h in event.block_hashes)
    assert event.parent_block_hash is None
    assert event.lora_id is None
    assert event.medium == "GPU"
    assert event.cache_salt is None
    # A tagged map in SGLang's field order; lora_id is always there, None-defaults are not.
    raw_event = msgspec.msgpack.decode(sub.raw[seq])[1][0]
    assert list(raw_event) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
    ]


async def test_a_restart_clears_and_numbers_from_zero_again(
    make_engine: Factory, subscribe: Callable[..., Subscriber]
) -> None:
    engine = await make_engine(page_size=2)
    sub = subscribe(engine)
    await joined(engine, sub)
    prompt = list(range(300, 309))
    await generate(engine, "grpc", "before", prompt)
    await engine.restart()
    assert await sub.replay_from(0) == [0]  # the old numbering's buffer went with it
    assert sub.batches[0].events == [SglangCleared()]
    assert await generate(engine, "grpc", "after", prompt) == 0


async def test_a_dropped_batch_is_recovered_by_replay(
    make_engine: Factory, subscribe: Callable[..., Subscriber]
) -> None:
    engine = await make_engine()
    sub = subscribe(engine)
    first = await joined(engine, sub, wire="http")
    await generate(engine, "http", "lost.fault=drop_kv_batch", [400, 401, 402])
    await generate(engine, "http", "seen", [500, 501, 502])
    assert await sub.recv_live() == first + 2  # the dropped batch left a gap
    assert await sub.replay_from(first + 1) == [first + 1, first + 2]
    (lost,) = sub.batches[first + 1].events
    assert isinstance(lost, SglangStored)
    assert lost.token_ids == [400, 401, 402]


async def test_evictions_travel_in_one_removal_event(
    make_engine: Factory, subscribe: Callable[..., Subscriber]
) -> None:
    # Four pages of two tokens (the pool also bounds a prompt: at most six tokens).
    engine = await make_engine(page_size=2, kv_capacity_tokens=8)
    sub = subscribe(engine)
    await joined(engine, sub)  # one page per warm-up request
    await generate(engine, "grpc", "a", list(range(600, 606)))  # three pages: one warm page is left
    a_seq = await sub.recv_live()
    await generate(engine, "grpc", "b", list(range(700, 705)))  # two pages: that one, then a's tail
    b_seq = await sub.recv_live()
    (a_stored,) = [e for e in sub.batches[a_seq].events if isinstance(e, SglangStored)]
    removed, stored = sub.batches[b_seq].events
    assert isinstance(removed, SglangRemoved)
    assert len(removed.block_hashes) == 2
    assert removed.block_hashes[1] == a_stored.block_hashes[2]
    assert isinstance(stored, SglangStored)
    assert stored.token_ids == list(range(700, 704))


async def test_an_adapters_pages_are_its_own_and_named(
    make_engine: Factory, subscribe: Callable[..., Subscriber]
) -> None:
    engine = await make_engine(lora_paths=("ad",))
    sub = subscribe(engine)
    await joined(engine, sub)
    prompt = list(range(800, 806))
    assert await generate(engine, "grpc", "plain", prompt) == 0
    await sub.recv_live()
    assert await generate(engine, "grpc", "lora", prompt, lora_path="ad") == 0
    seq = await sub.recv_live()
    assert await generate(engine, "grpc", "lora2", prompt, lora_path="ad") == 5
    (event,) = sub.batches[seq].events
    assert isinstance(event, SglangStored)
    assert event.lora_name == "ad"
    assert event.lora_id is None


def free_port_pair() -> int:
    """A port P with P + 1 free too (rank 1 publishes on P + 1)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("", 0))
            port = int(a.getsockname()[1])
            with socket.socket() as b:
                try:
                    b.bind(("", port + 1))
                except OSError:
                    continue
        return port
    raise AssertionError("no free port pair")


async def test_each_data_parallel_rank_publishes_on_its_port_with_its_rank(
    make_engine: Factory, subscribe: Callable[..., Subscriber]
) -> None:
    base = free_port_pair()
    engine = await make_engine(events=events_config(endpoint=f"tcp://*:{base}"), dp_size=2)
    assert [p.local_endpoint for p in engine.kv_cache.publishers] == [
        f"tcp://127.0.0.1:{base}",
        f"tcp://127.0.0.1:{base + 1}",
    ]
    sub = subscribe(engine, 1)

    async def warm(i: int) -> None:
        await generate(engine, "grpc", f"w{i}", [900 + 10 * i, 901 + 10 * i], routed_dp_rank=1)

    seq = await sub.join(warm, lambda: engine.kv_cache.publishers[1].next_seq - 1)
    assert sub.batches[seq].attn_dp_rank == 1
    # Rank 0's cache never saw it.
    assert await generate(engine, "grpc", "r0", [900, 901, 902], routed_dp_rank=0) == 0


async def test_server_info_describes_the_publisher_as_sglang_does(make_engine: Factory) -> None:
    base = free_port_pair()
    engine = await make_engine(
        events=events_config(endpoint=f"tcp://*:{base}", topic="kv"), page_size=4, dp_size=2
    )
    replay_port = int(engine.kv_cache.publishers[0].local_replay_endpoint.rpartition(":")[2])  # type: ignore[union-attr]
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session,
        session.get(f"http://127.0.0.1:{engine.http_port}/get_server_info") as resp,
    ):
        info = await resp.json()
    assert info["kv_events"] == {
        "publisher": "zmq",
        "endpoint_host": "*",
        "endpoint_port_base": base,
        "topic": "kv",
        "block_size": 4,
        "dp_size": 2,
        "replay_endpoint_port_base": replay_port,
    }
    async with grpc.aio.insecure_channel(f"127.0.0.1:{engine.grpc_port}") as channel:
        stub = sglang_pb2_grpc.SglangServiceStub(channel)
        reply = await stub.GetServerInfo(sglang_pb2.GetServerInfoRequest(), timeout=10)
    assert json.loads(reply.json_info)["kv_events"] == info["kv_events"]


async def test_without_a_publisher_server_info_says_none_and_hits_are_still_reported(
    make_engine: Factory,
) -> None:
    engine = await make_engine(events="{}")
    assert engine.kv_cache.publishers == []
    assert engine.server_info(http=True)["kv_events"] is None
    assert await generate(engine, "grpc", "a", [1, 2, 3]) == 0
    assert await generate(engine, "grpc", "b", [1, 2, 3]) == 2


async def test_a_salted_prompts_pages_are_its_own_and_carry_the_salt(
    make_engine: Factory, subscribe: Callable[..., Subscriber]
) -> None:
    engine = await make_engine()
    sub = subscribe(engine)
    await joined(engine, sub, wire="http")
    prompt = list(range(850, 856))
    assert await generate(engine, "http", "plain", prompt) == 0
    await sub.recv_live()
    assert await generate(engine, "http", "salted", prompt, cache_salt="s1") == 0
    seq = await sub.recv_live()
    assert await generate(engine, "http", "salted-again", prompt, cache_salt="s1") == 5
    assert await generate(engine, "http", "other-salt", prompt, cache_salt="s2") == 0
    (event,) = sub.batches[seq].events
    assert isinstance(event, SglangStored)
    assert event.cache_salt == "s1"
    assert event.token_ids == prompt


async def test_flush_cache_publishes_all_blocks_cleared_and_is_refused_while_requests_run(
    make_engine: Factory, subscribe: Callable[..., Subscriber]
) -> None:
    engine = await make_engine()
    sub = subscribe(engine)
    await joined(engine, sub, wire="http")
    prompt = list(range(950, 956))
    release = asyncio.Event()
    engine.faults.add("held", FaultPlan(FaultKind.STALL_FIRST_TOKEN, stall_secs=60, release=release))
    held = asyncio.create_task(generate(engine, "http", "held", prompt))
    url = f"http://127.0.0.1:{engine.http_port}/flush_cache"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        await sub.recv_live()  # its prompt's pages are cached: it runs
        async with session.post(url) as resp:
            busy = (resp.status, await resp.text())
        release.set()
        await held
        async with session.get(url) as resp:
            done = (resp.status, await resp.text())
    seq = await sub.recv_live()
    assert busy == (400, "Flush cache failed.\n")
    assert done[0] == 200
    assert done[1].startswith("Cache flushed.\n")
    assert sub.batches[seq].events == [SglangCleared()]
    assert await generate(engine, "http", "after", prompt) == 0
