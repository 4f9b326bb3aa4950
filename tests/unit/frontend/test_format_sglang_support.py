"""Shared helpers for the SGLang format plugin's tests (no tests here): contexts, parsing, a
driver that feeds outputs to the encoder as the handler does, and an SSE reader."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.formats.base import FormatContext, GenerateCall, HttpReply, WorkerFailure, parse_whole
from sidecar_frontend.formats.sglang import FORMAT, GENERATE, SglangFormat
from sidecar_frontend.formats.sglang.plan import SglangOptions

HEADERS = {"Content-Type": "application/json"}
STARTED_AT = 100.0  # the handler's monotonic clock
WALL_TIME = 1_796_113_361.0  # Unix seconds at arrival


def context(*, inflight: Sequence[str] = (), wall_time: float = WALL_TIME, **info: Any) -> FormatContext:
    fields: dict[str, Any] = {
        "engine": "sglang",
        "served_model_name": "my-model",
        "model_path": "/models/my-model",
        "max_context_length": 4096,
        "vocab_size": 32000,
        "eos_token_ids": [2],
    }
    fields.update(info)
    counter = itertools.count()
    return FormatContext(
        model_info=sidecar_pb2.ModelInfo(**fields),
        new_id=lambda: f"{next(counter):032x}",
        inflight_ids=frozenset(inflight),
        wall_time=wall_time,
    )


def fresh_id(n: int) -> str:
    """The n-th id the test context's ``new_id`` hands out."""
    return f"{n:032x}"


def parse(
    obj: object, ctx: FormatContext | None = None, *, incremental: bool = False
) -> GenerateCall | HttpReply:
    """Parsed by the SGLang format (``incremental``: made with --incremental-streaming-output)."""
    raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    fmt = SglangFormat(incremental_streaming_output=incremental) if incremental else FORMAT
    return parse_whole(fmt, GENERATE, raw, HEADERS, ctx or context())


def accepted(obj: object, ctx: FormatContext | None = None, *, incremental: bool = False) -> GenerateCall:
    call = parse(obj, ctx, incremental=incremental)
    assert isinstance(call, GenerateCall), call
    return call


def one(obj: object, ctx: FormatContext | None = None) -> sidecar_pb2.PreprocessedRequest:
    call = accepted(obj, ctx)
    assert len(call.requests) == 1
    return call.requests[0]


def refused(obj: object, ctx: FormatContext | None = None) -> HttpReply:
    reply = parse(obj, ctx)
    assert isinstance(reply, HttpReply), reply
    return reply


def body(reply: HttpReply) -> Any:
    return json.loads(reply.body)


def options(call: GenerateCall) -> SglangOptions:
    assert isinstance(call.options, SglangOptions)
    return call.options


def out(
    tokens: Sequence[int] = (),
    finish: int = sidecar_pb2.UNSPECIFIED,
    *,
    logprobs: Sequence[float] | None = None,
    stop_token: int | None = None,
    usage: tuple[int, int] | None = None,
    cached: int | None = None,
    prompt_logprobs: list[Any] | None = None,
    tops: Sequence[Sequence[tuple[int, float]]] | None = None,
) -> sidecar_pb2.LLMEngineOutput:
    """One sidecar output: ``tokens`` is the delta; ``usage`` (prompt, completion) on terminals."""
    message = sidecar_pb2.LLMEngineOutput(token_ids=tokens, finish_reason=finish)  # type: ignore[arg-type]
    if logprobs is not None:
        message.log_probs.extend(logprobs)
    if tops is not None:
        for row in tops:
            message.top_logprobs.add().entries.extend(
                sidecar_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in row
            )
    if stop_token is not None:
        message.stop_token_id = stop_token
    if usage is not None:
        message.completion_usage.prompt_tokens, message.completion_usage.completion_tokens = usage
        message.completion_usage.total_tokens = sum(usage)
        if cached is not None:
            message.completion_usage.cached_tokens = cached
    if prompt_logprobs is not None:
        message.engine_data.update({"prompt_logprobs": prompt_logprobs})
    return message


Step = tuple[int, "sidecar_pb2.LLMEngineOutput | WorkerFailure", float]


def drive(call: GenerateCall, steps: Sequence[Step]) -> tuple[bytes, HttpReply | None]:
    """Feed (index, output or failure, now) steps as the handler does; the stream's bytes
    (with ``close()``) and, for unary calls, the reply. Stops at ``aborted`` as the handler."""
    encoder = FORMAT.new_encoder(call, STARTED_AT)
    written = b""
    for index, item, now in steps:
        if isinstance(item, WorkerFailure):
            written += encoder.on_failure(index, item, now)
            if encoder.aborted:
                break
        else:
            written += encoder.on_output(index, item, now)
    if call.stream:
        return written + encoder.close(), None
    assert written == b""
    return written, encoder.reply()


def sse_events(data: bytes) -> list[Any]:
    """The stream's events in order; ``[DONE]`` as the string ``"[DONE]"``. Checks the framing."""
    assert data.endswith(b"\n\n"), data
    events: list[Any] = []
    for block in data.split(b"\n\n")[:-1]:
        assert block.startswith(b"data: "), block
        assert b"\n" not in block, block
        payload = block[len(b"data: ") :]
        events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events
