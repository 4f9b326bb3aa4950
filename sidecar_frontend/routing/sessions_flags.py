"""The sessions' flags (docs/configuration.md, docs/frontend.md "Sessions") and the settings
they make. Imported by the command line: nothing here loads aiohttp, grpc or numpy."""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from typing import Final

from sidecar_common.flags import at_least_arg, positive_int_arg, refuse_inapplicable, seconds_arg
from sidecar_frontend.routing.sessions import DEFAULT_SESSION_HEADERS, SessionSettings

__all__ = ["add_session_arguments", "session_settings"]

_SEPARATORS: Final = ':()<>@,;\\"/[]?={}'
_DEFAULTS: Final = SessionSettings()


def _header_names(text: str) -> tuple[str, ...]:
    """One header name, or several separated by commas or spaces, lower-cased."""
    names = tuple(dict.fromkeys(word.lower() for word in text.replace(",", " ").split()))
    if not names or any(c in _SEPARATORS for name in names for c in name):
        raise argparse.ArgumentTypeError(f"expected HTTP header names, got {text!r}")
    return names


def _saturation(text: str) -> float:
    """A positive number, or inf (never saturated)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number (or inf), got {text!r}")
    return value


def add_session_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group('sessions (docs/frontend.md, "Sessions")')
    group.add_argument(
        "--no-sessions",
        action="store_true",
        help="route requests naming a session as any other (/finish_session still answers, "
        "releasing nothing)",
    )
    group.add_argument(
        "--session-header",
        dest="session_headers",
        type=_header_names,
        action="append",
        default=None,
        metavar="NAME",
        help="a request header naming the request's session, the first present one wins; "
        "repeatable, or a comma-separated list (default: "
        f"{', '.join(DEFAULT_SESSION_HEADERS)}: SMG's and vllm-router's)",
    )
    group.add_argument(
        "--session-idle-secs",
        type=seconds_arg(allow_zero=True),
        default=_DEFAULTS.idle,
        metavar="SECS",
        help="a session unused this long is forgotten (its next turn starts it anew); 0: never",
    )
    group.add_argument(
        "--session-max",
        type=positive_int_arg,
        default=_DEFAULTS.max_sessions,
        metavar="N",
        help="the most sessions one process holds; past it the least recently used is forgotten",
    )
    group.add_argument(
        "--session-saturation",
        type=_saturation,
        default=_DEFAULTS.saturation,
        metavar="R",
        help="a session's turn leaves its worker when that worker runs at least R times its "
        "running limit (--worker-capacity, else its engine's) while another worker does not "
        "(inf: never)",
    )
    group.add_argument(
        "--session-spread",
        type=at_least_arg(0, whole=True),
        default=_DEFAULTS.spread,
        metavar="N",
        help="a new session may start on a worker holding up to N sessions more than the least "
        "loaded one, for the longest cached prefix or, with --processes, for the processes to "
        "choose alike",
    )
    group.add_argument(
        "--session-pause-wait-secs",
        type=at_least_arg(0),
        default=_DEFAULTS.pause_wait,
        metavar="SECS",
        help="a session's turn whose worker is paused by its trainer, or behind the newest "
        "weight version with --route-latest-weights, waits up to SECS for it before moving to "
        "another worker (0: moves at once)",
    )


def session_settings(ns: argparse.Namespace, worker_capacity: Mapping[str, int]) -> SessionSettings:
    """The settings the parsed flags make; ``worker_capacity``: the running limits of
    ``--worker-capacity``. Raises ValueError for a session flag set with ``--no-sessions``."""
    for dest in (
        "session_headers",
        "session_idle_secs",
        "session_max",
        "session_saturation",
        "session_spread",
        "session_pause_wait_secs",
    ):
        refuse_inapplicable(ns, dest, applies=not ns.no_sessions, rule="is not used with --no-sessions")
    headers = tuple(dict.fromkeys(name for group in ns.session_headers or () for name in group))
    idle: float = ns.session_idle_secs
    return SessionSettings(
        enabled=not ns.no_sessions,
        headers=headers or DEFAULT_SESSION_HEADERS,
        idle=idle if idle > 0 else None,
        max_sessions=ns.session_max,
        saturation=ns.session_saturation,
        spread=int(ns.session_spread),
        worker_capacity=dict(worker_capacity),
        pause_wait=ns.session_pause_wait_secs,
    )
