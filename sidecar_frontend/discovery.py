"""How the frontend finds its workers: a static list, Kubernetes DNS, or etcd.

:func:`run_discovery` feeds a :class:`DiscoverySink` (the worker set) until cancelled:

- ``static``: the ``--worker`` list, added once (then it returns). It may be empty: the
  frontend then starts with no worker and serves those registered through the membership API
  (sidecar_frontend/admin.py).
- ``dns``: every ``--dns-refresh-secs`` each ``--dns-name [ROLE=]NAME:PORT`` is resolved; each
  address is a worker on PORT (a Kubernetes headless Service has one A/AAAA record per ready
  Pod). An address no longer listed is drained; a failed lookup keeps the last answer.
- ``etcd``: the prefix is listed, then watched from the next revision: a key coming adds its
  worker (role from the value), a key going (deleted by a draining sidecar, or its lease
  expired) drains it. When etcd is out of reach the last view stays in force and, once back,
  a fresh listing catches up with whatever changed meanwhile, then the watch resumes.

The decisions are pure (:mod:`sidecar_frontend.discovery_records`); this module does the
lookups, the etcd calls and the waiting, each bounded: a DNS lookup by ``dns_timeout``, an etcd
call by ``etcd_call_timeout``, a silent etcd connection by gRPC keepalive.

Both dynamic modes also re-add a worker of the view that the sink does not hold: a worker set
ignores an add while it still drains the same address (a sidecar that restarted quickly) and
forgets it only once idle. etcd's view is compared with the set at each change of the set (the
worker set's events: a forgotten worker comes back at once) and every ``reconcile_interval`` at
the latest; DNS's at each refresh.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Literal, Protocol, cast

import anyio
import structlog
from anyio.abc import TaskStatus

from sidecar_common.disaggregation import ROLES, Role, is_role
from sidecar_common.flags import parsed_by, seconds_arg
from sidecar_common.registration_record import (
    DEFAULT_PREFIX,
    normalize_prefix,
    parse_etcd_endpoints,
)
from sidecar_common.retry import RetryForever
from sidecar_frontend.discovery_records import (
    AddWorker,
    Change,
    DnsTarget,
    DnsView,
    DrainWorker,
    EtcdView,
    Rejected,
    missing_workers,
    parse_dns_target,
    parse_worker,
)

__all__ = [
    "DISCOVERY_MODES",
    "DiscoveryConfig",
    "DiscoveryMode",
    "DiscoverySink",
    "Resolver",
    "add_discovery_arguments",
    "discovery_config_from_args",
    "run_discovery",
    "system_resolver",
]

log = structlog.get_logger("sidecar_frontend.discovery")

DiscoveryMode = Literal["static", "dns", "etcd"]
DISCOVERY_MODES: Final[tuple[DiscoveryMode, ...]] = ("static", "dns", "etcd")

# (host, port) -> the IP addresses it resolves to. Raises OSError when it cannot resolve.
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


class DiscoverySink(Protocol):
    """What discovery drives: the frontend's worker set."""

    def add_worker(self, address: str, role: str = "agg") -> None:
        """Start using ``address`` in ``role``; idempotent."""

    def drain_worker(self, address: str) -> None:
        """No new requests to ``address``; in-flight ones finish; then it is forgotten."""

    def addresses(self) -> frozenset[str]:
        """Every address the set holds, draining ones included."""

    def next_change(self) -> anyio.Event:
        """Set at the set's next change (a drained worker forgotten among them)."""


@dataclass(frozen=True)
class DiscoveryConfig:
    mode: DiscoveryMode = "static"
    static_workers: tuple[tuple[str, Role], ...] = ()
    dns_targets: tuple[DnsTarget, ...] = ()
    dns_refresh: float = 5.0
    dns_timeout: float = 5.0
    etcd_endpoints: tuple[str, ...] = ()
    etcd_prefix: str = DEFAULT_PREFIX
    etcd_call_timeout: float = 3.0
    etcd_retry_max_interval: float = 5.0
    reconcile_interval: float = 1.0


async def system_resolver(host: str, port: int) -> list[str]:
    """The host's resolver (/etc/resolv.conf, /etc/hosts): every address, A and AAAA."""
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def _apply(sink: DiscoverySink, changes: Iterable[Change], source: str) -> None:
    for change in changes:
        if isinstance(change, AddWorker):
            try:
                sink.add_worker(change.address, change.role)
            except ValueError as err:  # an address the worker set cannot dial
                log.error("discovered worker refused", source=source, worker=change.address, error=str(err))
                continue
            log.info("worker discovered", source=source, worker=change.address, role=change.role)
        elif isinstance(change, DrainWorker):
            sink.drain_worker(change.address)
            log.info("worker gone from discovery: draining", source=source, worker=change.address)
        elif isinstance(change, Rejected):
            log.warning(
                "ignoring a registration that is not a worker record", key=change.key, reason=change.reason
            )


async def run_discovery(
    config: DiscoveryConfig,
    sink: DiscoverySink,
    *,
    resolver: Resolver = system_resolver,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Feed ``sink`` from the configured source until cancelled (``static`` returns once its
    workers are added). ``task_status.started()`` comes after the first view was applied, or
    after the first attempt failed: the frontend serves with what it has while discovery
    keeps trying."""
    if config.mode == "static":
        _apply(sink, (AddWorker(a, r) for a, r in config.static_workers), "static")
        task_status.started()
        return
    if config.mode == "dns":
        await _run_dns(config, sink, resolver, task_status)
    else:
        await _run_etcd(config, sink, task_status)


async def _run_dns(
    config: DiscoveryConfig, sink: DiscoverySink, resolver: Resolver, task_status: TaskStatus[None]
) -> None:
    view = DnsView(config.dns_targets)
    failing: set[DnsTarget] = set()
    started = False
    while True:
        for target in config.dns_targets:
            try:
                with anyio.fail_after(config.dns_timeout):
                    hosts = await resolver(target.host, target.port)
            except (OSError, TimeoutError) as err:
                # Logged when it starts failing, not on every refresh while it keeps failing.
                level = log.debug if target in failing else log.warning
                failing.add(target)
                level("dns lookup failed; keeping the last answer", name=str(target), error=repr(err))
                continue
            if target in failing:
                failing.discard(target)
                log.info("dns lookup works again", name=str(target))
            _apply(sink, view.resolved(target, hosts), "dns")
        _apply(sink, missing_workers(view.workers(), sink.addresses()), "dns")
        if not started:
            started = True
            task_status.started()
        await anyio.sleep(config.dns_refresh)


async def _reconcile(view: EtcdView, sink: DiscoverySink, interval: float) -> None:
    while True:
        changed = sink.next_change()
        # At the set's next change (a drained worker it now forgets may be added again at once),
        # or after the interval at the latest.
        with anyio.move_on_after(interval):
            await changed.wait()
        _apply(sink, missing_workers(view.workers(), sink.addresses()), "etcd")


async def _run_etcd(config: DiscoveryConfig, sink: DiscoverySink, task_status: TaskStatus[None]) -> None:
    # Imported here: the etcd client pulls in grpc, which the command line (this module's
    # flags) and the other modes do not need.
    from sidecar_common.registration_etcd import EtcdError, etcd_backoff, open_session

    view = EtcdView()
    prefix = config.etcd_prefix.encode()
    endpoints = config.etcd_endpoints
    sessions = 0
    started = False

    def report_started() -> None:
        nonlocal started
        if not started:
            started = True
            task_status.started()

    def lost(error: BaseException, failures: int, pause: float) -> None:
        # A warning when it starts failing; the retries that follow are debug lines.
        level = log.warning if failures == 1 else log.debug
        level(
            "etcd discovery lost etcd; keeping the last view",
            error=str(error),
            workers=len(view.workers()),
            retry_in_secs=round(pause, 2),
        )
        report_started()  # out of reach from the start: the frontend starts with no worker

    retrying = RetryForever(
        etcd_backoff(config.etcd_retry_max_interval),
        retry_on=lambda error: isinstance(error, EtcdError),
        on_retry=lost,
    )

    async def listen_then_watch() -> None:
        """One session on the next endpoint: list the prefix, then follow its changes until
        etcd fails or the watch ends (both raise EtcdError)."""
        nonlocal sessions
        endpoint = endpoints[sessions % len(endpoints)]
        sessions += 1
        async with open_session(endpoint, config.etcd_call_timeout) as session:
            snapshot = await session.get_prefix(prefix)
            _apply(sink, view.resync(snapshot.items), "etcd")
            log.info(
                "etcd discovery in sync",
                etcd=endpoint,
                prefix=config.etcd_prefix,
                workers=len(view.workers()),
                revision=snapshot.revision,
            )
            retrying.made_progress()
            report_started()
            async with session.watch_prefix(prefix, snapshot.revision + 1) as events:
                async for event in events:
                    if event.kind == "put":
                        _apply(sink, view.put(event.key, event.value), "etcd")
                    else:
                        _apply(sink, view.delete(event.key), "etcd")
        raise EtcdError("the watch ended")

    async with anyio.create_task_group() as tg:
        tg.start_soon(_reconcile, view, sink, config.reconcile_interval)
        await retrying.run(listen_then_watch)  # never returns: every session ends in a retry


# ------------------------------------------------------------------------------ flags


def add_discovery_arguments(parser: argparse.ArgumentParser) -> None:
    """``--discovery``, ``--dns-name``, ``--dns-refresh-secs``, ``--etcd-endpoints``,
    ``--etcd-prefix`` (the CLI's environment mirrors apply to them like to any flag)."""
    group = parser.add_argument_group("discovery")
    group.add_argument(
        "--discovery",
        choices=DISCOVERY_MODES,
        default="static",
        help="where the workers come from: the --worker list, DNS (--dns-name) or etcd (--etcd-endpoints)",
    )
    group.add_argument(
        "--dns-name",
        dest="dns_names",
        type=parsed_by(parse_dns_target),
        action="append",
        default=None,
        metavar="[ROLE=]NAME:PORT",
        help="with --discovery dns: every address NAME resolves to is a worker on PORT "
        "(e.g. a Kubernetes headless Service); ROLE is agg (default), prefill or decode; repeatable",
    )
    group.add_argument(
        "--dns-refresh-secs",
        type=seconds_arg(allow_zero=False),
        default=5.0,
        metavar="SECS",
        help="with --discovery dns: how often the names are resolved again",
    )
    group.add_argument(
        "--etcd-endpoints",
        type=parsed_by(parse_etcd_endpoints),
        default=None,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="with --discovery etcd: the etcd members to ask, in turn",
    )
    group.add_argument(
        "--etcd-prefix",
        type=parsed_by(normalize_prefix),
        default=DEFAULT_PREFIX,
        metavar="PREFIX",
        help="with --discovery etcd: the key prefix the sidecars register under",
    )


def discovery_config_from_args(
    namespace: argparse.Namespace, static_workers: Iterable[str | tuple[str, str]] = ()
) -> DiscoveryConfig:
    """The parsed flags (and the CLI's ``--worker`` list, as addresses or (address, role))
    -> DiscoveryConfig. Raises ValueError with a usage message for a contradiction."""
    mode = cast(DiscoveryMode, namespace.discovery)
    workers: list[tuple[str, Role]] = []
    for item in static_workers:
        if isinstance(item, str):
            workers.append(parse_worker(item))
        else:
            address, role = item
            if not is_role(role):
                raise ValueError(f"worker {address}: role must be one of {', '.join(ROLES)}, got {role!r}")
            workers.append((parse_worker(address)[0], role))
    dns_targets = tuple(dict.fromkeys(namespace.dns_names or ()))
    endpoints: tuple[str, ...] = namespace.etcd_endpoints or ()
    if mode != "static" and workers:
        raise ValueError(f"--worker is the static list: it cannot be combined with --discovery {mode}")
    if mode == "dns" and not dns_targets:
        raise ValueError("--discovery dns needs at least one --dns-name NAME:PORT")
    if mode == "etcd" and not endpoints:
        raise ValueError("--discovery etcd needs --etcd-endpoints HOST:PORT[,...]")
    if mode != "dns" and dns_targets:
        raise ValueError("--dns-name is only used with --discovery dns")
    return DiscoveryConfig(
        mode=mode,
        static_workers=tuple(dict(workers).items()),
        dns_targets=dns_targets,
        dns_refresh=namespace.dns_refresh_secs,
        etcd_endpoints=endpoints,
        etcd_prefix=namespace.etcd_prefix,
    )
