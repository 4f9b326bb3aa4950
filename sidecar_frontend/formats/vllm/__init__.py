"""vLLM 0.33's token-in/token-out HTTP API (``--tokens-only``), as a pure format plugin.

Routes: ``POST /inference/v1/generate``; ``POST /inference/v1/abort_requests`` and its legacy
alias ``POST /abort_requests``; ``GET /health`` and ``GET /v1/models``. A generate body is read
once and judged by :func:`.validate.validate`, whose stages run in one order (the request model
in :mod:`.model`, ``sampling_params`` in :mod:`.sampling`, the checks outside vLLM's models in
:mod:`.checks`, the sub-request in :mod:`.plan`); responses are built in :mod:`.response`,
error bodies in :mod:`.errors`. This package ties them to the
:class:`~sidecar_frontend.formats.base.Format` contract and answers abort and the info routes.
``docs/frontend-vllm.md`` describes the format as served.

Ids: the client sees ``generate-tokens-<id>`` and the sidecar gets that same prefixed id, so
an abort naming it reaches the request. Unlike vLLM (where the client's own, unprefixed id
silently matches nothing), an abort naming the unprefixed id aborts the request too.
"""

from __future__ import annotations

import json
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
from sidecar_frontend.formats.vllm import validate
from sidecar_frontend.formats.vllm.errors import VllmError, detail_reply, error_reply
from sidecar_frontend.formats.vllm.plan import REQUEST_ID_PREFIX, VllmOptions
from sidecar_frontend.formats.vllm.response import VllmEncoder
from sidecar_frontend.formats.vllm.wire import compact_json

__all__ = ["FORMAT", "VllmFormat"]

GENERATE: Final = Route(("POST",), "/inference/v1/generate", RouteKind.GENERATE)
ABORT: Final = Route(("POST",), "/inference/v1/abort_requests", RouteKind.ABORT)
LEGACY_ABORT: Final = Route(("POST",), "/abort_requests", RouteKind.ABORT)
HEALTH: Final = Route(("GET",), "/health", RouteKind.INFO)
MODELS: Final = Route(("GET",), "/v1/models", RouteKind.INFO)


class VllmFormat:
    name = "vllm"
    routes: Sequence[Route] = (GENERATE, ABORT, LEGACY_ABORT, HEALTH, MODELS)

    def read_generate(
        self, route: Route, body: bytes, headers: Mapping[str, str]
    ) -> GenerateBody | HttpReply:
        del route  # one generate route
        return validate.read(body, headers)

    def parse_generate(
        self, route: Route, body: GenerateBody, headers: Mapping[str, str], ctx: FormatContext
    ) -> GenerateCall | HttpReply:
        del route
        return validate.validate(body, headers, ctx)

    def new_encoder(self, call: GenerateCall, started_at: float) -> Encoder:
        if not isinstance(call.options, VllmOptions):
            raise TypeError(f"not a vLLM call: options are {type(call.options).__name__}")
        return VllmEncoder(call.options, started_at)

    def parse_abort(self, route: Route, body: bytes, headers: Mapping[str, str]) -> AbortCall | HttpReply:
        """``{"request_ids": id | [ids]}``; the content type is not checked (vLLM does not)."""
        del route, headers
        try:
            data = json.loads(body)
        except json.JSONDecodeError as err:
            return _bad_request(f"JSON decode error: {err}")
        except (ValueError, RecursionError):
            return _bad_request("There was an error parsing the body")
        if not isinstance(data, dict):
            # vLLM answers a 500 here (its handler calls .get on the value); it is the client's mistake.
            return _bad_request(f"The request body must be a JSON object, not {_json_kind(data)}")
        ids = data.get("request_ids")
        if ids is None:
            return _bad_request("Missing 'request_ids' in request body")
        if isinstance(ids, str):
            ids = [ids]
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            return _bad_request("'request_ids' must be a request id or a list of request ids")
        return AbortCall(request_ids=_abort_targets(ids))

    def abort_reply(self, route: Route, call: AbortCall, aborted: int) -> HttpReply:
        # vLLM accepts the abort and answers before it runs: 200, empty body, no content type,
        # whether or not anything was found.
        del route, call, aborted
        return HttpReply(HTTPStatus.OK, b"", content_type="")

    def info(self, route: Route, ctx: FormatContext) -> HttpReply:
        if route.path == HEALTH.path:
            return HttpReply(HTTPStatus.OK, b"", content_type="")
        if route.path == MODELS.path:
            return HttpReply(HTTPStatus.OK, _models(ctx))
        return detail_reply(HTTPStatus.NOT_FOUND, "Not Found")

    def error_reply(self, status: int, message: str) -> HttpReply:
        return error_reply(status, message)

    def model_not_found(self, model: str, served: Sequence[str]) -> HttpReply:
        # vLLM's answer for a model it does not serve, listing every served name.
        message = f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}."
        return VllmError(message, "NotFoundError", HTTPStatus.NOT_FOUND, "model").reply()


def _abort_targets(ids: list[str]) -> tuple[str, ...]:
    """The sidecar ids to abort: the prefixed form of each id, and the id itself if already prefixed.

    A client whose own id is ``x`` runs as ``generate-tokens-x``; naming either ``x`` or
    ``generate-tokens-x`` reaches it.
    """
    targets: dict[str, None] = {}
    for request_id in ids:
        if request_id.startswith(REQUEST_ID_PREFIX):
            targets[request_id] = None
        targets[REQUEST_ID_PREFIX + request_id] = None
    return tuple(targets)


def _models(ctx: FormatContext) -> bytes:
    # One card per model the fleet serves, as vLLM lists one per served name.
    body = {"object": "list", "data": [_card(info, ctx) for info in ctx.models or (ctx.model_info,)]}
    return compact_json(body)


def _card(info: sidecar_pb2.ModelInfo, ctx: FormatContext) -> dict[str, object]:
    # vLLM stamps its model card when the list is asked for: the request's arrival here.
    created = int(ctx.wall_time)
    return {
        "id": info.served_model_name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": info.model_path or info.served_model_name,
        "parent": None,
        "max_model_len": info.max_context_length or None,
        "permission": [
            {
                "id": f"modelperm-{ctx.new_id()}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }


def _bad_request(message: str) -> HttpReply:
    return VllmError(message, HTTPStatus.BAD_REQUEST.phrase, HTTPStatus.BAD_REQUEST).reply()


def _json_kind(value: object) -> str:
    return {list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


FORMAT: Final = VllmFormat()
