"""The HTTP adapter against a scripted SGLang HTTP server on loopback: the wire shapes the
testkit engine does not produce on its own (odd statuses, broken events, long lines, the
deprecated info paths) and the exact abort body."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from sidecar_common.api import sidecar_pb2
from sidecar_common.endpoint import parse_endpoint
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_common.pool import PoolConfig, RetryPolicy
from sidecar_server.config import SidecarConfig
from sidecar_server.engine import GenerateCall
from sidecar_sglang.engine import SglangEngine
from sidecar_sglang.http_transport import over_http

pytestmark = pytest.mark.timeout(30)

SERVER_INFO = {
    "disaggregation_mode": "null",
    "incremental_streaming_output": True,
    "page_size": 1,
    "max_req_input_len": 31,
}


def event(ids: list[int], finish: object = None, **meta: object) -> bytes:
    body = {"text": "", "output_ids": ids, "meta_info": {"finish_reason": finish, "prompt_tokens": 2, **meta}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


@dataclass
class Script:
    """What the fake server answers on /generate, and what it saw."""

    status: int = 200
    chunks: list[bytes] = field(default_factory=list)
    close_early: bool = False
    aborts: list[Any] = field(default_factory=list)
    generate_bodies: list[Any] = field(default_factory=list)
    modern_info_paths: bool = True
    has_model_list: bool = True


def app_for(script: Script) -> web.Application:
    async def generate(request: web.Request) -> web.StreamResponse:
        script.generate_bodies.append(await request.json())
        if script.status != 200:
            return web.json_response({"error": {"message": "refused by script"}}, status=script.status)
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in script.chunks:
            await resp.write(chunk)
        if script.close_early:
            assert request.transport is not None
            request.transport.close()
            return resp
        await resp.write_eof()
        return resp

    async def abort(request: web.Request) -> web.Response:
        script.aborts.append(await request.json())
        return web.Response(status=200)

    def info(payload: object, modern: bool) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.Response:
            if modern != script.modern_info_paths:
                return web.Response(status=404)
            return web.json_response(payload)

        return handler

    app = web.Application()
    app.router.add_get("/health", ok)
    model = {"served_model_name": "m", "model_path": "/m"}
    for path, payload in (("model_info", model), ("server_info", SERVER_INFO)):
        app.router.add_get(f"/{path}", info(payload, True))
        app.router.add_get(f"/get_{path}", info(payload, False))
    if script.has_model_list:
        app.router.add_get("/v1/models", models)
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", abort)
    return app


async def ok(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def models(request: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": "m", "root": "m", "max_model_len": 64}]})


@asynccontextmanager
async def adapter(script: Script) -> AsyncIterator[SglangEngine]:
    runner = web.AppRunner(app_for(script))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    retry = RetryPolicy(attempt_timeout=1.0, max_interval=0.1, initial_interval=0.02)
    pool = PoolConfig(parse_endpoint("127.0.0.1:1"), connections=2, startup_deadline=5.0, retry=retry)
    engine = over_http(SidecarConfig(pool=pool), parse_endpoint(f"http://127.0.0.1:{port}"))
    try:
        await engine.start()
        yield engine
    finally:
        await engine.close()
        await runner.cleanup()


def call(pid: str = "0123-req") -> GenerateCall:
    return GenerateCall(sidecar_pb2.PreprocessedRequest(request_id="req", token_ids=[1, 2]), pid)


async def run(engine: SglangEngine) -> tuple[list[sidecar_pb2.LLMEngineOutput], SidecarError | None]:
    outs: list[sidecar_pb2.LLMEngineOutput] = []
    try:
        async for out in engine.generate(call()):
            outs.append(out)
    except SidecarError as err:
        return outs, err
    return outs, None


async def test_a_normal_stream_and_the_deprecated_info_paths() -> None:
    script = Script(chunks=[event([5]), event([6], "length"), b"data: [DONE]\n\n"], modern_info_paths=False)
    async with adapter(script) as engine:
        assert engine.model_info().served_model_name == "m"
        assert engine.model_info().max_context_length == 64
        outs, err = await run(engine)
    assert err is None
    assert [list(o.token_ids) for o in outs] == [[5], [6]]
    assert outs[-1].finish_reason == sidecar_pb2.LENGTH
    assert script.generate_bodies[0]["rid"] == "0123-req"
    assert script.generate_bodies[0]["stream"] is True


async def test_without_a_model_list_the_context_comes_from_server_info() -> None:
    async with adapter(Script(has_model_list=False)) as engine:
        assert engine.model_info().max_context_length == 32


async def test_a_long_event_split_across_reads() -> None:
    many = list(range(3, 20003))
    lps = [[-0.5, t, None] for t in many]
    raw = event(many, "length", output_token_logprobs=lps)
    script = Script(chunks=[raw[i : i + 1000] for i in range(0, len(raw), 1000)] + [b"data: [DONE]\n\n"])
    async with adapter(script) as engine:
        outs, err = await run(engine)
    assert err is None
    assert list(outs[-1].token_ids) == many


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (400, FailureReason.INVALID_ARGUMENT),
        (404, FailureReason.INVALID_ARGUMENT),
        (401, FailureReason.UNKNOWN),
        (403, FailureReason.UNKNOWN),
        (500, FailureReason.UNKNOWN),
        (502, FailureReason.CANNOT_CONNECT),
        (503, FailureReason.CANNOT_CONNECT),
    ],
)
async def test_http_status_before_the_stream(status: int, reason: FailureReason) -> None:
    async with adapter(Script(status=status)) as engine:
        outs, err = await run(engine)
    assert outs == []
    assert err is not None
    assert err.reason is reason
    assert "refused by script" in err.message


@pytest.mark.parametrize(
    ("chunks", "close_early", "prefix", "reason", "words"),
    [
        ([event([5]), b"data: {not json\n\n"], False, 1, FailureReason.PROTOCOL_ERROR, "not JSON"),
        ([event([5]), b"data: [DONE]\n\n"], False, 1, FailureReason.PROTOCOL_ERROR, "[DONE]"),
        # A connection cut mid-body: the read error is kept as the cause.
        (
            [event([5])],
            True,
            1,
            FailureReason.ENGINE_SHUTDOWN,
            "stream failed before its terminal: ClientPayloadError",
        ),
        ([event([5])], False, 1, FailureReason.ENGINE_SHUTDOWN, "ended"),
        (
            [event([5]), b'data: {"error": {"message": "too long", "code": 400}}\n\ndata: [DONE]\n\n'],
            False,
            1,
            FailureReason.INVALID_ARGUMENT,
            "too long",
        ),
        (
            [event([5]), event([6], {"type": "mystery"})],
            False,
            1,
            FailureReason.PROTOCOL_ERROR,
            "finish_reason",
        ),
    ],
)
async def test_broken_streams_give_the_prefix_then_a_typed_error(
    chunks: list[bytes], close_early: bool, prefix: int, reason: FailureReason, words: str
) -> None:
    async with adapter(Script(chunks=chunks, close_early=close_early)) as engine:
        outs, err = await run(engine)
    assert sum(len(o.token_ids) for o in outs) == prefix
    assert err is not None
    assert err.reason is reason
    assert words in err.message


async def test_abort_names_exactly_the_private_id() -> None:
    script = Script()
    async with adapter(script) as engine:
        await engine.abort("0123-req")
        await engine.abort("")  # never sent: SGLang would match every rid
    assert script.aborts == [{"rid": "0123-req", "abort_all": False}]


async def test_an_abort_we_asked_for_ends_cancelled() -> None:
    abort_event = event([], {"type": "abort", "message": "Abort before prefill"})
    script = Script(chunks=[event([5])])
    async with adapter(script) as engine:
        stream = engine.generate(call())
        first = await anext(stream)
        assert list(first.token_ids) == [5]
        await engine.abort("0123-req")
        script.chunks.append(abort_event)
        with pytest.raises(SidecarError) as info:
            await anext(stream)
        assert info.value.reason is FailureReason.CANCELLED
        await stream.aclose()  # type: ignore[attr-defined]
