"""A small format plugin for the handler's tests: JSON in, one SSE event per output out.

``POST /t/generate`` ``{"ids": [...], "max": 6, "rid": "x", "stream": true, "subs": 2}``
runs ``subs`` sub-requests (all with ``rid``). Streaming: ``data: {"i", "ids", "finish"}``
per output, ``data: {"i", "error", "message"}`` per failure, ``data: [DONE]``. Unary:
``{"outputs": [{"ids", "finish", "error"}...]}``. ``"fatal": true`` makes the first failure
end the whole response (``encoder.aborted``). ``POST /t/abort`` ``{"rid": "x"}`` or
``{"all": true}`` answers ``{"aborted": N}``. ``GET /health`` and ``GET /t/model`` answer
from the context.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.formats.base import (
    AbortCall,
    FormatContext,
    GenerateBody,
    GenerateCall,
    HttpReply,
    Route,
    RouteKind,
    WorkerFailure,
    named_model,
)

GENERATE = Route(("POST",), "/t/generate", RouteKind.GENERATE)
ABORT = Route(("POST",), "/t/abort", RouteKind.ABORT)
HEALTH = Route(("GET",), "/health", RouteKind.INFO)
MODEL = Route(("GET",), "/t/model", RouteKind.INFO)


def _json(status: int, value: object) -> HttpReply:
    return HttpReply(status, json.dumps(value).encode())


@dataclass
class _Options:
    fatal: bool


@dataclass
class ProbeEncoder:
    stream: bool
    fatal: bool
    count: int
    ids: list[list[int]] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    _aborted: bool = False

    def __post_init__(self) -> None:
        self.ids = [[] for _ in range(self.count)]
        self.finish = [None] * self.count
        self.errors = [None] * self.count

    @property
    def aborted(self) -> bool:
        return self._aborted

    def on_output(self, index: int, output: sidecar_pb2.LLMEngineOutput, now: float) -> bytes:
        self.ids[index].extend(output.token_ids)
        finish = None
        if output.finish_reason != sidecar_pb2.UNSPECIFIED:
            finish = sidecar_pb2.FinishReason.Name(output.finish_reason)
            self.finish[index] = finish
        if not self.stream:
            return b""
        event = {"i": index, "ids": list(output.token_ids), "finish": finish}
        return b"data: " + json.dumps(event).encode() + b"\n\n"

    def on_failure(self, index: int, failure: WorkerFailure, now: float) -> bytes:
        self.errors[index] = failure.reason.value
        if self.fatal:
            self._aborted = True
        if not self.stream:
            return b""
        event = {"i": index, "error": failure.reason.value, "message": failure.message}
        return b"data: " + json.dumps(event).encode() + b"\n\n"

    def close(self) -> bytes:
        return b"data: [DONE]\n\n"

    def reply(self) -> HttpReply:
        outputs = [
            {"ids": ids, "finish": finish, "error": error}
            for ids, finish, error in zip(self.ids, self.finish, self.errors, strict=True)
        ]
        return _json(200, {"outputs": outputs})


class ProbeFormat:
    name = "test"
    routes: Sequence[Route] = (GENERATE, ABORT, HEALTH, MODEL)

    def read_generate(
        self, route: Route, body: bytes, headers: Mapping[str, str]
    ) -> GenerateBody | HttpReply:
        try:
            data = json.loads(body)
        except ValueError:
            return self.error_reply(400, "body: not JSON")
        return GenerateBody(data, named_model(data))

    def parse_generate(
        self, route: Route, body: GenerateBody, headers: Mapping[str, str], ctx: FormatContext
    ) -> GenerateCall | HttpReply:
        data: dict[str, Any] = body.data  # type: ignore[assignment]
        if not isinstance(data.get("ids"), list) or not data["ids"]:
            return self.error_reply(400, "ids: required")
        rid = str(data.get("rid") or ctx.new_id())
        requests = []
        for _ in range(int(data.get("subs", 1))):
            request = sidecar_pb2.PreprocessedRequest(request_id=rid, token_ids=data["ids"])
            request.stop_conditions.max_tokens = int(data.get("max", 6))
            requests.append(request)
        return GenerateCall(requests, bool(data.get("stream")), _Options(bool(data.get("fatal"))))

    def new_encoder(self, call: GenerateCall, started_at: float) -> ProbeEncoder:
        assert isinstance(call.options, _Options)
        return ProbeEncoder(call.stream, call.options.fatal, len(call.requests))

    def parse_abort(self, route: Route, body: bytes, headers: Mapping[str, str]) -> AbortCall | HttpReply:
        data = json.loads(body or b"{}")
        if data.get("all"):
            return AbortCall(all_requests=True)
        return AbortCall((str(data["rid"]),))

    def abort_reply(self, route: Route, call: AbortCall, aborted: int) -> HttpReply:
        return _json(200, {"aborted": aborted})

    def info(self, route: Route, ctx: FormatContext) -> HttpReply:
        if route == HEALTH:
            return HttpReply(200, b"", content_type="")
        return _json(200, {"model": ctx.model_info.served_model_name})

    def error_reply(self, status: int, message: str) -> HttpReply:
        return _json(status, {"error": message, "status": status})

    def model_not_found(self, model: str, served: Sequence[str]) -> HttpReply:
        return _json(404, {"error": f"no model {model}", "served": list(served), "status": 404})


FORMAT = ProbeFormat()
