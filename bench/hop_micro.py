"""Per-chunk cost of the sidecar's own hot path, in process: no sockets, no grpc.

What one engine chunk costs between the engine's native message and the frontend's write:
the vLLM response conversion, the stream-shape tracker, the relay's buffer and writer, the
delivery bookkeeping. The engine stream is a list of prepared native messages (the servicer's
streaming shape, one token per chunk, optionally with logprobs) and the write does nothing, so
only the sidecar's own Python runs. Reported: the minimum over ``--rounds`` of the mean time
per chunk, in CPU time of this process (on a shared machine, wall time mostly measures the
neighbours; the minimum is the round least disturbed by cache and scheduler effects).

Run: ``python -m bench.hop_micro [--chunks 2048] [--rounds 15] [--logprobs]``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator

from smg_grpc_proto.generated import vllm_engine_pb2

from sidecar_common.api import sidecar_pb2
from sidecar_common.dispatch import Generation
from sidecar_common.engine import GenerateCall
from sidecar_common.relay import RelayConfig, relay
from sidecar_vllm.convert import ResponseState

__all__ = ["main", "per_chunk_seconds"]


def _messages(chunks: int, logprobs: bool) -> list[vllm_engine_pb2.GenerateResponse]:
    out = []
    for i in range(chunks):
        c = vllm_engine_pb2.GenerateStreamChunk(token_ids=[i], completion_tokens=1, index=0)
        if logprobs:
            c.output_logprobs.token_ids.append(i)
            c.output_logprobs.token_logprobs.append(-0.5)
        out.append(vllm_engine_pb2.GenerateResponse(chunk=c))
    done = vllm_engine_pb2.GenerateComplete(
        output_ids=[chunks - 1], finish_reason="length", completion_tokens=1, index=0
    )
    if logprobs:
        done.output_logprobs.token_ids.append(chunks - 1)
        done.output_logprobs.token_logprobs.append(-0.5)
    out.append(vllm_engine_pb2.GenerateResponse(complete=done))
    return out


class _Engine:
    """Feeds prepared native messages through the vLLM conversion (what the adapter does)."""

    name = "vllm"

    def __init__(self, messages: list[vllm_engine_pb2.GenerateResponse]) -> None:
        self._messages = messages

    async def generate(self, call: GenerateCall) -> AsyncIterator[sidecar_pb2.LLMEngineOutput]:
        state = ResponseState(call.request, "agg")
        for message in self._messages:
            for out in state.feed(message):
                yield out
            if state.finished:
                return

    async def abort(self, private_id: str) -> None:
        raise AssertionError("a finished stream is never aborted")


async def _noop_write(out: sidecar_pb2.LLMEngineOutput) -> None:
    return None


async def _one_round(messages: list[vllm_engine_pb2.GenerateResponse], logprobs: bool) -> float:
    request = sidecar_pb2.PreprocessedRequest(request_id="bench", token_ids=[1, 2, 3])
    if logprobs:
        request.output_options.logprobs = 0
    call = GenerateCall(request, "00000000000000000000-bench", False)
    gen = Generation(_Engine(messages), call)  # type: ignore[arg-type]
    start = time.process_time()
    await relay(gen, _noop_write, RelayConfig())
    return (time.process_time() - start) / len(messages)


def per_chunk_seconds(chunks: int, rounds: int, logprobs: bool) -> float:
    messages = _messages(chunks, logprobs)

    async def run() -> float:
        await _one_round(messages, logprobs)  # warm-up
        return min([await _one_round(messages, logprobs) for _ in range(rounds)])

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--logprobs", action="store_true")
    args = parser.parse_args()
    seconds = per_chunk_seconds(args.chunks, args.rounds, args.logprobs)
    print(
        f"hot path per chunk: {seconds * 1e6:.2f} us "
        f"(min of {args.rounds} rounds x {args.chunks} chunks, logprobs={args.logprobs})"
    )


if __name__ == "__main__":
    main()
