"""A tiny stand-in for vLLM's native gRPC API, for benchmarking when no testkit engine exists.

It serves only what the benchmark touches (Generate, HealthCheck, Abort, and standard gRPC
health) and streams like the real servicer does: chunks of ``--chunk-tokens`` new token ids,
then a ``complete`` that restates the final delta. It is deliberately cheap per message, so
that the engine side of the benchmark does not hide the hop being measured. The harness uses
the testkit engine when it is installed; ``--engine standin`` forces this one.

Run as its own process: ``python -m bench.standin_engine --listen H:P --chunk-tokens K``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from bench.grpc_serve import serve_until_signal

__all__ = ["main"]

_FIRST_TOKEN = 100


class _Engine(vllm_engine_pb2_grpc.VllmEngineServicer):  # type: ignore[misc]
    def __init__(self, chunk_tokens: int, token_latency_s: float) -> None:
        self._chunk = chunk_tokens
        self._latency = token_latency_s

    async def Generate(
        self, request: vllm_engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> AsyncIterator[vllm_engine_pb2.GenerateResponse]:
        params = request.sampling_params
        total = params.max_tokens if params.HasField("max_tokens") else 16
        prompt = len(request.tokenized.input_ids)
        sent = 0
        last: list[int] = []
        while sent < total:
            step = min(self._chunk, total - sent)
            if self._latency > 0:
                await asyncio.sleep(self._latency * step)
            last = [_FIRST_TOKEN + (sent + i) % 1000 for i in range(step)]
            sent += step
            yield vllm_engine_pb2.GenerateResponse(
                chunk=vllm_engine_pb2.GenerateStreamChunk(
                    token_ids=last, prompt_tokens=prompt, completion_tokens=step
                )
            )
        yield vllm_engine_pb2.GenerateResponse(
            complete=vllm_engine_pb2.GenerateComplete(
                output_ids=last, finish_reason="length", prompt_tokens=prompt, completion_tokens=len(last)
            )
        )

    async def HealthCheck(
        self, request: vllm_engine_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> vllm_engine_pb2.HealthCheckResponse:
        return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="ok")

    async def Abort(
        self, request: vllm_engine_pb2.AbortRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> vllm_engine_pb2.AbortResponse:
        return vllm_engine_pb2.AbortResponse()


async def _serve(listen: str, chunk_tokens: int, token_latency_s: float) -> None:
    server = grpc.aio.server()
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(_Engine(chunk_tokens, token_latency_s), server)
    await serve_until_signal(server, listen, "standin_engine")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench.standin_engine", description=__doc__)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--chunk-tokens", type=int, default=1)
    parser.add_argument("--token-latency-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    asyncio.run(_serve(args.listen, args.chunk_tokens, args.token_latency_ms / 1000.0))


if __name__ == "__main__":
    main()
