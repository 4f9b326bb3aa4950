"""The vLLM engine client: vLLM's native gRPC service over the shared channel pool.

I/O only. Every protocol rule lives in :mod:`sidecar_vllm.convert`; this module opens
calls, feeds the engine's messages to a :class:`~sidecar_vllm.convert.ResponseState`, and
turns transport failures into typed errors. Start-up, time bounds and the gRPC plumbing are
the shared skeleton's (:mod:`sidecar_server.engine_client`, :mod:`sidecar_server.engine_grpc`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import Final, Protocol, cast

import grpc
import structlog
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from sidecar_common.api import sidecar_pb2
from sidecar_common.disaggregation import DisaggregationMode
from sidecar_common.errors import FailureReason, SidecarError, rpc_status
from sidecar_common.pool import Clock, Connector, Deadline
from sidecar_common.rpc import NotHealthy
from sidecar_common.tracing import outgoing_metadata
from sidecar_server.config import SidecarConfig
from sidecar_server.engine import EngineHealth, EngineLoad, FlushOutcome, GenerateCall
from sidecar_server.engine_client import Discovery, EngineClient, EngineTimeouts
from sidecar_server.engine_grpc import EngineChannels
from sidecar_server.engine_state import EngineStatus, vllm_paused
from sidecar_vllm.convert import ResponseState, to_generate_request
from sidecar_vllm.refusals import generate_error

__all__ = ["KV_ROLES", "VllmEngine"]

_log = structlog.get_logger(__name__)

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

    def FlushCache(
        self, request: common_pb2.FlushCacheRequest, *, timeout: float
    ) -> Awaitable[common_pb2.FlushCacheResponse]: ...

    def Generate(
        self, request: vllm_engine_pb2.GenerateRequest, *, metadata: tuple[tuple[str, str], ...] | None = None
    ) -> _GenerateCall: ...


class VllmEngine(EngineClient):
    """One vLLM engine (``vllm serve --grpc``) behind ``config.pool``."""

    def __init__(
        self,
        config: SidecarConfig,
        *,
        clock: Clock | None = None,
        connector: Connector | None = None,
        timeouts: EngineTimeouts | None = None,
    ) -> None:
        self._channels: EngineChannels[_Stub] = EngineChannels(
            config.pool,
            lambda channel: cast(_Stub, vllm_engine_pb2_grpc.VllmEngineStub(channel)),
            clock=clock,
            connector=connector,
        )
        super().__init__(config, clock=self._channels.clock, timeouts=timeouts or EngineTimeouts())
        self._mode: DisaggregationMode = config.disaggregation_mode
        # The engine has answered is_paused true once: its servicer fills the field, so a
        # false from it means running (engine_state.vllm_paused).
        self._seen_paused = False

    @property
    def name(self) -> str:
        return "vllm"

    # ------------------------------------------------------------------- start-up

    @property
    def _target(self) -> str:
        return self._channels.target

    async def _connect(self, deadline: Deadline) -> None:
        await self._channels.connect(deadline)

    async def _check_health(self, timeout: float) -> None:
        reply = await self._channels.stub().HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=timeout)
        if not reply.healthy:
            raise NotHealthy(f"engine reports not healthy: {reply.message or 'no message'}")

    async def _discover(self, deadline: Deadline) -> Discovery:
        model = await self._channels.discover(
            "GetModelInfo",
            deadline,
            lambda stub, t: stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=t),
        )
        server = await self._channels.discover(
            "GetServerInfo",
            deadline,
            lambda stub, t: stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(), timeout=t),
        )
        self._check_kv_role(server.kv_role)
        info = sidecar_pb2.ModelInfo(
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
        await self._discover_capacity(deadline, info)
        return Discovery(info, {"kv_role": server.kv_role, "data_parallel_size": info.data_parallel_size})

    async def _discover_capacity(self, deadline: Deadline, info: sidecar_pb2.ModelInfo) -> None:
        """KV capacity and engine version, which only GetLoads reports. Best effort: an
        engine that cannot say leaves them zero/empty, as the API allows."""
        try:
            loads = await self._channels.discover(
                "GetLoads",
                deadline,
                lambda stub, t: stub.GetLoads(
                    vllm_engine_pb2.GetLoadsRequest(), timeout=min(t, self.timeouts.load)
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
                FailureReason.INVALID_ARGUMENT,
                f"--disaggregation-mode {self._mode} needs an engine with kv_role "
                f"{' or '.join(sorted(needed))}, but the engine reports kv_role "
                f"{kv_role!r}",
            )

    # ------------------------------------------------------------------- requests

    def _convert(
        self, request: sidecar_pb2.PreprocessedRequest, private_id: str
    ) -> vllm_engine_pb2.GenerateRequest:
        info = self._discovery.info if self._discovery is not None else None
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
        stream = self._channels.stub().Generate(native, metadata=outgoing_metadata())
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
        raise SidecarError(FailureReason.ENGINE_SHUTDOWN, "engine stream ended before the final chunk")

    async def _abort(self, private_id: str, timeout: float) -> None:
        # vLLM answers OK for an id it no longer knows, so a failure here is a real one (an
        # engine that cannot be reached or does not answer): raised for the dispatcher to log
        # and count as a failed abort.
        request = vllm_engine_pb2.AbortRequest(request_ids=[private_id])
        await self._channels.call("Abort", timeout, lambda stub, t: stub.Abort(request, timeout=t))

    async def _load(self, timeout: float) -> EngineLoad:
        reply = await self._channels.call(
            "GetLoads", timeout, lambda stub, t: stub.GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=t)
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

    async def _probe_health(self, timeout: float) -> EngineHealth:
        return await self._channels.probe(self._check_health, timeout)

    async def _status(self, timeout: float) -> EngineStatus:
        # vLLM's gRPC wire reports no weight version (only its HTTP dev-mode routes do).
        reply = await self._channels.call(
            "GetServerInfo",
            timeout,
            lambda stub, t: stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(), timeout=t),
        )
        paused = vllm_paused(reply.is_paused, seen_paused=self._seen_paused)
        self._seen_paused = self._seen_paused or reply.is_paused
        return EngineStatus(paused=paused)

    async def _flush_cache(self, timeout: float) -> FlushOutcome:
        # timeout_s 0: one attempt now, refused while requests hold blocks (smg's admin.py).
        reply = await self._channels.call(
            "FlushCache",
            timeout,
            lambda stub, t: stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=0.0), timeout=t),
        )
        return FlushOutcome(reply.success, reply.message)

    async def close(self) -> None:
        await self._channels.close()
