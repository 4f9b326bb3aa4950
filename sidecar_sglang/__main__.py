"""``sidecar-sglang`` / ``python -m sidecar_sglang``: the sidecar for an SGLang engine, over
SGLang's native gRPC (default) or its native HTTP API."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sidecar_common.endpoint import Endpoint, EndpointError, parse_endpoint
from sidecar_common.flags import positive_int_arg, refuse_inapplicable
from sidecar_server.cli import endpoint_arg, run_engine
from sidecar_server.config import EngineSpec, SidecarConfig

if TYPE_CHECKING:
    from sidecar_server.engine import Engine

__all__ = ["SPEC", "build", "check_flags", "main", "run"]


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    sglang = parser.add_argument_group("SGLang")
    sglang.add_argument(
        "--transport",
        choices=("grpc", "http"),
        default="grpc",
        help="SGLang's native wire to use: gRPC (--grpc-endpoint) or HTTP (--http-endpoint)",
    )
    sglang.add_argument(
        "--http-endpoint",
        type=endpoint_arg,
        default=None,
        metavar="HOST:PORT",
        help="SGLang's HTTP server (host:port or http://host:port); only with --transport http, "
        "where it is required (default: unset)",
    )
    sglang.add_argument(
        "--vocab-size",
        type=positive_int_arg,
        default=None,
        metavar="N",
        help="the model's vocabulary size (its config.json vocab_size; text_config's for a "
        "multimodal model), which SGLang reports nowhere: with it a prompt id outside the "
        "vocabulary is refused before the engine, in SGLang's words, and the workers report it "
        "(default: unset, not checked here)",
    )


def build(config: SidecarConfig, namespace: argparse.Namespace) -> Engine:
    """The engine for the chosen transport. A bad flag raises ValueError (a usage error)."""
    check_flags(namespace)
    vocab_size: int | None = getattr(namespace, "vocab_size", None)
    # The transports are imported once the flags are valid: --help and usage errors need
    # neither grpc nor aiohttp.
    if getattr(namespace, "transport", "grpc") == "grpc":
        from sidecar_sglang.grpc_transport import over_grpc

        return over_grpc(config, vocab_size=vocab_size)
    endpoint = _http_endpoint(namespace)
    if endpoint is None:
        raise ValueError("--transport http needs --http-endpoint (SGLang's HTTP server, host:port)")
    from sidecar_sglang.http_transport import over_http

    return over_http(config, endpoint, vocab_size=vocab_size)


def _http_endpoint(namespace: argparse.Namespace) -> Endpoint | None:
    value = getattr(namespace, "http_endpoint", None)
    if not value:
        return None
    if isinstance(value, Endpoint):
        return value
    try:
        return parse_endpoint(value)
    except EndpointError as error:
        raise ValueError(f"--http-endpoint: {error}") from error


def check_flags(namespace: argparse.Namespace) -> None:
    """Each transport's flags, refused under the other one (the rule of docs/common.md): an
    operator who gave only the HTTP address most likely forgot --transport http, and serving
    while ignoring a flag would dial an engine nobody named."""
    transport = getattr(namespace, "transport", "grpc")
    if transport not in ("grpc", "http"):
        raise ValueError(f"--transport must be grpc or http, not {transport!r}")
    over_http = transport == "http"
    refuse_inapplicable(
        namespace,
        "http_endpoint",
        applies=over_http,
        rule="is used only with --transport http (the transport is grpc, which dials --grpc-endpoint)",
    )
    for dest in ("grpc_endpoint", "grpc_connections"):
        refuse_inapplicable(
            namespace,
            dest,
            applies=not over_http,
            rule="is used only with --transport grpc (the transport is http, which dials --http-endpoint)",
        )


def _endpoint_when_unset(namespace: argparse.Namespace) -> Endpoint | None:
    """Over HTTP the gRPC endpoint is not used: the HTTP one stands in (so logs and the
    start-up deadline name the address really dialled)."""
    if getattr(namespace, "transport", "grpc") != "http":
        return None
    endpoint = _http_endpoint(namespace)
    if endpoint is None:
        raise ValueError("--transport http needs --http-endpoint (SGLang's HTTP server, host:port)")
    return endpoint


SPEC = EngineSpec(
    name="sglang",
    add_arguments=_add_arguments,
    build=build,
    endpoint_when_unset=_endpoint_when_unset,
    check_flags=check_flags,
)


def run(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """Run this sidecar with ``argv`` (default: the process's arguments); the exit code."""
    return run_engine(SPEC, argv, prog=prog)


def main() -> None:
    raise SystemExit(run())


if __name__ == "__main__":
    main()
