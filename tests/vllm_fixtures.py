"""Helpers for the vLLM tests: engine messages in the servicer's shape, and a running stack.

``servicer_stream`` reproduces what ``smg_grpc_servicer.vllm.servicer`` sends in streaming
mode: one chunk per engine step with that step's new tokens (counts per message), and after
the finishing step a ``complete`` whose ``output_ids`` restate that final delta.

``vllm_stack`` runs the testkit vLLM engine, a ``VllmEngine`` and a ``SidecarServer`` on
loopback in-process, and yields a public-API client; everything is torn down on exit.
(Plain async context managers: a non-root conftest cannot register fixture plugins.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeAlias

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2
from testkit.vllm_engine import VllmEngineConfig, VllmTestEngine

from sidecar_common.api import sidecar_pb2_grpc
from sidecar_common.disaggregation import DisaggregationMode
from sidecar_common.endpoint import parse_endpoint
from sidecar_common.pool import PoolConfig, RetryPolicy
from sidecar_common.tracing import Tracing
from sidecar_server.config import SidecarConfig
from sidecar_server.server import ServerConfig, SidecarServer
from sidecar_vllm.engine import VllmEngine
from tests.e2e_helpers import public_request

__all__ = [
    "Stack",
    "chunk",
    "complete",
    "output_logprobs",
    "public_request",
    "servicer_stream",
    "sidecar_config",
    "vllm_stack",
]

Resp: TypeAlias = vllm_engine_pb2.GenerateResponse


def output_logprobs(
    ids: Sequence[int], values: Sequence[float], tops: Sequence[Sequence[tuple[int, float]]] | None = None
) -> vllm_engine_pb2.OutputLogProbs:
    lp = vllm_engine_pb2.OutputLogProbs(token_ids=ids, token_logprobs=values)
    for top in tops or ():
        lp.top_logprobs.add(token_ids=[t for t, _ in top], values=[v for _, v in top])
    return lp


def chunk(
    ids: Sequence[int],
    index: int = 0,
    *,
    prompt: int = 3,
    cached: int = 0,
    logprobs: vllm_engine_pb2.OutputLogProbs | None = None,
    input_logprobs: vllm_engine_pb2.InputLogProbs | None = None,
) -> Resp:
    c = vllm_engine_pb2.GenerateStreamChunk(
        token_ids=ids, prompt_tokens=prompt, completion_tokens=len(ids), cached_tokens=cached, index=index
    )
    if logprobs is not None:
        c.output_logprobs.CopyFrom(logprobs)
    if input_logprobs is not None:
        c.input_logprobs.CopyFrom(input_logprobs)
    return Resp(chunk=c)


def complete(
    ids: Sequence[int],
    reason: str = "length",
    index: int = 0,
    *,
    prompt: int = 3,
    cached: int = 0,
    matched_token: int | None = None,
    matched_str: str | None = None,
    kv_json: str | None = None,
    logprobs: vllm_engine_pb2.OutputLogProbs | None = None,
) -> Resp:
    c = vllm_engine_pb2.GenerateComplete(
        output_ids=ids,
        finish_reason=reason,
        prompt_tokens=prompt,
        completion_tokens=len(ids),
        cached_tokens=cached,
        index=index,
    )
    if matched_token is not None:
        c.matched_token_id = matched_token
    if matched_str is not None:
        c.matched_stop_str = matched_str
    if kv_json is not None:
        c.kv_transfer_params_json = kv_json
    if logprobs is not None:
        c.output_logprobs.CopyFrom(logprobs)
    return Resp(complete=c)


def servicer_stream(deltas: Sequence[Sequence[int]], reason: str = "length", index: int = 0) -> list[Resp]:
    """One choice's messages as the real servicer streams them."""
    if not deltas:
        deltas = [[]]
    msgs = [chunk(d, index) for d in deltas]
    msgs.append(complete(deltas[-1], reason, index))
    return msgs


def sidecar_config(
    port: int, mode: DisaggregationMode = "agg", *, deadline: float = 10.0, connections: int = 2
) -> SidecarConfig:
    retry = RetryPolicy(attempt_timeout=1.0, max_interval=0.1, initial_interval=0.02)
    pool = PoolConfig(
        parse_endpoint(f"127.0.0.1:{port}"), connections=connections, startup_deadline=deadline, retry=retry
    )
    return SidecarConfig(pool=pool, listen="127.0.0.1:0", disaggregation_mode=mode)


@dataclass
class Stack:
    engine: VllmTestEngine
    adapter: VllmEngine
    server: SidecarServer
    stub: Any  # sidecar_pb2_grpc.WorkerStub (its async face is typing-only)


@asynccontextmanager
async def vllm_stack(
    engine: VllmTestEngine | None = None,
    mode: DisaggregationMode = "agg",
    *,
    drain_timeout: float = 30.0,
    tracing: Tracing | None = None,
    pending_calls: tuple[int, int] | None = None,
    **engine_config: Any,
) -> AsyncIterator[Stack]:
    """A testkit engine (``engine`` or one built from ``engine_config``), adapter and server."""
    if engine is None:
        engine = VllmTestEngine(VllmEngineConfig(**engine_config))
    port = await engine.start()
    adapter = VllmEngine(sidecar_config(port, mode))
    server = SidecarServer(
        adapter,
        ServerConfig(
            listen="127.0.0.1:0",
            drain_timeout=drain_timeout,
            hold_decode_cancels=mode == "decode",
            health_watch_interval=0.2,
            pending_calls=pending_calls,
        ),
        tracing=tracing,
    )
    channel: grpc.aio.Channel | None = None
    try:
        await adapter.start()
        await server.start()
        server.set_serving()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        yield Stack(engine, adapter, server, sidecar_pb2_grpc.WorkerStub(channel))
    finally:
        if channel is not None:
            await channel.close(None)
        await server.stop()
        await adapter.close()
        await engine.stop(0)
