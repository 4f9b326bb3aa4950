"""Whether a listen address can be bound, said in one line before a server tries.

grpc reports a failed bind as a bare RuntimeError (and prints its own line from C++), aiohttp
as an OSError with the socket's words: the daemons ask here first, so that a taken port, an
address of another host or a name that does not resolve is one line naming the address. The
server's own bind stays the final word (another process may take the port in between).
"""

from __future__ import annotations

import errno
import socket

from sidecar_common.endpoint import format_host_port

__all__ = ["bind_problem"]


def bind_problem(host: str, port: int, *, serving: str = "listen on") -> str | None:
    """Why ``host:port`` cannot be listened on now, or None: ``cannot <serving> host:port:
    <why>``. Binds (and closes) a socket per
    address the host resolves to, the way servers do on Linux (SO_REUSEADDR, so that a port
    whose last connections are in TIME_WAIT counts as free). As grpc does, one address that
    binds is enough (``localhost`` in a container without IPv6 still serves on 127.0.0.1),
    but one that another process holds is a conflict. With port 0 (the OS picks one) only the
    host is checked."""
    attempt = f"{serving} {format_host_port(host, port)}"
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        return f"cannot {attempt}: the host does not resolve ({err.strerror})"
    failures: list[OSError] = []
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    return f"cannot {attempt}: the address is in use by another process"
                failures.append(err)
    if not failures or len(failures) < len(infos):
        return None
    first = failures[0]
    if first.errno == errno.EADDRNOTAVAIL:
        return f"cannot {attempt}: not an address of this host"
    if first.errno == errno.EACCES:
        return f"cannot {attempt}: permission denied (a port below 1024 needs privileges)"
    return f"cannot {attempt}: {first.strerror or first}"
