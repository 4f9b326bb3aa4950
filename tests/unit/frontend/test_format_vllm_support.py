"""Shared helpers for the vLLM format plugin's tests (no tests here): contexts, parsing, SSE."""

from __future__ import annotations

import json
from typing import Any

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.formats.base import FormatContext, GenerateCall, HttpReply, parse_whole
from sidecar_frontend.formats.vllm import FORMAT, GENERATE
from sidecar_frontend.formats.vllm.plan import VllmOptions

JSON_HEADERS = {"Content-Type": "application/json"}
NEW_ID = "842536af25e84b36" + "0" * 16
WALL_TIME = 1796113919.7  # Unix seconds at arrival; the encoders' clock is monotonic


def context(**info: Any) -> FormatContext:
    fields: dict[str, Any] = {
        "engine": "vllm",
        "served_model_name": "my-model",
        "model_path": "/models/my-model",
        "max_context_length": 4096,
        "vocab_size": 32000,
        "max_num_seqs": 256,
        "data_parallel_size": 2,
        "disaggregation_mode": "agg",
        "eos_token_ids": [2],
    }
    fields.update(info)
    return FormatContext(
        model_info=sidecar_pb2.ModelInfo(**fields), new_id=lambda: NEW_ID, wall_time=WALL_TIME
    )


def body_of(obj: object) -> bytes:
    return json.dumps(obj).encode()


def parse(
    obj: object, headers: dict[str, str] | None = None, ctx: FormatContext | None = None
) -> GenerateCall | HttpReply:
    raw = obj if isinstance(obj, bytes) else body_of(obj)
    return parse_whole(FORMAT, GENERATE, raw, JSON_HEADERS if headers is None else headers, ctx or context())


def accepted(
    obj: object, headers: dict[str, str] | None = None, ctx: FormatContext | None = None
) -> GenerateCall:
    call = parse(obj, headers, ctx)
    assert isinstance(call, GenerateCall), call
    assert len(call.requests) == 1
    return call


def refused(
    obj: object, headers: dict[str, str] | None = None, ctx: FormatContext | None = None
) -> HttpReply:
    reply = parse(obj, headers, ctx)
    assert isinstance(reply, HttpReply), reply
    return reply


def options(call: GenerateCall) -> VllmOptions:
    assert isinstance(call.options, VllmOptions)
    return call.options


def error_of(reply: HttpReply) -> dict[str, Any]:
    body = json.loads(reply.body)
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert list(error) == ["message", "type", "param", "code"]
    assert error["code"] == reply.status
    return error


def sse_events(data: bytes) -> list[Any]:
    """The stream's events in order; ``[DONE]`` as the string ``"[DONE]"``. Checks framing and bytes."""
    assert data.endswith(b"\n\n"), data
    events: list[Any] = []
    for block in data.split(b"\n\n")[:-1]:
        assert block.startswith(b"data: "), block
        payload = block[len(b"data: ") :]
        if payload == b"[DONE]":
            events.append("[DONE]")
            continue
        event = json.loads(payload)
        # Byte-exact: chunks are compact JSON; vLLM writes its error event with json.dumps defaults.
        canonical = (
            json.dumps(event)
            if "error" in event
            else json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        )
        assert payload == canonical.encode(), payload
        events.append(event)
    return events
