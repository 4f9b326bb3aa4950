"""The testkit vLLM engine's RL surface: vLLM's /pause (abort, wait, keep), /resume,
/is_paused and weight-version routes on the admin HTTP port (aiohttp), and what the gRPC wire
shows of them (a raw VllmEngine stub): refusals while paused, GetServerInfo.is_paused,
FlushCache (docs/testkit.md, "Pause, weights, flush, routed experts")."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc
from testkit.__main__ import add_vllm_arguments, vllm_config_from_args
from testkit.book import Outcome
from testkit.generator import ModelSpec, SamplingSpec, generate
from testkit.vllm_engine import PAUSED_MESSAGE, VllmEngineConfig, VllmTestEngine
from testkit.weight_versions import WeightVersionSpan

from sidecar_common.flags import FlagParser

pytestmark = pytest.mark.timeout(30)

PROMPT = [101, 202, 303, 404, 505, 606, 707, 808, 909]
Msgs = list[pb.GenerateResponse]


@dataclass
class Served:
    engine: VllmTestEngine
    stub: pb_grpc.VllmEngineStub
    http: aiohttp.ClientSession

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.engine.admin_port}"

    async def post(self, path: str, body: object = None, **query: str) -> tuple[int, Any]:
        async with self.http.post(f"{self.admin}{path}", json=body, params=query) as resp:
            return resp.status, await resp.json()

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.http.get(f"{self.admin}{path}") as resp:
            return resp.status, await resp.json()

    async def server_info(self) -> pb.GetServerInfoResponse:
        return await self.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


@asynccontextmanager
async def serve(**kw: Any) -> AsyncIterator[Served]:
    engine = VllmTestEngine(VllmEngineConfig(admin_port=0, **kw))
    port = await engine.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            yield Served(engine, pb_grpc.VllmEngineStub(channel), http)
    finally:
        await channel.close(None)
        await engine.stop(0)


def request(rid: str, max_tokens: int, prompt: list[int] | None = None) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=PROMPT if prompt is None else prompt),
        sampling_params=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        stream=True,
    )


async def read_rest(call: Any) -> Msgs:
    out: Msgs = []
    while (m := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
        out.append(m)
    return out


def completes(msgs: Msgs) -> list[pb.GenerateComplete]:
    return [m.complete for m in msgs if m.WhichOneof("response") == "complete"]


def ids_of(msgs: Msgs) -> list[int]:
    return [t for m in msgs if m.WhichOneof("response") == "chunk" for t in m.chunk.token_ids]


async def until(cond: Callable[[], bool], secs: float = 10.0) -> None:
    # The engine's ledger has no change events to wait on; poll it under a deadline.
    async with asyncio.timeout(secs):
        while not cond():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def refused_while_paused(s: Served, rid: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await read_rest(s.stub.Generate(request(rid, 2), timeout=10))
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INTERNAL, PAUSED_MESSAGE)


async def test_pause_abort_ends_every_request_and_refuses_new_ones_until_resume() -> None:
    async with serve(token_latency_ms=20) as s:
        call = s.stub.Generate(request("ab-1", 1000), timeout=20)
        await call.read()
        assert await s.post("/pause", mode="abort") == (200, {"status": "paused"})
        assert completes(await read_rest(call))[-1].finish_reason == "abort"
        assert await s.get("/is_paused") == (200, {"is_paused": True})
        assert (await s.server_info()).is_paused
        await refused_while_paused(s, "ab-2")
        assert await s.post("/resume") == (200, {"status": "resumed"})
        assert not (await s.server_info()).is_paused
        msgs = await read_rest(s.stub.Generate(request("ab-3", 3), timeout=10))
        assert completes(msgs)[-1].finish_reason == "length"


async def test_pause_wait_lets_running_requests_finish_and_keeps_queued_ones_queued() -> None:
    async with serve(token_latency_ms=20, max_num_seqs=1) as s:
        running = s.stub.Generate(request("wt-1", 8), timeout=20)
        await running.read()
        queued = s.stub.Generate(request("wt-2", 3), timeout=20)
        await until(lambda: s.engine.book.waiting_ids() == ["wt-2"])
        assert await s.post("/pause", mode="wait") == (200, {"status": "paused"})
        # The pause returned once the running request had finished, in full.
        assert s.engine.book.outcome_of("wt-1") is Outcome.FINISHED
        assert completes(await read_rest(running))[-1].finish_reason == "length"
        assert s.engine.book.waiting_ids() == ["wt-2"]
        await refused_while_paused(s, "wt-3")
        await s.post("/resume")
        assert completes(await read_rest(queued))[-1].finish_reason == "length"


async def test_pause_keep_freezes_requests_accepts_new_ones_and_resumes_them_all() -> None:
    async with serve(token_latency_ms=20) as s:
        expected = [
            t.token_id for t in generate(ModelSpec(), PROMPT, SamplingSpec(max_tokens=10, ignore_eos=True))
        ]
        frozen = s.stub.Generate(request("kp-1", 10), timeout=20)
        first = [await frozen.read()]
        assert await s.post("/pause", mode="keep") == (200, {"status": "paused"})
        later = s.stub.Generate(request("kp-2", 10), timeout=20)
        await until(lambda: s.engine.book.waiting_ids() == ["kp-2"])
        # The frozen request keeps its KV blocks: the prefix cache cannot be reset.
        flush = await s.stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=10)
        assert not flush.success
        await s.post("/resume")
        assert ids_of(first + await read_rest(frozen)) == expected
        assert ids_of(await read_rest(later)) == expected


async def test_an_abort_during_a_keep_pause_ends_the_request_at_once() -> None:
    async with serve(token_latency_ms=20) as s:
        call = s.stub.Generate(request("kp-3", 1000), timeout=20)
        await call.read()
        await s.post("/pause", mode="keep")
        await s.stub.Abort(pb.AbortRequest(request_ids=["kp-3"]), timeout=10)
        assert completes(await read_rest(call))[-1].finish_reason == "abort"
        assert s.engine.is_paused
        await s.post("/resume")


@pytest.mark.parametrize(("clear", "cached"), [("true", 0), ("false", 8)])
async def test_a_pause_clears_the_prefix_cache_unless_asked_not_to(clear: str, cached: int) -> None:
    async with serve(block_size=4) as s:
        await read_rest(s.stub.Generate(request("cc-1", 2), timeout=10))
        await s.post("/pause", mode="abort", clear_cache=clear)
        await s.post("/resume")
        msgs = await read_rest(s.stub.Generate(request("cc-2", 2), timeout=10))
        assert completes(msgs)[-1].cached_tokens == cached


async def test_weight_versions_label_each_requests_tokens() -> None:
    async with serve(token_latency_ms=20) as s:
        assert await s.get("/weight_info") == (200, {"weight_version": "default"})
        call = s.stub.Generate(request("wv-1", 10), timeout=20)
        await call.read()
        await s.post("/pause", mode="keep")
        before = s.engine.book.held_tokens("wv-1")
        assert before is not None
        made = before - len(PROMPT)
        assert await s.post("/update_weight_version", {"new_version": "v1"}) == (
            200,
            {"success": True, "new_version": "v1"},
        )
        await s.post("/resume")
        await read_rest(call)
        assert s.engine.weight_versions_of("wv-1") == [
            [WeightVersionSpan("default", 0, made), WeightVersionSpan("v1", made, 10)]
        ]
        # A weight update's finish sets the version it names, and only then.
        assert (await s.post("/start_weight_update"))[0] == 200
        assert (await s.post("/update_weights", {"update_info": {"names": []}}))[0] == 200
        assert (await s.post("/finish_weight_update", {}))[0] == 200
        assert (await s.get("/weight_info"))[1] == {"weight_version": "v1"}
        await s.post("/finish_weight_update", {"weight_version": "v2"})
        assert (await s.get("/weight_info"))[1] == {"weight_version": "v2"}
        await read_rest(s.stub.Generate(request("wv-2", 3), timeout=10))
        assert s.engine.weight_versions_of("wv-2") == [[WeightVersionSpan("v2", 0, 3)]]


async def test_only_the_newest_ended_requests_spans_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    # Kept for every request, they grew the heap each of the engine's full collections walks
    # (25-32 ms pauses mid-run in bench.overload, every stream on the engine held up).
    monkeypatch.setattr("testkit.vllm_engine.KEPT_SPANS", 2)
    async with serve() as s:
        for rid in ("a", "b", "c"):
            await read_rest(s.stub.Generate(request(rid, 2), timeout=20))
        assert s.engine.weight_versions_of("a") is None
        assert s.engine.weight_versions_of("b") == [[WeightVersionSpan("default", 0, 2)]]
        assert s.engine.weight_versions_of("c") == [[WeightVersionSpan("default", 0, 2)]]


async def test_admin_parameters_are_checked() -> None:
    async with serve() as s:
        status, answer = await s.post("/pause", mode="sleep")
        assert (status, answer["error"]["param"], answer["error"]["code"]) == (400, "mode", 400)
        assert (await s.post("/update_weight_version", {}))[0] == 400
        assert not s.engine.is_paused


def test_admin_listen_flag() -> None:
    parser = FlagParser(prog="testkit-engine vllm")
    add_vllm_arguments(parser)
    assert vllm_config_from_args(parser.parse_args([])).admin_port is None
    config = vllm_config_from_args(parser.parse_args(["--admin-listen", "127.0.0.1:0"]))
    assert (config.admin_host, config.admin_port) == ("127.0.0.1", 0)
