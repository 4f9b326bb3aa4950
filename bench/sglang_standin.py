"""A cheap SGLang gRPC engine in cumulative mode with logprobs, for ``bench.sglang_growth``.

The testkit SGLang engine renders each cumulative message by serializing every logprob entry
so far (about 3 ms a message at 2,048 tokens on this machine): as the engine of a growth
benchmark it would set the pace, and the hop would run at a different load for short and
long outputs. This one keeps each list's JSON text and appends the new entry to it, so its
cost per message is a copy of the text; everything but Generate (discovery, health, Abort,
GetLoad) is the testkit engine's own.

The stream has SGLang's cumulative shape: every message carries every output id and every
``output_token_logprobs`` / ``output_top_logprobs`` entry so far (one alternative), meta
values as JSON text; the last adds the finish reason and the counts.

Run as its own process: ``python -m bench.sglang_standin --listen H:P [--token-latency-ms MS]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator
from typing import Any

import grpc
from testkit.sglang_engine import SglangTestEngine
from testkit.sglang_info import SglangEngineConfig

from sidecar_common.api import sglang_pb2
from sidecar_common.endpoint import parse_host_port
from testkit import sglang_grpc

__all__ = ["main"]

_FIRST_TOKEN = 1000


def _logprob(i: int) -> str:
    # Realistic widths: SGLang sends full float reprs.
    return repr(-((i * 7919) % 10007) / 1234.5678901)


_TOKEN_LATENCY_S = 0.0


async def _generate(
    self: sglang_grpc._Servicer,
    request: sglang_pb2.GenerateRequest,
    context: grpc.aio.ServicerContext[Any, Any],
) -> AsyncIterator[sglang_pb2.GenerateResponse]:
    sp = request.sampling_params
    total = sp.max_new_tokens if sp.HasField("max_new_tokens") else 16
    logprobs = request.return_logprob if request.HasField("return_logprob") else False
    top = request.top_logprobs_num if request.HasField("top_logprobs_num") else 0
    prompt = len(request.input_ids)
    message = sglang_pb2.GenerateResponse()
    meta = message.meta_info
    meta["id"] = json.dumps(request.rid)
    meta["finish_reason"] = "null"
    meta["prompt_tokens"] = str(prompt)
    meta["weight_version"] = '"default"'
    lp_text = top_text = "["
    for i in range(total):
        token = _FIRST_TOKEN + (i * 31) % 20000
        message.output_ids.append(token)
        if logprobs:
            sep = "," if i else ""
            lp = _logprob(i)
            lp_text += f"{sep}[{lp},{token},null]"
            meta["output_token_logprobs"] = lp_text + "]"
            if top:
                top_text += f"{sep}[[{lp},{token},null]]"
                meta["output_top_logprobs"] = top_text + "]"
        meta["completion_tokens"] = str(i + 1)
        meta["cached_tokens"] = "0"
        if i == total - 1:
            meta["finish_reason"] = json.dumps({"type": "length", "length": total})
            message.finished = True
        if _TOKEN_LATENCY_S:
            await asyncio.sleep(_TOKEN_LATENCY_S)
        # grpc serializes the message before asking for the next one: reusing it is safe.
        yield message


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sglang_standin")
    parser.add_argument("--listen", required=True, help="HOST:PORT for gRPC")
    parser.add_argument("--token-latency-ms", type=float, default=0.0, help="pause before each message")
    args = parser.parse_args(argv)
    global _TOKEN_LATENCY_S
    _TOKEN_LATENCY_S = args.token_latency_ms / 1000.0
    listen = parse_host_port(args.listen, port_zero_allowed=True)
    sglang_grpc._Servicer.Generate = _generate  # type: ignore[method-assign]
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    asyncio.run(_serve(listen.host, listen.port))


async def _serve(host: str, port: int) -> None:
    config = SglangEngineConfig(grpc_host=host, grpc_port=port, http_port=None, incremental=False)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with SglangTestEngine(config):
        await stop.wait()


if __name__ == "__main__":
    main()
