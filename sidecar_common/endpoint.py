"""Engine endpoint parsing (docs/common.md "Engine endpoint").

Accepted: ``host:port``, ``grpc://host:port``, ``http://host:port`` (all plaintext), with an
IPv6 host in brackets (``[::1]:50051``). A lone trailing ``/`` is accepted and ignored, because
people paste ``http://host:port/`` from a browser; any longer path is refused. Surrounding
whitespace is ignored (environment variables often carry a newline). Everything else is refused
at parse time with a message that says what is wrong, before any network I/O.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

__all__ = ["Endpoint", "EndpointError", "parse_endpoint"]

_PLAINTEXT_SCHEMES: Final = frozenset({"grpc", "http"})
_TLS_SCHEMES: Final = frozenset({"https", "grpcs"})
# RFC 1123 host names (and IPv4 dotted quads, which match too); underscores are tolerated
# because container and compose service names use them.
_HOSTNAME: Final = re.compile(
    r"[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?)*\.?"
)
_PORT: Final = re.compile(r"[0-9]{1,5}")
_NUMERIC_HOST: Final = re.compile(r"[0-9.]+")


class EndpointError(ValueError):
    """A refused endpoint; the message says what is wrong."""


_Refuse = Callable[[str], "EndpointError"]


@dataclass(frozen=True)
class Endpoint:
    host: str  # without brackets, even for IPv6
    port: int

    @property
    def target(self) -> str:
        """``host:port`` as grpcio and aiohttp want it (IPv6 in brackets)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def http_base_url(self) -> str:
        return f"http://{self.target}"

    def __str__(self) -> str:
        return self.target


def parse_endpoint(text: str) -> Endpoint:
    """``host:port``, ``grpc://host:port`` or ``http://host:port``; refuses the rest."""
    stripped = text.strip()

    def refuse(problem: str) -> EndpointError:
        return EndpointError(f"invalid endpoint {text!r}: {problem}")

    if not stripped:
        raise EndpointError("invalid endpoint: it is empty (expected host:port)")
    rest = stripped
    if "://" in stripped:
        scheme, rest = stripped.split("://", 1)
        scheme = scheme.lower()
        if scheme in _TLS_SCHEMES:
            raise refuse(f"TLS is not supported yet ({scheme}://); use grpc:// or http:// (plaintext)")
        if scheme not in _PLAINTEXT_SCHEMES:
            shown = f"{scheme}://" if scheme else "an empty scheme"
            raise refuse(f"unsupported scheme {shown}; use host:port, grpc://host:port or http://host:port")
    if "#" in rest:
        raise refuse("a fragment ('#...') is not allowed")
    if "?" in rest:
        raise refuse("a query ('?...') is not allowed")
    authority, slash, path = rest.partition("/")
    if slash and path:
        raise refuse(f"a path ('/{path}') is not allowed")
    if "@" in authority:
        raise refuse("user info ('user@') is not allowed")
    if not authority:
        raise refuse("the host is missing")
    host, port_text = _split_host_port(authority, refuse)
    return Endpoint(host, _parse_port(port_text, refuse))


def _split_host_port(authority: str, refuse: _Refuse) -> tuple[str, str]:
    if authority.startswith("["):
        inside, bracket, after = authority[1:].partition("]")
        if not bracket:
            raise refuse("an IPv6 address opened with '[' has no closing ']'")
        try:
            ipaddress.IPv6Address(inside)
        except ValueError:
            raise refuse(f"{inside!r} in brackets is not an IPv6 address") from None
        if not after:
            raise refuse("the port is missing (expected [ipv6]:port)")
        if not after.startswith(":"):
            raise refuse(f"unexpected {after!r} after the IPv6 address (expected :port)")
        return inside, after[1:]
    colons = authority.count(":")
    if colons == 0:
        raise refuse("the port is missing (expected host:port)")
    if colons > 1:
        raise refuse("an IPv6 address must be in brackets, e.g. [::1]:50051")
    host, _, port_text = authority.partition(":")
    if not host:
        raise refuse("the host is missing")
    if not _HOSTNAME.fullmatch(host):
        raise refuse(f"{host!r} is not a valid host name or IPv4 address")
    if _NUMERIC_HOST.fullmatch(host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise refuse(f"{host!r} is not a valid IPv4 address") from None
    return host, port_text


def _parse_port(port_text: str, refuse: _Refuse) -> int:
    if not port_text:
        raise refuse("the port is missing")
    if not _PORT.fullmatch(port_text):
        raise refuse(f"port {port_text!r} is not a number")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise refuse(f"port {port} is out of range (1..65535)")
    return port
