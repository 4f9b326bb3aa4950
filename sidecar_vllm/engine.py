"""The vLLM engine adapter: vLLM's native gRPC service over the shared channel pool.

I/O only. Every protocol rule lives in :mod:`sidecar_vllm.convert`; this module opens
calls, feeds the engine's messages to a :class:`~sidecar_vllm.convert.ResponseState`, and
turns transport failures into typed errors.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final, Protocol, TypeVar, cast

import grpc
import structlog
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from sidecar_common.api import sidecar_pb2
from sidecar_common.disaggregation import DisaggregationMode
from sidecar_common.errors import ErrorReason, SidecarError, rpc_status
from sidecar_common.pool import ChannelPool, Clock, Connector, Deadline, retry_until_deadline
from sidecar_common.rpc import NotHealthy, StubCache, bounded_call, discovery_timeout, probe
from sidecar_common.tracing import outgoing_metadata
from sidecar_server.config import SidecarConfig
from sidecar_server.engine import EngineLoad, GenerateCall
from sidecar_vllm.convert import ResponseState, to_generate_request
from sidecar_vllm.refusals import generate_error

__all__ = ["ABORT_TIMEOUT", "HEALTH_TIMEOUT", "KV_ROLES", "LOAD_TIMEOUT", "VllmEngine"]

_log = structlog.get_logger(__name__)
T = TypeVar("T")

ABORT_TIMEOUT: Final = 2.0
HEALTH_TIMEOUT: Final = 1.5
LOAD_TIMEOUT: Final = 2.0

# The engine kv_role each disaggregation half needs.
KV_ROLES: Final[dict[DisaggregationMode, frozenset[str]]] = {
    "prefill": frozenset({"kv_producer", "kv_both"}),
    "decode": frozenset({"kv_consumer", "kv_both"}),
}


class _GenerateCall(Protocol):
    def __aiter__(self) -> AsyncIterator[vllm_engine_pb2.GenerateResponse]: ...

    def cancel(self) -> bool: ...


class _Stub(Protocol):
    """The typed face of ``VllmEngineStub`` (its generated module ships no stubs)."""

    def HealthCheck(
        self, request: vllm_engine_pb2.HealthCheckRequest, *, timeout: float
    ) -> Awaitable[vllm_engine_pb2.HealthCheckResponse]: ...

    def GetModelInfo(
        self, request: vllm_engine_pb2.GetModelInfoRequest, *, timeout: float
    ) -> Awaitable[vllm_engine_pb2.GetModelInfoResponse]: ...

    def GetServerInfo(
        self, request: vllm_engine_pb2.GetServerInfoRequest, *, timeout: float
    ) -> Awaitable[vllm_engine_pb2.GetServerInfoResponse]: ...

    def GetLoads(
        self, request: vllm_engine_pb2.GetLoadsRequest, *, timeout: float
    ) -> Awaitable[vllm_engine_pb2.GetLoadsResponse]: ...

    def Abort(
        self, request: vllm_engine_pb2.AbortRequest, *, timeout: float
    ) -> Awaitable[vllm_engine_pb2.AbortResponse]: ...

    def Generate(
        self, request: vllm_engine_pb2.GenerateRequest, *, metadata: tuple[tuple[str, str], ...] | None = None
    ) -> _GenerateCall: ...


class VllmEngine:
    """One vLLM engine (``vllm serve --grpc``) behind ``config.pool``."""

    def __init__(
        self,
        config: SidecarConfig,
        *,
        clock: Clock | None = None,
        connector: Connector | None = None,
    ) -> None:
        self._config = config
        self._mode: DisaggregationMode = config.disaggregation_mode
        self._pool = ChannelPool(config.pool, clock=clock, connector=connector)
        self._stubs: StubCache[_Stub] = StubCache(
            self._pool, lambda channel: cast(_Stub, vllm_engine_pb2_grpc.VllmEngineStub(channel))
        )
        self._info: sidecar_pb2.ModelInfo | None = None
        self.health_problem: str | None = None  # why the last health probe failed

    @property
    def name(self) -> str:
        return "vllm"

    # ------------------------------------------------------------------- start-up

    async def start(self) -> None:
        # One deadline for the pool, the health wait and discovery (docs/common.md).
        deadline = Deadline.start(self._pool.clock, self._config.pool.startup_deadline)
        await self._pool.connect(deadline)
        target = self._config.pool.endpoint.target
        await retry_until_deadline(
            f"vllm engine {target} (HealthCheck)", self._health_attempt, deadline, self._config.pool.retry
        )
        model = await self._discover(
            "GetModelInfo",
            deadline,
            lambda stub, t: stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=t),
        )
        server = await self._discover(
            "GetServerInfo",
            deadline,
            lambda stub, t: stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(), timeout=t),
        )
        self._check_kv_role(server.kv_role)
        self._info = sidecar_pb2.ModelInfo(
            engine="vllm",
            served_model_name=model.served_model_name or model.model_path,
            model_path=model.model_path,
            tokenizer_path=model.tokenizer_path,
            max_context_length=model.max_context_length,
            vocab_size=model.vocab_size,
            eos_token_ids=[t for t in model.eos_token_ids if t >= 0],
            kv_block_size=max(server.block_size, 0),
            max_num_seqs=max(server.max_num_seqs, 0),
            data_parallel_size=max(server.data_parallel_size, 0),
            disaggregation_mode=self._mode,
            supports_vision=model.supports_vision,
        )
        await self._discover_capacity(deadline, self._info)
        _log.info(
            "vllm engine discovered",
            served_model_name=self._info.served_model_name,
            kv_role=server.kv_role,
            data_parallel_size=self._info.data_parallel_size,
            elapsed=round(deadline.elapsed(), 3),
        )

    async def _health_attempt(self, timeout: float) -> None:
        reply = await self._stubs.next().HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=timeout)
        if not reply.healthy:
            raise NotHealthy(f"engine reports not healthy: {reply.message or 'no message'}")

    async def _discover(
        self, rpc: str, deadline: Deadline, call: Callable[[_Stub, float], Awaitable[T]]
    ) -> T:
        timeout = discovery_timeout(rpc, deadline, self._config.pool.retry)
        stub = self._stubs.next()
        return await bounded_call(rpc, timeout, lambda t: call(stub, t))

    async def _discover_capacity(self, deadline: Deadline, info: sidecar_pb2.ModelInfo) -> None:
        """KV capacity and engine version, which only GetLoads reports. Best effort: an
        engine that cannot say leaves them zero/empty, as the API allows."""
        try:
            loads = await self._discover(
                "GetLoads",
                deadline,
                lambda stub, t: stub.GetLoads(
                    vllm_engine_pb2.GetLoadsRequest(), timeout=min(t, LOAD_TIMEOUT)
                ),
            )
        except SidecarError as err:
            _log.warning("vllm engine capacity unknown", error=err.message)
            return
        info.engine_version = loads.version
        block = info.kv_block_size
        tokens = max((load.max_total_num_tokens for load in loads.loads), default=0)
        if block > 0 and tokens > 0:
            # Per rank: every data-parallel rank holds its own cache of this size.
            info.total_kv_blocks = tokens // block

    def _check_kv_role(self, kv_role: str) -> None:
        needed = KV_ROLES.get(self._mode)
        if needed is not None and kv_role not in needed:
            raise SidecarError(
                ErrorReason.INVALID_ARGUMENT,
                f"--disaggregation-mode {self._mode} needs an engine with kv_role "
                f"{' or '.join(sorted(needed))}, but the engine reports kv_role "
                f"{kv_role!r}",
            )

    def model_info(self) -> sidecar_pb2.ModelInfo:
        if self._info is None:
            raise SidecarError(ErrorReason.ENGINE_SHUTDOWN, "the vllm engine is not discovered yet")
        return self._info

    # ------------------------------------------------------------------- requests

    def _convert(
        self, request: sidecar_pb2.PreprocessedRequest, private_id: str
    ) -> vllm_engine_pb2.GenerateRequest:
        info = self._info
        return to_generate_request(
            request,
            private_id,
            mode=self._mode,
            supports_vision=info.supports_vision if info is not None else False,
            data_parallel_size=info.data_parallel_size if info is not None else 0,
        )

    def validate(self, request: sidecar_pb2.PreprocessedRequest) -> vllm_engine_pb2.GenerateRequest:
        # The private id is not drawn yet: generate() sets it on this same message.
        return self._convert(request, "validate")

    async def generate(self, call: GenerateCall) -> AsyncIterator[sidecar_pb2.LLMEngineOutput]:
        native = call.native
        if isinstance(native, vllm_engine_pb2.GenerateRequest):
            native.request_id = call.private_id
        else:
            native = self._convert(call.request, call.private_id)
        state = ResponseState(call.request, self._mode)
        # The request's trace context (docs/common.md, "Tracing") as gRPC metadata.
        stream = self._stubs.next().Generate(native, metadata=outgoing_metadata())
        try:
            async for message in stream:
                for out in state.feed(message):
                    yield out
                if state.finished:
                    return
        except grpc.RpcError as err:
            raise generate_error(*rpc_status(err)) from None
        finally:
            # Leaving early (error, aclose, cancel) must release the HTTP/2 stream now.
            stream.cancel()
        raise SidecarError(ErrorReason.ENGINE_SHUTDOWN, "engine stream ended before the final chunk")

    async def abort(self, private_id: str) -> None:
        # vLLM answers OK for an id it no longer knows, so a failure here is a real one (an
        # engine that cannot be reached or does not answer): raised for the dispatcher to log
        # and count as a failed abort.
        request = vllm_engine_pb2.AbortRequest(request_ids=[private_id])
        await bounded_call("Abort", ABORT_TIMEOUT, lambda t: self._stubs.next().Abort(request, timeout=t))

    async def load(self) -> EngineLoad:
        reply = await bounded_call(
            "GetLoads",
            LOAD_TIMEOUT,
            lambda t: self._stubs.next().GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=t),
        )
        return EngineLoad(
            ranks=tuple(
                sidecar_pb2.RankLoad(
                    dp_rank=max(load.dp_rank, 0),
                    running_requests=max(load.num_running_reqs, 0),
                    waiting_requests=max(load.num_waiting_reqs, 0),
                    kv_usage=min(max(load.token_usage, 0.0), 1.0),
                )
                for load in reply.loads
            )
        )

    async def healthy(self) -> bool:
        return await probe(self._health_attempt, HEALTH_TIMEOUT, self._note_health_problem)

    def _note_health_problem(self, why: str) -> None:
        # Read by the server's health watch for its "engine unhealthy" line.
        self.health_problem = why

    async def close(self) -> None:
        self._stubs.clear()
        await self._pool.close()
