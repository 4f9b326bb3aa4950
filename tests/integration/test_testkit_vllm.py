"""The testkit vLLM engine seen through a raw vLLM gRPC client on loopback."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc
from testkit.__main__ import control_app
from testkit.book import Outcome
from testkit.faults import FaultKind, FaultPlan
from testkit.generator import EOS_TRIGGER_TOKEN, ModelSpec, SamplingSpec, generate
from testkit.vllm_engine import (
    MAX_QUEUED_TOKENS_MESSAGE,
    QUEUE_OVERFLOW_MESSAGE,
    VllmEngineConfig,
    VllmTestEngine,
)

PROMPT = [101, 202, 303, 404]
Msgs = list[pb.GenerateResponse]


@asynccontextmanager
async def serve(
    **kw: object,
) -> AsyncIterator[tuple[VllmTestEngine, pb_grpc.VllmEngineStub, grpc.aio.Channel]]:
    engine = VllmTestEngine(VllmEngineConfig(**kw))  # type: ignore[arg-type]
    port = await engine.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield engine, pb_grpc.VllmEngineStub(channel), channel
    finally:
        await channel.close(None)
        await engine.stop(0)


def request(rid: str, prompt: list[int] | None = None, **sp: object) -> pb.GenerateRequest:
    params = pb.SamplingParams(**sp)
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=PROMPT if prompt is None else prompt),
        sampling_params=params,
        stream=True,
    )


async def collect(stub: pb_grpc.VllmEngineStub, req: pb.GenerateRequest) -> Msgs:
    return [m async for m in stub.Generate(req, timeout=10)]


async def until(cond: Callable[[], bool], what: str, secs: float = 5.0) -> None:
    for _ in range(int(secs / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def read_rest(call: grpc.aio.UnaryStreamCall) -> Msgs:  # type: ignore[type-arg]
    out: Msgs = []
    while (m := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
        out.append(m)
    return out


def chunks(msgs: Msgs, index: int = 0) -> list[pb.GenerateStreamChunk]:
    return [m.chunk for m in msgs if m.WhichOneof("response") == "chunk" and m.chunk.index == index]


def completes(msgs: Msgs) -> list[pb.GenerateComplete]:
    return [m.complete for m in msgs if m.WhichOneof("response") == "complete"]


def expected_ids(max_tokens: int, index: int = 0, **kw: object) -> list[int]:
    toks = generate(ModelSpec(), PROMPT, SamplingSpec(max_tokens=max_tokens, **kw), index)  # type: ignore[arg-type]
    return [t.token_id for t in toks]


async def test_stream_shape_matches_the_servicer() -> None:
    async with serve(chunk_tokens=2) as (engine, stub, _):
        msgs = await collect(stub, request("a", max_tokens=5, prompt_logprobs=1, logprobs=2))
    cs = chunks(msgs)
    assert [len(c.token_ids) for c in cs] == [2, 2, 1]
    assert [t for c in cs for t in c.token_ids] == expected_ids(5)
    assert all(c.completion_tokens == len(c.token_ids) and c.prompt_tokens == len(PROMPT) for c in cs)
    assert cs[0].HasField("input_logprobs")
    assert not any(c.HasField("input_logprobs") for c in cs[1:])
    assert not cs[0].input_logprobs.token_logprobs[0].HasField("value")
    assert all(len(c.output_logprobs.token_ids) == len(c.token_ids) for c in cs)
    assert cs[0].output_logprobs.top_logprobs[0].token_ids[0] == cs[0].token_ids[0]
    (done,) = completes(msgs)
    assert msgs[-1].WhichOneof("response") == "complete"
    assert done.finish_reason == "length"
    assert list(done.output_ids) == list(cs[-1].token_ids)  # restates the final delta
    assert done.completion_tokens == 1
    assert done.HasField("input_logprobs")
    assert engine.book.outcome_of("a") is Outcome.FINISHED
    assert engine.running_count() == 0


async def test_n2_gives_two_indexed_choices() -> None:
    async with serve() as (_, stub, _ch):
        msgs = await collect(stub, request("n", max_tokens=4, n=2))
    assert sorted(c.index for c in completes(msgs)) == [0, 1]
    ids0 = [t for c in chunks(msgs, 0) for t in c.token_ids]
    ids1 = [t for c in chunks(msgs, 1) for t in c.token_ids]
    assert ids0 == expected_ids(4, 0)
    assert ids1 == expected_ids(4, 1)
    assert ids0 != ids1


async def test_matched_stop_reporting() -> None:
    stop_id = expected_ids(8)[2]
    full_text = "".join(t.text for t in generate(ModelSpec(), PROMPT, SamplingSpec(max_tokens=8)))
    async with serve() as (_, stub, _ch):
        (tok,) = completes(await collect(stub, request("t", max_tokens=8, stop_token_ids=[stop_id])))
        (eos,) = completes(await collect(stub, request("e", [EOS_TRIGGER_TOKEN, 2, 500], max_tokens=8)))
        (txt,) = completes(await collect(stub, request("s", max_tokens=8, stop=[full_text[2:5]])))
    assert tok.finish_reason == "stop"
    assert tok.matched_token_id == stop_id
    assert eos.finish_reason == "stop"
    assert list(eos.output_ids) == [2]
    assert eos.WhichOneof("matched_stop") is None  # vLLM sets no stop_reason for the EOS id
    assert txt.matched_stop_str == full_text[2:5]


async def test_abort_mid_stream_ends_with_abort_terminal_and_frees_the_slot() -> None:
    async with serve(token_latency_ms=20) as (engine, stub, _):
        call = stub.Generate(request("ab", max_tokens=1000), timeout=10)
        first = await call.read()
        assert first.chunk.token_ids
        await stub.Abort(pb.AbortRequest(request_ids=["ab"]), timeout=5)
        rest = await read_rest(call)
        assert rest[-1].complete.finish_reason == "abort"
        assert list(rest[-1].complete.output_ids) == []
        assert engine.running_count() == 0
        assert engine.book.aborts == ["ab"]
        assert engine.book.outcome_of("ab") is Outcome.ABORTED


async def test_client_cancel_stops_the_request() -> None:
    async with serve(token_latency_ms=20) as (engine, stub, _):
        call = stub.Generate(request("cc", max_tokens=1000), timeout=10)
        await call.read()
        assert engine.running_count() == 1
        call.cancel()
        await until(lambda: engine.running_count() == 0, "the cancelled request to stop")
        assert engine.book.outcome_of("cc") is Outcome.CANCELLED


async def expect_status(
    stub: pb_grpc.VllmEngineStub, req: pb.GenerateRequest
) -> tuple[grpc.StatusCode, Msgs]:
    got: Msgs = []

    async def drain() -> None:
        async for m in stub.Generate(req, timeout=10):
            got.append(m)

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await drain()
    return err.value.code(), got


async def test_request_faults_by_id_directive() -> None:
    async with serve() as (engine, stub, _):
        code, got = await expect_status(stub, request("r1.fault=fail_open", max_tokens=5))
        assert (code, got) == (grpc.StatusCode.UNAVAILABLE, [])

        msgs = await collect(stub, request("r2.fault=close_after:3", max_tokens=10))
        assert sum(len(c.token_ids) for c in chunks(msgs)) == 3
        assert completes(msgs) == []

        code, got = await expect_status(
            stub, request("r3.fault=error_after:2:RESOURCE_EXHAUSTED", max_tokens=10)
        )
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert sum(len(c.token_ids) for c in chunks(got)) == 2

        msgs = await collect(stub, request("r4.fault=repeat_after_terminal", max_tokens=2))
        assert msgs[-2].WhichOneof("response") == "complete"
        assert msgs[-1] == msgs[0]

        msgs = await collect(stub, request("r5.fault=stall_first_token:0.05", max_tokens=2))
        assert completes(msgs)[0].finish_reason == "length"
        assert engine.running_count() == 0


@pytest.mark.parametrize(
    ("variant", "check"),
    [
        ("missing_finish_reason", lambda d: d.finish_reason == ""),
        ("unknown_finish_reason", lambda d: d.finish_reason not in ("stop", "length", "abort", "error", "")),
        ("count_mismatch", lambda d: d.completion_tokens != len(d.output_ids)),
        ("negative_id", lambda d: 0xFFFFFFFF in d.output_ids),
    ],
)
async def test_malformed_terminal_variants(
    variant: str, check: Callable[[pb.GenerateComplete], bool]
) -> None:
    async with serve() as (_, stub, _ch):
        (done,) = completes(
            await collect(stub, request(f"m.fault=malformed_terminal:{variant}", max_tokens=3))
        )
    assert check(done)


async def test_hang_from_the_fault_book_keeps_the_stream_open() -> None:
    async with serve() as (engine, stub, _):
        engine.faults.add("pub-7", FaultPlan(FaultKind.HANG, after=1), times=1)
        call = stub.Generate(request("priv-1-pub-7", max_tokens=10), timeout=10)
        first = await call.read()
        assert len(first.chunk.token_ids) == 1
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(call.read()), 0.2)
        assert engine.running_count() == 1  # a hung request is visibly running
        call.cancel()
        await until(lambda: engine.running_count() == 0, "the hung request to stop")
        # times=1: the next request with that id runs normally
        assert completes(await collect(stub, request("priv-2-pub-7", max_tokens=2)))


async def test_capacity_makes_extra_requests_wait_fifo() -> None:
    async with serve(max_num_seqs=1, token_latency_ms=10) as (engine, stub, _):
        first = stub.Generate(request("c1", max_tokens=1000), timeout=10)
        await first.read()
        # One at a time: two calls started together may reach the engine in either order.
        second = asyncio.create_task(collect(stub, request("c2", max_tokens=2)))
        await until(lambda: engine.book.waiting_count == 1, "c2 waiting")
        third = asyncio.create_task(collect(stub, request("c3", max_tokens=2)))
        await until(lambda: engine.book.waiting_count == 2, "two waiting requests")
        loads = await stub.GetLoads(pb.GetLoadsRequest(), timeout=5)
        assert (loads.loads[0].num_running_reqs, loads.loads[0].num_waiting_reqs) == (1, 2)
        assert engine.book.waiting_ids() == ["c2", "c3"]
        await stub.Abort(pb.AbortRequest(request_ids=["c3"]), timeout=5)  # aborted while waiting
        await stub.Abort(pb.AbortRequest(request_ids=["c1"]), timeout=5)
        await read_rest(first)
        assert completes(await second)[0].finish_reason == "length"
        assert [d.finish_reason for d in completes(await third)] == ["abort"]
        assert engine.running_count() == 0
        assert engine.book.waiting_count == 0


async def test_startup_delay_refuses_then_accepts() -> None:
    # Long enough that the first check comes before it on a loaded machine too.
    engine = VllmTestEngine(VllmEngineConfig(startup_delay_secs=3.0))
    port = await engine.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health.Check(health_pb2.HealthCheckRequest(), timeout=0.1)
            assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            await engine.wait_ready(30)
            resp = await health.Check(
                health_pb2.HealthCheckRequest(service="vllm.grpc.engine.VllmEngine"),
                timeout=5,
                wait_for_ready=True,
            )
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            assert (
                await pb_grpc.VllmEngineStub(channel).HealthCheck(pb.HealthCheckRequest(), timeout=5)
            ).healthy
    finally:
        await engine.stop(0)


async def test_discovery_reports_the_configuration() -> None:
    async with serve(served_model_name="m1", kv_role="kv_both", data_parallel_size=2, max_num_seqs=7) as (
        _,
        stub,
        _ch,
    ):
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
        server = await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
        loads = await stub.GetLoads(pb.GetLoadsRequest(), timeout=5)
    assert (info.served_model_name, list(info.eos_token_ids), info.vocab_size) == ("m1", [2], 32000)
    assert (server.kv_role, server.data_parallel_size, server.max_num_seqs) == ("kv_both", 2, 7)
    assert loads.dp_rank_count == 2


async def test_prefill_returns_a_handoff_and_decode_checks_it() -> None:
    async with serve(kv_role="kv_both") as (engine, stub, _):
        req = request("p", max_tokens=1)
        req.kv_transfer_params_json = json.dumps({"do_remote_decode": True})
        (done,) = completes(await collect(stub, req))
        handoff = json.loads(done.kv_transfer_params_json)
        assert handoff["do_remote_prefill"] is True
        assert isinstance(handoff["remote_port"], int)
        assert handoff["remote_block_ids"]

        dec = request("d", max_tokens=3)
        handoff["remote_port"] = str(handoff["remote_port"])
        dec.kv_transfer_params_json = json.dumps(handoff)
        assert completes(await collect(stub, dec))[0].finish_reason == "length"
        assert engine.handoffs == [("d", handoff)]

        bad = request("d2", max_tokens=3)
        bad.kv_transfer_params_json = json.dumps({"do_remote_prefill": True})
        code, _ = await expect_status(stub, bad)
        assert code is grpc.StatusCode.INVALID_ARGUMENT


async def test_invalid_requests_are_invalid_argument() -> None:
    async with serve(context_length=16) as (engine, stub, _):
        for req in (request("x1", [], max_tokens=2), request("x2", list(range(101, 120)), max_tokens=2)):
            code, got = await expect_status(stub, req)
            assert (code, got) == (grpc.StatusCode.INVALID_ARGUMENT, [])
        assert engine.running_count() == 0


async def test_n_beyond_max_num_seqs_is_refused_at_once_and_the_engine_keeps_serving() -> None:
    # 28 million choices once built 28 million generators on the event loop (no answer, GBs).
    async with serve(max_num_seqs=4) as (engine, stub, _):
        code, got = await asyncio.wait_for(
            expect_status(stub, request("many", max_tokens=2, n=28_376_735)), 5
        )
        assert (code, got) == (grpc.StatusCode.INVALID_ARGUMENT, [])
        msgs = await collect(stub, request("four", max_tokens=2, n=4))
        assert sorted(c.index for c in completes(msgs)) == [0, 1, 2, 3]
        assert engine.running_count() == 0


async def test_die_mid_stream_then_restart_on_the_same_port() -> None:
    async with serve(token_latency_ms=20) as (engine, stub, channel):
        call = stub.Generate(request("k", max_tokens=1000), timeout=10)
        await call.read()
        port = engine.port
        await engine.die()
        with pytest.raises(grpc.aio.AioRpcError):
            await read_rest(call)
        assert await engine.restart() == port
        await until(lambda: engine.running_count() == 0, "no request left running")
        await channel_ready(channel)
        assert completes(await collect(stub, request("k2", max_tokens=2)))


async def channel_ready(channel: grpc.aio.Channel) -> None:
    wait: Awaitable[None] = channel.channel_ready()
    await asyncio.wait_for(wait, 5)


async def test_client_leaving_while_waiting_leaves_the_queue() -> None:
    async with serve(max_num_seqs=1, token_latency_ms=10) as (engine, stub, _):
        first = stub.Generate(request("w1", max_tokens=1000), timeout=10)
        await first.read()
        queued = stub.Generate(request("w2", max_tokens=2), timeout=10)
        await until(lambda: engine.book.waiting_ids() == ["w2"], "w2 to wait")
        queued.cancel()
        await until(lambda: engine.book.waiting_count == 0, "w2 to leave the queue")
        assert engine.book.outcome_of("w2") is Outcome.CANCELLED
        first.cancel()
        await until(lambda: engine.running_count() == 0, "w1 to stop")
        assert [type(m).__name__ for m in engine.book.requests()] == ["GenerateRequest"] * 2


async def test_duplicate_live_request_id_is_refused_and_the_live_one_keeps_running() -> None:
    async with serve(token_latency_ms=10) as (engine, stub, _):
        live = stub.Generate(request("dup", max_tokens=1000), timeout=10)
        await live.read()
        code, _ = await expect_status(stub, request("dup", max_tokens=2))
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert engine.book.running_ids() == ["dup"]
        live.cancel()
        await until(lambda: engine.running_count() == 0, "dup to stop")


async def test_abort_during_a_first_token_stall_ends_without_tokens() -> None:
    async with serve() as (engine, stub, _):
        engine.faults.add("stall", FaultPlan(FaultKind.STALL_FIRST_TOKEN, stall_secs=5.0))
        task = asyncio.create_task(collect(stub, request("stall-1", max_tokens=3)))
        await until(lambda: engine.running_count() == 1, "the stalled request to run")
        await stub.Abort(pb.AbortRequest(request_ids=["stall-1"]), timeout=5)
        msgs = await asyncio.wait_for(task, 5)
        assert [t for c in chunks(msgs) for t in c.token_ids] == []
        assert [d.finish_reason for d in completes(msgs)] == ["abort"]


async def test_control_endpoint_installs_faults_and_shows_the_book() -> None:
    async with (
        serve() as (engine, stub, _),
        TestClient(TestServer(control_app(engine.book, engine.faults))) as http,
    ):
        resp = await http.post("/faults", json={"match": "ctl", "fault": "close_after:1", "times": 1})
        assert resp.status == 200
        bad = await http.post("/faults", json={"match": "x", "fault": "explode"})
        assert bad.status == 400
        msgs = await collect(stub, request("ctl-1", max_tokens=5))
        assert completes(msgs) == []
        book = await (await http.get("/book")).json()
        assert book["running"] == []
        assert book["finished"] == [{"request_id": "ctl-1", "outcome": "faulted", "detail": "close_after"}]
        await http.delete("/faults")


async def test_kv_capacity_makes_requests_wait_for_room() -> None:
    async with serve(total_kv_tokens=6, token_latency_ms=10) as (engine, stub, _):
        big = stub.Generate(request("kv1", max_tokens=1000), timeout=10)
        await big.read()
        queued = asyncio.create_task(collect(stub, request("kv2", max_tokens=2)))
        await until(lambda: engine.book.waiting_ids() == ["kv2"], "kv2 to wait for KV room")
        loads = await stub.GetLoads(pb.GetLoadsRequest(), timeout=5)
        assert loads.loads[0].num_used_tokens >= len(PROMPT)
        big.cancel()
        assert completes(await asyncio.wait_for(queued, 5))[0].finish_reason == "length"
        assert engine.running_count() == 0


async def test_non_streamed_request_gets_one_complete_per_choice_with_every_token() -> None:
    req = request("ns", max_tokens=5, n=2)
    req.stream = False
    async with serve(chunk_tokens=2) as (_, stub, _ch):
        msgs = await collect(stub, req)
    assert [m.WhichOneof("response") for m in msgs] == ["complete", "complete"]
    by_index = {d.index: d for d in completes(msgs)}
    assert list(by_index[0].output_ids) == expected_ids(5, 0)
    assert list(by_index[1].output_ids) == expected_ids(5, 1)
    assert by_index[1].completion_tokens == 5


async def expect_refusal(
    stub: pb_grpc.VllmEngineStub, req: pb.GenerateRequest
) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(stub, req)
    return caught.value.code(), caught.value.details() or ""


async def test_past_max_num_queued_reqs_a_request_is_refused_busy_as_vllm_refuses_it() -> None:
    # vLLM's check_admission: unfinished sequences (a request of n counts n) + this one's > limit
    # -> QueueOverflowError, which the servicer ends UNAVAILABLE with its text.
    async with serve(max_num_queued_reqs=3) as (engine, stub, _):
        engine.faults.add("held", FaultPlan(FaultKind.HANG, after=1))
        held = stub.Generate(request("held", max_tokens=10, n=2), timeout=10)
        await held.read()
        assert await expect_refusal(stub, request("two", max_tokens=2, n=2)) == (
            grpc.StatusCode.UNAVAILABLE,
            QUEUE_OVERFLOW_MESSAGE,
        )
        assert completes(await collect(stub, request("one", max_tokens=2)))  # 2 + 1 fits
        # The request's own faults come first: a bad request is a bad request, busy or not.
        code, _ = await expect_refusal(stub, request("bad", [], max_tokens=2, n=2))
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        held.cancel()
        await until(lambda: engine.running_count() == 0, "the held request to stop")
        assert completes(await collect(stub, request("two-now", max_tokens=2, n=2)))


async def test_at_max_num_queued_tokens_in_prefill_a_request_is_refused_busy() -> None:
    # MaxQueuedTokensError: the prompt tokens of requests still in prefill (no output yet) are
    # at the limit; a request counts no more once its first output went out.
    async with serve(max_num_queued_tokens=len(PROMPT)) as (engine, stub, _):
        engine.faults.add("prefilling", FaultPlan(FaultKind.HANG, after=0))
        stuck = stub.Generate(request("prefilling", max_tokens=10), timeout=10)
        await until(lambda: engine.running_count() == 1, "the request in prefill")
        assert await expect_refusal(stub, request("next", max_tokens=2)) == (
            grpc.StatusCode.UNAVAILABLE,
            MAX_QUEUED_TOKENS_MESSAGE,
        )
        stuck.cancel()
        await until(lambda: engine.running_count() == 0, "the stuck request to stop")
        engine.faults.add("decoding", FaultPlan(FaultKind.HANG, after=1))
        decoding = stub.Generate(request("decoding", max_tokens=10), timeout=10)
        await decoding.read()  # its prefill is done
        assert completes(await collect(stub, request("then", max_tokens=2)))
        decoding.cancel()
