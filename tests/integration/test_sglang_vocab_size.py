"""``--vocab-size``: SGLang reports its vocabulary size on none of its info calls, and its default
servers never check a prompt's ids against it (the id reaches the model). Given by the operator,
the SGLang sidecar checks the ids before any engine call, refuses one outside in SGLang's words
(its Rust HTTP server's sentence), and reports the size to the frontend in ModelInfo."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from testkit.sglang_engine import SglangTestEngine
from testkit.sglang_info import SglangEngineConfig

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_common.endpoint import parse_endpoint
from sidecar_server.cli import parse_config
from sidecar_server.server import ServerConfig, SidecarServer
from sidecar_sglang.__main__ import SPEC, build
from sidecar_sglang.engine import SglangEngine
from sidecar_sglang.grpc_transport import over_grpc
from sidecar_sglang.http_transport import over_http
from tests.e2e_helpers import public_request
from tests.sglang_fixtures import sidecar_config

pytestmark = pytest.mark.timeout(60)


@asynccontextmanager
async def _stack(transport: str, vocab_size: int | None) -> AsyncIterator[tuple[SglangTestEngine, Any]]:
    engine = SglangTestEngine(SglangEngineConfig())
    await engine.start()
    config = sidecar_config(engine.grpc_port or 1, "agg")
    if transport == "grpc":
        adapter = over_grpc(config, vocab_size=vocab_size)
    else:
        adapter = over_http(config, parse_endpoint(f"127.0.0.1:{engine.http_port}"), vocab_size=vocab_size)
    server = SidecarServer(adapter, ServerConfig(listen="127.0.0.1:0"))
    channel: grpc.aio.Channel | None = None
    try:
        await adapter.start()
        await server.start()
        server.set_serving()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        yield engine, sidecar_pb2_grpc.WorkerStub(channel)
    finally:
        if channel is not None:
            await channel.close(None)
        await server.stop()
        await adapter.close()
        await engine.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["grpc", "http"])
async def test_an_id_outside_the_vocabulary_is_refused_before_the_engine(transport: str) -> None:
    async with _stack(transport, 32000) as (engine, stub):
        info = await stub.GetModelInfo(sidecar_pb2.GetModelInfoRequest(), timeout=10)
        assert info.vocab_size == 32000
        before = len(engine.book.received)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stub.Generate(public_request(token_ids=[5, 32000, 40000]), timeout=10):
                pass
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == (
            "input_ids contains out-of-vocabulary token id 32000; valid range is [0, 32000)."
        )
        assert len(engine.book.received) == before, "the engine saw the request"
        served = [out async for out in stub.Generate(public_request(token_ids=[5, 31999]), timeout=10)]
        assert served[-1].finish_reason == sidecar_pb2.LENGTH


@pytest.mark.asyncio
async def test_without_it_nothing_is_reported_or_checked_here() -> None:
    async with _stack("grpc", None) as (engine, stub):
        info = await stub.GetModelInfo(sidecar_pb2.GetModelInfoRequest(), timeout=10)
        assert info.vocab_size == 0
        before = len(engine.book.received)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stub.Generate(public_request(token_ids=[32000]), timeout=10):
                pass
        # The engine's own refusal, read as the client's mistake.
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(engine.book.received) > before


@pytest.mark.parametrize("transport", [[], ["--transport", "http", "--http-endpoint", "127.0.0.1:30000"]])
def test_the_flag_reaches_the_engine(transport: list[str]) -> None:
    argv = transport or ["--grpc-endpoint", "127.0.0.1:30001"]
    config, ns = parse_config(SPEC, [*argv, "--vocab-size", "151936"], {}, log_format_default="json")
    assert ns.vocab_size == 151936
    engine = build(config, ns)
    assert isinstance(engine, SglangEngine)
    assert engine.vocab_size == 151936
    config, ns = parse_config(SPEC, argv, {}, log_format_default="json")
    engine = build(config, ns)
    assert isinstance(engine, SglangEngine)
    assert engine.vocab_size is None


@pytest.mark.parametrize("value", ["0", "-5", "x"])
def test_a_vocabulary_size_below_one_is_a_usage_error(value: str) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_config(
            SPEC, ["--grpc-endpoint", "127.0.0.1:30001", "--vocab-size", value], {}, log_format_default="json"
        )
    assert exc.value.code == 2
