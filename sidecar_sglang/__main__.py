"""``sidecar-sglang`` / ``python -m sidecar_sglang``: the sidecar for an SGLang engine, over
SGLang's native gRPC (default) or its native HTTP API."""

from __future__ import annotations

import argparse

from sidecar_common.cli import run_engine
from sidecar_common.config import EngineSpec, SidecarConfig
from sidecar_common.endpoint import Endpoint, EndpointError, parse_endpoint
from sidecar_common.engine import Engine
from sidecar_sglang.grpc_engine import SglangGrpcEngine
from sidecar_sglang.http_engine import SglangHttpEngine

__all__ = ["SPEC", "build", "main"]


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--transport",
        choices=("grpc", "http"),
        default="grpc",
        help="SGLang's native wire to use: gRPC (--grpc-endpoint) or HTTP (--http-endpoint)",
    )
    parser.add_argument(
        "--http-endpoint",
        default=None,
        help="SGLang's HTTP server (host:port or http://host:port); required with --transport http",
    )


def build(config: SidecarConfig, namespace: argparse.Namespace) -> Engine:
    """The engine for the chosen transport. A bad flag raises ValueError (a usage error)."""
    transport = getattr(namespace, "transport", "grpc")
    if transport == "grpc":
        _refuse_http_endpoint_on_grpc(namespace)
        return SglangGrpcEngine(config)
    if transport != "http":
        raise ValueError(f"--transport must be grpc or http, not {transport!r}")
    endpoint = _http_endpoint(namespace)
    if endpoint is None:
        raise ValueError("--http-endpoint is required with --transport http")
    return SglangHttpEngine(config, endpoint)


def _http_endpoint(namespace: argparse.Namespace) -> Endpoint | None:
    text = getattr(namespace, "http_endpoint", None)
    if not text:
        return None
    try:
        return parse_endpoint(text)
    except EndpointError as error:
        raise ValueError(f"--http-endpoint: {error}") from error


def _refuse_http_endpoint_on_grpc(namespace: argparse.Namespace) -> None:
    # An operator who gave only the HTTP address most likely forgot --transport http; serving
    # gRPC while ignoring the flag would dial an engine nobody named.
    if getattr(namespace, "http_endpoint", None):
        raise ValueError(
            "--http-endpoint is used only with --transport http (the transport is grpc, "
            "which dials --grpc-endpoint)"
        )


def _endpoint_when_unset(namespace: argparse.Namespace) -> Endpoint | None:
    """Over HTTP the gRPC endpoint is not used: the HTTP one stands in (so logs and the
    start-up deadline name the address really dialled)."""
    if getattr(namespace, "transport", "grpc") != "http":
        _refuse_http_endpoint_on_grpc(namespace)
        return None
    endpoint = _http_endpoint(namespace)
    if endpoint is None:
        raise ValueError("--transport http needs --http-endpoint (SGLang's HTTP server, host:port)")
    return endpoint


SPEC = EngineSpec(
    name="sglang", add_arguments=_add_arguments, build=build, endpoint_when_unset=_endpoint_when_unset
)


def main() -> None:
    raise SystemExit(run_engine(SPEC))


if __name__ == "__main__":
    main()
