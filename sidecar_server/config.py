"""Configuration shared by every sidecar, and how an engine package plugs into the CLI."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from sidecar_common.disaggregation import DisaggregationMode
from sidecar_common.endpoint import Endpoint
from sidecar_common.message_size import GRPC_MAX_MESSAGE_BYTES
from sidecar_common.pool_settings import PoolConfig
from sidecar_common.registration_record import RegistrationConfig
from sidecar_common.tls_settings import TlsFiles
from sidecar_server.kv_config import KvEventsConfig

if TYPE_CHECKING:
    # Only named in annotations: the command line reads this module without grpc.
    from sidecar_server.engine import Engine

__all__ = ["EngineSpec", "SidecarConfig"]


@dataclass(frozen=True)
class SidecarConfig:
    """The common flags (docs/common.md), parsed and validated."""

    pool: PoolConfig  # --grpc-endpoint, --grpc-connections, timeouts, startup deadline
    listen: str = "0.0.0.0:50061"
    disaggregation_mode: DisaggregationMode = "agg"
    metrics_port: int | None = None
    metrics_host: str | None = None  # --metrics-host; None: the host of --listen
    log_format: Literal["json", "console"] = "json"
    log_level: str = "info"
    drain_timeout: float = 30.0
    registration: RegistrationConfig | None = None  # --etcd-endpoints & co; None: off
    tls: TlsFiles | None = None  # --tls-cert, --tls-key, --tls-client-ca; None: plaintext
    reflection: bool = True  # --no-reflection switches it off
    # The largest request message the public port accepts (--max-request-bytes).
    max_request_bytes: int = GRPC_MAX_MESSAGE_BYTES
    kv_events: KvEventsConfig | None = None  # --kv-events-endpoint & co; None: off
    # WatchLoad's push interval in seconds (--load-push-interval-ms).
    load_push_interval: float = 0.1


@dataclass(frozen=True)
class EngineSpec:
    """What an engine package gives the shared CLI: its name, its own flags, and a factory.

    ``build`` receives the common config and the parsed namespace (for the engine's own
    flags, e.g. SGLang's ``--transport``). It must not do I/O; ``Engine.start`` does.
    A bad engine-specific flag value raises ``ValueError`` with a message (usage error).

    ``check_flags`` refuses, at parse time, the engine's flags that contradict each other or
    do not apply to the chosen mode (raising ValueError: a usage error, exit 2; see
    ``sidecar_common.flags.refuse_inapplicable``).

    ``endpoint_when_unset`` lets an engine whose chosen transport is not gRPC (SGLang over
    HTTP) supply the engine address when ``--grpc-endpoint`` is not given; returning None
    keeps ``--grpc-endpoint`` required.
    """

    name: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    build: Callable[[SidecarConfig, argparse.Namespace], Engine]
    endpoint_when_unset: Callable[[argparse.Namespace], Endpoint | None] | None = None
    check_flags: Callable[[argparse.Namespace], None] | None = None
