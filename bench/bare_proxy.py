"""The do-nothing baseline: a grpc.aio proxy that relays vLLM's native API as raw bytes.

It never decodes a message: generic handlers with identity (de)serializers on both sides, one
upstream message written downstream as it arrives. Whatever a converting sidecar costs beyond
this process is the price of conversion (and whatever coalescing saves is its gain).

Run as its own process: ``python -m bench.bare_proxy --listen H:P --upstream H:P``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import Callable
from typing import Any

import grpc

from sidecar_common.message_size import GRPC_MAX_MESSAGE_BYTES

__all__ = ["main", "serve"]

_STREAMING = frozenset({"/vllm.grpc.engine.VllmEngine/Generate"})
_OPTIONS = [
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
]


def _remaining(context: grpc.aio.ServicerContext[bytes, bytes]) -> float | None:
    left = context.time_remaining()
    # grpc reports "no deadline" as a huge number; pass None so the upstream call has none too.
    return None if left is None or left > 1e9 else left


class _Forwarder(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """Routes every method to the upstream channel, streaming only for Generate."""

    def __init__(self, channels: list[grpc.aio.Channel]) -> None:
        self._channels = channels
        self._next = 0

    def _pick(self) -> grpc.aio.Channel:
        # Round-robin over independent connections, as the sidecars' pool does, so the
        # baseline is not handicapped by one shared HTTP/2 connection.
        self._next = (self._next + 1) % len(self._channels)
        return self._channels[self._next]

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method: str = handler_call_details.method
        if method in _STREAMING:
            return grpc.unary_stream_rpc_method_handler(self._stream(method))
        return grpc.unary_unary_rpc_method_handler(self._unary(method))

    def _stream(self, method: str) -> Callable[..., Any]:
        upstreams = [ch.unary_stream(method, None, None) for ch in self._channels]

        async def relay(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> None:
            self._next = (self._next + 1) % len(upstreams)
            call = upstreams[self._next](request, timeout=_remaining(context))
            try:
                async for message in call:
                    await context.write(message)
            except grpc.aio.AioRpcError as err:
                await context.abort(err.code(), err.details() or "")
            finally:
                # The client left (or the relay failed): close the engine stream, which is how
                # the native API learns of a cancel.
                call.cancel()

        return relay

    def _unary(self, method: str) -> Callable[..., Any]:
        async def relay(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
            try:
                upstream = self._pick().unary_unary(method, None, None)
                reply: bytes = await upstream(request, timeout=_remaining(context))
            except grpc.aio.AioRpcError as err:
                await context.abort(err.code(), err.details() or "")
            return reply

        return relay


async def serve(listen: str, upstream: str, connections: int) -> None:
    channels = [
        grpc.aio.insecure_channel(upstream, options=[*_OPTIONS, ("grpc.use_local_subchannel_pool", 1)])
        for _ in range(connections)
    ]
    server = grpc.aio.server(options=_OPTIONS)
    server.add_generic_rpc_handlers((_Forwarder(channels),))
    if server.add_insecure_port(listen) == 0:
        raise SystemExit(f"bare_proxy: cannot listen on {listen}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0.5)
    for channel in channels:
        await channel.close(None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench.bare_proxy", description=__doc__)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument(
        "--connections", type=int, default=8, help="upstream channels (the sidecars' default)"
    )
    parser.add_argument("--no-uvloop", action="store_true", help="use the default asyncio loop")
    args = parser.parse_args(argv)
    if not args.no_uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            uvloop.install()
    asyncio.run(serve(args.listen, args.upstream, args.connections))


if __name__ == "__main__":
    main()
