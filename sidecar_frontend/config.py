"""The frontend's settings as the command line builds them: plain data, no aiohttp or grpc
(``--help`` and a usage error import neither). The handler and the worker set read them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from sidecar_common.pool_settings import RetryPolicy
from sidecar_common.tls_settings import ClientTlsFiles
from sidecar_frontend.admission.capacity import CapacitySettings
from sidecar_frontend.admission.state import AdmissionSettings
from sidecar_frontend.admission.who import WhoRules
from sidecar_frontend.fleet import FleetSettings
from sidecar_frontend.migration import DEFAULT_MIGRATION_LIMIT
from sidecar_frontend.outliers import OutlierSettings
from sidecar_frontend.retry_budget import RetryBudgetSettings

__all__ = [
    "DEFAULT_KEEPALIVE_TIMEOUT",
    "DEFAULT_LISTEN_BACKLOG",
    "DEFAULT_MAX_BODY_BYTES",
    "AdminConfig",
    "AdmissionConfig",
    "ConnectionSettings",
    "HandlerConfig",
    "WorkerSetConfig",
]

DEFAULT_MAX_BODY_BYTES: Final = 64 * 1024 * 1024
# Connections the kernel may hold complete but not yet accepted: a burst of thousands of
# clients (a trainer's rollouts) must not meet refused connections (aiohttp's own default is
# 128). The kernel caps it at net.core.somaxconn (4096 by default since Linux 5.4).
DEFAULT_LISTEN_BACKLOG: Final = 4096
# An idle keep-alive connection is closed after this long: longer than the common load
# balancers' idle timeouts (60 s to 350 s, except GCP's 600 s), so a balancer is never the
# one to find a connection closed under a request it forwards; short enough that connections
# a client forgot do not pile up for an hour (aiohttp's default, 3630 s).
DEFAULT_KEEPALIVE_TIMEOUT: Final = 620.0


@dataclass(frozen=True)
class HandlerConfig:
    request_timeout: float | None = 3600.0  # None: no deadline
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    migration_limit: int = DEFAULT_MIGRATION_LIMIT
    # A generation its engine aborted on its own goes on, unless its request says otherwise
    # (X-Resume-On-Abort; sidecar_frontend/resume.py).
    resume_on_abort: bool = False
    # How long a retry or a migration waits for a worker to serve when none does (workers
    # restarting or being replaced): the gap an SRE expects a fleet to bridge.
    worker_wait: float = 5.0
    # Generate calls at one sidecar without their first output yet (taken up or still waiting
    # in its gRPC server): more wait in the frontend, where a wait costs nothing and a client
    # that leaves is simply gone (--max-starting-calls-per-worker).
    start_slots: int = 64
    # Retries across workers as a fraction of recent successes (sidecar_frontend/retry_budget.py).
    retry_budget: RetryBudgetSettings = field(default_factory=RetryBudgetSettings)


@dataclass(frozen=True)
class WorkerSetConfig:
    connections: int = 2  # gRPC channels (TCP connections) per sidecar
    rpc_timeout: float = 5.0  # GetModelInfo, GetLoad, Abort
    load_poll_interval: float = 1.0
    retry: RetryPolicy = field(default_factory=lambda: RetryPolicy(attempt_timeout=5.0, max_interval=1.0))
    # Pause before watching health again after the Watch stream broke.
    rewatch_interval: float = 0.2
    # A worker that does not answer is reported at once, then at an interval doubling from
    # this up to the cap: never silence for minutes, never a line a second. (Dialling is
    # reported by the connection pool at its own such pace: `waiting for worker`.)
    report_first_secs: float = 2.0
    report_max_secs: float = 30.0
    # The models this frontend serves (served_model_name); empty: whatever the workers serve.
    models: frozenset[str] = frozenset()
    # Dial the workers over TLS with these files (None: plaintext).
    tls: ClientTlsFiles | None = None
    # How often the TLS files are looked at (a stat each) for a rotation.
    tls_check_interval: float = 5.0
    # After a rotation, how long calls in flight on the old connections may go on there.
    retire_grace: float = 3600.0
    # A worker whose TLS handshake fails is tried again after this, doubling up to the cap.
    tls_refused_retry: tuple[float, float] = (1.0, 30.0)
    # One connection round: the pool reports as it dials (at once, then at a doubling
    # interval up to 30 s), so a long round keeps a dead worker to about two lines a minute;
    # an unreachable worker is dialled round after round until drained.
    connect_round_secs: float = 300.0
    # How long a redial with rotated TLS files may take before the old connections are kept.
    redial_secs: float = 30.0
    # The most keys a worker's KV cache snapshot may hold (all its chunks), and one KV delta
    # (added, removed and announced keys together); past either, the worker misbehaves.
    kv_max_snapshot_keys: int = 4_000_000
    kv_max_update_keys: int = 262_144
    # A worker failing calls of its own fault this many times in a row is ejected (outliers.py).
    outliers: OutlierSettings = field(default_factory=OutlierSettings)
    # Pauses and weight versions (fleet.py): --route-latest-weights, --paused-hold-secs.
    fleet: FleetSettings = field(default_factory=FleetSettings)


@dataclass(frozen=True)
class ConnectionSettings:
    """How the HTTP listener takes connections (``--listen-backlog``,
    ``--keepalive-timeout-secs``, ``--min-open-files``)."""

    backlog: int = DEFAULT_LISTEN_BACKLOG
    keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT
    # Refuse to start when the open files limit cannot be raised to this (None: start anyway).
    min_open_files: int | None = None


@dataclass(frozen=True)
class AdminConfig:
    """The membership API (sidecar_frontend/admin.py): ``--admin-token``, ``--admin-listen``."""

    # Admin calls need ``Authorization: Bearer <token>``; None: they are answered from loopback only.
    token: str | None = field(default=None, repr=False)
    # Serve the admin endpoints here alone (None: on --listen, beside the formats' routes).
    listen: str | None = None


@dataclass(frozen=True)
class AdmissionConfig:
    """The admission flags (sidecar_frontend/admission/)."""

    enabled: bool = True
    settings: AdmissionSettings = field(default_factory=AdmissionSettings)
    capacity: CapacitySettings = field(default_factory=CapacitySettings)
    # A worker's running limit by its address, over what its engine reports (--worker-capacity).
    worker_capacity: Mapping[str, int] = field(default_factory=dict)
    who: WhoRules = field(default_factory=WhoRules)
    # The rate limits file (--rate-limits); None: no rate limits.
    rate_limits: str | None = None
    # How often the queue looks at the fleet again while requests wait (for load reports of other
    # frontends' requests, which no event of this frontend announces).
    tick: float = 0.1
    # A request that waited this long while every running slot holds less urgent work may take
    # the slot of one of those (preempted, resumed later token-exactly); None: never.
    preempt_after: float | None = None
