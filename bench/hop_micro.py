"""Per-chunk cost of the sidecar's own hot path, in process: no sockets, no grpc.

What one engine chunk costs between the engine's native message and the frontend's write:
the vLLM response conversion, the per-choice tracker (engine side and delivered side), the
relay's buffer and writer. The engine stream is a list of prepared native messages (the servicer's
streaming shape, one token per chunk, optionally with logprobs) and the write does nothing, so
only the sidecar's own Python runs. Reported: the minimum over ``--rounds`` of the mean time
per chunk, in CPU time of this process (on a shared machine, wall time mostly measures the
neighbours; the minimum is the round least disturbed by cache and scheduler effects), for the
whole relay and for its synchronous part alone (conversion and tracker, five times as many
rounds: they are short).

Run: ``python -m bench.hop_micro [--chunks 256] [--rounds 60] [--logprobs]``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator

from smg_grpc_proto.generated import vllm_engine_pb2

from sidecar_common.api import sidecar_pb2
from sidecar_server.dispatch import ChoiceTracker, Generation
from sidecar_server.engine import GenerateCall
from sidecar_server.relay import RelayConfig, relay
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
    call = GenerateCall(_request(logprobs), "00000000000000000000-bench", False)
    gen = Generation(_Engine(messages), call)  # type: ignore[arg-type]
    start = time.process_time()
    await relay(gen, _noop_write, RelayConfig())
    return (time.process_time() - start) / len(messages)


def _request(logprobs: bool) -> sidecar_pb2.PreprocessedRequest:
    request = sidecar_pb2.PreprocessedRequest(request_id="bench", token_ids=[1, 2, 3])
    if logprobs:
        request.output_options.logprobs = 0
    return request


def _sync_round(messages: list[vllm_engine_pb2.GenerateResponse], logprobs: bool) -> float:
    """Only the synchronous part: conversion and the tracker's two sides, per chunk."""
    state = ResponseState(_request(logprobs), "agg")
    tracker = ChoiceTracker("vllm", 1)
    start = time.process_time()
    for message in messages:
        for out in state.feed(message):
            tracker.observe(out)
            tracker.delivered(out)
    return (time.process_time() - start) / len(messages)


def sync_per_chunk_seconds(chunks: int, rounds: int, logprobs: bool) -> float:
    messages = _messages(chunks, logprobs)
    _sync_round(messages, logprobs)  # warm-up
    return min(_sync_round(messages, logprobs) for _ in range(rounds))


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
    relayed = per_chunk_seconds(args.chunks, args.rounds, args.logprobs)
    converted = sync_per_chunk_seconds(args.chunks, args.rounds * 5, args.logprobs)
    print(
        f"per chunk: relay {relayed * 1e6:.2f} us, conversion + tracker {converted * 1e6:.2f} us "
        f"(min of rounds of {args.chunks} chunks, logprobs={args.logprobs})"
    )


if __name__ == "__main__":
    main()
