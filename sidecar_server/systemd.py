"""The systemd readiness protocol (sd_notify), without libsystemd.

A ``Type=notify`` unit is "started" only once the service sends ``READY=1``; for a sidecar
that means after the engine is connected and discovered, which can take many minutes while
the engine loads its weights. The protocol is one AF_UNIX datagram of ``KEY=VALUE`` lines to
the socket named by ``$NOTIFY_SOCKET``.

With ``WatchdogSec=`` in the unit, systemd passes ``$WATCHDOG_USEC`` and restarts the service
when no ``WATCHDOG=1`` arrives within it. :func:`feed_watchdog` sends them from the event loop
itself, at half that interval (what sd_watchdog_enabled(3) advises), so they stop exactly
when the loop is wedged, which is what the restart is for.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import anyio

__all__ = ["feed_watchdog", "notify", "notify_socket_address", "watchdog_period"]


def notify_socket_address(environ: Mapping[str, str] | None = None) -> str | bytes | None:
    """Where notifications go: a filesystem path, an abstract address (bytes), or None."""
    env = os.environ if environ is None else environ
    path = env.get("NOTIFY_SOCKET", "")
    if not path:
        return None
    if path.startswith("@"):
        # Linux abstract namespace: a leading NUL instead of the '@' systemd writes.
        return b"\0" + path[1:].encode()
    return path


def notify(message: str, *, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``message`` (e.g. ``"READY=1\\nSTATUS=serving"``) to systemd.

    Returns True when the datagram was sent, False when not running under a notify-aware
    supervisor or the socket refused it. Never raises: a readiness notification must not be
    what brings the service down.
    """
    address = notify_socket_address(environ)
    if address is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(1.0)
            sock.sendto(message.encode(), address)
    except OSError:
        return False
    return True


def watchdog_period(environ: Mapping[str, str] | None = None, *, pid: int | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings: half of ``$WATCHDOG_USEC``, or None when no
    watchdog is asked of this process.

    ``$WATCHDOG_PID``, when set, names the process the watchdog is for: a child that
    inherited the variables must not ping for its parent. Unusable values mean no watchdog,
    as in sd_watchdog_enabled(3).
    """
    env = os.environ if environ is None else environ
    usec_text = env.get("WATCHDOG_USEC", "")
    if not usec_text.isdigit() or int(usec_text) == 0:
        return None
    pid_text = env.get("WATCHDOG_PID", "")
    own_pid = os.getpid() if pid is None else pid
    if pid_text and (not pid_text.isdigit() or int(pid_text) != own_pid):
        return None
    return int(usec_text) / 1_000_000 / 2


async def feed_watchdog(period: float, *, environ: Mapping[str, str] | None = None) -> None:
    """Send ``WATCHDOG=1`` now and every ``period`` seconds, until cancelled. Runs on the
    event loop on purpose: a loop that stops turning stops the pings."""
    while True:
        notify("WATCHDOG=1", environ=environ)
        await anyio.sleep(period)
