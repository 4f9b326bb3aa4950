"""A reference point between the bare proxy and the sidecar: the floor of a *converting* hop.

It serves the public ``sidecar.v1.Worker/Generate`` over vLLM's native API with the least
work a converting hop can do: decode each native message, build one ``LLMEngineOutput``,
encode it, in the handler's own task (no buffer, no second task, no coalescing, no abort
bookkeeping, no metrics). It handles only what the benchmark sends (prompt, max_tokens,
ignore_eos; n = 1), so it is a measuring stick, not a sidecar: bare proxy → this → sidecar
splits a sidecar's cost into "any grpc.aio hop", "decode + convert + encode" and "everything
else the sidecar does per message and per request".

Run as its own process: ``python -m bench.convert_floor --listen H:P --upstream H:P``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import signal

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2

from sidecar_common.api import sidecar_pb2

__all__ = ["main"]

_CONNECTIONS = 8  # as the sidecars' pool


async def _serve(listen: str, upstream: str) -> None:
    channels = [
        grpc.aio.insecure_channel(upstream, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(_CONNECTIONS)
    ]
    generates = [
        ch.unary_stream(
            "/vllm.grpc.engine.VllmEngine/Generate",
            vllm_engine_pb2.GenerateRequest.SerializeToString,
            vllm_engine_pb2.GenerateResponse.FromString,
        )
        for ch in channels
    ]
    ids = itertools.count()

    async def generate(
        request: sidecar_pb2.PreprocessedRequest,
        context: grpc.aio.ServicerContext[sidecar_pb2.PreprocessedRequest, sidecar_pb2.LLMEngineOutput],
    ) -> None:
        n = next(ids)
        stop = request.stop_conditions
        native = vllm_engine_pb2.GenerateRequest(
            request_id=f"floor-{n}",
            tokenized=vllm_engine_pb2.TokenizedInput(input_ids=request.token_ids),
            sampling_params=vllm_engine_pb2.SamplingParams(
                max_tokens=stop.max_tokens, ignore_eos=stop.ignore_eos, top_p=1.0, repetition_penalty=1.0
            ),
            stream=True,
        )
        call = generates[n % len(generates)](native)
        try:
            async for message in call:
                if message.WhichOneof("response") == "chunk":
                    chunk = message.chunk
                    if chunk.token_ids:
                        await context.write(
                            sidecar_pb2.LLMEngineOutput(token_ids=chunk.token_ids, index=chunk.index)
                        )
                    continue
                done = message.complete
                await context.write(
                    sidecar_pb2.LLMEngineOutput(index=done.index, finish_reason=sidecar_pb2.LENGTH)
                )
                return
        finally:
            # Closing the engine stream is how the native API learns of a cancel.
            call.cancel()

    handler = grpc.method_handlers_generic_handler(
        "sidecar.v1.Worker",
        {
            "Generate": grpc.unary_stream_rpc_method_handler(
                generate,
                request_deserializer=sidecar_pb2.PreprocessedRequest.FromString,
                response_serializer=sidecar_pb2.LLMEngineOutput.SerializeToString,
            )
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    if server.add_insecure_port(listen) == 0:
        raise SystemExit(f"convert_floor: cannot listen on {listen}")
    await server.start()
    stop_event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_event.set)
    await stop_event.wait()
    await server.stop(0.5)
    for channel in channels:
        await channel.close(None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench.convert_floor", description=__doc__)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args(argv)
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    asyncio.run(_serve(args.listen, args.upstream))


if __name__ == "__main__":
    main()
