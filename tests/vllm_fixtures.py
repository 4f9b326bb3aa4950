"""Builders of vLLM engine messages in the shape of vLLM's own servicer, for the vLLM tests.

``servicer_stream`` reproduces what ``smg_grpc_servicer.vllm.servicer`` sends in streaming
mode: one chunk per engine step with that step's new tokens (counts per message), and after
the finishing step a ``complete`` whose ``output_ids`` restate that final delta.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

from smg_grpc_proto.generated import vllm_engine_pb2

__all__ = ["chunk", "complete", "output_logprobs", "servicer_stream"]

Resp: TypeAlias = vllm_engine_pb2.GenerateResponse


def output_logprobs(
    ids: Sequence[int], values: Sequence[float], tops: Sequence[Sequence[tuple[int, float]]] | None = None
) -> vllm_engine_pb2.OutputLogProbs:
    lp = vllm_engine_pb2.OutputLogProbs(token_ids=ids, token_logprobs=values)
    for top in tops or ():
        lp.top_logprobs.add(token_ids=[t for t, _ in top], values=[v for _, v in top])
    return lp


def chunk(
    ids: Sequence[int],
    index: int = 0,
    *,
    prompt: int = 3,
    cached: int = 0,
    logprobs: vllm_engine_pb2.OutputLogProbs | None = None,
    input_logprobs: vllm_engine_pb2.InputLogProbs | None = None,
) -> Resp:
    c = vllm_engine_pb2.GenerateStreamChunk(
        token_ids=ids, prompt_tokens=prompt, completion_tokens=len(ids), cached_tokens=cached, index=index
    )
    if logprobs is not None:
        c.output_logprobs.CopyFrom(logprobs)
    if input_logprobs is not None:
        c.input_logprobs.CopyFrom(input_logprobs)
    return Resp(chunk=c)


def complete(
    ids: Sequence[int],
    reason: str = "length",
    index: int = 0,
    *,
    prompt: int = 3,
    cached: int = 0,
    matched_token: int | None = None,
    matched_str: str | None = None,
    kv_json: str | None = None,
    logprobs: vllm_engine_pb2.OutputLogProbs | None = None,
) -> Resp:
    c = vllm_engine_pb2.GenerateComplete(
        output_ids=ids,
        finish_reason=reason,
        prompt_tokens=prompt,
        completion_tokens=len(ids),
        cached_tokens=cached,
        index=index,
    )
    if matched_token is not None:
        c.matched_token_id = matched_token
    if matched_str is not None:
        c.matched_stop_str = matched_str
    if kv_json is not None:
        c.kv_transfer_params_json = kv_json
    if logprobs is not None:
        c.output_logprobs.CopyFrom(logprobs)
    return Resp(complete=c)


def servicer_stream(deltas: Sequence[Sequence[int]], reason: str = "length", index: int = 0) -> list[Resp]:
    """One choice's messages as the real servicer streams them."""
    if not deltas:
        deltas = [[]]
    msgs = [chunk(d, index) for d in deltas]
    msgs.append(complete(deltas[-1], reason, index))
    return msgs
