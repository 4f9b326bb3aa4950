"""The testkit SGLang engine seen through raw clients on both native wires (loopback).

What a sidecar relies on: the stream shapes SGLang 0.5.23 produces (cumulative or
incremental), the finish reasons, how aborts, cancels and disconnects end a request (and
that nothing keeps running afterwards), the faults a test asks for, and the info endpoints.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import grpc
import pytest
from testkit.book import Outcome
from testkit.faults import FaultKind, FaultPlan
from testkit.generator import EOS_TRIGGER_TOKEN
from testkit.sglang_cli import add_arguments, config_from_args
from testkit.sglang_engine import SglangTestEngine
from testkit.sglang_info import SglangEngineConfig

from sidecar_common.api import sglang_pb2, sglang_pb2_grpc

pytestmark = pytest.mark.timeout(30)

Factory = Callable[..., Awaitable[SglangTestEngine]]
PROMPT = [101, 102, 103, 104]
EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # grpc-stubs lack it


@pytest.fixture
async def make_engine() -> AsyncIterator[Factory]:
    engines: list[SglangTestEngine] = []

    async def make(**overrides: Any) -> SglangTestEngine:
        engine = SglangTestEngine(SglangEngineConfig(**overrides))
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.stop()
        assert engine.task_count == 0
        assert engine.book.running_count == 0
        assert engine.book.waiting_count == 0


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


class Grpc:
    def __init__(self, port: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = sglang_pb2_grpc.SglangServiceStub(self.channel)


@pytest.fixture
async def grpc_client() -> AsyncIterator[Callable[[SglangTestEngine], Grpc]]:
    clients: list[Grpc] = []

    def make(engine: SglangTestEngine) -> Grpc:
        c = Grpc(engine.grpc_port)
        clients.append(c)
        return c

    yield make
    for c in clients:
        await c.channel.close(grace=None)


def greq(
    rid: str, max_new: int = 6, prompt: list[int] | None = None, **kw: Any
) -> sglang_pb2.GenerateRequest:
    sp_fields = {k: kw.pop(k) for k in ("stop", "stop_token_ids", "ignore_eos", "min_new_tokens") if k in kw}
    sp = sglang_pb2.SamplingParams(max_new_tokens=max_new, **sp_fields)
    return sglang_pb2.GenerateRequest(
        input_ids=prompt or PROMPT, sampling_params=sp, stream=True, rid=rid, **kw
    )


def hbody(rid: str, max_new: int = 6, prompt: list[int] | None = None, **kw: Any) -> dict[str, Any]:
    sp: dict[str, Any] = {
        k: kw.pop(k) for k in ("stop", "stop_token_ids", "ignore_eos", "min_new_tokens") if k in kw
    }
    sp["max_new_tokens"] = max_new
    return {"input_ids": prompt or PROMPT, "sampling_params": sp, "stream": True, "rid": rid, **kw}


def meta(msg: sglang_pb2.GenerateResponse) -> dict[str, Any]:
    """gRPC meta_info values are JSON text."""
    return {k: json.loads(v) for k, v in msg.meta_info.items()}


async def grpc_all(client: Grpc, req: sglang_pb2.GenerateRequest) -> list[sglang_pb2.GenerateResponse]:
    return [m async for m in client.stub.Generate(req, timeout=10)]


async def read1(call: Any) -> sglang_pb2.GenerateResponse:
    msg = await call.read()
    assert isinstance(msg, sglang_pb2.GenerateResponse)
    return msg


async def drain(call: Any) -> list[sglang_pb2.GenerateResponse]:
    """The rest of a call already read with ``read()`` (the iterator API may not be mixed in)."""
    out: list[sglang_pb2.GenerateResponse] = []
    while (msg := await call.read()) is not EOF:
        out.append(msg)
    return out


async def sse(resp: aiohttp.ClientResponse) -> tuple[list[dict[str, Any]], bool]:
    """SSE events (parsed) and whether ``[DONE]`` ended them."""
    events: list[dict[str, Any]] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        if data == "[DONE]":
            return events, True
        events.append(json.loads(data))
    return events, False


async def http_all(session: aiohttp.ClientSession, port: int, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with session.post(f"http://127.0.0.1:{port}/generate", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events, done = await sse(resp)
    assert done
    return events


async def until(cond: Callable[[], bool], secs: float = 5.0) -> None:
    # The engine's ledger has no change events to wait on; poll it under a deadline.
    async with asyncio.timeout(secs):
        while not cond():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


# -- stream shapes ----------------------------------------------------------------------------
async def test_grpc_cumulative_stream(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc]
) -> None:
    engine = await make_engine()
    msgs = await grpc_all(grpc_client(engine), greq("cum-1", 5, ignore_eos=True))
    assert len(msgs) == 5
    ids = list(msgs[-1].output_ids)
    for i, m in enumerate(msgs):
        assert list(m.output_ids) == ids[: i + 1]  # cumulative
        md = meta(m)
        assert md["id"] == "cum-1"
        assert md["prompt_tokens"] == len(PROMPT)
        assert md["completion_tokens"] == i + 1
        assert m.finished == (i == 4)
        assert (md["finish_reason"] is None) == (i < 4)
        assert ("e2e_latency" in md) == (i == 4)
    assert meta(msgs[-1])["finish_reason"] == {"type": "length", "length": 5}
    assert all(v.strip() for v in msgs[0].meta_info.values())


async def test_grpc_incremental_stream_matches_cumulative(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc]
) -> None:
    cum = await make_engine()
    inc = await make_engine(incremental=True, chunk_tokens=2)
    full = list((await grpc_all(grpc_client(cum), greq("same", 7, ignore_eos=True)))[-1].output_ids)
    msgs = await grpc_all(grpc_client(inc), greq("same", 7, ignore_eos=True))
    assert [len(m.output_ids) for m in msgs] == [2, 2, 2, 1]
    assert [t for m in msgs for t in m.output_ids] == full
    assert [meta(m)["completion_tokens"] for m in msgs] == [2, 4, 6, 7]


@pytest.mark.parametrize("incremental", [False, True])
async def test_http_stream_shapes(
    make_engine: Factory, http: aiohttp.ClientSession, incremental: bool
) -> None:
    engine = await make_engine(incremental=incremental)
    events = await http_all(http, engine.http_port, hbody("h-1", 6, ignore_eos=True))
    assert len(events) == 6
    reference = await make_engine()
    final = (await http_all(http, reference.http_port, hbody("h-1", 6, ignore_eos=True)))[-1]
    if incremental:
        assert [len(e["output_ids"]) for e in events] == [1] * 6
        assert [t for e in events for t in e["output_ids"]] == final["output_ids"]
        assert "".join(e["text"] for e in events) == final["text"]
    else:
        for i, e in enumerate(events):
            assert e["output_ids"] == final["output_ids"][: i + 1]
            assert final["text"].startswith(e["text"])
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert events[-1]["meta_info"]["id"] == "h-1"


async def test_http_non_streaming_returns_one_json(make_engine: Factory, http: aiohttp.ClientSession) -> None:
    engine = await make_engine()
    body = hbody("ns", 3, ignore_eos=True)
    body["stream"] = False
    async with http.post(f"http://127.0.0.1:{engine.http_port}/generate", json=body) as resp:
        assert resp.status == 200
        out = await resp.json()
    assert len(out["output_ids"]) == 3
    assert out["meta_info"]["finish_reason"]["type"] == "length"


async def test_http_refuses_unknown_sampling_keys_as_sglang_does(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    # SGLang's HTTP seed is `sampling_seed`; `seed` is an unknown SamplingParams keyword (400).
    engine = await make_engine()
    url = f"http://127.0.0.1:{engine.http_port}/generate"
    body = hbody("seeded", 3, ignore_eos=True)
    body["sampling_params"]["seed"] = 7
    async with http.post(url, json=body) as resp:
        assert resp.status == 400
        assert "seed" in (await resp.json())["message"]
    body["sampling_params"]["sampling_seed"] = body["sampling_params"].pop("seed")
    async with http.post(url, json=body) as resp:
        assert resp.status == 200


# -- finish reasons -------------------------------------------------------------------------
@pytest.mark.parametrize("wire", ["grpc", "http"])
async def test_finish_reasons(
    make_engine: Factory,
    grpc_client: Callable[[SglangTestEngine], Grpc],
    http: aiohttp.ClientSession,
    wire: str,
) -> None:
    engine = await make_engine(eos_token_id=7)

    async def final(rid: str, max_new: int = 8, prompt: list[int] | None = None, **kw: Any) -> dict[str, Any]:
        if wire == "grpc":
            msgs = await grpc_all(grpc_client(engine), greq(rid, max_new, prompt, **kw))
            return {"output_ids": list(msgs[-1].output_ids), "meta_info": meta(msgs[-1])}
        return (await http_all(http, engine.http_port, hbody(rid, max_new, prompt, **kw)))[-1]

    base = await final("f-len", 8, ignore_eos=True)
    assert base["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    stop_id = base["output_ids"][3]
    by_token = await final("f-tok", 8, stop_token_ids=[stop_id])
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert by_token["output_ids"] == base["output_ids"][:4]
    eos = await final("f-eos", 8, prompt=[EOS_TRIGGER_TOKEN, 3, 150])
    assert eos["meta_info"]["finish_reason"] == {"type": "stop", "matched": 7}
    assert eos["output_ids"][-1] == 7
    assert len(eos["output_ids"]) == 3
    if wire == "http":
        text_of = base["text"]
        stop = text_of[len(text_of) // 2 :][:2]
        by_str = await final("f-str", 8, ignore_eos=True, stop=[stop])
        assert by_str["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert stop not in by_str["text"]


async def test_a_repeated_prefix_reports_cached_tokens(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(page_size=4)
    prompt = list(range(150, 160))
    first = (await http_all(http, engine.http_port, hbody("pc-1", 2, prompt=prompt)))[-1]
    again = (await http_all(http, engine.http_port, hbody("pc-2", 2, prompt=prompt)))[-1]
    other = (await http_all(http, engine.http_port, hbody("pc-3", 2, prompt=[*prompt[:5], 999])))[-1]
    assert [e["meta_info"]["cached_tokens"] for e in (first, again, other)] == [0, 8, 4]


async def test_logprobs_shape(make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc]) -> None:
    engine = await make_engine()
    req = greq("lp", 3, ignore_eos=True, return_logprob=True, top_logprobs_num=2, logprob_start_len=0)
    final = (await grpc_all(grpc_client(engine), req))[-1]
    last = meta(final)
    out = last["output_token_logprobs"]
    assert [row[1] for row in out] == list(final.output_ids)
    assert len(out) == 3
    assert all(isinstance(lp, float) and text is None for lp, _, text in out)
    assert all(len(top) == 2 for top in last["output_top_logprobs"])
    inp = last["input_token_logprobs"]
    assert [row[1] for row in inp] == PROMPT
    assert inp[0][0] is None


@pytest.mark.parametrize("incremental", [False, True])
async def test_input_logprobs_ride_on_every_event(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc], incremental: bool
) -> None:
    # SGLang's tokenizer manager sets the accumulated input logprobs on each event's meta;
    # incremental streaming slices only the output lists.
    engine = await make_engine(incremental=incremental)
    req = greq("lp-all", 3, ignore_eos=True, return_logprob=True, logprob_start_len=0)
    events = await grpc_all(grpc_client(engine), req)
    assert len(events) == 3
    inputs = [meta(e)["input_token_logprobs"] for e in events]
    assert [row[1] for row in inputs[0]] == PROMPT
    assert inputs == [inputs[0]] * 3


# -- aborts, cancels, disconnects ----------------------------------------------------------------
async def test_grpc_abort_ends_cancelled_without_terminal(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc]
) -> None:
    engine = await make_engine(token_latency_ms=20)
    client = grpc_client(engine)
    call = client.stub.Generate(greq("ab-1", 1000, ignore_eos=True), timeout=10)
    seen = [await read1(call)]
    assert (await client.stub.Abort(sglang_pb2.AbortRequest(rid="ab-1"))).success
    with pytest.raises(grpc.aio.AioRpcError) as err:
        seen += await drain(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    assert not any(m.finished for m in seen)
    await until(lambda: engine.book.running_count == 0)
    assert "ab-1" in engine.book.aborts


async def test_abort_matches_by_prefix_of_a_live_rid(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(token_latency_ms=20)
    url = f"http://127.0.0.1:{engine.http_port}"
    async with (
        http.post(f"{url}/generate", json=hbody("job-1", 1000, ignore_eos=True)) as a,
        http.post(f"{url}/generate", json=hbody("job-1b", 1000, ignore_eos=True)) as b,
    ):
        firsts = [json.loads((await r.content.readline())[len(b"data: ") :]) for r in (a, b)]
        # A bare prefix naming no live request is ignored (one tokenizer worker).
        async with http.post(f"{url}/abort_request", json={"rid": "job-", "abort_all": False}) as r:
            assert r.status == 200
        assert engine.book.running_count == 2
        async with http.post(f"{url}/abort_request", json={"rid": "job-1", "abort_all": False}) as r:
            assert r.status == 200
        for resp, first in zip((a, b), firsts, strict=True):
            events, done = await sse(resp)
            events.insert(0, first)
            assert done
            assert events[-1]["meta_info"]["finish_reason"] == {
                "type": "abort",
                "message": "Aborted",
                "status_code": None,
                "err_type": None,
            }
            # The decode step already scheduled still lands, on the abort chunk itself.
            assert len(events[-1]["output_ids"]) == len(events[-2]["output_ids"]) + 1
    assert engine.book.running_count == 0
    assert engine.book.aborts == ["job-", "job-1"]
    assert set(engine.abort_log[-1].matched) == {"job-1", "job-1b"}


async def test_bare_prefix_aborts_with_several_tokenizer_workers(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc], http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(token_latency_ms=20, tokenizer_workers=2)
    client = grpc_client(engine)
    calls = [client.stub.Generate(greq(f"grp-{i}", 1000, ignore_eos=True), timeout=10) for i in range(2)]
    for c in calls:
        await c.read()
    async with http.post(f"http://127.0.0.1:{engine.http_port}/abort_request", json={"rid": "grp-"}) as r:
        assert r.status == 200
    for c in calls:
        last = (await drain(c))[-1]
        assert last.finished
        assert meta(last)["finish_reason"]["type"] == "abort"
    assert engine.book.running_count == 0


async def test_grpc_client_cancel_aborts_at_once(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc]
) -> None:
    engine = await make_engine(token_latency_ms=20)
    call = grpc_client(engine).stub.Generate(greq("cx-1", 1000, ignore_eos=True), timeout=10)
    await call.read()
    assert engine.book.running_count == 1
    call.cancel()
    await until(lambda: engine.book.running_count == 0)
    assert [r.source for r in engine.abort_log] == ["grpc-cancel"]
    assert engine.book.aborts == []  # no client sent an Abort


async def test_http_disconnect_aborts_after_the_delay(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(token_latency_ms=20, disconnect_abort_delay_secs=0.5)
    url = f"http://127.0.0.1:{engine.http_port}"
    resp = await http.post(f"{url}/generate", json=hbody("dc-1", 1000, ignore_eos=True))
    await resp.content.readline()
    resp.close()
    await until(lambda: engine.book.running_count == 0)
    assert [r.source for r in engine.abort_log] == ["http-disconnect"]
    # The request outlived its client for a while: a leak test can see that window.
    assert engine.book.outcome_of("dc-1") is not None


async def test_explicit_abort_arrives_before_the_disconnect_abort(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(token_latency_ms=20)  # default 2 s disconnect delay
    url = f"http://127.0.0.1:{engine.http_port}"
    resp = await http.post(f"{url}/generate", json=hbody("dc-2", 1000, ignore_eos=True))
    await resp.content.readline()
    async with http.post(f"{url}/abort_request", json={"rid": "dc-2"}) as r:
        assert r.status == 200
    resp.close()
    await until(lambda: engine.book.running_count == 0)
    assert engine.book.aborts == ["dc-2"]
    assert [r.source for r in engine.abort_log] == ["http"]


async def test_waiting_request_is_queued_and_abortable(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc]
) -> None:
    engine = await make_engine(token_latency_ms=20, max_running_requests=1)
    client = grpc_client(engine)
    first = client.stub.Generate(greq("q-1", 1000, ignore_eos=True), timeout=10)
    await first.read()
    second = client.stub.Generate(greq("q-2", 5, ignore_eos=True), timeout=10)
    await until(lambda: engine.book.waiting_count == 1)
    assert engine.book.waiting_ids() == ["q-2"]
    # An abort that reaches the scheduler by prefix but not through q-2's own channel.
    engine.abort("q-2", source="test")
    last = (await drain(second))[-1]
    assert meta(last)["finish_reason"] == {
        "type": "abort",
        "message": "Abort in waiting queue",
    }
    first.cancel()
    await until(lambda: engine.book.running_count == 0)


async def test_kv_capacity_makes_requests_wait(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc]
) -> None:
    engine = await make_engine(token_latency_ms=20, kv_capacity_tokens=10)
    client = grpc_client(engine)
    first = client.stub.Generate(greq("kv-1", 1000, prompt=[150] * 8, ignore_eos=True), timeout=10)
    await read1(first)
    second = client.stub.Generate(greq("kv-2", 2, prompt=[150] * 8), timeout=10)
    await until(lambda: engine.book.waiting_ids() == ["kv-2"])
    assert engine.book.running_ids() == ["kv-1"]
    loads = json.loads((await client.stub.GetLoad(sglang_pb2.GetLoadRequest())).json_info)
    assert loads[0]["num_waiting_reqs"] == 1
    first.cancel()
    assert (await drain(second))[-1].finished  # ran once the first one freed its KV


async def test_both_wires_give_the_same_tokens(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc], http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(chunk_tokens=3)
    via_grpc = (await grpc_all(grpc_client(engine), greq("same-g", 9, ignore_eos=True)))[-1]
    via_http = (await http_all(http, engine.http_port, hbody("same-h", 9, ignore_eos=True)))[-1]
    assert list(via_grpc.output_ids) == via_http["output_ids"]


async def test_many_concurrent_requests_all_finish_within_capacity(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc]
) -> None:
    engine = await make_engine(max_running_requests=3, token_latency_ms=1)
    client = grpc_client(engine)
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, engine.book.running_count)
            await asyncio.sleep(0.002)

    watcher = asyncio.ensure_future(watch())
    try:
        results = await asyncio.gather(*(grpc_all(client, greq(f"many-{i}", 5)) for i in range(12)))
    finally:
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher
    assert all(r[-1].finished for r in results)
    assert 1 <= peak <= 3
    assert engine.book.running_count == 0


async def test_abort_all_on_both_wires(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc], http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(token_latency_ms=20)
    client = grpc_client(engine)
    calls = [client.stub.Generate(greq(f"all-{i}", 1000, ignore_eos=True), timeout=10) for i in range(2)]
    for c in calls:
        await read1(c)
    assert (await client.stub.Abort(sglang_pb2.AbortRequest(abort_all=True))).success
    for c in calls:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await drain(c)
        assert err.value.code() == grpc.StatusCode.CANCELLED
    await until(lambda: engine.book.running_count == 0)

    url = f"http://127.0.0.1:{engine.http_port}"
    async with http.post(f"{url}/generate", json=hbody("all-h", 1000, ignore_eos=True)) as resp:
        await resp.content.readline()
        async with http.post(f"{url}/abort_request", json={"rid": "", "abort_all": True}) as r:
            assert r.status == 200
        events, done = await sse(resp)
    assert done
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert engine.book.running_count == 0


async def test_grpc_abort_of_an_unknown_rid_is_ignored_but_recorded(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc]
) -> None:
    engine = await make_engine()
    stub = grpc_client(engine).stub
    assert (await stub.Abort(sglang_pb2.AbortRequest(rid="gone"))).success
    assert engine.book.aborts == ["gone"]
    assert engine.abort_log[0].matched == ()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Abort(sglang_pb2.AbortRequest(rid=""))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- refusals -----------------------------------------------------------------------------------
async def test_duplicate_live_rid(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc], http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(token_latency_ms=20)
    client = grpc_client(engine)
    call = client.stub.Generate(greq("dup", 1000, ignore_eos=True), timeout=10)
    await call.read()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await grpc_all(client, greq("dup"))
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "dup" in (err.value.details() or "")
    events = await http_all(http, engine.http_port, hbody("dup"))
    assert events == [
        {
            "error": {
                "message": "Duplicate request ID detected: dup",
                "type": "invalid_request_error",
                "code": 400,
                "retryable": False,
            }
        }
    ]
    call.cancel()


async def test_bad_http_bodies_are_400(make_engine: Factory, http: aiohttp.ClientSession) -> None:
    engine = await make_engine()
    url = f"http://127.0.0.1:{engine.http_port}/generate"
    async with http.post(url, data=b"{not json", headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
    async with http.post(url, json={"input_ids": "abc", "stream": True}) as r:
        assert r.status == 400
        assert (await r.json())["code"] == 400
    body = hbody("long", 10, prompt=[150] * 4095)
    body["stream"] = False
    async with http.post(url, json=body) as r:
        assert r.status == 400
        assert "context length" in (await r.json())["error"]["message"]


# -- faults ------------------------------------------------------------------------------------
async def test_faults_on_grpc(make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc]) -> None:
    engine = await make_engine()
    client = grpc_client(engine)
    engine.faults.add("open", FaultPlan(FaultKind.FAIL_OPEN))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await grpc_all(client, greq("open"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    msgs = await grpc_all(client, greq("x.fault=close_after:2", 8, ignore_eos=True))
    assert len(msgs) == 2
    assert not any(m.finished for m in msgs)

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await grpc_all(client, greq("x.fault=error_after:1:RESOURCE_EXHAUSTED", 8))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    checks: list[tuple[str, Callable[[sglang_pb2.GenerateResponse], bool]]] = [
        ("missing_finish_reason", lambda m: meta(m)["finish_reason"] is None),
        (
            "unknown_finish_reason",
            lambda m: meta(m)["finish_reason"]["type"] not in ("stop", "length", "abort"),
        ),
        ("count_mismatch", lambda m: meta(m)["completion_tokens"] != len(m.output_ids)),
        ("negative_id", lambda m: min(m.output_ids) < 0),
    ]
    for variant, check in checks:
        msgs = await grpc_all(client, greq(f"m.fault=malformed_terminal:{variant}", 3, ignore_eos=True))
        assert msgs[-1].finished, variant
        assert check(msgs[-1]), variant

    msgs = await grpc_all(client, greq("r.fault=repeat_after_terminal", 3, ignore_eos=True))
    assert [m.finished for m in msgs] == [False, False, True, False]
    assert msgs[-1] == msgs[0]
    assert engine.book.running_count == 0


async def test_faults_on_http(make_engine: Factory, http: aiohttp.ClientSession) -> None:
    engine = await make_engine()
    url = f"http://127.0.0.1:{engine.http_port}/generate"
    async with http.post(url, json=hbody("o.fault=fail_open")) as r:
        assert r.status == 503

    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(url, json=hbody("c.fault=close_after:2", 8, ignore_eos=True)) as r:
            await sse(r)

    events = await http_all(http, engine.http_port, hbody("e.fault=error_after:1:RESOURCE_EXHAUSTED", 8))
    assert len(events) == 2
    assert events[-1]["error"]["code"] == 429

    events = await http_all(http, engine.http_port, hbody("m.fault=malformed_terminal:negative_id", 3))
    assert events[-1]["output_ids"][-1] == -1
    events = await http_all(
        http, engine.http_port, hbody("r.fault=repeat_after_terminal", 3, ignore_eos=True)
    )
    assert len(events) == 4
    assert events[-1] == events[0]
    await until(lambda: engine.book.running_count == 0)


async def test_control_endpoints_for_out_of_process_tests(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    engine = await make_engine()
    url = f"http://127.0.0.1:{engine.http_port}"
    async with http.post(f"{url}/testkit/faults", json={"match": "ctl", "directive": "close_after:1"}) as r:
        assert r.status == 200
    async with http.post(f"{url}/testkit/faults", json={"match": "ctl", "directive": "nonsense"}) as r:
        assert r.status == 400
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(f"{url}/generate", json=hbody("ctl-1", 4)) as resp:
            await sse(resp)
    async with http.get(f"{url}/testkit/state") as r:
        state = await r.json()
    assert state["running"] == []
    assert state["received"] == ["ctl-1"]
    assert state["finished"] == [{"rid": "ctl-1", "outcome": "faulted", "detail": ""}]


@pytest.mark.parametrize("wire", ["grpc", "http"])
async def test_hang_keeps_the_stream_open_until_the_client_leaves(
    make_engine: Factory,
    grpc_client: Callable[[SglangTestEngine], Grpc],
    http: aiohttp.ClientSession,
    wire: str,
) -> None:
    engine = await make_engine(disconnect_abort_delay_secs=0.1)
    engine.faults.add("hang-me", FaultPlan(FaultKind.HANG, after=1))
    if wire == "grpc":
        call = grpc_client(engine).stub.Generate(greq("hang-me", 8), timeout=10)
        await call.read()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(call.read(), 0.3)
        assert engine.book.running_count == 1
        call.cancel()
    else:
        resp = await http.post(f"http://127.0.0.1:{engine.http_port}/generate", json=hbody("hang-me", 8))
        assert (await resp.content.readline()).startswith(b"data: ")
        assert await resp.content.readline() == b"\n"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(resp.content.readline(), 0.3)
        assert engine.book.running_count == 1
        resp.close()
    await until(lambda: engine.book.running_count == 0)


async def test_stall_first_token(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc]
) -> None:
    engine = await make_engine()
    engine.faults.add("slow", FaultPlan(FaultKind.STALL_FIRST_TOKEN, stall_secs=0.3))
    call = grpc_client(engine).stub.Generate(greq("slow", 2), timeout=10)
    first = asyncio.ensure_future(read1(call))
    done, _ = await asyncio.wait({first}, timeout=0.1)
    assert not done  # still stalled
    msgs = [await first, *await drain(call)]
    assert msgs[-1].finished


async def test_kill_then_restart_on_the_same_ports(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc], http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(token_latency_ms=20)
    ports = (engine.grpc_port, engine.http_port)
    client = grpc_client(engine)
    call = client.stub.Generate(greq("k-1", 1000, ignore_eos=True), timeout=10)
    await call.read()
    await engine.kill()
    with pytest.raises(grpc.aio.AioRpcError):
        await drain(call)
    with pytest.raises(aiohttp.ClientConnectionError):
        await http.get(f"http://127.0.0.1:{ports[1]}/health")
    assert await engine.restart() == ports
    msgs = await grpc_all(client, greq("k-2", 2))
    assert msgs[-1].finished


# -- info ---------------------------------------------------------------------------------------
async def test_info_endpoints(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc], http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(
        served_model_name="tiny", context_length=2048, incremental=True, page_size=16, kv_capacity_tokens=9000
    )
    stub = grpc_client(engine).stub
    g = json.loads((await stub.GetServerInfo(sglang_pb2.GetServerInfoRequest())).json_info)
    url = f"http://127.0.0.1:{engine.http_port}"
    async with http.get(f"{url}/server_info") as r:
        h = await r.json()
    async with http.get(f"{url}/get_server_info") as r:
        assert await r.json() == {**h, "startup_time": h["startup_time"]} or r.status == 200
    for info in (g, h):
        assert info["served_model_name"] == "tiny"
        assert info["context_length"] is None  # the launch flag was not given
        assert info["max_req_input_len"] == 2047
        assert info["page_size"] == 16
        assert info["max_total_num_tokens"] == 9000
        assert info["incremental_streaming_output"] is True
        assert info["disaggregation_mode"] == "null"
        assert {"max_running_requests", "dp_size", "disaggregation_bootstrap_port"} <= info.keys()
    assert "version" not in g
    assert h["version"] == "0.5.23"

    cards = (await stub.ListModels(sglang_pb2.ListModelsRequest())).models
    assert [(c.id, c.max_model_len) for c in cards] == [("tiny", 2048)]
    async with http.get(f"{url}/v1/models") as r:
        assert [(c["id"], c["max_model_len"]) for c in (await r.json())["data"]] == [("tiny", 2048)]
    mi = await stub.GetModelInfo(sglang_pb2.GetModelInfoRequest())
    assert json.loads(mi.json_info)["served_model_name"] == "tiny"
    assert mi.model_path
    for path in ("/model_info", "/get_model_info"):
        async with http.get(url + path) as r:
            assert (await r.json())["served_model_name"] == "tiny"
    loads = json.loads((await stub.GetLoad(sglang_pb2.GetLoadRequest())).json_info)
    assert loads[0]["dp_rank"] == 0
    assert loads[0]["num_running_reqs"] == 0
    async with http.get(f"{url}/v1/loads") as r:
        assert (await r.json())["loads"][0]["max_running_requests"] == 256
    assert (await stub.HealthCheck(sglang_pb2.HealthCheckRequest())).healthy
    async with http.get(f"{url}/health") as r:
        assert r.status == 200


async def test_startup_delay(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc], http: aiohttp.ClientSession
) -> None:
    # Long enough that the not-ready checks finish first on a loaded 2-core machine.
    engine = await make_engine(startup_delay_secs=2.0)
    stub = grpc_client(engine).stub
    assert not (await stub.HealthCheck(sglang_pb2.HealthCheckRequest())).healthy
    async with http.get(f"http://127.0.0.1:{engine.http_port}/health") as r:
        assert r.status == 503
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await grpc_all(grpc_client(engine), greq("early"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    await engine.wait_ready(10)
    assert (await stub.HealthCheck(sglang_pb2.HealthCheckRequest())).healthy
    async with http.get(f"http://127.0.0.1:{engine.http_port}/health") as r:
        assert r.status == 200


# -- disaggregation -----------------------------------------------------------------------------
async def test_prefill_requires_bootstrap_and_makes_one_token(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc], http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(disaggregation_mode="prefill")
    client = grpc_client(engine)
    # SGLang's scheduler refuses it (set_finish_with_abort): a clean abort terminal of status 400.
    (refusal,) = await grpc_all(client, greq("p-0", 8))
    reason = json.loads(refusal.meta_info["finish_reason"])
    assert refusal.finished
    assert reason["type"] == "abort"
    assert reason["status_code"] == 400
    assert "without bootstrap room" in reason["message"]
    dp = sglang_pb2.DisaggregatedParams(
        bootstrap_host="10.0.0.1", bootstrap_port=8998, bootstrap_room=2**63 - 1
    )
    msgs = await grpc_all(client, greq("p-1", 8, disaggregated_params=dp))
    assert len(msgs[-1].output_ids) == 1
    assert msgs[-1].finished
    assert engine.bootstraps["p-1"] == ("10.0.0.1", 8998, 2**63 - 1)
    events = await http_all(http, engine.http_port, hbody("p-2", 8))
    assert events[0]["meta_info"]["finish_reason"]["status_code"] == 400
    body = hbody("p-3", 8, bootstrap_host="h", bootstrap_port=1, bootstrap_room=5)
    events = await http_all(http, engine.http_port, body)
    assert len(events[-1]["output_ids"]) == 1
    assert engine.bootstraps["p-3"] == ("h", 1, 5)


async def test_decode_records_the_bootstrap_triple(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc]
) -> None:
    engine = await make_engine(disaggregation_mode="decode")
    dp = sglang_pb2.DisaggregatedParams(bootstrap_host="pf", bootstrap_port=9000, bootstrap_room=42)
    msgs = await grpc_all(grpc_client(engine), greq("d-1", 4, ignore_eos=True, disaggregated_params=dp))
    assert len(msgs[-1].output_ids) == 4
    assert engine.bootstraps == {"d-1": ("pf", 9000, 42)}
    info = engine.server_info(http=False)
    assert info["disaggregation_mode"] == "decode"


async def test_engine_as_a_context_manager(http: aiohttp.ClientSession) -> None:
    async with SglangTestEngine(SglangEngineConfig(grpc_port=None)) as engine:
        assert engine.grpc_port == 0
        async with http.get(f"{engine.http_url}/health") as r:
            assert r.status == 200
    assert engine.task_count == 0
    with pytest.raises(aiohttp.ClientConnectionError):
        await http.get(f"{engine.http_url}/health")


# -- the console entry --------------------------------------------------------------------------
def test_cli_flags_make_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = (
        "--grpc-listen 127.0.0.1:0 --http-listen off --incremental --served-model-name m "
        "--eos-token-id 5 --context-length 1024 --kv-capacity-tokens 5000 --max-running-requests 3 "
        "--token-latency-ms 2.5 --chunk-tokens 4 --startup-delay-secs 1 --disaggregation-mode decode "
        "--bootstrap-port 9100 --fault r1=close_after:2"
    )
    args = parser.parse_args(flags.split())
    cfg = config_from_args(args)
    assert (cfg.grpc_port, cfg.http_port, cfg.incremental) == (0, None, True)
    assert (cfg.model_name, cfg.eos_token_id, cfg.context_length, cfg.context_length_flag) == (
        "m",
        5,
        1024,
        1024,
    )
    assert (cfg.kv_capacity_tokens, cfg.max_running_requests, cfg.chunk_tokens) == (5000, 3, 4)
    assert (cfg.disaggregation_mode, cfg.bootstrap_port, cfg.startup_delay_secs) == ("decode", 9100, 1.0)
    assert args.fault[0][0] == "r1"
    assert config_from_args(parser.parse_args([])).incremental is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--incremental", "--cumulative"])


def test_cli_lora_flags_make_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--lora-paths", "sql=/a/sql", "chat"]))
    assert (cfg.enable_lora, cfg.lora_paths, cfg.lora_enabled) == (None, ("sql", "chat"), True)
    cfg = config_from_args(parser.parse_args(["--enable-lora"]))
    assert (cfg.enable_lora, cfg.lora_paths, cfg.lora_enabled) == (True, (), True)
    assert config_from_args(parser.parse_args([])).lora_enabled is False


# -- bad requests: refused as SGLang refuses them, and the engine carries on -------------------
async def assert_serving(engine: SglangTestEngine, client: Grpc) -> None:
    """Healthy at once, nothing left running or waiting, and a good request is served."""
    reply = await client.stub.HealthCheck(sglang_pb2.HealthCheckRequest(), timeout=1)
    assert reply.healthy
    await until(lambda: not engine.live_ids())
    assert engine.book.running_count == 0
    assert engine.book.waiting_count == 0
    msgs = await grpc_all(client, greq(f"after-{len(engine.book.finished)}", 3, ignore_eos=True))
    assert msgs[-1].finished
    assert len(msgs[-1].output_ids) == 3


def _sampling(rid: str, **fields: Any) -> sglang_pb2.GenerateRequest:
    req = greq(rid, 4)
    for name, value in fields.items():
        setattr(req.sampling_params, name, value)
    return req


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"temperature": float("nan")}, "temperature must be a non-negative finite number"),
        ({"temperature": float("inf")}, "temperature must be a non-negative finite number"),
        ({"temperature": -1.0}, "temperature must be a non-negative finite number"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": float("nan")}, "top_p must be in (0, 1]"),
        ({"min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"top_k": 0}, "top_k must be -1 (disable) or at least 1"),
        ({"frequency_penalty": float("-inf")}, "frequency_penalty must be in [-2, 2]"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0, 2]"),
        ({"min_new_tokens": 5}, "min_new_tokens must be in [0, max_new_tokens(4)]"),
        ({"max_new_tokens": -1}, "max_new_tokens must be at least 0"),
    ],
)
async def test_sampling_params_sglang_does_not_verify_are_internal_on_grpc_and_400_on_http(
    make_engine: Factory,
    grpc_client: Callable[[SglangTestEngine], Grpc],
    http: aiohttp.ClientSession,
    fields: dict[str, Any],
    says: str,
) -> None:
    # SGLang's tokenizer manager raises (SamplingParams.verify); its gRPC bridge sends the
    # error, which the Rust server ends the stream with as INTERNAL; HTTP answers 400.
    engine = await make_engine()
    client = grpc_client(engine)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await grpc_all(client, _sampling("bad-g", **fields))
    assert info.value.code() is grpc.StatusCode.INTERNAL
    assert says in (info.value.details() or "")
    body = hbody("bad-h", 4)
    body["sampling_params"].update(fields)
    body["stream"] = False
    async with http.post(f"{engine.http_url}/generate", data=json.dumps(body)) as resp:
        assert resp.status == 400
        assert says in (await resp.json())["error"]["message"]
    await assert_serving(engine, client)


LORA_OFF = (
    "LoRA adapter 'sql' was requested, but LoRA is not enabled. Please launch the server with "
    "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
)


async def test_a_lora_adapter_while_lora_is_off_is_internal_on_grpc_and_400_on_http(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc], http: aiohttp.ClientSession
) -> None:
    # SGLang's tokenizer manager raises a ValueError before it reads the prompt: the Rust gRPC
    # server ends the stream with INTERNAL and the text; HTTP streams its error event (400).
    engine = await make_engine()
    async with http.get(f"{engine.http_url}/server_info") as resp:
        assert (await resp.json())["enable_lora"] is None
    client = grpc_client(engine)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await grpc_all(client, greq("lora-g", lora_path="sql"))
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INTERNAL, LORA_OFF)
    async with http.post(f"{engine.http_url}/generate", json=hbody("lora-h", lora_path="sql")) as resp:
        assert resp.status == 200
        events, done = await sse(resp)
    assert done
    assert events == [
        {"error": {"message": LORA_OFF, "type": "invalid_request_error", "code": 400, "retryable": False}}
    ]
    lora_on = await make_engine(enable_lora=True, lora_paths=("sql",))
    assert len(await grpc_all(grpc_client(lora_on), greq("lora-on", 2, lora_path="sql"))) == 2


def lora_not_loaded(adapter: str, loaded: str) -> str:
    # SGLang 0.5.23's tokenizer manager (_resolve_lora_path): a ValueError listing its
    # lora_ref_cache keys (the --lora-paths names and those loaded since) as a dict_keys.
    return (
        f"Got LoRA adapter that has never been loaded: {adapter}\nAll loaded adapters: dict_keys({loaded})."
    )


@pytest.mark.parametrize(
    ("config", "loaded"),
    [
        ({"enable_lora": True}, "[]"),
        ({"lora_paths": ("sql", "it's")}, "['sql', \"it's\"]"),  # --lora-paths alone turn LoRA on
    ],
)
async def test_an_adapter_never_loaded_is_refused_as_sglang_does(
    make_engine: Factory,
    grpc_client: Callable[[SglangTestEngine], Grpc],
    http: aiohttp.ClientSession,
    config: dict[str, Any],
    loaded: str,
) -> None:
    engine = await make_engine(**config)
    async with http.get(f"{engine.http_url}/server_info") as resp:
        assert (await resp.json())["enable_lora"] is True
    words = lora_not_loaded("chat", loaded)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await grpc_all(grpc_client(engine), greq("nl-g", lora_path="chat"))
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INTERNAL, words)
    unary = {**hbody("nl-u", lora_path="chat"), "stream": False}
    async with http.post(f"{engine.http_url}/generate", json=unary) as resp:
        assert (resp.status, await resp.json()) == (400, {"error": {"message": words}})
    async with http.post(f"{engine.http_url}/generate", json=hbody("nl-h", lora_path="chat")) as resp:
        assert resp.status == 200
        events, done = await sse(resp)
    assert done
    assert events == [
        {"error": {"message": words, "type": "invalid_request_error", "code": 400, "retryable": False}}
    ]


async def test_an_absent_max_new_tokens_is_capped_not_refused_when_the_default_would_overflow(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc], http: aiohttp.ClientSession
) -> None:
    # SGLang refuses prompt + max_new_tokens past the context only for a max_new_tokens the
    # request gave; its default (128) is capped by the scheduler. Found by the bad-input
    # property: the sidecar (rightly) let such a request through and the engine refused it.
    engine = await make_engine(context_length=64)
    prompt = [101 + i for i in range(60)]
    req = greq("absent", prompt=prompt)
    req.sampling_params.ClearField("max_new_tokens")
    msgs = await grpc_all(grpc_client(engine), req)
    assert meta(msgs[-1])["finish_reason"]["type"] == "length"
    body = hbody("absent-h", prompt=prompt)
    del body["sampling_params"]["max_new_tokens"]
    body["stream"] = False
    async with http.post(f"{engine.http_url}/generate", data=json.dumps(body)) as resp:
        assert resp.status == 200, await resp.text()
    explicit = greq("explicit", max_new=10, prompt=prompt)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await grpc_all(grpc_client(engine), explicit)
    assert "Requested token count exceeds" in (info.value.details() or "")


async def test_greedy_temperature_makes_any_top_k_acceptable(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc]
) -> None:
    engine = await make_engine()
    msgs = await grpc_all(grpc_client(engine), _sampling("greedy", temperature=0.0, top_k=0))
    assert msgs[-1].finished


@pytest.mark.parametrize(
    ("overrides", "build", "says"),
    [
        ({}, lambda: greq("lp", 4, return_logprob=True, logprob_start_len=9), "logprob_start_len"),
        (
            {"kv_capacity_tokens": 5},
            lambda: greq("kv", 1, prompt=[101, 102, 103, 104]),
            "Input length (4 tokens)",
        ),
    ],
)
async def test_scheduler_refusals_end_the_stream_with_a_400_abort(
    make_engine: Factory,
    grpc_client: Callable[[SglangTestEngine], Grpc],
    overrides: dict[str, Any],
    build: Callable[[], sglang_pb2.GenerateRequest],
    says: str,
) -> None:
    # SGLang's scheduler refuses these with set_finish_with_abort: a clean terminal, status OK.
    engine = await make_engine(**overrides)
    client = grpc_client(engine)
    (msg,) = await grpc_all(client, build())
    reason = json.loads(msg.meta_info["finish_reason"])
    assert msg.finished
    assert not msg.output_ids
    assert (reason["type"], reason["status_code"], reason["err_type"]) == ("abort", 400, "BadRequestError")
    assert says in reason["message"]
    if not overrides:
        await assert_serving(engine, client)


async def test_a_top_n_beyond_the_vocabulary_is_refused_without_stalling_the_engine(
    make_engine: Factory, grpc_client: Callable[[SglangTestEngine], Grpc]
) -> None:
    engine = await make_engine()
    client = grpc_client(engine)
    req = greq("top", 4, return_logprob=True, top_logprobs_num=2**31 - 1)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await grpc_all(client, req)
    assert info.value.code() is grpc.StatusCode.INTERNAL
    await assert_serving(engine, client)


async def test_an_error_inside_the_scheduler_fails_that_request_only(
    make_engine: Factory,
    grpc_client: Callable[[SglangTestEngine], Grpc],
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An exception while generating ends that stream with INTERNAL (HTTP: an error event), as
    SGLang's bridge does; the request leaves the book and the engine keeps serving."""
    from testkit import generator

    real_step = generator.Generator.step

    def step(self: generator.Generator) -> generator.GeneratedToken:
        if self.prompt[0] == 999:
            raise RuntimeError("testkit: boom")
        return real_step(self)

    monkeypatch.setattr(generator.Generator, "step", step)
    engine = await make_engine()
    client = grpc_client(engine)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await grpc_all(client, greq("boom-g", 4, prompt=[999, 101]))
    assert info.value.code() is grpc.StatusCode.INTERNAL
    assert "boom" in (info.value.details() or "")
    events = await http_all(http, engine.http_port, hbody("boom-h", 4, prompt=[999, 101]))
    assert "boom" in events[-1]["error"]["message"]
    assert {r.request_id: r.outcome for r in engine.book.finished if r.request_id.startswith("boom")} == {
        "boom-g": Outcome.ERROR,
        "boom-h": Outcome.ERROR,
    }
    await assert_serving(engine, client)


async def test_token_ids_logprob_is_served_and_checked_on_http(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    engine = await make_engine()
    body = hbody(
        "tid", 2, ignore_eos=True, return_logprob=True, logprob_start_len=0, token_ids_logprob=[7, 5]
    )
    final = (await http_all(http, engine.http_port, body))[-1]["meta_info"]
    out, inp = final["output_token_ids_logprobs"], final["input_token_ids_logprobs"]
    assert len(out) == 2
    assert all([row[1] for row in r] == [7, 5] for r in out)
    assert len(inp) == len(PROMPT)
    assert inp[0] is None
    assert list(final).index("output_token_ids_logprobs") == list(final).index("input_token_ids_logprobs") + 1
    # SGLang's tokenizer manager: after the length checks, in its words (HTTP 400).
    oov = hbody("tid-oov", 2, return_logprob=True, token_ids_logprob=[engine.config.vocab_size])
    oov["stream"] = False
    async with http.post(f"{engine.http_url}/generate", json=oov) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["message"] == (
            f"token_ids_logprob contains out-of-vocabulary token id {engine.config.vocab_size}; "
            f"valid range is [0, {engine.config.vocab_size})."
        )
