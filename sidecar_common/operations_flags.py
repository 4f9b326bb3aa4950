"""The operations flags every daemon declares alike (the sidecars and the frontend):
``--metrics-port``, ``--metrics-host``, ``--log-format``, ``--log-level``, and the rule that
``--metrics-host`` needs ``--metrics-port``.

Apart from :mod:`sidecar_common.flags`, the generic flag library, because these flags are
what the daemons have in common; standard library only, as ``flags`` is.
"""

from __future__ import annotations

import argparse
from typing import Final

from sidecar_common import flags
from sidecar_common.log_settings import LOG_LEVELS

__all__ = [
    "METRICS_HOST_HELP",
    "add_operations_arguments",
    "metrics_address_flags",
    "refuse_metrics_host_without_port",
]

METRICS_HOST_HELP: Final = (
    "address the metrics endpoint binds; needs --metrics-port (default: the host of --listen)"
)


def add_operations_arguments(
    parser: argparse.ArgumentParser, *, metrics_host_help: str = METRICS_HOST_HELP
) -> None:
    """Add the "operations" group; ``metrics_host_help`` is the --help line of
    --metrics-host, which each daemon words its own way."""
    ops = parser.add_argument_group("operations")
    ops.add_argument(
        "--metrics-port",
        type=flags.port_arg,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on this port (default: unset: off)",
    )
    ops.add_argument(
        "--metrics-host",
        type=flags.bind_host_arg,
        default=None,
        metavar="HOST",
        help=metrics_host_help,
    )
    ops.add_argument(
        "--log-format",
        choices=("json", "console"),
        default=None,
        help="json lines, or human-readable (default: console on a terminal, else json)",
    )
    ops.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default="info",
        help="the least severe lines logged",
    )


def refuse_metrics_host_without_port(ns: argparse.Namespace) -> None:
    """--metrics-host set while metrics are off is a usage error (docs/common.md, "Flags that
    do not apply")."""
    flags.refuse_inapplicable(
        ns, "metrics_host", applies=ns.metrics_port is not None, rule="needs --metrics-port (metrics are off)"
    )


def metrics_address_flags(sources: flags.FlagSources) -> str:
    """The flags that chose the metrics address, as a start-up failure names them:
    ``--metrics-port``, with ``--metrics-host`` when it was set (else the host is the one of
    ``--listen``), each with its variable when the value came from one."""
    dests = ("metrics_host", "metrics_port") if sources.is_set("metrics_host") else ("metrics_port",)
    return ", ".join(sources.naming(dest) for dest in dests)
