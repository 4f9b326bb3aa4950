"""SGLang's native HTTP API (0.5.23, a server without a tokenizer) as a pure format plugin.

``FORMAT`` implements :class:`~sidecar_frontend.formats.base.Format`: ``/generate`` (POST and
PUT), ``/abort_request``, and the informational routes a ``/generate`` client reads. A
``/generate`` body is read once and judged by :func:`.validate.validate`, whose stages run in
one order (the request model in ``model``, the contract gate in ``checks``, SGLang's value
checks in ``values``, the sub-requests in ``plan``); responses are encoded in ``response``,
SGLang's bytes and error bodies written in ``wire``. What we serve and where we deliberately
differ from the real server: docs/frontend-sglang.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Final

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.formats.base import (
    AbortCall,
    Encoder,
    FormatContext,
    GenerateBody,
    GenerateCall,
    HttpReply,
    Route,
    RouteKind,
)
from sidecar_frontend.formats.sglang import validate
from sidecar_frontend.formats.sglang.model import ModelErrors, validate_abort
from sidecar_frontend.formats.sglang.plan import SglangOptions
from sidecar_frontend.formats.sglang.response import SglangEncoder
from sidecar_frontend.formats.sglang.wire import dumps, status_error

__all__ = ["FORMAT", "SglangFormat"]

# The SGLang release whose HTTP behaviour this plugin reproduces (reported by /server_info).
SGLANG_API_VERSION: Final = "0.5.23"

GENERATE: Final = Route(("POST", "PUT"), "/generate", RouteKind.GENERATE)
ABORT: Final = Route(("POST",), "/abort_request", RouteKind.ABORT)
_INFO_PATHS: Final = (
    "/health",
    "/health_generate",
    "/model_info",
    "/get_model_info",
    "/server_info",
    "/get_server_info",
    "/v1/models",
)
_EMPTY: Final = HttpReply(200, b"", content_type="")


# What SGLang reports as its weight version when none was given (its --weight-version default).
DEFAULT_WEIGHT_VERSION: Final = "default"


def _model_info(info: sidecar_pb2.ModelInfo, weight_version: str | None) -> dict[str, object]:
    # SGLang answers its current version here (the tokenizer manager's, moved by
    # /update_weight_version; http_server.py model_info): the fleet's newest stands for it.
    return {
        "model_path": info.model_path,
        "served_model_name": info.served_model_name,
        "tokenizer_path": info.tokenizer_path or None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": weight_version or DEFAULT_WEIGHT_VERSION,
        "reasoning_parser": None,
        "tool_call_parser": None,
        # The frontend is one aggregated server to its clients, whatever the sidecars run.
        "disaggregation_mode": "null",
        "has_image_understanding": info.supports_vision,
        "has_audio_understanding": False,
    }


def _server_info(info: sidecar_pb2.ModelInfo, incremental: bool) -> dict[str, object]:
    context = info.max_context_length or None
    tokens = info.kv_block_size * info.total_kv_blocks
    return {
        "model_path": info.model_path,
        "served_model_name": info.served_model_name,
        "tokenizer_path": info.tokenizer_path or None,
        "skip_tokenizer_init": True,
        "context_length": context,
        "stream_interval": 1,
        "incremental_streaming_output": incremental,
        "dp_size": max(info.data_parallel_size, 1),
        "disaggregation_mode": "null",
        "max_req_input_len": context - 6 if context else None,
        "max_total_num_tokens": tokens or None,
        # SGLang's /server_info is its launch configuration: the --weight-version it was started
        # with, never moved by an update (http_server.py server_info; /model_info has the
        # current one). The frontend is launched with none.
        "weight_version": DEFAULT_WEIGHT_VERSION,
        "version": SGLANG_API_VERSION,
        "frontend": "sidecar",
    }


def _models(ctx: FormatContext) -> dict[str, object]:
    # One card per model the fleet serves (SGLang lists its one served model).
    return {"object": "list", "data": [_card(info, ctx) for info in ctx.models or (ctx.model_info,)]}


def _card(info: sidecar_pb2.ModelInfo, ctx: FormatContext) -> dict[str, object]:
    return {
        "id": info.served_model_name,
        "object": "model",
        "created": int(ctx.wall_time),
        "owned_by": "sglang",
        "root": info.served_model_name,
        "parent": None,
        "max_model_len": info.max_context_length or None,
    }


class SglangFormat:
    """SGLang ``/generate`` and friends, with the server options they depend on.

    ``incremental_streaming_output``: as SGLang's --incremental-streaming-output, a stream's
    events carry only what is new (cumulative output otherwise).
    """

    name = "sglang"
    routes: Sequence[Route] = (
        GENERATE,
        ABORT,
        *(Route(("GET",), path, RouteKind.INFO) for path in _INFO_PATHS),
    )

    def __init__(self, *, incremental_streaming_output: bool = False) -> None:
        self.incremental_streaming_output = incremental_streaming_output

    def read_generate(
        self, route: Route, body: bytes, headers: Mapping[str, str]
    ) -> GenerateBody | HttpReply:
        return validate.read(body, headers)

    def parse_generate(
        self, route: Route, body: GenerateBody, headers: Mapping[str, str], ctx: FormatContext
    ) -> GenerateCall | HttpReply:
        return validate.validate(body, ctx, incremental=self.incremental_streaming_output)

    def new_encoder(self, call: GenerateCall, started_at: float) -> Encoder:
        assert isinstance(call.options, SglangOptions)
        return SglangEncoder(call.options, stream=call.stream, started_at=started_at)

    def parse_abort(self, route: Route, body: bytes, headers: Mapping[str, str]) -> AbortCall | HttpReply:
        # SGLang's AbortReq, as its framework's pydantic validates it (lax: "yes" is true).
        try:
            request = validate_abort(validate.read_body(body, headers))
        except ModelErrors as err:
            return err.reply()
        rid, abort_all = request.rid, request.abort_all
        if abort_all:
            return AbortCall(all_requests=True)
        # SGLang drops an abort with an empty rid (it would prefix-match every request), and
        # aborts by prefix a rid in flight (its scheduler's rule).
        return AbortCall(request_ids=(rid,) if rid else (), by_prefix=True)

    def abort_reply(self, route: Route, call: AbortCall, aborted: int) -> HttpReply:
        # 200 with an empty body whatever was (or was not) aborted, as SGLang answers.
        return _EMPTY

    def info(self, route: Route, ctx: FormatContext) -> HttpReply:
        info = ctx.model_info
        if route.path in ("/health", "/health_generate"):
            # Before any worker has served the model, SGLang's answer while starting: 503.
            return _EMPTY if info.served_model_name else HttpReply(503, b"", content_type="")
        if route.path in ("/model_info", "/get_model_info"):
            return HttpReply(200, dumps(_model_info(info, ctx.weight_version)))
        if route.path in ("/server_info", "/get_server_info"):
            return HttpReply(200, dumps(_server_info(info, self.incremental_streaming_output)))
        if route.path == "/v1/models":
            return HttpReply(200, dumps(_models(ctx)))
        return self.error_reply(404, "Not Found")

    def error_reply(self, status: int, message: str) -> HttpReply:
        if status in (404, 405):
            # FastAPI's own answers for an unknown path or a wrong method.
            return HttpReply(status, dumps({"detail": HTTPStatus(status).phrase}))
        return status_error(status, message)

    def model_not_found(self, model: str, served: Sequence[str]) -> HttpReply:
        # SGLang serves one model and has no such answer; its error body for a non-400 status.
        return status_error(404, f"The model `{model}` does not exist. Served models: {', '.join(served)}.")


# The format with SGLang's default options (the frontend makes its own from its flags).
FORMAT: Final = SglangFormat()
