"""SGLang's native gRPC service (``sglang.runtime.v1.SglangService``) as a transport.

I/O and framing only: the request goes out as :func:`~sidecar_sglang.convert_request.to_grpc`
builds it, replies come back as JSON (the info calls) or as :class:`NativeEvent` decoded from
the wire bytes (:mod:`sidecar_sglang.grpc_events`). The rules are :class:`SglangEngine`'s.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Final

import grpc

from sidecar_common.api import sglang_pb2, sglang_pb2_grpc
from sidecar_common.errors import protocol_error, rpc_status
from sidecar_common.pool import Clock, Connector, Deadline, is_transient
from sidecar_common.rpc import NotHealthy
from sidecar_common.tracing import outgoing_headers
from sidecar_server.config import SidecarConfig
from sidecar_server.engine import EngineHealth, FlushOutcome
from sidecar_server.engine_client import EngineTimeouts
from sidecar_server.engine_grpc import EngineChannels
from sidecar_server.engine_state import EngineStatus, weight_version_of
from sidecar_sglang.convert_request import NativeRequest, Transport, to_grpc
from sidecar_sglang.convert_response import NativeEvent
from sidecar_sglang.engine import SglangEngine, random_room
from sidecar_sglang.grpc_events import GrpcEventDecoder
from sidecar_sglang.refusals import generate_error
from sidecar_sglang.transport import EngineFacts, StreamCut

__all__ = ["GrpcTransport", "over_grpc"]

_GENERATE: Final = "/sglang.runtime.v1.SglangService/Generate"
# Requests serialized, replies left as bytes.
_RawGenerate = grpc.aio.UnaryStreamMultiCallable[sglang_pb2.GenerateRequest, bytes]


def over_grpc(
    config: SidecarConfig,
    *,
    clock: Clock | None = None,
    connector: Connector | None = None,
    room: Callable[[], int] = random_room,
    timeouts: EngineTimeouts | None = None,
    vocab_size: int | None = None,
) -> SglangEngine:
    """The SGLang engine started with ``--grpc-port``, behind ``config.pool``."""
    return SglangEngine(
        config,
        GrpcTransport(config, clock=clock, connector=connector),
        room=room,
        timeouts=timeouts,
        vocab_size=vocab_size,
    )


def _json(rpc: str, text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        raise protocol_error("sglang", f"{rpc} json_info is not JSON") from None


def _object(rpc: str, value: object) -> dict[str, object]:
    if not isinstance(value, dict):
        raise protocol_error("sglang", f"{rpc} json_info is not a JSON object")
    return value


class GrpcTransport:
    """SGLang's gRPC service over ``config.pool``'s channels."""

    def __init__(
        self, config: SidecarConfig, *, clock: Clock | None = None, connector: Connector | None = None
    ) -> None:
        self._channels: EngineChannels[sglang_pb2_grpc.SglangServiceAsyncStub] = EngineChannels(
            config.pool, sglang_pb2_grpc.SglangServiceStub, clock=clock, connector=connector
        )
        # Generate's replies stay wire bytes: grpc_events reads only what it needs of them.
        self._generate = self._channels.stubs(
            lambda channel: channel.unary_stream(
                _GENERATE,
                request_serializer=sglang_pb2.GenerateRequest.SerializeToString,
                response_deserializer=None,
            )
        )
        self.clock = self._channels.clock
        self.target = self._channels.target
        self.host = config.pool.endpoint.host

    kind: Transport = "grpc"
    health_call = "HealthCheck"
    # A gRPC call starts lazily: the first event is the first sign of admission.
    handoff_on_admission = False

    def is_starting(self, error: BaseException) -> bool:
        return is_transient(error)

    async def connect(self, deadline: Deadline) -> None:
        await self._channels.connect(deadline)

    async def check_health(self, timeout: float) -> None:
        reply = await self._channels.stub().HealthCheck(sglang_pb2.HealthCheckRequest(), timeout=timeout)
        if not reply.healthy:
            raise NotHealthy("engine reports not healthy")

    async def probe_health(self, timeout: float) -> EngineHealth:
        return await self._channels.probe(self.check_health, timeout)

    async def engine_facts(self, deadline: Deadline) -> EngineFacts:
        channels = self._channels
        model = await channels.discover(
            "GetModelInfo", deadline, lambda s, t: s.GetModelInfo(sglang_pb2.GetModelInfoRequest(), timeout=t)
        )
        server = await channels.discover(
            "GetServerInfo",
            deadline,
            lambda s, t: s.GetServerInfo(sglang_pb2.GetServerInfoRequest(), timeout=t),
        )
        listed = await channels.discover(
            "ListModels", deadline, lambda s, t: s.ListModels(sglang_pb2.ListModelsRequest(), timeout=t)
        )
        model_json = _object("GetModelInfo", _json("GetModelInfo", model.json_info or "{}"))
        model_json.setdefault("model_path", model.model_path)
        cards: list[dict[str, object]] = []
        for card in listed.models:
            entry: dict[str, object] = {"id": card.id, "root": card.root}
            if card.HasField("parent"):
                entry["parent"] = card.parent
            if card.HasField("max_model_len"):
                entry["max_model_len"] = card.max_model_len
            cards.append(entry)
        return EngineFacts(
            model_json, _object("GetServerInfo", _json("GetServerInfo", server.json_info)), cards
        )

    @asynccontextmanager
    async def stream(
        self, native: NativeRequest, *, cumulative: bool
    ) -> AsyncIterator[AsyncIterator[NativeEvent]]:
        request = to_grpc(native)
        request.trace_headers.update(outgoing_headers())  # the request's trace context
        call = self._generate.next()(request)
        decode = GrpcEventDecoder(native, cumulative=cumulative).decode
        events = self._events(call, decode, native.input_ids, unary=not native.stream)
        try:
            yield events
        finally:
            await events.aclose()
            # Leaving early (error, aclose, cancel) must release the HTTP/2 stream now.
            call.cancel()

    async def _events(
        self,
        call: grpc.aio.UnaryStreamCall[sglang_pb2.GenerateRequest, bytes],
        decode: Callable[[bytes], NativeEvent],
        prompt: Sequence[int],
        *,
        unary: bool,
    ) -> AsyncGenerator[NativeEvent]:
        try:
            async for message in call:
                yield decode(message)
        except grpc.RpcError as err:
            # SGLang ends a stream it aborted at our request with CANCELLED and no terminal.
            abort_echo = err.code() == grpc.StatusCode.CANCELLED
            error = generate_error(*rpc_status(err), prompt, unary=unary)
            raise StreamCut(error, abort_echo=abort_echo) from None

    async def abort(self, rid: str, timeout: float) -> None:
        request = sglang_pb2.AbortRequest(rid=rid, abort_all=False)
        await self._channels.call("Abort", timeout, lambda s, t: s.Abort(request, timeout=t))

    async def load(self, timeout: float) -> object:
        reply = await self._channels.call(
            "GetLoad", timeout, lambda s, t: s.GetLoad(sglang_pb2.GetLoadRequest(), timeout=t)
        )
        return _json("GetLoad", reply.json_info)

    async def engine_status(self, timeout: float) -> EngineStatus:
        """``GetModelInfo``'s weight version. The pause state is on SGLang's WatchEngineState
        stream only, which our mirror of the service does not carry: not known here."""
        reply = await self._channels.call(
            "GetModelInfo", timeout, lambda s, t: s.GetModelInfo(sglang_pb2.GetModelInfoRequest(), timeout=t)
        )
        info = _object("GetModelInfo", _json("GetModelInfo", reply.json_info or "{}"))
        return EngineStatus(paused=None, weight_version=weight_version_of(info))

    async def flush_cache(self, timeout: float) -> FlushOutcome:
        """``FlushCache``: SGLang's bridge answers ``success`` with the message "Cache
        flushed." whether or not it flushed, so a refusal says so in words of its own."""
        reply = await self._channels.call(
            "FlushCache", timeout, lambda s, t: s.FlushCache(sglang_pb2.FlushCacheRequest(), timeout=t)
        )
        if reply.success:
            return FlushOutcome(True, reply.message)
        return FlushOutcome(
            False, f"the engine did not flush its cache (FlushCache success=false: {reply.message!r})"
        )

    async def close(self) -> None:
        await self._channels.close()
