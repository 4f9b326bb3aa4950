"""The systemd readiness protocol (sd_notify), without libsystemd.

A ``Type=notify`` unit is "started" only once the service sends ``READY=1``; for a sidecar
that means after the engine is connected and discovered, which can take many minutes while
the engine loads its weights. The protocol is one AF_UNIX datagram of ``KEY=VALUE`` lines to
the socket named by ``$NOTIFY_SOCKET``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

__all__ = ["notify", "notify_socket_address"]


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
