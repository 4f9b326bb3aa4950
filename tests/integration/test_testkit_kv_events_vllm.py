"""The testkit vLLM engine's prefix cache and KV events, on the real wire: a raw vLLM gRPC
client sends requests, a pyzmq SUB + DEALER (tests/kv_events_mirror.py) decode what the engine
publishes with structs that mirror vLLM's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import grpc
import msgspec
import zmq
import zmq.asyncio
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc
from testkit.faults import FaultKind, FaultPlan
from testkit.kv_events import parse_kv_events_config
from testkit.vllm_engine import VllmEngineConfig, VllmTestEngine

from tests.kv_events_mirror import Subscriber, VllmBatch, VllmCleared, VllmRemoved, VllmStored

Msgs = list[pb.GenerateResponse]


def events_config(**extra: object) -> str:
    body = {"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0", **extra}
    return msgspec.json.encode(body).decode()


@asynccontextmanager
async def serve(
    events: str | None = None, **kw: object
) -> AsyncIterator[tuple[VllmTestEngine, pb_grpc.VllmEngineStub, Subscriber | None]]:
    config = VllmEngineConfig(
        kv_events=parse_kv_events_config(events or events_config(), "vllm"),
        **kw,  # type: ignore[arg-type]
    )
    engine = VllmTestEngine(config)
    port = await engine.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    sub = None
    if engine.kv_cache.publishers:
        pub = engine.kv_cache.publishers[0]
        sub = Subscriber(pub.local_endpoint, pub.local_replay_endpoint, "vllm", pub.config.topic.encode())
    try:
        yield engine, pb_grpc.VllmEngineStub(channel), sub
    finally:
        if sub is not None:
            sub.close()
        await channel.close(None)
        await engine.stop(0)


def request(rid: str, prompt: list[int], max_tokens: int = 2) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        stream=True,
    )


async def generate(stub: pb_grpc.VllmEngineStub, rid: str, prompt: list[int], max_tokens: int = 2) -> Msgs:
    return [m async for m in stub.Generate(request(rid, prompt, max_tokens), timeout=30)]


def cached_counts(msgs: Msgs) -> set[int]:
    """Every cached_tokens the stream reported (chunks and completes)."""
    return {getattr(m, m.WhichOneof("response")).cached_tokens for m in msgs}


def prompt_of(n: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


async def joined(engine: VllmTestEngine, stub: pb_grpc.VllmEngineStub, sub: Subscriber) -> int:
    """Warm the subscription with throw-away prompts; the first live sequence number."""

    size = engine.config.block_size

    async def warm(i: int) -> None:  # one block each
        await generate(stub, f"warm-{i}", prompt_of(size + 1, base=20000 + 100 * i), max_tokens=1)

    return await sub.join(warm, lambda: engine.kv_cache.publishers[0].next_seq - 1)


async def test_a_request_publishes_its_full_blocks_and_a_repeat_reports_them_cached() -> None:
    async with serve(block_size=16) as (engine, stub, sub):
        assert sub is not None
        first_live = await joined(engine, stub, sub)
        prompt = prompt_of(40)
        first = await generate(stub, "a", prompt, max_tokens=1)
        seq = await sub.recv_live()
        again = await generate(stub, "b", prompt, max_tokens=1)
    assert seq == first_live + 1
    assert cached_counts(first) == {0}
    assert cached_counts(again) == {32}  # two full blocks; the 8-token tail is never cached
    batch = sub.batches[seq]
    assert isinstance(batch, VllmBatch)
    assert batch.data_parallel_rank == 0
    (stored,) = batch.events
    assert isinstance(stored, VllmStored)
    assert stored.token_ids == prompt[:32]
    assert stored.block_size == 16
    assert len(stored.block_hashes) == 2
    assert stored.parent_block_hash is None
    assert all(0 <= h < 1 << 64 for h in stored.block_hashes)
    assert stored.medium == "GPU"
    assert stored.lora_id is None
    assert stored.lora_name is None
    assert stored.extra_keys == [None, None]
    assert stored.group_idx == 0


async def test_the_payload_is_vllms_encoding_field_for_field() -> None:
    async with serve(block_size=4) as (engine, stub, sub):
        assert sub is not None
        seq = await joined(engine, stub, sub)
    ts, events, rank = msgspec.msgpack.decode(sub.raw[seq])
    assert isinstance(ts, float)
    assert rank == 0
    (event,) = events
    # A tagged map, the tag first, then the fields in vLLM's order; None-defaults left out.
    assert list(event) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
    ]
    assert event["type"] == "BlockStored"


async def test_output_blocks_extend_the_prompts_chain() -> None:
    async with serve(block_size=4) as (engine, stub, sub):
        assert sub is not None
        await joined(engine, stub, sub)
        prompt = prompt_of(7)
        msgs = await generate(stub, "out", prompt, max_tokens=6)
        prompt_seq = await sub.recv_live()
        output_seq = await sub.recv_live()
    out_ids = [t for m in msgs if m.WhichOneof("response") == "chunk" for t in m.chunk.token_ids]
    (prompt_block,) = sub.batches[prompt_seq].events
    (output_blocks,) = sub.batches[output_seq].events
    assert prompt_block.token_ids == prompt[:4]
    # prompt + output minus the last token (never computed): 12 tokens, blocks 2 and 3.
    assert output_blocks.token_ids == (prompt + out_ids)[4:12]
    assert output_blocks.parent_block_hash == prompt_block.block_hashes[-1]


async def test_lru_eviction_publishes_one_removal_per_block_tail_first() -> None:
    async with serve(block_size=4, num_gpu_blocks_override=3) as (engine, stub, sub):
        assert sub is not None
        # One block per warm-up; a late SUB join takes several, so up to all three are warm.
        await joined(engine, stub, sub)
        a = await generate(stub, "a", prompt_of(9, base=1), max_tokens=1)  # a1, a2: one warm block left
        a_seq = await sub.recv_live()
        b = await generate(stub, "b", prompt_of(9, base=500), max_tokens=1)  # needs 2: evicts 2
        b_seq = await sub.recv_live()
        a_again = await generate(stub, "a2", prompt_of(9, base=1), max_tokens=1)
    assert cached_counts(a) == cached_counts(b) == {0}
    (a_stored,) = [e for e in sub.batches[a_seq].events if isinstance(e, VllmStored)]
    removed = [e for e in sub.batches[b_seq].events if isinstance(e, VllmRemoved)]
    stored = [e for e in sub.batches[b_seq].events if isinstance(e, VllmStored)]
    # The warm-up's block was used least recently: it goes first; then a's tail before a's head.
    assert [len(e.block_hashes) for e in removed] == [1, 1]
    assert removed[1].block_hashes == [a_stored.block_hashes[1]]
    assert len(stored) == 1
    assert len(stored[0].block_hashes) == 2
    assert sub.batches[b_seq].events.index(stored[0]) == 2  # removals come before the store
    assert cached_counts(a_again) == {4}  # a's first block survived


async def test_replay_answers_from_the_asked_sequence_and_ends_with_the_marker() -> None:
    async with serve(events=events_config(buffer_steps=3), block_size=4) as (engine, stub, sub):
        assert sub is not None
        first = await joined(engine, stub, sub)
        for i in range(4):
            await generate(stub, f"r{i}", prompt_of(5, base=3000 + 10 * i), max_tokens=1)
            await sub.recv_live()
        last = first + 4
        assert await sub.replay_from(last - 1) == [last - 1, last]
        # Older than the buffer: silently from the oldest still kept.
        assert await sub.replay_from(0) == [last - 2, last - 1, last]
        assert await sub.replay_from(last + 1) == []


async def test_a_dropped_batch_leaves_a_gap_that_replay_fills() -> None:
    async with serve(block_size=4) as (engine, stub, sub):
        assert sub is not None
        first = await joined(engine, stub, sub)
        engine.kv_cache.drop_next_batch()
        await generate(stub, "lost", prompt_of(5, base=4000), max_tokens=1)
        await generate(stub, "seen", prompt_of(5, base=5000), max_tokens=1)
        seen = await sub.recv_live()
        assert seen == first + 2  # the gap: first + 1 never came live
        assert await sub.replay_from(first + 1) == [first + 1, first + 2]
    (lost,) = sub.batches[first + 1].events
    assert lost.token_ids == prompt_of(4, base=4000)


async def test_a_fault_directive_in_the_request_id_drops_its_batch() -> None:
    async with serve(block_size=4) as (engine, stub, sub):
        assert sub is not None
        first = await joined(engine, stub, sub)
        await generate(stub, "x.fault=drop_kv_batch", prompt_of(5, base=4000), max_tokens=1)
        await generate(stub, "y", prompt_of(5, base=5000), max_tokens=1)
        assert await sub.recv_live() == first + 2
        assert await sub.replay_from(first + 1) == [first + 1, first + 2]


async def test_a_restart_is_a_sequence_reset_with_a_cold_cache_and_no_clear_event() -> None:
    async with serve(block_size=4) as (engine, stub, sub):
        assert sub is not None
        await joined(engine, stub, sub)
        prompt = prompt_of(9, base=6000)
        await generate(stub, "before", prompt, max_tokens=1)
        await sub.recv_live()
        await engine.restart()
        after = await generate(stub, "after", prompt, max_tokens=1)
        await joined(engine, stub, sub)  # the SUB reconnects by itself, and joins late again
        assert (await sub.replay_from(0))[0] == 0  # numbering started again
    assert cached_counts(after) == {0}
    (stored,) = sub.batches[0].events  # no AllBlocksCleared: batch 0 is the new store
    assert isinstance(stored, VllmStored)
    assert stored.token_ids == prompt[:8]


async def test_a_restart_fault_in_the_request_id_restarts_the_publisher() -> None:
    async with serve(block_size=4) as (engine, stub, sub):
        assert sub is not None
        first = await joined(engine, stub, sub)
        assert first >= 0
        prompt = prompt_of(9, base=6000)
        await generate(stub, "before", prompt, max_tokens=1)
        await sub.recv_live()
        msgs = await generate(stub, "again.fault=restart_kv_publisher", prompt, max_tokens=1)
        await joined(engine, stub, sub)
        assert (await sub.replay_from(0))[0] == 0
    assert cached_counts(msgs) == {0}  # the cache went with the publisher
    (stored,) = sub.batches[0].events
    assert isinstance(stored, VllmStored)
    assert stored.token_ids == prompt[:8]


async def test_prefill_waits_for_uncached_tokens_only() -> None:
    # 100 ms per uncached token: a 33-token prompt waits 3.3 s cold and 0.1 s when 32 are cached.
    async with serve(block_size=16) as (engine, stub, _):
        cached_prompt = prompt_of(33, base=7000)
        await generate(stub, "warm", cached_prompt, max_tokens=1)
        engine.config = replace(engine.config, prefill_us_per_token=100_000.0)
        order: list[str] = []

        async def run(rid: str, prompt: list[int]) -> None:
            await generate(stub, rid, prompt, max_tokens=1)
            order.append(rid)

        cold = asyncio.create_task(run("cold", prompt_of(33, base=8000)))
        await asyncio.sleep(0)
        await run("hot", cached_prompt)
        await cold
    assert order == ["hot", "cold"]


async def test_without_the_flag_nothing_is_published_and_hits_are_still_reported() -> None:
    async with serve(events='{"enable_kv_cache_events": false}', block_size=4) as (engine, stub, sub):
        assert sub is None
        assert engine.kv_cache.publishers == []
        await generate(stub, "a", prompt_of(9), max_tokens=1)
        again = await generate(stub, "b", prompt_of(9), max_tokens=1)
    assert cached_counts(again) == {8}


async def test_a_concrete_address_is_connected_to_so_a_binding_subscriber_receives() -> None:
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    try:
        async with serve(events=events_config(endpoint=f"tcp://127.0.0.1:{port}"), block_size=4) as (
            engine,
            stub,
            _,
        ):
            assert not engine.kv_cache.publishers[0].binds
            for i in range(50):  # the connection is made in the background: until one arrives
                await generate(stub, f"c{i}", prompt_of(5, base=100 * i), max_tokens=1)
                if await sub.poll(500):
                    break
            _, seq, payload = await sub.recv_multipart()
    finally:
        sub.close(0)
        ctx.term()
    batch = msgspec.msgpack.decode(payload, type=VllmBatch)
    assert int.from_bytes(seq, "big") <= i  # batches sent before the subscription are lost
    assert isinstance(batch.events[0], VllmStored)


async def test_each_data_parallel_rank_has_its_cache_and_publisher() -> None:
    # Port 0 stays 0 for every rank in vLLM: each rank's socket gets its own free port.
    async with serve(block_size=4, data_parallel_size=2) as (engine, stub, _):
        rank0, rank1 = engine.kv_cache.publishers
        assert rank1.endpoint != rank0.endpoint
        sub = Subscriber(rank1.local_endpoint, rank1.local_replay_endpoint, "vllm")
        try:

            async def warm(i: int) -> None:
                req = request(f"w{i}", prompt_of(5, base=100 * i), max_tokens=1)
                req.data_parallel_rank = 1
                _ = [m async for m in stub.Generate(req, timeout=30)]

            seq = await sub.join(warm, lambda: rank1.next_seq - 1)
        finally:
            sub.close()
        assert sub.batches[seq].data_parallel_rank == 1
        assert rank0.next_seq == 0  # rank 0 published nothing
        # Rank 0's cache never saw those prompts.
        assert cached_counts(await generate(stub, "r0", prompt_of(5, base=0), max_tokens=1)) == {0}


async def test_flush_cache_publishes_all_blocks_cleared_and_is_refused_while_requests_run() -> None:
    async with serve(block_size=4) as (engine, stub, sub):
        assert sub is not None
        await joined(engine, stub, sub)
        prompt = prompt_of(9, base=9000)
        release = asyncio.Event()
        engine.faults.add("held", FaultPlan(FaultKind.STALL_FIRST_TOKEN, stall_secs=60, release=release))
        held = asyncio.create_task(generate(stub, "held", prompt, max_tokens=1))
        await sub.recv_live()  # its prompt's blocks are cached: it runs
        busy = await stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=10)
        release.set()
        await held
        done = await stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=10)
        seq = await sub.recv_live()
        after = await generate(stub, "after", prompt, max_tokens=1)
    assert not busy.success
    assert done.success
    assert sub.batches[seq].events == [VllmCleared()]
    assert cached_counts(after) == {0}
