"""SGLang's native gRPC wire (``sglang.runtime.v1.SglangService``) over the testkit engine.

Framing follows SGLang 0.5.23's Rust server (its admin RPCs too: FlushCache, PauseGeneration,
ContinueGeneration, UpdateWeightsFromDisk, answered as its Python bridge builds them): every
meta_info value is JSON text; a request's channel is keyed by its exact rid; ``Abort`` closes
that channel (the stream ends CANCELLED with no terminal message) and forwards the rid to the
scheduler, which aborts by prefix; an ``Abort`` for a rid with no open channel is ignored; a
stream the client cancels is aborted at once; submit errors and the tokenizer manager's
refusals (``RequestRejected``) and any error inside a request's scheduler task end the stream
with INTERNAL (the Rust server maps every bridge error so). A refusal of SGLang's scheduler is
not an error on this wire: the stream carries one terminal with an ``abort`` finish of
status_code 400 and ends OK
(see ``sglang_checks``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from sidecar_common.api import sglang_pb2, sglang_pb2_grpc
from sidecar_common.endpoint import format_host_port
from sidecar_common.message_size import GRPC_MAX_MESSAGE_BYTES
from testkit.book import Outcome
from testkit.sglang_core import (
    PAUSE_MODES,
    Bootstrap,
    Chunk,
    Closed,
    Cut,
    Fail,
    NativeRequest,
    RequestRejected,
    RequestStream,
)
from testkit.sglang_served import ServedEngine

__all__ = ["SglangGrpcServer", "native_request_from_proto", "response_from_out"]

SERVICE_NAME = "sglang.runtime.v1.SglangService"


# SamplingParams fields the engine only verifies (absent stays absent: SGLang's defaults apply).
_CHECKED_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)


def native_request_from_proto(req: sglang_pb2.GenerateRequest, rid: str) -> NativeRequest:
    sp = req.sampling_params if req.HasField("sampling_params") else sglang_pb2.SamplingParams()

    bootstrap = None
    if req.HasField("disaggregated_params"):
        dp = req.disaggregated_params
        bootstrap = Bootstrap(dp.bootstrap_host, dp.bootstrap_port, dp.bootstrap_room)
    return NativeRequest(
        rid=rid,
        input_ids=tuple(req.input_ids),
        wire="grpc",
        max_new_tokens=sp.max_new_tokens if sp.HasField("max_new_tokens") else None,
        min_new_tokens=sp.min_new_tokens,
        stop=tuple(sp.stop),
        stop_token_ids=tuple(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        n=sp.n if sp.HasField("n") else 1,
        seed=sp.seed if sp.HasField("seed") else None,
        stream=req.stream if req.HasField("stream") else False,
        return_logprob=req.return_logprob if req.HasField("return_logprob") else False,
        top_logprobs_num=req.top_logprobs_num if req.HasField("top_logprobs_num") else 0,
        logprob_start_len=req.logprob_start_len if req.HasField("logprob_start_len") else -1,
        bootstrap=bootstrap,
        priority=req.priority if req.HasField("priority") else None,
        routed_dp_rank=req.routed_dp_rank if req.HasField("routed_dp_rank") else None,
        lora_path=req.lora_path if req.HasField("lora_path") else None,
        **{n: getattr(sp, n) for n in _CHECKED_SAMPLING if sp.HasField(n)},  # type: ignore[arg-type]
    )


def response_from_out(out: dict[str, Any], finished: bool) -> sglang_pb2.GenerateResponse:
    """SGLang's chunk dict → GenerateResponse: ids as-is, each meta value as JSON text."""
    meta = {k: json.dumps(v, separators=(",", ":")) for k, v in out["meta_info"].items()}
    return sglang_pb2.GenerateResponse(output_ids=out["output_ids"], meta_info=meta, finished=finished)


class _Servicer(sglang_pb2_grpc.SglangServiceServicer):
    def __init__(self, engine: ServedEngine) -> None:
        self._engine = engine
        self._channels: dict[str, RequestStream] = {}

    async def Generate(
        self, request: sglang_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[sglang_pb2.GenerateResponse]:
        engine = self._engine
        rid = request.rid if request.HasField("rid") else engine.new_rid()
        engine.book.record_request(rid, request)
        engine.book.record_trace_context(rid, dict(request.trace_headers))
        if rid in self._channels:
            message = f"Failed to submit request: Duplicate active gRPC request id: {rid}"
            engine.book.refused(rid, Outcome.ERROR, message)
            await context.abort(grpc.StatusCode.INTERNAL, message)
        try:
            stream = engine.submit(native_request_from_proto(request, rid))
        except RequestRejected as e:
            await context.abort(grpc.StatusCode[e.grpc_code], e.grpc_message)
        self._channels[rid] = stream
        ended = False  # the stream reached an end of its own (else the client left)
        try:
            while True:
                ev = await stream.next()
                if ev is None or isinstance(ev, Cut):
                    ended = True
                    return
                if isinstance(ev, Chunk):
                    yield response_from_out(ev.out, ev.finished)
                    continue
                ended = True
                if isinstance(ev, Fail):
                    await context.abort(grpc.StatusCode[ev.code], ev.message)
                assert isinstance(ev, Closed)
                await context.abort(grpc.StatusCode.CANCELLED, ev.message)
        finally:
            if self._channels.get(rid) is stream:
                del self._channels[rid]
            if not ended and engine.is_live(rid) and not engine.drop_held(rid):
                engine.abort(rid, source="grpc-cancel")

    async def Abort(
        self, request: sglang_pb2.AbortRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> sglang_pb2.AbortResponse:
        engine = self._engine
        if request.abort_all:
            channels, self._channels = self._channels, {}
            for rid, s in channels.items():
                s.put(Closed(f"Request aborted: {rid}"))
                engine.drop_held(rid)  # held by a pause: its client is gone, not the scheduler's
            engine.abort("", True, source="grpc")
            return sglang_pb2.AbortResponse(success=True)
        if not request.rid.strip():
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "Abort requires a non-empty rid unless abort_all is true"
            )
        stream = self._channels.pop(request.rid, None)
        if stream is None:
            engine.note_ignored_abort(request.rid, source="grpc")
        else:
            stream.put(Closed(f"Request aborted: {request.rid}"))
            engine.drop_held(request.rid)
            engine.abort(request.rid, source="grpc")
        return sglang_pb2.AbortResponse(success=True)

    # -- admin RPCs: the 0.5.23 bridge's answers (entrypoints/grpc_bridge.py) --------------
    async def FlushCache(
        self, request: sglang_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> sglang_pb2.FlushCacheResponse:
        # The bridge says "Cache flushed." whether or not the flush was done.
        return sglang_pb2.FlushCacheResponse(success=self._engine.flush_cache(), message="Cache flushed.")

    async def PauseGeneration(
        self, request: sglang_pb2.PauseGenerationRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> sglang_pb2.PauseGenerationResponse:
        if request.mode not in PAUSE_MODES:
            # SGLang does not check (its scheduler asserts the mode, which ends it); the testkit refuses.
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"mode must be one of {', '.join(PAUSE_MODES)} (testkit)"
            )
        await self._engine.pause_generation(request.mode)
        return sglang_pb2.PauseGenerationResponse(message=f"Generation paused (mode={request.mode}).")

    async def ContinueGeneration(
        self, request: sglang_pb2.ContinueGenerationRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> sglang_pb2.ContinueGenerationResponse:
        self._engine.continue_generation()
        return sglang_pb2.ContinueGenerationResponse(message="Generation continued.")

    async def UpdateWeightsFromDisk(
        self, request: sglang_pb2.UpdateWeightsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> sglang_pb2.UpdateWeightsResponse:
        # This wire carries no weight version: the version is unchanged (SGLang sets one only
        # when the update names it).
        success, message, _ = await self._engine.update_weights_from_disk(request.model_path)
        return sglang_pb2.UpdateWeightsResponse(success=success, message=message)

    async def HealthCheck(
        self, request: sglang_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> sglang_pb2.HealthCheckResponse:
        return sglang_pb2.HealthCheckResponse(healthy=self._engine.ready)

    async def GetModelInfo(
        self, request: sglang_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> sglang_pb2.GetModelInfoResponse:
        info = self._engine.model_info(http=False)
        return sglang_pb2.GetModelInfoResponse(model_path=info["model_path"], json_info=json.dumps(info))

    async def GetServerInfo(
        self, request: sglang_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> sglang_pb2.GetServerInfoResponse:
        return sglang_pb2.GetServerInfoResponse(json_info=json.dumps(self._engine.server_info(http=False)))

    async def ListModels(
        self, request: sglang_pb2.ListModelsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> sglang_pb2.ListModelsResponse:
        cfg = self._engine.config
        card = sglang_pb2.ModelCard(id=cfg.model_name, root=cfg.model_name, max_model_len=cfg.context_length)
        return sglang_pb2.ListModelsResponse(models=[card])

    async def GetLoad(
        self, request: sglang_pb2.GetLoadRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> sglang_pb2.GetLoadResponse:
        rank = request.dp_rank if request.HasField("dp_rank") else None
        return sglang_pb2.GetLoadResponse(json_info=json.dumps(self._engine.loads(rank)))


class SglangGrpcServer:
    """A grpc.aio server with the SGLang service and standard health, on one port."""

    def __init__(self, engine: ServedEngine, host: str, port: int) -> None:
        self._engine = engine
        self._host = host
        self.port = port
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
                # grpcio turns SO_REUSEPORT on by default: a second engine would share a
                # taken port and split its traffic. Off, the bind fails and start-up says so.
                ("grpc.so_reuseport", 0),
            ]
        )
        sglang_pb2_grpc.add_SglangServiceServicer_to_server(_Servicer(self._engine), server)
        health_servicer = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        bound = server.add_insecure_port(format_host_port(self._host, self.port))
        if bound == 0:
            raise OSError(f"cannot bind gRPC to {format_host_port(self._host, self.port)}")
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, not_serving)
        await server.start()
        self.port = bound
        self._server = server
        self._engine.spawn(self._serving_when_ready(health_servicer))

    async def _serving_when_ready(self, health_servicer: Any) -> None:
        await self._engine.wait_ready(None)
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(None)
