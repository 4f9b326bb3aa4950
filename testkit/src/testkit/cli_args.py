"""Argument types shared by the ``testkit-engine`` subcommands."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from sidecar_common.endpoint import HostPortError, parse_host_port
from testkit.faults import FaultPlan, parse_fault_flag
from testkit.kv_events import Flavor, KvEventsConfig, parse_kv_events_config

__all__ = ["fault_arg", "kv_events_arg", "listen_arg", "optional_listen_arg"]


def listen_arg(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 in brackets; port 0 picks a free port) → (host, port)."""
    try:
        address = parse_host_port(text, port_zero_allowed=True)
    except HostPortError:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}") from None
    return address.host, address.port


def optional_listen_arg(text: str) -> tuple[str, int] | None:
    """Like :func:`listen_arg`; ``off`` / ``none`` / empty turns that listener off."""
    if text.lower() in ("off", "none", ""):
        return None
    return listen_arg(text)


def fault_arg(text: str) -> tuple[str, FaultPlan]:
    """``MATCH=DIRECTIVE`` (see :func:`testkit.faults.parse_fault_flag`)."""
    try:
        return parse_fault_flag(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def kv_events_arg(flavor: Flavor) -> Callable[[str], KvEventsConfig]:
    """``--kv-events-config`` JSON, read as ``flavor`` reads it."""

    def parse(text: str) -> KvEventsConfig:
        try:
            return parse_kv_events_config(text, flavor)
        except ValueError as e:
            # argparse names the flag already.
            raise argparse.ArgumentTypeError(str(e).removeprefix("--kv-events-config: ")) from None

    return parse
