"""The testkit SGLang engine's RL surface through real clients (aiohttp, gRPC stubs): pause in
each mode and continue, weight versions (updates, spans on final outputs), flush cache and
routed experts, as SGLang 0.5.23 serves them (docs/testkit.md, "Pause, weights, flush,
routed experts")."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import grpc
import pytest
from testkit.book import Outcome
from testkit.routed_experts import ExpertsShape, routed_experts
from testkit.sglang_engine import SglangTestEngine, flush_failed_after_update
from testkit.sglang_info import SglangEngineConfig

from sidecar_common.api import sglang_pb2, sglang_pb2_grpc

pytestmark = pytest.mark.timeout(30)

Factory = Callable[..., Awaitable[SglangTestEngine]]
PROMPT = [101, 102, 103, 104]
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORTED_WAITING = {"type": "abort", "message": "Abort in waiting queue"}
PAUSED = {"message": "Generation paused successfully.", "status": "ok"}
CONTINUED = {"message": "Generation continued successfully.", "status": "ok"}


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


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


def body(rid: str, max_new: int = 6, *, stream: bool = True, **kw: Any) -> dict[str, Any]:
    return {
        "rid": rid,
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True},
        "stream": stream,
        **kw,
    }


class Stream:
    """One open SSE /generate, read an event at a time."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.events: list[dict[str, Any]] = []

    async def next(self) -> dict[str, Any] | None:
        async for raw in self.resp.content:
            line = raw.decode().strip()
            if not line:
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return None
            event: dict[str, Any] = json.loads(data)
            self.events.append(event)
            return event
        return None

    async def rest(self) -> dict[str, Any]:
        """Every event to the end; the last (the terminal)."""
        while await self.next() is not None:
            pass
        return self.events[-1]


async def open_stream(http: aiohttp.ClientSession, engine: SglangTestEngine, b: dict[str, Any]) -> Stream:
    resp = await http.post(f"{engine.http_url}/generate", json=b)
    assert resp.status == 200
    return Stream(resp)


async def post(http: aiohttp.ClientSession, engine: SglangTestEngine, path: str, b: object = None) -> Any:
    async with http.post(f"{engine.http_url}{path}", json=b) as resp:
        return (
            resp.status,
            await resp.json() if resp.content_type == "application/json" else await resp.text(),
        )


async def get(http: aiohttp.ClientSession, engine: SglangTestEngine, path: str) -> tuple[int, Any]:
    async with http.get(f"{engine.http_url}{path}") as resp:
        return (
            resp.status,
            await resp.json() if resp.content_type == "application/json" else await resp.text(),
        )


async def until(cond: Callable[[], bool], secs: float = 10.0) -> None:
    # The engine's ledger has no change events to wait on; poll it under a deadline.
    async with asyncio.timeout(secs):
        while not cond():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def reference(http: aiohttp.ClientSession, engine: SglangTestEngine, max_new: int) -> list[int]:
    """The tokens an undisturbed request makes (the generator does not depend on the rid)."""
    status, answer = await post(http, engine, "/generate", body("reference", max_new, stream=False))
    assert status == 200
    ids: list[int] = answer["output_ids"]
    return ids


def tokens_made(engine: SglangTestEngine, rid: str) -> int:
    made = engine.output_tokens(rid)
    assert made is not None
    return made


# -- pause: abort -------------------------------------------------------------------------------
async def test_pause_abort_aborts_what_runs_and_holds_new_requests_until_continue(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(token_latency_ms=20)
    running = await open_stream(http, engine, body("run-1", 1000))
    await running.next()
    assert await post(http, engine, "/pause_generation", {"mode": "abort"}) == (200, PAUSED)
    last = await running.rest()
    assert last["meta_info"]["finish_reason"] == ABORTED
    assert last["meta_info"]["weight_versions"] == [
        {"version": "default", "start": 0, "end": last["meta_info"]["completion_tokens"]}
    ]
    assert (await get(http, engine, "/ready"))[0] == 503
    # A request arriving now waits before the scheduler, answered once generation continues.
    held = asyncio.ensure_future(post(http, engine, "/generate", body("new-1", 3, stream=False)))
    await until(lambda: engine.held_count == 1)
    assert engine.book.running_ids() == []
    assert engine.book.waiting_ids() == []
    assert await post(http, engine, "/continue_generation", {}) == (200, CONTINUED)
    status, answer = await held
    assert status == 200
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert (await get(http, engine, "/ready"))[0] == 200


async def test_an_abort_does_not_reach_a_held_request_but_its_client_leaving_drops_it(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(disconnect_abort_delay_secs=0)
    assert (await post(http, engine, "/pause_generation", {"mode": "retract"}))[0] == 200
    kept = asyncio.ensure_future(post(http, engine, "/generate", body("kept", 2, stream=False)))
    left = await http.post(f"{engine.http_url}/generate", json=body("left", 2))
    await until(lambda: engine.held_count == 2)
    # SGLang's scheduler does not know a held request: the abort changes nothing.
    assert (await post(http, engine, "/abort_request", {"rid": "kept"}))[0] == 200
    left.close()
    await until(lambda: engine.book.outcome_of("left") is Outcome.CANCELLED)
    assert engine.held_count == 1
    await post(http, engine, "/continue_generation")
    status, answer = await kept
    assert (status, answer["meta_info"]["finish_reason"]) == (200, {"type": "length", "length": 2})


# -- pause: in place ------------------------------------------------------------------------------
async def test_pause_in_place_keeps_requests_and_their_kv_and_continues_them(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(token_latency_ms=20)
    expected = await reference(http, engine, 12)
    stream = await open_stream(http, engine, body("ip-1", 12))
    await stream.next()
    assert (await post(http, engine, "/pause_generation", {"mode": "in_place"}))[0] == 200
    assert engine.book.running_ids() == ["ip-1"]
    # Its KV stays: a flush is refused while a request runs in place.
    assert await post(http, engine, "/flush_cache") == (400, "Flush cache failed.\n")
    loads = (await get(http, engine, "/v1/loads"))[1]["loads"][0]
    assert (loads["num_running_reqs"], loads["num_waiting_reqs"]) == (1, 0)
    await post(http, engine, "/continue_generation")
    last = await stream.rest()
    assert last["output_ids"] == expected
    assert last["meta_info"]["num_retractions"] == 0


async def test_a_request_aborted_during_an_in_place_pause_ends_on_continue(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(token_latency_ms=20)
    stream = await open_stream(http, engine, body("ip-2", 1000))
    await stream.next()
    await post(http, engine, "/pause_generation", {"mode": "in_place"})
    made = tokens_made(engine, "ip-2")
    await post(http, engine, "/abort_request", {"rid": "ip-2"})
    await post(http, engine, "/continue_generation")
    last = await stream.rest()
    # The step SGLang still runs for an aborted request brings one more token.
    assert last["meta_info"]["finish_reason"] == ABORTED
    assert len(last["output_ids"]) == made + 1


# -- pause: retract -------------------------------------------------------------------------------
async def test_pause_retract_requeues_running_requests_which_recompute_on_continue(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(token_latency_ms=20)
    expected = await reference(http, engine, 10)
    stream = await open_stream(http, engine, body("rt-1", 10))
    await stream.next()
    assert (await post(http, engine, "/pause_generation", {"mode": "retract"}))[0] == 200
    loads = (await get(http, engine, "/v1/loads"))[1]["loads"][0]
    assert (loads["num_running_reqs"], loads["num_waiting_reqs"]) == (0, 1)
    # Retracted requests hold no KV: the cache can be flushed during the pause.
    assert (await post(http, engine, "/flush_cache"))[0] == 200
    await post(http, engine, "/continue_generation")
    last = await stream.rest()
    assert last["output_ids"] == expected
    assert last["meta_info"]["num_retractions"] == 1
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 10}


async def test_a_retracted_request_aborted_during_the_pause_answers_from_the_waiting_queue(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(token_latency_ms=20)
    stream = await open_stream(http, engine, body("rt-2", 1000))
    await stream.next()
    await post(http, engine, "/pause_generation", {"mode": "retract"})
    made = tokens_made(engine, "rt-2")
    await post(http, engine, "/abort_request", {"rid": "rt-2"})
    last = await stream.rest()  # answered at once, while still paused
    assert engine.pause_mode == "retract"
    meta = last["meta_info"]
    assert meta["finish_reason"] == ABORTED_WAITING
    assert len(last["output_ids"]) == meta["completion_tokens"] == made
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": made}]
    await post(http, engine, "/continue_generation")


# -- weight versions ------------------------------------------------------------------------------
async def test_a_request_across_an_update_labels_its_tokens_by_the_weights_that_made_them(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(token_latency_ms=20)
    stream = await open_stream(http, engine, body("wv-1", 10))
    await stream.next()
    await post(http, engine, "/pause_generation", {"mode": "in_place"})
    before = tokens_made(engine, "wv-1")
    status, answer = await post(
        http,
        engine,
        "/update_weights_from_disk",
        {"model_path": "/ckpt/step-1", "weight_version": "step-1", "flush_cache": False},
    )
    assert (status, answer) == (
        200,
        {
            "success": True,
            "message": "Succeeded to update model weights. Weight version updated to step-1.",
            "num_paused_requests": 0,
        },
    )
    info = (await get(http, engine, "/model_info"))[1]
    # SGLang reports an update's model path as the model's path and served name.
    assert (info["weight_version"], info["model_path"], info["served_model_name"]) == (
        "step-1",
        "/ckpt/step-1",
        "/ckpt/step-1",
    )
    await post(http, engine, "/continue_generation")
    last = await stream.rest()
    meta = last["meta_info"]
    assert meta["weight_versions"] == [
        {"version": "default", "start": 0, "end": before},
        {"version": "step-1", "start": before, "end": 10},
    ]
    assert meta["weight_version"] == "step-1"
    # Unfinished outputs say the version then in force, and carry no spans.
    said = [e["meta_info"]["weight_version"] for e in stream.events[:-1]]
    assert said[0] == "default"
    assert said[-1] == "step-1"
    assert all("weight_versions" not in e["meta_info"] for e in stream.events[:-1])


async def test_an_update_whose_flush_fails_fails_but_the_scheduler_takes_its_version(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(token_latency_ms=20)
    stream = await open_stream(http, engine, body("wv-2", 8))
    await stream.next()
    await post(http, engine, "/pause_generation", {"mode": "in_place"})
    before = tokens_made(engine, "wv-2")
    status, answer = await post(
        http, engine, "/update_weights_from_disk", {"model_path": "/ckpt/2", "weight_version": "v2"}
    )
    assert (status, answer) == (
        400,
        {"success": False, "message": flush_failed_after_update, "num_paused_requests": 0},
    )
    assert (await get(http, engine, "/model_info"))[1]["weight_version"] == "default"
    await post(http, engine, "/continue_generation")
    meta = (await stream.rest())["meta_info"]
    assert [s["version"] for s in meta["weight_versions"]] == ["default", "v2"]
    assert meta["weight_versions"][0]["end"] == before


async def test_an_unpaused_update_waits_for_requests_in_flight_and_holds_new_ones(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(token_latency_ms=20)
    stream = await open_stream(http, engine, body("up-1", 1000))
    await stream.next()
    update = asyncio.ensure_future(
        post(http, engine, "/update_weights_from_disk", {"model_path": "/ckpt/3", "weight_version": "v3"})
    )
    await until(lambda: engine.holding)
    later = asyncio.ensure_future(post(http, engine, "/generate", body("up-2", 4, stream=False)))
    await until(lambda: engine.held_count == 1)
    assert not update.done()
    await post(http, engine, "/abort_request", {"rid": "up-1"})
    assert (await update)[0] == 200
    first = await stream.rest()
    assert {s["version"] for s in first["meta_info"]["weight_versions"]} == {"default"}
    status, answer = await later
    assert status == 200
    assert answer["meta_info"]["weight_versions"] == [{"version": "v3", "start": 0, "end": 4}]


async def test_update_weight_version_aborts_by_default_or_splits_running_requests(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(token_latency_ms=20)
    stream = await open_stream(http, engine, body("uv-1", 1000))
    await stream.next()
    assert await post(http, engine, "/update_weight_version", {"new_version": "v4"}) == (
        200,
        {"success": True, "message": "Weight version updated to v4", "new_version": "v4"},
    )
    assert (await stream.rest())["meta_info"]["finish_reason"] == ABORTED
    assert (await get(http, engine, "/model_info"))[1]["weight_version"] == "v4"

    stream = await open_stream(http, engine, body("uv-2", 8))
    await stream.next()
    await post(http, engine, "/pause_generation", {"mode": "in_place"})
    before = tokens_made(engine, "uv-2")
    await post(http, engine, "/update_weight_version", {"new_version": "v5", "abort_all_requests": False})
    await post(http, engine, "/continue_generation")
    meta = (await stream.rest())["meta_info"]
    assert meta["weight_versions"] == [
        {"version": "v4", "start": 0, "end": before},
        {"version": "v5", "start": before, "end": 8},
    ]


async def test_the_launch_version_is_reported_everywhere(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(weight_version="run-7")
    assert (await get(http, engine, "/model_info"))[1]["weight_version"] == "run-7"
    status, answer = await post(http, engine, "/generate", body("lv-1", 3, stream=False))
    assert status == 200
    assert answer["meta_info"]["weight_version"] == "run-7"
    assert answer["meta_info"]["weight_versions"] == [{"version": "run-7", "start": 0, "end": 3}]


# -- flush cache ----------------------------------------------------------------------------------
async def test_flush_cache_empties_the_prefix_cache(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    engine = await make_engine()

    async def cached(rid: str) -> int:
        answer = (await post(http, engine, "/generate", body(rid, 2, stream=False)))[1]
        hits: int = answer["meta_info"]["cached_tokens"]
        return hits

    assert await cached("fl-1") == 0
    assert await cached("fl-2") == len(PROMPT) - 1  # the last prompt token is always computed
    assert (await post(http, engine, "/flush_cache"))[0] == 200
    assert await cached("fl-3") == 0


# -- health ---------------------------------------------------------------------------------------
async def test_health_fails_while_paused_and_ready_says_paused(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(health_check_timeout_secs=0.2)
    assert (await get(http, engine, "/health"))[0] == 200
    await post(http, engine, "/pause_generation", {"mode": "in_place"})
    # SGLang's probe is a one-token generation, held like any other until its timeout.
    assert (await get(http, engine, "/health_generate"))[0] == 503
    assert (await get(http, engine, "/ready"))[0] == 503
    await post(http, engine, "/continue_generation")
    assert (await get(http, engine, "/health"))[0] == 200
    assert (await get(http, engine, "/ready"))[0] == 200


async def test_admin_bodies_are_checked(make_engine: Factory, http: aiohttp.ClientSession) -> None:
    engine = await make_engine()
    assert (await post(http, engine, "/pause_generation", {"mode": "sleep"}))[0] == 400
    assert (await post(http, engine, "/update_weights_from_disk", {"weight_version": "x"}))[0] == 400
    assert (await post(http, engine, "/update_weight_version", {}))[0] == 400
    assert engine.pause_mode is None


# -- routed experts -------------------------------------------------------------------------------
SHAPE = ExpertsShape(num_layers=3, top_k=2, num_experts=16)


def decode(text: str) -> list[list[list[int]]]:
    raw = base64.b64decode(text)
    flat = struct.unpack(f"<{len(raw) // 4}i", raw)
    k, layers = SHAPE.top_k, SHAPE.num_layers
    return [
        [list(flat[r + layer * k : r + (layer + 1) * k]) for layer in range(layers)]
        for r in range(0, len(flat), layers * k)
    ]


@pytest.mark.parametrize("start", [0, 2, 4])
async def test_routed_experts_cover_the_sequence_from_the_start_asked(
    make_engine: Factory, http: aiohttp.ClientSession, start: int
) -> None:
    engine = await make_engine(
        enable_return_routed_experts=True, num_hidden_layers=3, num_experts_per_tok=2, num_experts=16
    )
    asked = body("re-1", 5, stream=False, return_routed_experts=True, routed_experts_start_len=start)
    answer = (await post(http, engine, "/generate", asked))[1]
    rows = decode(answer["meta_info"]["routed_experts"])
    assert len(rows) == len(PROMPT) + 5 - 1 - start
    assert all(len(row) == 3 and all(len(set(layer)) == 2 for layer in row) for row in rows)
    assert rows == routed_experts(PROMPT + answer["output_ids"], start, SHAPE)
    again = (await post(http, engine, "/generate", {**asked, "rid": "re-2"}))[1]
    assert again["meta_info"]["routed_experts"] == answer["meta_info"]["routed_experts"]


async def test_routed_experts_ride_on_the_final_output_only_and_only_when_served(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    served = await make_engine(enable_return_routed_experts=True)
    stream = await open_stream(http, served, body("re-3", 4, return_routed_experts=True))
    last = await stream.rest()
    assert "routed_experts" in last["meta_info"]
    assert all("routed_experts" not in e["meta_info"] for e in stream.events[:-1])
    plain = await make_engine()
    answer = (
        await post(http, plain, "/generate", body("re-4", 4, stream=False, return_routed_experts=True))
    )[1]
    assert "routed_experts" not in answer["meta_info"]


async def test_a_start_past_the_prompt_is_the_schedulers_400_abort(
    make_engine: Factory, http: aiohttp.ClientSession
) -> None:
    engine = await make_engine(enable_return_routed_experts=True)
    b = body("re-5", 4, return_routed_experts=True, routed_experts_start_len=len(PROMPT) + 1)
    last = await (await open_stream(http, engine, b)).rest()
    assert last["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "recv_req.routed_experts_start_len=5 is higher than the number of input tokens "
        "len(req.origin_input_ids)=4. Please use a smaller routed_experts_start_len.",
        "status_code": 400,
        "err_type": "BadRequestError",
    }


# -- gRPC -----------------------------------------------------------------------------------------
@pytest.fixture
async def stub() -> AsyncIterator[Callable[[SglangTestEngine], Any]]:
    channels: list[grpc.aio.Channel] = []

    def make(engine: SglangTestEngine) -> Any:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{engine.grpc_port}")
        channels.append(channel)
        return sglang_pb2_grpc.SglangServiceStub(channel)

    yield make
    for channel in channels:
        await channel.close(None)


def greq(rid: str, max_new: int) -> sglang_pb2.GenerateRequest:
    sp = sglang_pb2.SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    return sglang_pb2.GenerateRequest(input_ids=PROMPT, sampling_params=sp, stream=True, rid=rid)


def meta(msg: sglang_pb2.GenerateResponse) -> dict[str, Any]:
    return {k: json.loads(v) for k, v in msg.meta_info.items()}


async def drain(call: Any) -> list[sglang_pb2.GenerateResponse]:
    """The rest of a call already read with ``read()`` (the iterator API may not be mixed in)."""
    out: list[sglang_pb2.GenerateResponse] = []
    while (msg := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
        out.append(msg)
    return out


async def test_grpc_pause_continue_and_spans(
    make_engine: Factory, stub: Callable[[SglangTestEngine], Any]
) -> None:
    engine = await make_engine(token_latency_ms=20)
    client = stub(engine)
    call = client.Generate(greq("g-1", 1000), timeout=20)
    await call.read()
    paused = await client.PauseGeneration(sglang_pb2.PauseGenerationRequest(mode="abort"), timeout=10)
    assert paused.message == "Generation paused (mode=abort)."
    last = (await drain(call))[-1]
    assert meta(last)["finish_reason"] == ABORTED
    assert meta(last)["weight_versions"][0]["version"] == "default"
    held = client.Generate(greq("g-2", 3), timeout=20)
    await until(lambda: engine.held_count == 1)
    flushed = await client.FlushCache(sglang_pb2.FlushCacheRequest(), timeout=10)
    assert (flushed.success, flushed.message) == (True, "Cache flushed.")
    updated = await client.UpdateWeightsFromDisk(
        sglang_pb2.UpdateWeightsRequest(model_path="/ckpt/g"), timeout=10
    )
    assert (updated.success, updated.message) == (True, "Succeeded to update model weights.")
    info = json.loads((await client.GetModelInfo(sglang_pb2.GetModelInfoRequest(), timeout=10)).json_info)
    # This wire's update carries no version: it stays.
    assert (info["model_path"], info["weight_version"]) == ("/ckpt/g", "default")
    resumed = await client.ContinueGeneration(sglang_pb2.ContinueGenerationRequest(), timeout=10)
    assert resumed.message == "Generation continued."
    msgs = [m async for m in held]
    assert meta(msgs[-1])["weight_versions"] == [{"version": "default", "start": 0, "end": 3}]


async def test_grpc_pause_mode_is_checked_and_a_cancelled_held_request_is_dropped(
    make_engine: Factory, stub: Callable[[SglangTestEngine], Any]
) -> None:
    engine = await make_engine()
    client = stub(engine)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.PauseGeneration(sglang_pb2.PauseGenerationRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await client.PauseGeneration(sglang_pb2.PauseGenerationRequest(mode="in_place"), timeout=10)
    call = client.Generate(greq("g-3", 3), timeout=20)
    await until(lambda: engine.held_count == 1)
    call.cancel()
    await until(lambda: engine.book.outcome_of("g-3") is Outcome.CANCELLED)
    assert engine.held_count == 0
    await client.ContinueGeneration(sglang_pb2.ContinueGenerationRequest(), timeout=10)
