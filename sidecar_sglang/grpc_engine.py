"""The SGLang engine over its native gRPC service (``sglang.runtime.v1.SglangService``).

I/O only: every protocol rule lives in :mod:`sidecar_sglang.convert_request`,
:mod:`sidecar_sglang.convert_response` and :mod:`sidecar_sglang.discovery`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final, TypeVar

import grpc
import structlog

from sidecar_common.api import sglang_pb2, sglang_pb2_grpc, sidecar_pb2
from sidecar_common.errors import from_rpc_error, protocol_error
from sidecar_common.pool import ChannelPool, Clock, Connector, Deadline, retry_until_deadline
from sidecar_common.rpc import NotHealthy, StubCache, bounded_call, discovery_timeout, probe
from sidecar_common.tracing import outgoing_headers
from sidecar_server.config import SidecarConfig
from sidecar_server.engine import EngineLoad, GenerateCall
from sidecar_sglang.adapter import SglangAdapterBase, random_room
from sidecar_sglang.convert_request import to_grpc
from sidecar_sglang.discovery import discover, loads_from_json
from sidecar_sglang.grpc_events import GrpcEventDecoder

__all__ = ["ABORT_TIMEOUT", "HEALTH_TIMEOUT", "LOAD_TIMEOUT", "SglangGrpcEngine", "random_room"]

_log = structlog.get_logger(__name__)
T = TypeVar("T")

_GENERATE: Final = "/sglang.runtime.v1.SglangService/Generate"
# Requests serialized, replies left as bytes.
_RawGenerate = grpc.aio.UnaryStreamMultiCallable[sglang_pb2.GenerateRequest, bytes]

ABORT_TIMEOUT: Final = 2.0
HEALTH_TIMEOUT: Final = 1.5
LOAD_TIMEOUT: Final = 2.0


def _json(rpc: str, text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        raise protocol_error("sglang", f"{rpc} json_info is not JSON") from None


def _object(rpc: str, value: object) -> dict[str, object]:
    if not isinstance(value, dict):
        raise protocol_error("sglang", f"{rpc} json_info is not a JSON object")
    return value


class SglangGrpcEngine(SglangAdapterBase):
    """One SGLang engine started with ``--grpc-port``, behind ``config.pool``."""

    def __init__(
        self,
        config: SidecarConfig,
        *,
        clock: Clock | None = None,
        connector: Connector | None = None,
        room: Callable[[], int] = random_room,
    ) -> None:
        super().__init__(config, "grpc", room)
        self._pool = ChannelPool(config.pool, clock=clock, connector=connector)
        self._stubs: StubCache[sglang_pb2_grpc.SglangServiceAsyncStub] = StubCache(
            self._pool, sglang_pb2_grpc.SglangServiceStub
        )
        # Generate's replies stay wire bytes: grpc_events reads only what it needs of them.
        self._generate: StubCache[_RawGenerate] = StubCache(
            self._pool,
            lambda channel: channel.unary_stream(
                _GENERATE,
                request_serializer=sglang_pb2.GenerateRequest.SerializeToString,
                response_deserializer=None,
            ),
        )
        self.health_problem: str | None = None  # why the last health probe failed

    # ------------------------------------------------------------------- start-up

    async def start(self) -> None:
        # One deadline for the pool, the health wait and discovery (docs/common.md).
        deadline = Deadline.start(self._pool.clock, self._config.pool.startup_deadline)
        await self._pool.connect(deadline)
        target = self._config.pool.endpoint.target
        await retry_until_deadline(
            f"sglang engine {target} (HealthCheck)", self._health_attempt, deadline, self._config.pool.retry
        )
        model = await self._unary(
            "GetModelInfo", deadline, lambda s, t: s.GetModelInfo(sglang_pb2.GetModelInfoRequest(), timeout=t)
        )
        server = await self._unary(
            "GetServerInfo",
            deadline,
            lambda s, t: s.GetServerInfo(sglang_pb2.GetServerInfoRequest(), timeout=t),
        )
        listed = await self._unary(
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
        self._found = discover(
            model_json,
            _object("GetServerInfo", _json("GetServerInfo", server.json_info)),
            cards,
            expected_mode=self._config.disaggregation_mode,
            transport="grpc",
            engine_host=self._config.pool.endpoint.host,
        )
        self._settings = self._found.settings
        _log.info(
            "sglang engine discovered",
            transport="grpc",
            served_model_name=self._found.model_info.served_model_name,
            incremental=self._found.incremental,
            disaggregation_mode=self._found.model_info.disaggregation_mode,
            elapsed=round(deadline.elapsed(), 3),
        )

    async def _health_attempt(self, timeout: float) -> None:
        reply = await self._stubs.next().HealthCheck(sglang_pb2.HealthCheckRequest(), timeout=timeout)
        if not reply.healthy:
            raise NotHealthy("engine reports not healthy")

    async def _unary(
        self,
        rpc: str,
        deadline: Deadline,
        call: Callable[[sglang_pb2_grpc.SglangServiceAsyncStub, float], Awaitable[T]],
    ) -> T:
        return await self._bounded(rpc, discovery_timeout(rpc, deadline, self._config.pool.retry), call)

    async def _bounded(
        self,
        rpc: str,
        timeout: float,
        call: Callable[[sglang_pb2_grpc.SglangServiceAsyncStub, float], Awaitable[T]],
    ) -> T:
        stub = self._stubs.next()
        return await bounded_call(rpc, timeout, lambda t: call(stub, t))

    # ------------------------------------------------------------------- requests

    async def generate(self, call: GenerateCall) -> AsyncIterator[sidecar_pb2.LLMEngineOutput]:
        pid = call.private_id
        native, state = self._open(call)
        decode = GrpcEventDecoder(native, cumulative=state.cumulative).decode
        request = to_grpc(native)
        request.trace_headers.update(outgoing_headers())  # the request's trace context
        stream = self._generate.next()(request)
        try:
            async for message in stream:
                for out in state.feed(decode(message), aborted_by_us=self._live.get(pid, False)):
                    yield out
                if state.done:
                    return
            raise state.end_of_stream(aborted_by_us=self._live.get(pid, False))
        except grpc.RpcError as err:
            # SGLang ends a stream it aborted at our request with CANCELLED and no terminal.
            if self._live.get(pid, False) and err.code() == grpc.StatusCode.CANCELLED:
                raise state.end_of_stream(aborted_by_us=True) from None
            raise from_rpc_error("Generate", err) from None
        finally:
            # Leaving early (error, aclose, cancel) must release the HTTP/2 stream now.
            stream.cancel()
            self._live.pop(pid, None)

    async def abort(self, private_id: str) -> None:
        if not private_id:
            # SGLang matches rids by prefix: an empty rid would abort everything.
            return
        if private_id in self._live:
            self._live[private_id] = True
        # SGLang answers OK for a rid it no longer knows, so a failure here is a real one:
        # raised for the dispatcher to log and count as a failed abort.
        request = sglang_pb2.AbortRequest(rid=private_id, abort_all=False)
        await self._bounded("Abort", ABORT_TIMEOUT, lambda s, t: s.Abort(request, timeout=t))

    async def load(self) -> EngineLoad:
        reply = await self._bounded(
            "GetLoad", LOAD_TIMEOUT, lambda s, t: s.GetLoad(sglang_pb2.GetLoadRequest(), timeout=t)
        )
        return EngineLoad(ranks=loads_from_json(_json("GetLoad", reply.json_info)))

    async def healthy(self) -> bool:
        return await probe(self._health_attempt, HEALTH_TIMEOUT, self._note_health_problem)

    def _note_health_problem(self, why: str) -> None:
        # Read by the server's health watch for its "engine unhealthy" line.
        self.health_problem = why

    async def close(self) -> None:
        self._stubs.clear()
        self._generate.clear()
        await self._pool.close()
