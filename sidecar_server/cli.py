"""The sidecar command line: the common flags, their environment mirrors, run one engine.

Every flag ``--foo-bar`` (the engine's own included) can also come from ``SIDECAR_FOO_BAR``:
a flag beats its variable, a variable beats the default, and a variable with a bad value is
a usage error that names the variable. Every refusal here (bad numbers, a bad endpoint or
listen address, TLS files that cannot work, a flag the chosen mode does not use) is one line
and exit 2 before any network I/O; the machinery is sidecar_common.flags, shared with the
frontend and the testkit.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Final, cast

from sidecar_common import flags
from sidecar_common.disaggregation import ROLES, DisaggregationMode
from sidecar_common.endpoint import Endpoint, parse_endpoint
from sidecar_common.grpc_core import choose_core_settings
from sidecar_common.log_settings import LogFormat, default_log_format
from sidecar_common.message_size import GRPC_MAX_MESSAGE_BYTES
from sidecar_common.operations_flags import add_operations_arguments, refuse_metrics_host_without_port
from sidecar_common.parent_death import die_with_parent
from sidecar_common.pool_settings import PoolConfig, RetryPolicy
from sidecar_common.registration_record import (
    DEFAULT_PREFIX,
    RecordError,
    RegistrationConfig,
    advertise_address,
    normalize_prefix,
    parse_advertise,
    parse_etcd_endpoints,
)
from sidecar_common.tls_settings import TlsFiles, TlsSettingsError, check_pem, tls_files
from sidecar_common.version import add_version_flag
from sidecar_server.config import EngineSpec, SidecarConfig
from sidecar_server.kv_config import add_kv_events_arguments, kv_events_config

__all__ = [
    "ENV_PREFIX",
    "build_parser",
    "endpoint_arg",
    "parse_config",
    "run_engine",
]

ENV_PREFIX: Final = "SIDECAR_"

# grpc's message length option is a C int.
_GRPC_MAX_MESSAGE_BYTES: Final = 2**31 - 1
# A WatchLoad stream sends a report at least every second (its heartbeat): a slower push
# could not keep it.
_MAX_PUSH_INTERVAL_MS: Final = 1000


# The engine endpoint flags' type (the SGLang sidecar's --http-endpoint too).
endpoint_arg: Final[Callable[[str], Endpoint]] = flags.parsed_by(parse_endpoint)


def _lease_ttl(text: str) -> int:
    # etcd grants whole seconds; below 2 s a keepalive every third of it is a busy loop.
    value = flags.positive_int_arg(text)
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
            _check_key_pair(files)
    except TlsSettingsError as err:
        parser.error(str(err))
    return files


def _check_key_pair(files: TlsFiles) -> None:
    """The key must be the certificate's (and not encrypted: grpc takes no passphrase);
    grpc would only fail to bind the port."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # A passphrase callback that gives none: an encrypted key fails here, never prompts.
        context.load_cert_chain(files.cert, files.key, password=lambda: b"")
    except ssl.SSLError as err:
        why = err.reason or str(err)
        raise TlsSettingsError(
            f"--tls-key {files.key} does not go with --tls-cert {files.cert} ({why}; "
            "the key must be the certificate's, unencrypted)"
        ) from None
    except OSError as err:
        raise TlsSettingsError(f"cannot read --tls-cert or --tls-key: {err.strerror or err}") from None


def _refuse_inapplicable_common(ns: argparse.Namespace) -> None:
    """The common flags that only mean something beside another one (docs/common.md, "Flags
    that do not apply")."""
    refuse_metrics_host_without_port(ns)
    for dest in ("etcd_prefix", "advertise", "etcd_lease_ttl_secs"):
        flags.refuse_inapplicable(
            ns,
            dest,
            applies=ns.etcd_endpoints is not None,
            rule="needs --etcd-endpoints (registration in etcd is off)",
        )


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
    value = flags.positive_int_arg(text)
    if value > _GRPC_MAX_MESSAGE_BYTES:
        raise argparse.ArgumentTypeError(
            f"must be at most {_GRPC_MAX_MESSAGE_BYTES} (gRPC's limit), got {value}"
        )
    return value


def _push_interval_ms(text: str) -> int:
    value = flags.positive_int_arg(text)
    if value > _MAX_PUSH_INTERVAL_MS:
        raise argparse.ArgumentTypeError(
            f"must be at most {_MAX_PUSH_INTERVAL_MS} (WatchLoad's heartbeat is a second), got {value}"
        )
    return value


def _add_security_arguments(parser: argparse.ArgumentParser) -> None:
    security = parser.add_argument_group("security of the --listen port")
    security.add_argument(
        "--tls-cert",
        type=_pem_file,
        default=None,
        metavar="PEM",
        help="serve TLS with this certificate (chain); needs --tls-key (default: unset: plaintext)",
    )
    security.add_argument(
        "--tls-key",
        type=_pem_file,
        default=None,
        metavar="PEM",
        help="the private key of --tls-cert (default: unset: plaintext)",
    )
    security.add_argument(
        "--tls-client-ca",
        type=_pem_file,
        default=None,
        metavar="PEM",
        help="mutual TLS: refuse clients without a certificate signed by this CA "
        "(default: unset: any client)",
    )
    security.add_argument(
        "--no-reflection",
        action="store_true",
        help="do not serve gRPC server reflection (grpcurl then needs the .proto files)",
    )
    security.add_argument(
        "--max-request-bytes",
        type=_byte_count,
        default=GRPC_MAX_MESSAGE_BYTES,
        metavar="BYTES",
        help="largest request message accepted; larger ones are refused with RESOURCE_EXHAUSTED",
    )


def build_parser(spec: EngineSpec, *, prog: str | None = None) -> argparse.ArgumentParser:
    """The common flags of docs/common.md, then the engine's own."""
    parser = flags.FlagParser(
        prog=prog or f"sidecar-{spec.name}",
        env_prefix=ENV_PREFIX,
        description=(
            f"gRPC sidecar between an LLM serving frontend and a {spec.name} engine. "
            f"Every --flag-name may also be set as {ENV_PREFIX}FLAG_NAME; the flag wins."
        ),
    )
    add_version_flag(parser)
    engine = parser.add_argument_group("engine connection")
    engine.add_argument(
        "--grpc-endpoint",
        type=endpoint_arg,
        default=None,
        metavar="HOST:PORT",
        help="the engine's gRPC address: host:port, grpc://host:port or http://host:port "
        "(default: unset: required)",
    )
    engine.add_argument(
        "--grpc-connections",
        type=flags.positive_int_arg,
        default=8,
        metavar="N",
        help="independent HTTP/2 connections to the engine",
    )
    engine.add_argument(
        "--grpc-connect-attempt-timeout-secs",
        type=flags.seconds_arg(allow_zero=False),
        default=30.0,
        metavar="SECS",
        help="bound on one connection attempt",
    )
    engine.add_argument(
        "--grpc-retry-interval-secs",
        type=flags.seconds_arg(allow_zero=False),
        default=1.0,
        metavar="SECS",
        help="cap of the backoff between connection attempts",
    )
    engine.add_argument(
        "--grpc-startup-deadline-secs",
        type=flags.seconds_arg(allow_zero=False),
        default=1800.0,
        metavar="SECS",
        help="one deadline for connecting every connection and discovering the engine; while "
        "waiting, each failed attempt is logged, at a growing interval",
    )
    serve = parser.add_argument_group("serving")
    serve.add_argument(
        "--listen",
        type=flags.listen_arg,
        default="0.0.0.0:50061",
        metavar="HOST:PORT",
        help="gRPC listen address",
    )
    serve.add_argument(
        "--disaggregation-mode",
        choices=ROLES,
        default="agg",
        help="the role of this worker in a disaggregated prefill/decode pair",
    )
    serve.add_argument(
        "--drain-timeout-secs",
        type=flags.seconds_arg(allow_zero=True),
        default=30.0,
        metavar="SECS",
        help="on SIGTERM, how long in-flight generations may finish before they are cancelled",
    )
    serve.add_argument(
        "--load-push-interval-ms",
        type=_push_interval_ms,
        default=100,
        metavar="MS",
        help="WatchLoad: at most one load report per this many milliseconds to each client (changes "
        "in between are coalesced), and the engine's load read this often while any client watches",
    )
    _add_security_arguments(parser)
    fleet = parser.add_argument_group("fleet registration (etcd)")
    fleet.add_argument(
        "--etcd-endpoints",
        type=flags.parsed_by(parse_etcd_endpoints),
        default=None,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="register this worker in etcd once serving (default: unset: off)",
    )
    fleet.add_argument(
        "--etcd-prefix",
        type=flags.parsed_by(normalize_prefix),
        default=DEFAULT_PREFIX,
        metavar="PREFIX",
        help="key prefix of the worker registrations; needs --etcd-endpoints",
    )
    fleet.add_argument(
        "--advertise",
        type=flags.parsed_by(parse_advertise),
        default=None,
        metavar="HOST:PORT",
        help="address frontends dial, written into etcd; needs --etcd-endpoints "
        "(default: --listen, refused if a wildcard)",
    )
    fleet.add_argument(
        "--etcd-lease-ttl-secs",
        type=_lease_ttl,
        default=10,
        metavar="SECS",
        help="how long the registration outlives a sidecar that died without withdrawing; "
        "needs --etcd-endpoints",
    )
    add_kv_events_arguments(parser)
    add_operations_arguments(parser)
    spec.add_arguments(parser)
    return parser


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
    ns = flags.parse_with_env(parser, argv, environ, ENV_PREFIX)
    endpoint: Endpoint | None = ns.grpc_endpoint
    try:
        _refuse_inapplicable_common(ns)
        kv_events = kv_events_config(ns)
        if spec.check_flags is not None:
            spec.check_flags(ns)
        if endpoint is None and spec.endpoint_when_unset is not None:
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
        kv_events=kv_events,
        load_push_interval=ns.load_push_interval_ms / 1000,
    )
    return config, ns


def run_engine(spec: EngineSpec, argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """Parse, then run the daemon until it is told to stop; returns the exit code."""
    if not die_with_parent(os.environ):
        print(f"{prog or f'sidecar-{spec.name}'}: the process that started it is gone", file=sys.stderr)
        return 1
    args = sys.argv[1:] if argv is None else argv
    config, namespace = parse_config(spec, args, os.environ, prog=prog)
    choose_core_settings()
    # Imported late: the daemon pulls in grpc and the server, which --help and usage errors
    # do not need (and grpc must load after its settings are chosen).
    from sidecar_server.daemon import run

    return run(spec, config, namespace)
