"""Command line: the common flags, their environment mirrors, and the ``sidecar`` command.

Every flag ``--foo-bar`` (the engine's own included) can also come from ``SIDECAR_FOO_BAR``:
a flag beats its variable, a variable beats the default, and a variable with a bad value is
a usage error that names the variable. Every refusal here (bad numbers, a bad endpoint or
listen address) exits 2 before any network I/O.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, NoReturn, cast

from sidecar_common.config import DEFAULT_MAX_REQUEST_BYTES, EngineSpec, SidecarConfig
from sidecar_common.disaggregation import DisaggregationMode
from sidecar_common.endpoint import Endpoint, EndpointError, parse_endpoint
from sidecar_common.logs import LOG_LEVELS, LogFormat, default_log_format
from sidecar_common.pool import PoolConfig, RetryPolicy
from sidecar_common.registration_record import (
    DEFAULT_PREFIX,
    RecordError,
    RegistrationConfig,
    advertise_address,
    normalize_prefix,
    parse_advertise,
    parse_etcd_endpoints,
)
from sidecar_common.tls import TlsFiles, TlsSettingsError, check_pem, tls_files
from sidecar_common.version import package_version

__all__ = [
    "ENGINES",
    "ENV_PREFIX",
    "annotate_env_help",
    "build_parser",
    "env_var_for",
    "load_spec",
    "main",
    "parse_config",
    "parse_listen",
    "parse_with_env",
    "port_arg",
    "positive_int_arg",
    "run_engine",
    "seconds_arg",
]

ENV_PREFIX: Final = "SIDECAR_"

# Engine name -> module defining ``SPEC: EngineSpec``; imported only when chosen, so that
# `sidecar vllm` never pays for (or breaks on) the SGLang package, and vice versa.
ENGINES: Final[Mapping[str, str]] = {
    "vllm": "sidecar_vllm.__main__",
    "sglang": "sidecar_sglang.__main__",
}

# `sidecar frontend ...` runs the HTTP frontend (sidecar_frontend) instead of a sidecar.
FRONTEND: Final = "frontend"

# grpc's message length option is a C int.
_GRPC_MAX_MESSAGE_BYTES: Final = 2**31 - 1

_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off", ""})


def env_var_for(option: str, prefix: str = ENV_PREFIX) -> str:
    """``--grpc-endpoint`` -> ``SIDECAR_GRPC_ENDPOINT``."""
    return prefix + option.lstrip("-").replace("-", "_").upper()


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seconds(*, allow_zero: bool) -> Callable[[str], float]:
    bound = ">= 0" if allow_zero else "> 0"

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seconds {bound}, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"must be a number of seconds {bound}, got {text}")
        return value

    convert.__name__ = "seconds"
    return convert


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {value}")
    return value


def parse_listen(text: str) -> str:
    """Validate ``host:port`` (IPv6 in brackets); port 0 asks the OS for a free one."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"expected host:port, got {text!r}")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise argparse.ArgumentTypeError(f"unbalanced brackets in {text!r}")
    elif ":" in host:
        raise argparse.ArgumentTypeError(f"an IPv6 host needs brackets, e.g. [::]:50061, got {text!r}")
    if any(c.isspace() or c in "/?#@" for c in host):
        raise argparse.ArgumentTypeError(f"not a host name or address: {host!r}")
    if not port_text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a numeric port, got {port_text!r}")
    port = int(port_text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {port}")
    return f"{host}:{port}"


def _bind_host(text: str) -> str:
    """A host name or address to bind (IPv6 with or without brackets), brackets removed."""
    host = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    if not host or any(c.isspace() or c in "/?#@[]" for c in host):
        raise argparse.ArgumentTypeError(f"not a host name or address: {text!r}")
    return host


def _endpoint(text: str) -> Endpoint:
    # Parsed as the flag's type so that a refusal is a usage error naming the flag (or its
    # variable), before anything touches the network.
    try:
        return parse_endpoint(text)
    except EndpointError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _etcd_endpoints(text: str) -> tuple[str, ...]:
    try:
        return parse_etcd_endpoints(text)
    except RecordError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _etcd_prefix(text: str) -> str:
    try:
        return normalize_prefix(text)
    except RecordError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _advertise(text: str) -> str:
    try:
        return parse_advertise(text)
    except RecordError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _lease_ttl(text: str) -> int:
    # etcd grants whole seconds; below 2 s a keepalive every third of it is a busy loop.
    value = _positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2 seconds, got {value}")
    return value


def _tls_config(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> TlsFiles | None:
    try:
        files = tls_files(ns.tls_cert, ns.tls_key, ns.tls_client_ca)
        if files is not None:
            # The contents too: a key given as the certificate is a usage error, named here,
            # where grpc would only fail to bind the port.
            check_pem(files.cert, "certificate")
            check_pem(files.key, "private key")
            if files.client_ca is not None:
                check_pem(files.client_ca, "certificate")
    except TlsSettingsError as err:
        parser.error(str(err))
    return files


def _registration_config(
    parser: argparse.ArgumentParser, ns: argparse.Namespace, listen: str
) -> RegistrationConfig | None:
    if ns.etcd_endpoints is None:
        return None
    try:
        # Port 0 is only known once bound; the check here is that the host is dialable.
        advertise_address(listen, ns.advertise, bound_port=1)
    except RecordError as err:
        parser.error(str(err))
    return RegistrationConfig(
        endpoints=ns.etcd_endpoints,
        prefix=ns.etcd_prefix,
        advertise=ns.advertise,
        lease_ttl=ns.etcd_lease_ttl_secs,
    )


def _pem_file(text: str) -> Path:
    # Checked as the flag's type, so that a missing or unreadable file is a usage error
    # naming the flag; the server reads it again when it starts.
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return path


def _byte_count(text: str) -> int:
    value = _positive_int(text)
    if value > _GRPC_MAX_MESSAGE_BYTES:
        raise argparse.ArgumentTypeError(
            f"must be at most {_GRPC_MAX_MESSAGE_BYTES} (gRPC's limit), got {value}"
        )
    return value


def _add_security_arguments(parser: argparse.ArgumentParser) -> None:
    security = parser.add_argument_group("security of the --listen port")
    security.add_argument(
        "--tls-cert",
        type=_pem_file,
        default=None,
        metavar="PEM",
        help="serve TLS with this certificate (chain); needs --tls-key (plaintext when unset)",
    )
    security.add_argument("--tls-key", type=_pem_file, default=None, metavar="PEM", help="its private key")
    security.add_argument(
        "--tls-client-ca",
        type=_pem_file,
        default=None,
        metavar="PEM",
        help="mutual TLS: refuse clients without a certificate signed by this CA",
    )
    security.add_argument(
        "--no-reflection",
        action="store_true",
        help="do not serve gRPC server reflection (grpcurl then needs the .proto files)",
    )
    security.add_argument(
        "--max-request-bytes",
        type=_byte_count,
        default=DEFAULT_MAX_REQUEST_BYTES,
        metavar="BYTES",
        help="largest request message accepted; larger ones are refused with RESOURCE_EXHAUSTED",
    )


def build_parser(spec: EngineSpec, *, prog: str | None = None) -> argparse.ArgumentParser:
    """The common flags of docs/common.md, then the engine's own."""
    parser = argparse.ArgumentParser(
        prog=prog or f"sidecar-{spec.name}",
        description=(
            f"gRPC sidecar between an LLM serving frontend and a {spec.name} engine. "
            f"Every --flag-name may also be set as {ENV_PREFIX}FLAG_NAME; the flag wins."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    engine = parser.add_argument_group("engine connection")
    engine.add_argument(
        "--grpc-endpoint",
        type=_endpoint,
        default=None,
        metavar="HOST:PORT",
        help="the engine's gRPC address: host:port, grpc://host:port or http://host:port",
    )
    engine.add_argument(
        "--grpc-connections",
        type=_positive_int,
        default=8,
        metavar="N",
        help="independent HTTP/2 connections to the engine",
    )
    engine.add_argument(
        "--grpc-connect-attempt-timeout-secs",
        type=_seconds(allow_zero=False),
        default=30.0,
        metavar="SECS",
        help="bound on one connection attempt",
    )
    engine.add_argument(
        "--grpc-retry-interval-secs",
        type=_seconds(allow_zero=False),
        default=1.0,
        metavar="SECS",
        help="cap of the backoff between connection attempts",
    )
    engine.add_argument(
        "--grpc-startup-deadline-secs",
        type=_seconds(allow_zero=False),
        default=1800.0,
        metavar="SECS",
        help="one deadline for connecting every connection and discovering the engine",
    )
    serve = parser.add_argument_group("serving")
    serve.add_argument(
        "--listen",
        type=parse_listen,
        default="0.0.0.0:50061",
        metavar="HOST:PORT",
        help="gRPC listen address",
    )
    serve.add_argument(
        "--disaggregation-mode",
        choices=("agg", "prefill", "decode"),
        default="agg",
        help="the role of this worker in a disaggregated prefill/decode pair",
    )
    serve.add_argument(
        "--drain-timeout-secs",
        type=_seconds(allow_zero=True),
        default=30.0,
        metavar="SECS",
        help="on SIGTERM, how long in-flight generations may finish before they are cancelled",
    )
    _add_security_arguments(parser)
    fleet = parser.add_argument_group("fleet registration (etcd)")
    fleet.add_argument(
        "--etcd-endpoints",
        type=_etcd_endpoints,
        default=None,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="register this worker in etcd once serving (off when unset)",
    )
    fleet.add_argument(
        "--etcd-prefix",
        type=_etcd_prefix,
        default=DEFAULT_PREFIX,
        metavar="PREFIX",
        help="key prefix of the worker registrations",
    )
    fleet.add_argument(
        "--advertise",
        type=_advertise,
        default=None,
        metavar="HOST:PORT",
        help="address frontends dial, written into etcd; default: --listen (refused if a wildcard)",
    )
    fleet.add_argument(
        "--etcd-lease-ttl-secs",
        type=_lease_ttl,
        default=10,
        metavar="SECS",
        help="how long the registration outlives a sidecar that died without withdrawing",
    )
    ops = parser.add_argument_group("operations")
    ops.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on this port (off when unset)",
    )
    ops.add_argument(
        "--metrics-host",
        type=_bind_host,
        default=None,
        metavar="HOST",
        help="address the metrics endpoint binds; default: the host of --listen",
    )
    ops.add_argument(
        "--log-format",
        choices=("json", "console"),
        default=None,
        help="json lines, or human-readable; default: console on a terminal, else json",
    )
    ops.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default="info")
    spec.add_arguments(parser)
    annotate_env_help(parser)
    return parser


def annotate_env_help(parser: argparse.ArgumentParser, prefix: str = ENV_PREFIX) -> None:
    """Add each flag's environment variable to its --help line."""
    for action, var in _env_actions(parser, prefix):
        if action.help != argparse.SUPPRESS:
            action.help = f"{action.help or ''} [env {var}]".lstrip()


class _FromEnv:
    """Marks a destination no command-line flag has set, so its variable may fill it."""

    def __init__(self, var: str) -> None:
        self.var = var

    def __repr__(self) -> str:  # what --help shows as the default
        return f"${self.var}"


def _env_actions(
    parser: argparse.ArgumentParser, prefix: str = ENV_PREFIX
) -> list[tuple[argparse.Action, str]]:
    found: list[tuple[argparse.Action, str]] = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs:
            found.append((action, env_var_for(longs[0], prefix)))
    return found


def _from_env(
    parser: argparse.ArgumentParser, action: argparse.Action, var: str, raw: str, default: Any
) -> Any:
    """The value an environment variable gives ``action`` (``default`` when it switches a
    flag off), or a usage error naming ``var``."""

    def refuse(problem: str) -> NoReturn:
        parser.error(f"environment variable {var}={raw!r}: {problem}")

    if action.nargs == 0:
        # store_true / store_false / store_const: the variable switches the flag on or off.
        word = raw.strip().lower()
        if word in _TRUE:
            return action.const
        if word in _FALSE:
            return default
        refuse("expected true/false, 1/0, yes/no or on/off")
    convert = action.type if callable(action.type) else str
    words = raw.split() if action.nargs in ("*", "+") or isinstance(action.nargs, int) else [raw]
    values: list[Any] = []
    for word in words:
        try:
            value = convert(word)
        except argparse.ArgumentTypeError as err:
            refuse(str(err))
        except (TypeError, ValueError):
            refuse(f"invalid {getattr(convert, '__name__', 'value')} value")
        if action.choices is not None and value not in action.choices:
            refuse(f"invalid choice (choose from {', '.join(map(str, action.choices))})")
        values.append(value)
    if isinstance(action, argparse._AppendAction):
        return values
    return values if action.nargs in ("*", "+") or isinstance(action.nargs, int) else values[0]


def parse_with_env(
    parser: argparse.ArgumentParser,
    argv: Sequence[str],
    environ: Mapping[str, str],
    prefix: str = ENV_PREFIX,
) -> argparse.Namespace:
    """Parse ``argv``; a flag no argument set takes its ``<prefix>FLAG_NAME`` variable."""
    # Destinations backed by a set variable get a marker default and lose `required`, so
    # argparse itself tells us (marker still there) which ones no flag has set.
    pending: dict[str, list[tuple[argparse.Action, str, str]]] = {}
    originals: dict[str, Any] = {}
    markers: dict[str, object] = {}
    for action, var in _env_actions(parser, prefix):
        raw = environ.get(var)
        if raw is not None:
            pending.setdefault(action.dest, []).append((action, var, raw))
    for action in parser._actions:
        if action.dest in pending:
            originals.setdefault(action.dest, action.default)
            # Append actions copy their default into a fresh list, so None is their marker.
            marker = (
                None if isinstance(action, argparse._AppendAction) else _FromEnv(pending[action.dest][0][1])
            )
            action.default = markers.setdefault(action.dest, marker)
            action.required = False
    namespace = parser.parse_args(list(argv))
    for dest, sources in pending.items():
        if getattr(namespace, dest) is not markers[dest]:
            continue  # a flag set it: the flag wins, the variable is not even parsed
        value = originals[dest]
        for action, var, raw in sources:
            value = _from_env(parser, action, var, raw, originals[dest])
        setattr(namespace, dest, value)
    return namespace


def parse_config(
    spec: EngineSpec,
    argv: Sequence[str],
    environ: Mapping[str, str],
    *,
    prog: str | None = None,
    log_format_default: LogFormat | None = None,
) -> tuple[SidecarConfig, argparse.Namespace]:
    """Flags and environment -> the validated common config, and the namespace (for the
    engine's own flags). Usage errors exit 2 through argparse; nothing here does I/O."""
    parser = build_parser(spec, prog=prog)
    ns = parse_with_env(parser, argv, environ)
    endpoint: Endpoint | None = ns.grpc_endpoint
    if endpoint is None and spec.endpoint_when_unset is not None:
        try:
            endpoint = spec.endpoint_when_unset(ns)
        except ValueError as error:
            parser.error(str(error))
    if endpoint is None:
        parser.error(f"--grpc-endpoint (or {ENV_PREFIX}GRPC_ENDPOINT) is required")
    log_format: LogFormat = ns.log_format or log_format_default or default_log_format()
    pool = PoolConfig(
        endpoint=endpoint,
        connections=ns.grpc_connections,
        startup_deadline=ns.grpc_startup_deadline_secs,
        retry=RetryPolicy(
            attempt_timeout=ns.grpc_connect_attempt_timeout_secs,
            max_interval=ns.grpc_retry_interval_secs,
        ),
    )
    config = SidecarConfig(
        pool=pool,
        listen=ns.listen,
        disaggregation_mode=cast(DisaggregationMode, ns.disaggregation_mode),
        metrics_port=ns.metrics_port,
        metrics_host=ns.metrics_host,
        log_format=log_format,
        log_level=ns.log_level,
        drain_timeout=ns.drain_timeout_secs,
        registration=_registration_config(parser, ns, ns.listen),
        tls=_tls_config(parser, ns),
        reflection=not ns.no_reflection,
        max_request_bytes=ns.max_request_bytes,
    )
    return config, ns


def run_engine(spec: EngineSpec, argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """Parse, then run the daemon until it is told to stop; returns the exit code."""
    args = sys.argv[1:] if argv is None else argv
    config, namespace = parse_config(spec, args, os.environ, prog=prog)
    # Imported late: the daemon pulls in grpc and the server, which --help and usage errors
    # do not need.
    from sidecar_common.daemon import run

    return run(spec, config, namespace)


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sidecar",
        usage="sidecar {%s} [flags...]" % ",".join((*ENGINES, FRONTEND)),  # noqa: UP031
        description="gRPC sidecar between an LLM serving frontend and an inference engine.",
        epilog="Run `sidecar ENGINE --help` for the flags of one engine.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    parser.add_argument(
        "engine", choices=(*ENGINES, FRONTEND), help="the inference engine to serve, or the HTTP frontend"
    )
    return parser


def load_spec(name: str) -> EngineSpec:
    """The EngineSpec of a known engine, imported on demand."""
    module = importlib.import_module(ENGINES[name])
    spec = getattr(module, "SPEC", None)
    if not isinstance(spec, EngineSpec):
        raise ImportError(f"{ENGINES[name]} defines no SPEC")
    return spec


def main(argv: Sequence[str] | None = None) -> int:
    """``sidecar ENGINE [flags...]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not args or args[0].startswith("-"):
        # `sidecar --help` / `--version` exit 0; anything else without an engine is 2.
        top.parse_args(args[:1])
        top.error("an engine name is required")
    name = args[0]
    if name == FRONTEND:
        # Imported on demand, like an engine: the frontend pulls in aiohttp's server.
        from sidecar_frontend.__main__ import main as frontend_main

        return frontend_main(args[1:], prog="sidecar frontend")
    if name not in ENGINES:
        top.error(f"unknown engine {name!r} (choose from {', '.join(ENGINES)})")
    try:
        spec = load_spec(name)
    except ImportError as err:
        top.exit(2, f"sidecar: engine {name!r} is not available: {err}\n")
    return run_engine(spec, args[1:], prog=f"sidecar {name}")


# Flag types the frontend's command line shares.
positive_int_arg = _positive_int
seconds_arg = _seconds
port_arg = _port
