"""A small client of the sidecar's public API, for trying a sidecar by hand.

    python -m testkit.client --target 127.0.0.1:50061 --prompt 1,2,3 --max-tokens 16 --wait-secs 30

Prints each streamed chunk as it arrives, then the finish reason and usage; a failure
prints the typed status (ErrorInfo reason and the migratable flag) and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass, field

import grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc

__all__ = ["GenerationResult", "generate", "main", "wait_serving"]


@dataclass
class GenerationResult:
    chunks: list[sidecar_pb2.LLMEngineOutput] = field(default_factory=list)
    error: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk.token_ids]


async def wait_serving(target: str, timeout: float) -> None:
    """Wait until the sidecar's health says SERVING (it connects and discovers first)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if loop.time() > give_up:
                raise TimeoutError(f"sidecar at {target} not SERVING after {timeout:.0f} s")
            await asyncio.sleep(0.1)


def _describe_error(error: grpc.aio.AioRpcError) -> str:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    reason = "?"
    migratable = "?"
    for detail in status.details if status is not None else []:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            reason = info.reason
            migratable = info.metadata.get("migratable", "?")
    return f"{error.code().name} reason={reason} migratable={migratable}: {error.details()}"


async def generate(
    target: str, request: sidecar_pb2.PreprocessedRequest, *, timeout: float = 60.0, echo: bool = False
) -> GenerationResult:
    result = GenerationResult()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = sidecar_pb2_grpc.WorkerStub(channel)
        call = stub.Generate(request, timeout=timeout)
        try:
            async for chunk in call:
                result.chunks.append(chunk)
                if echo:
                    _print_chunk(chunk)
        except grpc.aio.AioRpcError as error:
            result.error = _describe_error(error)
    return result


def _print_chunk(chunk: sidecar_pb2.LLMEngineOutput) -> None:
    text = repr(chunk.text) if chunk.HasField("text") else "-"
    line = f"[choice {chunk.index}] tokens={list(chunk.token_ids)} text={text}"
    if chunk.finish_reason != sidecar_pb2.UNSPECIFIED:
        usage = chunk.completion_usage
        line += (
            f"\n[choice {chunk.index}] finish={sidecar_pb2.FinishReason.Name(chunk.finish_reason)}"
            f" stop_reason={chunk.WhichOneof('stop_reason') or '-'}"
            f" usage(prompt={usage.prompt_tokens}, completion={usage.completion_tokens},"
            f" total={usage.total_tokens})"
        )
    print(line, flush=True)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m testkit.client", description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="127.0.0.1:50061", help="the sidecar's host:port")
    parser.add_argument("--prompt", default="1,2,3,4", help="comma-separated prompt token ids")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--request-id", default="")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument(
        "--wait-secs",
        type=float,
        default=0.0,
        help="first wait up to this long for the sidecar's health to say SERVING (a sidecar just"
        " started connects to its engine first); 0: call at once (default: 0)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    request = sidecar_pb2.PreprocessedRequest(
        request_id=args.request_id,
        token_ids=[int(t) for t in args.prompt.split(",") if t.strip()],
        stop_conditions=sidecar_pb2.StopConditions(max_tokens=args.max_tokens),
    )
    if args.wait_secs > 0:
        try:
            asyncio.run(wait_serving(args.target, timeout=args.wait_secs))
        except TimeoutError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    result = asyncio.run(generate(args.target, request, timeout=args.timeout, echo=True))
    if result.error is not None:
        print(f"error: {result.error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
