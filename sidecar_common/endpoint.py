"""``host:port``: the one parser, the one formatter and the one wildcard rule (pure).

The addresses the programs read (engine endpoints, ``--listen``, ``--advertise``, etcd
endpoints, static workers, DNS targets, worker records, the testkit's listeners, the engines'
KV-event sockets) go through :func:`parse_host_port`; the ones they write into records, bind,
dial or log go through :func:`format_host_port` (an IPv6 literal in brackets). A wildcard host
(:func:`is_wildcard_host`) is one a server binds and nobody can dial; :func:`loopback_for` is
what a process on the same host dials instead.

The rules: surrounding whitespace is ignored (environment variables often carry a newline);
an IPv6 host is in brackets and is an IPv6 address; any other host is an RFC 1123 host name
(underscores tolerated, because container and compose service names use them) or, when
numeric, a valid IPv4 address; the port is 1 to 5 decimal digits in 1..65535, or 0..65535
where the caller binds (port 0 asks the OS for a free one). A refusal is a
:class:`HostPortError` naming the problem; each caller words it (:class:`HostPortWords`, or
its own message), so that the parse rules live once while the flags keep their messages.

Engine endpoints (docs/common.md "Engine endpoint") add a scheme: ``host:port``,
``grpc://host:port``, ``http://host:port`` (all plaintext). A lone trailing ``/`` is accepted
and ignored, because people paste ``http://host:port/`` from a browser; any longer path is
refused, as are user info, queries and fragments, before any network I/O.

ZeroMQ's TCP addresses (the engines' KV-event sockets) are ``tcp://host:port``
(:func:`parse_tcp_endpoint`): the same host and port rules, and ZeroMQ's ``*`` for every
interface.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from dataclasses import dataclass
from typing import Final

__all__ = [
    "Endpoint",
    "EndpointError",
    "HostPort",
    "HostPortError",
    "HostPortProblem",
    "HostPortWords",
    "format_host_port",
    "is_wildcard_host",
    "loopback_for",
    "parse_bind_host",
    "parse_endpoint",
    "parse_host_port",
    "parse_tcp_endpoint",
]

# RFC 1123 host names (and IPv4 dotted quads, which match too); underscores are tolerated
# because container and compose service names use them.
_HOSTNAME: Final = re.compile(
    r"[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?)*\.?"
)
_NUMERIC_HOST: Final = re.compile(r"[0-9.]+")
_DIGITS: Final = re.compile(r"[0-9]+")
_PORT_MAX: Final = 65535
_ZMQ_WILDCARD: Final = "*"


def _unbracketed(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def format_host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 literal in brackets (a host already in brackets is kept)."""
    bare = _unbracketed(host)
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def is_wildcard_host(host: str) -> bool:
    """True for a host that means "every interface" (empty, ``0.0.0.0``, ``::`` in any
    spelling, with or without brackets, and ZeroMQ's ``*``): a server binds it, nobody can
    dial it."""
    bare = _unbracketed(host.strip())
    if not bare or bare == _ZMQ_WILDCARD:
        return True
    try:
        return ipaddress.ip_address(bare).is_unspecified
    except ValueError:
        return False


def loopback_for(host: str) -> str:
    """The host a process beside a server bound on ``host`` dials it by: for a wildcard, the
    loopback of its family (``::1`` for an IPv6 one, else ``127.0.0.1``); any other host as
    it is. Without brackets."""
    if not is_wildcard_host(host):
        return _unbracketed(host.strip())
    return "::1" if ":" in host else "127.0.0.1"


@dataclass(frozen=True)
class HostPort:
    """A parsed address. ``host`` is without brackets, even for IPv6."""

    host: str
    port: int

    @property
    def bracketed_host(self) -> str:
        """The host as it stands in ``host:port`` (an IPv6 literal in brackets)."""
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def target(self) -> str:
        """``host:port`` as grpcio, aiohttp and the logs want it (IPv6 in brackets)."""
        return format_host_port(self.host, self.port)

    @property
    def http_base_url(self) -> str:
        return f"http://{self.target}"

    def __str__(self) -> str:
        return self.target


# An engine endpoint is a HostPort (parsed by parse_endpoint, which also reads a scheme).
Endpoint = HostPort


class HostPortProblem(enum.Enum):
    """Why a text is not ``host:port``."""

    NO_HOST = "no host"  # empty, or nothing before ':port'
    NO_PORT = "no port"  # no ':' after the host
    EMPTY_PORT = "empty port"  # ':' with nothing after it
    UNCLOSED_BRACKET = "unclosed bracket"  # '[' without ']' (or ']' without '[')
    AFTER_BRACKETS = "text after brackets"  # '[v6]' followed by something else than ':port'
    NOT_IPV6_IN_BRACKETS = "not IPv6 in brackets"
    IPV6_UNBRACKETED = "IPv6 without brackets"  # more than one ':' outside brackets
    BAD_HOST_NAME = "bad host name"  # not an RFC 1123 name (spaces, '/', '@', ',', ...)
    BAD_IPV4 = "bad IPv4 address"  # numeric, but not a dotted quad
    PORT_NOT_NUMBER = "port not a number"
    PORT_OUT_OF_RANGE = "port out of range"


class HostPortError(ValueError):
    """A refused ``host:port``: the problem, the text, and the part it is about (``detail``:
    the host as written, the address inside brackets, the port text, or what follows the
    brackets). The message is a plain description; callers word it for their users."""

    def __init__(self, problem: HostPortProblem, text: str, detail: str = "") -> None:
        super().__init__(f"{problem.value} in {text!r}")
        self.problem = problem
        self.text = text
        self.detail = detail


@dataclass(frozen=True)
class HostPortWords:
    """How a program words each refusal, with ``str.format`` fields ``text`` (what was
    given) and ``detail`` (see :class:`HostPortError`)."""

    not_host_port: str  # no host, no port
    brackets: str  # unbalanced brackets, or text after them
    unbracketed_ipv6: str
    bad_host: str  # not a host name, IPv4 address or IPv6 address
    bad_port: str  # empty or not a number
    port_out_of_range: str

    def message(self, err: HostPortError) -> str:
        template = {
            HostPortProblem.NO_HOST: self.not_host_port,
            HostPortProblem.NO_PORT: self.not_host_port,
            HostPortProblem.EMPTY_PORT: self.bad_port,
            HostPortProblem.UNCLOSED_BRACKET: self.brackets,
            HostPortProblem.AFTER_BRACKETS: self.brackets,
            HostPortProblem.NOT_IPV6_IN_BRACKETS: self.bad_host,
            HostPortProblem.IPV6_UNBRACKETED: self.unbracketed_ipv6,
            HostPortProblem.BAD_HOST_NAME: self.bad_host,
            HostPortProblem.BAD_IPV4: self.bad_host,
            HostPortProblem.PORT_NOT_NUMBER: self.bad_port,
            HostPortProblem.PORT_OUT_OF_RANGE: self.port_out_of_range,
        }[err.problem]
        return template.format(text=err.text, detail=err.detail)


def parse_host_port(text: str, *, port_zero_allowed: bool) -> HostPort:
    """``host:port`` or ``[ipv6]:port`` (surrounding whitespace ignored); port 0 only where
    ``port_zero_allowed`` (an address to bind). Raises :class:`HostPortError`."""
    stripped = text.strip()
    if stripped.startswith("["):
        inside, bracket, after = stripped[1:].partition("]")
        if not bracket:
            raise HostPortError(HostPortProblem.UNCLOSED_BRACKET, text, stripped)
        if not _is_ipv6(inside):
            raise HostPortError(HostPortProblem.NOT_IPV6_IN_BRACKETS, text, inside)
        if not after:
            raise HostPortError(HostPortProblem.NO_PORT, text, inside)
        if not after.startswith(":"):
            raise HostPortError(HostPortProblem.AFTER_BRACKETS, text, after)
        host, port_text = inside, after[1:]
    else:
        colons = stripped.count(":")
        if colons == 0:
            problem = HostPortProblem.NO_PORT if stripped else HostPortProblem.NO_HOST
            raise HostPortError(problem, text, stripped)
        if colons > 1:
            raise HostPortError(HostPortProblem.IPV6_UNBRACKETED, text, stripped)
        host, _, port_text = stripped.partition(":")
        _check_host(host, text)
    return HostPort(host, _port(port_text, text, port_zero_allowed=port_zero_allowed))


def parse_bind_host(text: str) -> str:
    """A host to bind: a host name or an address, an IPv6 literal with or without brackets
    (surrounding whitespace ignored). Returns it without brackets; raises
    :class:`HostPortError`."""
    stripped = text.strip()
    if stripped.startswith("[") or stripped.endswith("]"):
        inside = _unbracketed(stripped)
        if inside == stripped:
            raise HostPortError(HostPortProblem.UNCLOSED_BRACKET, text, stripped)
        if not _is_ipv6(inside):
            raise HostPortError(HostPortProblem.NOT_IPV6_IN_BRACKETS, text, inside)
        return inside
    if ":" in stripped:
        if not _is_ipv6(stripped):
            raise HostPortError(HostPortProblem.BAD_HOST_NAME, text, stripped)
        return stripped
    _check_host(stripped, text)
    return stripped


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def _check_host(host: str, text: str) -> None:
    if not host:
        raise HostPortError(HostPortProblem.NO_HOST, text, host)
    if not _HOSTNAME.fullmatch(host):
        raise HostPortError(HostPortProblem.BAD_HOST_NAME, text, host)
    if _NUMERIC_HOST.fullmatch(host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise HostPortError(HostPortProblem.BAD_IPV4, text, host) from None


def _port(port_text: str, text: str, *, port_zero_allowed: bool) -> int:
    if not port_text:
        raise HostPortError(HostPortProblem.EMPTY_PORT, text, port_text)
    if not _DIGITS.fullmatch(port_text):
        raise HostPortError(HostPortProblem.PORT_NOT_NUMBER, text, port_text)
    port = int(port_text)
    if not (0 if port_zero_allowed else 1) <= port <= _PORT_MAX:
        raise HostPortError(HostPortProblem.PORT_OUT_OF_RANGE, text, port_text)
    return port


# --- engine endpoints -------------------------------------------------------------------------

_PLAINTEXT_SCHEMES: Final = frozenset({"grpc", "http"})
_TLS_SCHEMES: Final = frozenset({"https", "grpcs"})
_PORT_DIGITS_MAX: Final = 5


class EndpointError(ValueError):
    """A refused endpoint; the message says what is wrong."""


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
    try:
        return parse_host_port(authority, port_zero_allowed=False)
    except HostPortError as err:
        raise refuse(_endpoint_problem(err)) from None


def _endpoint_problem(err: HostPortError) -> str:
    """The endpoint flags' words for each problem (docs/common.md)."""
    detail = err.detail
    match err.problem:
        case HostPortProblem.NO_HOST:
            return "the host is missing"
        case HostPortProblem.NO_PORT:
            shape = "[ipv6]:port" if err.text.strip().startswith("[") else "host:port"
            return f"the port is missing (expected {shape})"
        case HostPortProblem.EMPTY_PORT:
            return "the port is missing"
        case HostPortProblem.UNCLOSED_BRACKET:
            return "an IPv6 address opened with '[' has no closing ']'"
        case HostPortProblem.NOT_IPV6_IN_BRACKETS:
            return f"{detail!r} in brackets is not an IPv6 address"
        case HostPortProblem.AFTER_BRACKETS:
            return f"unexpected {detail!r} after the IPv6 address (expected :port)"
        case HostPortProblem.IPV6_UNBRACKETED:
            return "an IPv6 address must be in brackets, e.g. [::1]:50051"
        case HostPortProblem.BAD_HOST_NAME:
            return f"{detail!r} is not a valid host name or IPv4 address"
        case HostPortProblem.BAD_IPV4:
            return f"{detail!r} is not a valid IPv4 address"
        case HostPortProblem.PORT_NOT_NUMBER:
            return f"port {detail!r} is not a number"
        case HostPortProblem.PORT_OUT_OF_RANGE:
            if len(detail) > _PORT_DIGITS_MAX:
                return f"port {detail!r} is not a number"
            return f"port {int(detail)} is out of range (1..65535)"


# --- ZeroMQ TCP addresses ---------------------------------------------------------------------

_TCP_SCHEME: Final = "tcp://"


def parse_tcp_endpoint(text: str) -> HostPort:
    """``tcp://host:port`` (ZeroMQ's TCP address; surrounding whitespace ignored): the host as
    :func:`parse_host_port` reads it, or ``*`` (every interface, kept as ``*``); a port in
    1..65535. Raises :class:`EndpointError` saying what is wrong."""
    stripped = text.strip()

    def refuse(problem: str) -> EndpointError:
        return EndpointError(f"invalid endpoint {text!r}: {problem}")

    if not stripped.startswith(_TCP_SCHEME):
        raise refuse("expected tcp://HOST:PORT")
    authority = stripped[len(_TCP_SCHEME) :]
    host, colon, port_text = authority.partition(":")
    try:
        if host == _ZMQ_WILDCARD and colon:
            address = HostPort(host, _port(port_text, text, port_zero_allowed=False))
        else:
            address = parse_host_port(authority, port_zero_allowed=False)
    except HostPortError as err:
        if err.problem is HostPortProblem.PORT_OUT_OF_RANGE and int(err.detail) == 0:
            raise refuse(
                "port 0 cannot be dialled (a socket bound on port 0 was given a port of its own: "
                "give that one)"
            ) from None
        raise refuse(_endpoint_problem(err)) from None
    return address
