"""The stand-in vLLM gRPC engine of ``bench.full_path``: it answers every request at once and
does no other work, so that what the benchmark measures is the proxies in front of it.

It speaks vLLM's native API (``vllm.grpc.engine.VllmEngine`` from ``smg-grpc-proto``) as far as
both proxies use it: ``Generate`` (streamed: one token per ``chunk``, then a ``complete`` that
restates the last chunk, as vLLM's servicer does; not streamed: one ``complete`` holding every
token), ``HealthCheck``, ``Abort``, ``GetModelInfo``, ``GetServerInfo``, ``GetLoads`` and the
standard gRPC health service. ``GetModelInfo`` names ``--model-path`` as the model and its
tokenizer: SMG loads its tokenizer from there (``bench.smg`` writes one); our sidecar reads
only the names and limits.

Cheapness is the point: each message is serialized once (per prompt length and position) and
then sent as raw bytes, so the engine's share of CPU 0, which it shares with the load
generator, stays small. Every request is generated to its ``max_tokens`` (``ignore_eos`` or
not: the ids never hit an end-of-sequence token).

Run as its own process: ``python -m bench.full_path_engine --listen H:P --model-path DIR``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from bench.grpc_serve import serve_until_signal

__all__ = ["main"]

_SERVICE = "vllm.grpc.engine.VllmEngine"
_FIRST_TOKEN = 100  # output ids cycle through 100..1099: inside any vocabulary, never EOS (2)
_ID_CYCLE = 1000
_DEFAULT_MAX_TOKENS = 16
_MAX_CONTEXT = 32768


def token_id(position: int) -> int:
    """The id the engine generates at ``position`` (0-based) of every output."""
    return _FIRST_TOKEN + position % _ID_CYCLE


class _Messages:
    """Serialized responses, built once per (prompt length, position) and reused."""

    def __init__(self) -> None:
        self._chunks: dict[tuple[int, int], bytes] = {}
        self._last: dict[tuple[int, int], bytes] = {}
        self._whole: dict[tuple[int, int], bytes] = {}

    def chunk(self, prompt_tokens: int, position: int) -> bytes:
        key = (prompt_tokens, position)
        raw = self._chunks.get(key)
        if raw is None:
            raw = pb.GenerateResponse(
                chunk=pb.GenerateStreamChunk(
                    token_ids=[token_id(position)], prompt_tokens=prompt_tokens, completion_tokens=1
                )
            ).SerializeToString()
            self._chunks[key] = raw
        return raw

    def streamed_complete(self, prompt_tokens: int, total: int) -> bytes:
        """The terminal of a streamed request: the final delta (its last token) again."""
        key = (prompt_tokens, total)
        raw = self._last.get(key)
        if raw is None:
            raw = _complete([token_id(total - 1)], prompt_tokens)
            self._last[key] = raw
        return raw

    def whole_complete(self, prompt_tokens: int, total: int) -> bytes:
        """The only message of a request that did not ask to stream: every token."""
        key = (prompt_tokens, total)
        raw = self._whole.get(key)
        if raw is None:
            raw = _complete([token_id(i) for i in range(total)], prompt_tokens)
            self._whole[key] = raw
        return raw


def _complete(ids: list[int], prompt_tokens: int) -> bytes:
    message = pb.GenerateResponse(
        complete=pb.GenerateComplete(
            output_ids=ids, finish_reason="length", prompt_tokens=prompt_tokens, completion_tokens=len(ids)
        )
    )
    raw: bytes = message.SerializeToString()
    return raw


class _Engine:
    def __init__(self, model_path: str, served_model_name: str, max_num_seqs: int) -> None:
        self.model_path = model_path
        self.served_model_name = served_model_name
        self.max_num_seqs = max_num_seqs
        self.messages = _Messages()
        self.running = 0
        self.started_at = time.monotonic()
        self.last_receive = time.time()

    async def generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[bytes]:
        self.last_receive = time.time()
        params = request.sampling_params
        total = params.max_tokens if params.HasField("max_tokens") else _DEFAULT_MAX_TOKENS
        prompt = len(request.tokenized.input_ids)
        self.running += 1
        try:
            if not request.stream:
                yield self.messages.whole_complete(prompt, total)
                return
            chunk = self.messages.chunk
            for position in range(total):
                yield chunk(prompt, position)
            yield self.messages.streamed_complete(prompt, total)
        finally:
            self.running -= 1

    async def health_check(self, request: pb.HealthCheckRequest, context: Any) -> pb.HealthCheckResponse:
        return pb.HealthCheckResponse(healthy=True, message="Health")

    async def abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortResponse:
        # Nothing to stop: a cancelled Generate call ends its generator on its own.
        return pb.AbortResponse()

    async def model_info(self, request: pb.GetModelInfoRequest, context: Any) -> pb.GetModelInfoResponse:
        return pb.GetModelInfoResponse(
            model_path=self.model_path,
            is_generation=True,
            max_context_length=_MAX_CONTEXT,
            vocab_size=32000,
            served_model_name=self.served_model_name,
            tokenizer_path=self.model_path,
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            eos_token_ids=[2],
            pad_token_id=0,
            bos_token_id=1,
            max_req_input_len=_MAX_CONTEXT,
        )

    async def server_info(self, request: pb.GetServerInfoRequest, context: Any) -> pb.GetServerInfoResponse:
        return pb.GetServerInfoResponse(
            active_requests=self.running,
            last_receive_timestamp=self.last_receive,
            uptime_seconds=time.monotonic() - self.started_at,
            server_type="vllm-grpc",
            data_parallel_size=1,
            kv_cache_dtype="auto",
            block_size=16,
            model_dtype="torch.bfloat16",
            max_num_seqs=self.max_num_seqs,
        )

    async def loads(self, request: pb.GetLoadsRequest, context: Any) -> pb.GetLoadsResponse:
        load = pb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=self.running,
            num_total_reqs=self.running,
            max_total_num_tokens=1 << 24,
            max_running_requests=self.max_num_seqs,
            utilization=self.running / self.max_num_seqs,
        )
        return pb.GetLoadsResponse(
            timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            version="bench",
            dp_rank_count=1,
            loads=[load],
        )


def _handler(engine: _Engine) -> grpc.GenericRpcHandler[Any, Any]:
    def unary(fn: Any, request_type: Any) -> grpc.RpcMethodHandler[Any, Any]:
        return grpc.unary_unary_rpc_method_handler(
            fn,
            request_deserializer=request_type.FromString,
            response_serializer=lambda message: message.SerializeToString(),
        )

    methods = {
        # Generate's responses are already bytes: no serializer.
        "Generate": grpc.unary_stream_rpc_method_handler(
            engine.generate, request_deserializer=pb.GenerateRequest.FromString
        ),
        "HealthCheck": unary(engine.health_check, pb.HealthCheckRequest),
        "Abort": unary(engine.abort, pb.AbortRequest),
        "GetModelInfo": unary(engine.model_info, pb.GetModelInfoRequest),
        "GetServerInfo": unary(engine.server_info, pb.GetServerInfoRequest),
        "GetLoads": unary(engine.loads, pb.GetLoadsRequest),
    }
    return grpc.method_handlers_generic_handler(_SERVICE, methods)


# gRPC core refuses calls the application has not taken up yet past a soft limit (at random)
# and a hard one, and cancels one left waiting 30 s: a Python server busy streaming takes up
# about one new call per event-loop turn, so a burst of 2,048 calls would fail here, at the
# stand-in, on either side. Lifted: a call waits for its turn, it is never refused.
_SERVER_OPTIONS = [
    ("grpc.server.max_pending_requests", 1 << 20),
    ("grpc.server.max_pending_requests_hard_limit", 1 << 20),
    ("grpc.server_max_unrequested_time_in_server", 24 * 3600),
]


async def _serve(listen: str, engine: _Engine) -> None:
    server = grpc.aio.server(options=_SERVER_OPTIONS)
    server.add_generic_rpc_handlers((_handler(engine),))
    await serve_until_signal(server, listen, "full_path_engine")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.full_path_engine", description=__doc__)
    parser.add_argument("--listen", required=True, help="HOST:PORT")
    parser.add_argument("--model-path", required=True, help="directory GetModelInfo names (a tokenizer)")
    parser.add_argument("--served-model-name", default="bench-model")
    parser.add_argument("--max-num-seqs", type=int, default=16384, help="reported only: nothing waits")
    args = parser.parse_args(argv)
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    engine = _Engine(args.model_path, args.served_model_name, args.max_num_seqs)
    asyncio.run(_serve(args.listen, engine))


if __name__ == "__main__":
    main()
