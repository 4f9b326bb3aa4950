"""The frontend's command line: flags, their ``SIDECAR_FRONTEND_*`` mirrors, the config.

Same conventions as the sidecars (sidecar_server/cli.py): a flag beats its variable, a
variable beats the default, a bad value is a usage error (exit 2) naming the flag or the
variable, and nothing here does network I/O. Nor does anything it imports load numpy (the
routing keys' library, a tenth of a second before any help or usage error):
tests/unit/frontend/test_cli_imports.py.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from sidecar_common.flags import (
    FlagParser,
    FlagSources,
    annotate_env_help,
    at_least_arg,
    flag_sources,
    listen_arg,
    parse_with_env,
    positive_int_arg,
    refuse_inapplicable,
    seconds_arg,
)
from sidecar_common.log_settings import LogFormat, default_log_format
from sidecar_common.operations_flags import add_operations_arguments, refuse_metrics_host_without_port
from sidecar_common.registration_record import RecordError
from sidecar_common.tls_settings import ClientTlsFiles, TlsSettingsError, load_client_files
from sidecar_common.version import add_version_flag
from sidecar_frontend.admission.capacity import CapacitySettings
from sidecar_frontend.admission.state import AdmissionSettings
from sidecar_frontend.admission.who import DEFAULT_PRIORITY_HEADER, DEFAULT_TENANT_HEADER, WhoRules
from sidecar_frontend.config import (
    DEFAULT_MAX_BODY_BYTES,
    AdminConfig,
    AdmissionConfig,
    ConnectionSettings,
    HandlerConfig,
    WorkerSetConfig,
)
from sidecar_frontend.discovery import DiscoveryConfig, add_discovery_arguments, discovery_config_from_args
from sidecar_frontend.discovery_records import parse_worker
from sidecar_frontend.fleet import FleetSettings
from sidecar_frontend.migration import DEFAULT_MIGRATION_LIMIT
from sidecar_frontend.outliers import OutlierSettings
from sidecar_frontend.retry_budget import RetryBudgetSettings
from sidecar_frontend.routing.policy import PolicyConfig
from sidecar_frontend.routing.router import RouterConfig, Routing
from sidecar_frontend.routing.sessions_flags import add_session_arguments, session_settings

__all__ = ["ENV_PREFIX", "FORMATS", "FrontendConfig", "build_parser", "parse_config"]

ENV_PREFIX: Final = "SIDECAR_FRONTEND_"

# Format name -> module defining ``FORMAT``, imported when chosen.
FORMATS: Final[Mapping[str, str]] = {
    "sglang": "sidecar_frontend.formats.sglang",
    "vllm": "sidecar_frontend.formats.vllm",
}


@dataclass(frozen=True)
class FrontendConfig:
    listen: str
    discovery: DiscoveryConfig  # the static --worker list is its "static" mode
    formats: tuple[str, ...]
    handler: HandlerConfig
    worker_set: WorkerSetConfig
    routing: RouterConfig
    metrics_port: int | None
    metrics_host: str | None  # None: the host of --listen
    drain_timeout: float
    log_format: LogFormat
    log_level: str
    # Where each value came from: a start-up failure names the flag, or its variable.
    sources: FlagSources = field(default_factory=FlagSources)
    # The SGLang format's --incremental-streaming-output (formats.sglang.SglangFormat).
    sglang_incremental_streaming_output: bool = False
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    # Frontend processes serving --listen (sidecar_frontend/processes/); 1: this process alone.
    processes: int = 1
    connections: ConnectionSettings = field(default_factory=ConnectionSettings)
    # The membership API (sidecar_frontend/admin.py).
    admin: AdminConfig = field(default_factory=AdminConfig)


def _workers(text: str) -> tuple[str, ...]:
    """One ``[ROLE=]HOST:PORT``, or several separated by commas or spaces (handy in the
    variable); each checked here, so a bad one is a usage error naming the flag."""
    words = text.replace(",", " ").split()
    if not words:
        raise argparse.ArgumentTypeError(f"expected [ROLE=]HOST:PORT, got {text!r}")
    for word in words:
        try:
            parse_worker(word)
        except RecordError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return tuple(words)


def _prefill_workers(text: str) -> tuple[str, ...]:
    """``HOST:PORT`` (or several, comma- or space-separated): workers of role prefill."""
    words = _workers(text)
    for word in words:
        if "=" in word:
            raise argparse.ArgumentTypeError(f"expected HOST:PORT (the role is prefill), got {word!r}")
    return tuple(f"prefill={word}" for word in words)


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected a model name, got {text!r}")
    return names


def _formats(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in FORMATS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(FORMATS)}, got {text!r}"
        )
    return names


def _fraction(text: str) -> float:
    """A number from 0 up to (not including) 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to below 1, got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to below 1, got {text!r}")
    return value


def _worker_capacity(text: str) -> tuple[str, int]:
    """``HOST:PORT=N``: that worker runs at most N sequences at once, whatever its engine says."""
    address, sep, count = text.rpartition("=")
    if not sep or not address:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT=N, got {text!r}")
    try:
        limit = int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT=N with N a whole number, got {text!r}"
        ) from None
    if limit < 1:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT=N with N at least 1, got {text!r}")
    return address, limit


def _admin_token(text: str) -> str:
    if not text or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError("expected a token without spaces (what admin calls send as bearer)")
    return text


def _header_name(text: str) -> str:
    name = text.strip()
    if not name or any(c.isspace() or c in ':()<>@,;\\"/[]?={}' for c in name):
        raise argparse.ArgumentTypeError(f"expected an HTTP header name, got {text!r}")
    return name.lower()


_ratio: Final = at_least_arg(1.0)
_count: Final = at_least_arg(0, whole=True)
_weight: Final = at_least_arg(0.0)


def _refuse_inapplicable(ns: argparse.Namespace) -> None:
    """Flags the chosen discovery mode, formats or routing do not use (the rule of docs/common.md)."""
    routing = ns.routing
    indexed = routing in (None, Routing.KV.value, Routing.APPROX.value)
    for dest in (
        "routing_index_max_mb",
        "routing_hot_spot_ratio",
        "routing_hot_spot_slack",
        "routing_left_behind_weight",
    ):
        refuse_inapplicable(
            ns,
            dest,
            applies=indexed,
            rule=f"is used only with --routing kv or approx (or unset), not {routing}",
        )
    refuse_inapplicable(
        ns,
        "routing_approx_ttl_secs",
        applies=routing in (None, Routing.APPROX.value),
        rule=f"is used only with --routing approx (or unset), not {routing}",
    )
    mode = ns.discovery
    refuse_inapplicable(
        ns, "dns_refresh_secs", applies=mode == "dns", rule=f"is used only with --discovery dns, not {mode}"
    )
    for dest in ("etcd_endpoints", "etcd_prefix"):
        refuse_inapplicable(
            ns, dest, applies=mode == "etcd", rule=f"is used only with --discovery etcd, not {mode}"
        )
    refuse_inapplicable(
        ns,
        "sglang_incremental_streaming_output",
        applies="sglang" in ns.formats,
        rule="is used only when --format includes sglang",
    )
    for dest in (
        "max_queue_depth",
        "max_queue_wait_secs",
        "admission_headroom",
        "lower_band_share",
        "worker_capacity",
        "load_stale_secs",
        "tenant_header",
        "priority_header",
        "sglang_low_priority_values_first",
        "rate_limits",
        "preempt_after_secs",
    ):
        refuse_inapplicable(
            ns,
            dest,
            applies=not ns.no_admission,
            rule="is used only with admission on (not with --no-admission)",
        )
    refuse_inapplicable(
        ns,
        "admin_listen",
        applies=ns.processes == 1,
        rule="is used only with --processes 1 (several processes share --listen only)",
    )
    refuse_metrics_host_without_port(ns)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = FlagParser(
        prog=prog or "sidecar-frontend",
        env_prefix=ENV_PREFIX,
        description=(
            "HTTP frontend serving SGLang's /generate and vLLM's /inference/v1/generate "
            "(token in, token out) over sidecars reached by gRPC. Every --flag-name may also be "
            f"set as {ENV_PREFIX}FLAG_NAME; the flag wins. Traces (W3C traceparent) go on to the "
            "workers; spans are exported over OTLP/gRPC when OTEL_EXPORTER_OTLP_ENDPOINT is set."
        ),
    )
    add_version_flag(parser)
    serve = parser.add_argument_group("serving")
    serve.add_argument(
        "--listen", type=listen_arg, default="0.0.0.0:8000", metavar="HOST:PORT", help="HTTP listen address"
    )
    serve.add_argument(
        "--processes",
        type=positive_int_arg,
        default=1,
        metavar="N",
        help="frontend processes serving --listen together, each a whole frontend (its own "
        "worker connections, routing view and admission share) under one supervising parent; "
        "up to one per core given to the frontend (1: this process alone, no parent)",
    )
    connections = ConnectionSettings()
    serve.add_argument(
        "--listen-backlog",
        type=positive_int_arg,
        default=connections.backlog,
        metavar="N",
        help="connections the kernel holds complete before the frontend accepts them (capped by "
        "the host's net.core.somaxconn, which the start-up log shows)",
    )
    serve.add_argument(
        "--keepalive-timeout-secs",
        type=seconds_arg(allow_zero=False),
        default=connections.keepalive_timeout,
        metavar="SECS",
        help="an idle keep-alive connection is closed after this long",
    )
    serve.add_argument(
        "--min-open-files",
        type=positive_int_arg,
        default=None,
        metavar="N",
        help="the frontend raises its open files limit to the hard limit at start; refuse to "
        "start (exit 1) when that is below N (each connection is one open file) (default: "
        "unset: start whatever the limit)",
    )
    serve.add_argument(
        "--format",
        dest="formats",
        type=_formats,
        default=tuple(FORMATS),
        metavar="NAMES",
        help="the HTTP formats to serve, comma-separated (sglang, vllm)",
    )
    serve.add_argument(
        "--sglang-incremental-streaming-output",
        action="store_true",
        help="SGLang streams send only the new tokens (as SGLang's server flag of that name); "
        "without it every event repeats the output so far",
    )
    serve.add_argument(
        "--request-timeout-secs",
        type=seconds_arg(allow_zero=True),
        default=3600.0,
        metavar="SECS",
        help="a generation still running after this long is ended (0: no limit)",
    )
    serve.add_argument(
        "--migration-limit",
        type=int,
        default=DEFAULT_MIGRATION_LIMIT,
        metavar="N",
        help="how many times one generation may move to another worker after its worker failed "
        "(0: a failure after the first token is reported; one retry before it is always allowed)",
    )
    serve.add_argument(
        "--resume-on-abort",
        action="store_true",
        help="a generation its engine aborted on its own (a trainer pausing it in abort mode) "
        "goes on from the tokens it delivered, budget deducted, once a worker takes new "
        "requests, as if every request sent X-Resume-On-Abort: true (a request's header still "
        "decides for it; docs/frontend.md, 'Resume on request')",
    )
    budget = RetryBudgetSettings()
    serve.add_argument(
        "--retry-budget-ratio",
        type=_weight,
        default=budget.ratio,
        metavar="R",
        help="retries on another worker (a busy or failed worker's request, before its first "
        "token) allowed per request that succeeded recently, so an overloaded fleet never "
        "multiplies its own load; past it the client gets the worker's own answer",
    )
    serve.add_argument(
        "--retry-budget-min-per-sec",
        type=_weight,
        default=budget.min_per_second,
        metavar="N",
        help="retries per second always allowed, whatever the successes (a quiet fleet still retries)",
    )
    serve.add_argument(
        "--max-starting-calls-per-worker",
        type=positive_int_arg,
        default=HandlerConfig.start_slots,
        metavar="N",
        help="Generate calls this frontend has at one sidecar without their first output; more wait "
        "here (gRPC's server refuses calls past ~1,000 waiting and drops one after 30 s)",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=positive_int_arg,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="BYTES",
        help="larger request bodies are refused (413)",
    )
    serve.add_argument(
        "--drain-timeout-secs",
        type=seconds_arg(allow_zero=True),
        default=30.0,
        metavar="SECS",
        help="on SIGTERM, how long in-flight requests may finish before they are ended",
    )
    workers = parser.add_argument_group("workers")
    workers.add_argument(
        "--worker",
        dest="workers",
        type=_workers,
        action="append",
        default=None,
        metavar="[ROLE=]HOST:PORT",
        help="a sidecar's gRPC address (--discovery static); ROLE is agg (default), prefill or "
        "decode; repeatable, or a comma-separated list (default: none)",
    )
    workers.add_argument(
        "--prefill-worker",
        dest="prefill_workers",
        type=_prefill_workers,
        action="append",
        default=None,
        metavar="HOST:PORT",
        help="a sidecar in --disaggregation-mode prefill (--discovery static; the same as "
        "--worker prefill=HOST:PORT); with prefill workers, requests are prefilled there and "
        "decoded on the decode workers; repeatable (default: none)",
    )
    workers.add_argument(
        "--model",
        dest="models",
        type=_names,
        action="append",
        default=None,
        metavar="NAME",
        help="serve only this model (a worker's served_model_name); workers serving another are "
        "refused; repeatable, or a comma-separated list (default: every model the workers serve)",
    )
    workers.add_argument(
        "--worker-connections",
        type=positive_int_arg,
        default=2,
        metavar="N",
        help="gRPC connections to each worker",
    )
    workers.add_argument(
        "--worker-tls-ca",
        type=Path,
        default=None,
        metavar="PEM",
        help="dial the workers over TLS, trusting the certificates this CA signed; re-read when "
        "the file changes (default: unset: plaintext)",
    )
    workers.add_argument(
        "--worker-tls-cert",
        type=Path,
        default=None,
        metavar="PEM",
        help="this frontend's client certificate (chain) for workers that require mutual TLS "
        "(--tls-client-ca); needs --worker-tls-key and --worker-tls-ca; re-read when it changes "
        "(default: unset: no client certificate)",
    )
    workers.add_argument(
        "--worker-tls-key",
        type=Path,
        default=None,
        metavar="PEM",
        help="the private key of --worker-tls-cert; re-read when it changes",
    )
    outliers = OutlierSettings()
    workers.add_argument(
        "--outlier-failures",
        type=_count,
        default=outliers.consecutive_failures,
        metavar="N",
        help="a worker whose calls fail of its own fault (not the client's, not busy) N times in a "
        "row is taken out of routing for a while, then given one request; never the last worker "
        "of a model (0: never)",
    )
    workers.add_argument(
        "--outlier-ejection-secs",
        type=seconds_arg(allow_zero=False),
        default=outliers.first_ejection,
        metavar="SECS",
        help="how long a worker is out after its first ejection; doubling each time it is ejected again",
    )
    workers.add_argument(
        "--outlier-max-ejection-secs",
        type=seconds_arg(allow_zero=False),
        default=outliers.max_ejection,
        metavar="SECS",
        help="the longest an ejection lasts",
    )
    routing = parser.add_argument_group("routing")
    routing.add_argument(
        "--routing",
        choices=[r.value for r in Routing],
        default=None,
        help="how a worker is chosen: kv (by the prefix the workers' KV caches hold, from their "
        "cache streams, weighed against load), approx (the same from this frontend's own routing "
        "decisions), load (power of two choices on requests in flight), round-robin, random "
        "(default: kv for the workers that publish their cache, approx for the others)",
    )
    routing.add_argument(
        "--routing-index-max-mb",
        type=positive_int_arg,
        default=256,
        metavar="MIB",
        help="memory cap of each model's block index; over it the least recently used blocks are forgotten",
    )
    routing.add_argument(
        "--routing-approx-ttl-secs",
        type=seconds_arg(allow_zero=False),
        default=120.0,
        metavar="SECS",
        help="how long approx routing assumes a prompt stays cached on the worker it was sent to",
    )
    routing.add_argument(
        "--routing-hot-spot-ratio",
        type=_ratio,
        default=PolicyConfig.hot_spot_ratio,
        metavar="R",
        help="a worker running more than R times the requests of the least busy one (plus "
        "--routing-hot-spot-slack) loses its cache affinity until the others catch up",
    )
    routing.add_argument(
        "--routing-hot-spot-slack",
        type=_count,
        default=PolicyConfig.hot_spot_slack,
        metavar="N",
        help="requests a worker may run beyond R times the least busy one's before it counts as a hot spot",
    )
    routing.add_argument(
        "--routing-left-behind-weight",
        type=_weight,
        default=PolicyConfig.left_behind_weight,
        metavar="W",
        help="what each cached prompt token left behind weighs, in prompt tokens to prefill, "
        "when a worker holding less of the prompt than the best holder is considered",
    )
    routing.add_argument(
        "--routing-max-snapshot-keys",
        type=positive_int_arg,
        default=WorkerSetConfig.kv_max_snapshot_keys,
        metavar="N",
        help="the most block keys a worker's KV cache snapshot may hold; a worker that sends more "
        "is taken out of routing for a while (a snapshot is about a worker's whole cache)",
    )
    routing.add_argument(
        "--routing-max-update-keys",
        type=positive_int_arg,
        default=WorkerSetConfig.kv_max_update_keys,
        metavar="N",
        help="the most block keys one KV cache update of a worker may carry; past it, as above",
    )
    add_session_arguments(parser)
    _add_admission_arguments(parser)
    add_discovery_arguments(parser)
    _add_admin_arguments(parser)
    _add_fleet_arguments(parser)
    add_operations_arguments(
        parser, metrics_host_help="address the metrics endpoint binds (default: the host of --listen)"
    )
    annotate_env_help(parser, ENV_PREFIX)
    return parser


def _add_admission_arguments(parser: argparse.ArgumentParser) -> None:
    admission = parser.add_argument_group('admission (docs/frontend.md, "Admission")')
    defaults = AdmissionSettings()
    admission.add_argument(
        "--no-admission",
        action="store_true",
        help="send every request straight to a worker, however loaded the fleet is (no queue, no "
        "fair share, no 429): the frontend's behaviour before admission",
    )
    admission.add_argument(
        "--max-queue-depth",
        type=positive_int_arg,
        default=defaults.max_queue_depth,
        metavar="N",
        help="requests that may wait for room in one priority band of one model; past it, 429",
    )
    admission.add_argument(
        "--max-queue-wait-secs",
        type=seconds_arg(allow_zero=False),
        default=defaults.max_queue_wait,
        metavar="SECS",
        help="how long a request may wait for room before it is refused (429)",
    )
    admission.add_argument(
        "--admission-headroom",
        type=_fraction,
        default=defaults.headroom,
        metavar="F",
        help="the fraction of the fleet's running slots that only a tenant under its fair share "
        "may take, kept while more than one tenant is around: what keeps a quiet tenant's first "
        "token fast under another tenant's flood",
    )
    admission.add_argument(
        "--lower-band-share",
        type=_fraction,
        default=defaults.lower_band_share,
        metavar="F",
        help="the least fraction of tokens admitted that lower priority bands get while they wait "
        "(0: strict priority)",
    )
    admission.add_argument(
        "--worker-capacity",
        type=_worker_capacity,
        action="append",
        default=None,
        metavar="HOST:PORT=N",
        help="that worker runs at most N sequences at once, over its engine's max_num_seqs "
        "(vLLM) or max_running_requests (SGLang); repeatable (default: what each engine reports)",
    )
    admission.add_argument(
        "--load-stale-secs",
        type=seconds_arg(allow_zero=False),
        default=CapacitySettings.stale_after,
        metavar="SECS",
        help="a worker whose load its sidecar last reported longer ago counts as full for "
        "admission (unless every worker of the model is that stale)",
    )
    admission.add_argument(
        "--tenant-header",
        type=_header_name,
        default=DEFAULT_TENANT_HEADER,
        metavar="NAME",
        help="the request header naming its tenant, for fair share and rate limits (absent: the "
        "default tenant); a gateway in front should set it from authentication and strip the "
        "client's own",
    )
    admission.add_argument(
        "--priority-header",
        type=_header_name,
        default=DEFAULT_PRIORITY_HEADER,
        metavar="NAME",
        help="a request header whose integer overrides the body's priority, in the format's own "
        "meaning (vLLM: lower first; SGLang: larger first)",
    )
    admission.add_argument(
        "--sglang-low-priority-values-first",
        action="store_true",
        help="SGLang requests with lower priority values are served first (as SGLang's own server "
        "flag of that name); without it, larger values first",
    )
    admission.add_argument(
        "--preempt-after-secs",
        type=seconds_arg(allow_zero=False),
        default=None,
        metavar="SECS",
        help="a request that waited this long while every running slot holds less urgent work "
        "takes one of those slots: that generation pauses (its client sees no error and no "
        "repeated token) and resumes from its delivered tokens once there is room (default: "
        "unset: never)",
    )
    admission.add_argument(
        "--rate-limits",
        default=None,
        metavar="FILE",
        help='per-tenant requests and tokens per minute (TOML; docs/configuration.md, "Rate limits '
        'file"); re-read when it changes (default: unset: no rate limits)',
    )


def _add_admin_arguments(parser: argparse.ArgumentParser) -> None:
    admin = parser.add_argument_group('membership API (docs/rl.md, "The membership API")')
    admin.add_argument(
        "--admin-token",
        type=_admin_token,
        default=None,
        metavar="TOKEN",
        help="admin calls (POST, GET and DELETE /workers; /add_worker, /remove_worker, /list_workers) "
        "need the header Authorization: Bearer TOKEN, from any address; prefer the variable (a "
        "command line is visible to the host's users) (default: unset: admin calls are answered "
        "only from loopback)",
    )
    admin.add_argument(
        "--admin-listen",
        type=listen_arg,
        default=None,
        metavar="HOST:PORT",
        help="serve the admin calls on this address only, not on --listen (default: unset: on --listen)",
    )


def _add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    fleet = parser.add_argument_group(
        'pauses and weight versions (docs/frontend.md, "Pauses and weight versions")'
    )
    fleet.add_argument(
        "--route-latest-weights",
        action="store_true",
        help="new requests go only to the workers whose engine reports the fleet's newest weight "
        "version (the one most recently reported as new, or the one POST /weight_version set); the "
        "others are listed pending until they report it (default: off: any version takes requests)",
    )
    fleet.add_argument(
        "--paused-hold-secs",
        type=seconds_arg(allow_zero=True),
        default=FleetSettings.paused_hold,
        metavar="SECS",
        help="while every worker of a model is paused (or, with --route-latest-weights, none is at "
        "the newest version), a new request waits this long for one to take it, then is answered 503",
    )


def _admission_config(ns: argparse.Namespace) -> AdmissionConfig:
    if ns.no_admission:
        return AdmissionConfig(enabled=False)
    return AdmissionConfig(
        enabled=True,
        settings=AdmissionSettings(
            max_queue_depth=ns.max_queue_depth,
            max_queue_wait=ns.max_queue_wait_secs,
            headroom=ns.admission_headroom,
            lower_band_share=ns.lower_band_share,
        ),
        # Each of --processes N processes admits against its share of every worker's slots.
        capacity=CapacitySettings(stale_after=ns.load_stale_secs, processes=ns.processes),
        worker_capacity=dict(ns.worker_capacity or ()),
        who=WhoRules(
            tenant_header=ns.tenant_header,
            priority_header=ns.priority_header,
            sglang_low_priority_values_first=ns.sglang_low_priority_values_first,
        ),
        rate_limits=ns.rate_limits,
        preempt_after=ns.preempt_after_secs,
    )


def _outliers(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> OutlierSettings:
    try:
        return OutlierSettings(
            consecutive_failures=int(ns.outlier_failures),
            first_ejection=ns.outlier_ejection_secs,
            max_ejection=ns.outlier_max_ejection_secs,
        )
    except ValueError as err:
        parser.error(f"--outlier-*: {err}")


def _worker_tls(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> ClientTlsFiles | None:
    ca, cert, key = ns.worker_tls_ca, ns.worker_tls_cert, ns.worker_tls_key
    if (cert is None) != (key is None):
        missing = "--worker-tls-cert" if cert is None else "--worker-tls-key"
        parser.error(f"--worker-tls-cert and --worker-tls-key go together: {missing} is missing")
    if ca is None:
        if cert is not None:
            parser.error(
                "--worker-tls-cert needs --worker-tls-ca (the CA that signed the workers' certificates)"
            )
        return None
    files = ClientTlsFiles(ca=ca, cert=cert, key=key)
    try:
        load_client_files(files)  # read and checked now: a usage error rather than a dark fleet
    except TlsSettingsError as err:
        parser.error(f"--worker-tls-*: {err}")
    return files


def parse_config(
    argv: Sequence[str], environ: Mapping[str, str], *, prog: str | None = None
) -> FrontendConfig:
    parser = build_parser(prog)
    ns = parse_with_env(parser, argv, environ, ENV_PREFIX)
    workers = [word for group in (*(ns.workers or ()), *(ns.prefill_workers or ())) for word in group]
    if ns.migration_limit < 0:
        parser.error(f"--migration-limit must be 0 or more, got {ns.migration_limit}")
    try:
        discovery = discovery_config_from_args(ns, workers)
        _refuse_inapplicable(ns)
        sessions = session_settings(ns, dict(ns.worker_capacity or ()))
    except ValueError as err:
        parser.error(str(err))
    timeout: float = ns.request_timeout_secs
    return FrontendConfig(
        listen=ns.listen,
        discovery=discovery,
        formats=ns.formats,
        handler=HandlerConfig(
            request_timeout=timeout if timeout > 0 else None,
            max_body_bytes=ns.max_body_bytes,
            migration_limit=ns.migration_limit,
            resume_on_abort=ns.resume_on_abort,
            start_slots=ns.max_starting_calls_per_worker,
            retry_budget=RetryBudgetSettings(
                ratio=ns.retry_budget_ratio, min_per_second=ns.retry_budget_min_per_sec
            ),
        ),
        worker_set=WorkerSetConfig(
            connections=ns.worker_connections,
            models=frozenset(name for group in ns.models or () for name in group),
            tls=_worker_tls(parser, ns),
            # Calls in flight when the TLS files rotate may finish on the old connections.
            retire_grace=timeout + 5.0 if timeout > 0 else WorkerSetConfig.retire_grace,
            kv_max_snapshot_keys=ns.routing_max_snapshot_keys,
            kv_max_update_keys=ns.routing_max_update_keys,
            outliers=_outliers(parser, ns),
            fleet=FleetSettings(
                route_latest_weights=ns.route_latest_weights, paused_hold=ns.paused_hold_secs
            ),
        ),
        routing=RouterConfig(
            routing=Routing(ns.routing) if ns.routing is not None else None,
            index_max_bytes=ns.routing_index_max_mb * 1024 * 1024,
            approx_ttl=ns.routing_approx_ttl_secs,
            policy=PolicyConfig(
                hot_spot_ratio=ns.routing_hot_spot_ratio,
                hot_spot_slack=ns.routing_hot_spot_slack,
                left_behind_weight=ns.routing_left_behind_weight,
            ),
            sessions=sessions,
        ),
        metrics_port=ns.metrics_port,
        metrics_host=ns.metrics_host,
        drain_timeout=ns.drain_timeout_secs,
        log_format=ns.log_format or default_log_format(),
        log_level=ns.log_level,
        sources=flag_sources(ns),
        sglang_incremental_streaming_output=ns.sglang_incremental_streaming_output,
        admission=_admission_config(ns),
        processes=ns.processes,
        connections=ConnectionSettings(
            backlog=ns.listen_backlog,
            keepalive_timeout=ns.keepalive_timeout_secs,
            min_open_files=ns.min_open_files,
        ),
        admin=AdminConfig(token=ns.admin_token, listen=ns.admin_listen),
    )
