"""SGLang protocol conversion (pure), in two halves shared by both transports:
:mod:`sidecar_sglang.convert_request` (PreprocessedRequest -> native gRPC/HTTP request) and
:mod:`sidecar_sglang.convert_response` (native events -> LLMEngineOutput deltas)."""

from __future__ import annotations

from sidecar_sglang.convert_request import (
    Bootstrap,
    NativeRequest,
    NativeSampling,
    RequestSettings,
    bootstrap_struct,
    build_native,
    to_grpc,
    to_http_json,
)
from sidecar_sglang.convert_response import (
    NativeEvent,
    ResponseState,
    error_from_http_status,
    event_from_grpc,
    event_from_http,
)

__all__ = [
    "Bootstrap",
    "NativeEvent",
    "NativeRequest",
    "NativeSampling",
    "RequestSettings",
    "ResponseState",
    "bootstrap_struct",
    "build_native",
    "error_from_http_status",
    "event_from_grpc",
    "event_from_http",
    "to_grpc",
    "to_http_json",
]
