"""Argument types shared by the ``testkit-engine`` subcommands."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from testkit.faults import FaultPlan, parse_fault_flag
from testkit.kv_events import Flavor, KvEventsConfig, parse_kv_events_config

__all__ = ["fault_arg", "kv_events_arg", "listen_arg", "optional_listen_arg"]


def listen_arg(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 in brackets) → (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


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
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse
