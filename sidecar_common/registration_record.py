"""What a sidecar writes into etcd about itself, and how a frontend reads it back (pure).

One key per worker: ``<prefix><advertised host:port>``, its value a small JSON object::

    {"address": "10.0.0.5:50061", "engine": "vllm", "model": "llama", "role": "agg",
     "data_parallel_size": 1, "version": "0.1.0"}

The key is attached to a lease the sidecar keeps alive, so a dead sidecar's key disappears
when the lease expires. Encoding and decoding live here, side by side, so that the writer and
the reader cannot drift apart; nothing here does I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from sidecar_common.disaggregation import ROLES, Role, is_role
from sidecar_common.endpoint import (
    HostPort,
    HostPortError,
    HostPortWords,
    format_host_port,
    is_wildcard_host,
    parse_host_port,
)

__all__ = [
    "DEFAULT_PREFIX",
    "RECORD_FIELDS",
    "RecordError",
    "RegistrationConfig",
    "WorkerRecord",
    "advertise_address",
    "decode_record",
    "encode_record",
    "normalize_prefix",
    "parse_advertise",
    "parse_etcd_endpoints",
    "record_key",
]

DEFAULT_PREFIX: Final = "/llm-sidecars/workers/"
RECORD_FIELDS: Final = ("address", "engine", "model", "role", "data_parallel_size", "version")


class RecordError(ValueError):
    """A value, prefix, endpoint or address that cannot be used; the message says why."""


@dataclass(frozen=True)
class WorkerRecord:
    """One registered sidecar, as the frontends see it."""

    address: str  # host:port the frontends dial (IPv6 in brackets)
    engine: str  # "vllm" or "sglang"
    model: str  # the served model name
    role: Role = "agg"
    data_parallel_size: int = 1
    version: str = ""


@dataclass(frozen=True)
class RegistrationConfig:
    """Where and how a sidecar registers itself (``--etcd-*`` and ``--advertise``)."""

    endpoints: tuple[str, ...]  # host:port of etcd members, tried in turn
    prefix: str = DEFAULT_PREFIX  # normalized: ends with "/"
    advertise: str | None = None  # None: the --listen host with the bound port
    lease_ttl: int = 10  # seconds a dead sidecar's key survives it
    call_timeout: float = 3.0  # bound on each etcd call (and on the withdrawal at drain)
    retry_max_interval: float = 5.0  # cap of the backoff between registration attempts


def _record_words(what: str) -> HostPortWords:
    return HostPortWords(
        not_host_port=what + ": expected host:port, got {text!r}",
        brackets=what + ": unbalanced brackets in {text!r}",
        unbracketed_ipv6=what + ": an IPv6 host needs brackets, e.g. [fd00::1]:50061, got {text!r}",
        bad_host=what + ": not a host name or address: {detail!r}",
        bad_port=what + ": expected a port in 1..65535, got {detail!r}",
        port_out_of_range=what + ": expected a port in 1..65535, got {detail!r}",
    )


def _address(text: str, what: str) -> HostPort:
    try:
        return parse_host_port(text, port_zero_allowed=False)
    except HostPortError as err:
        raise RecordError(_record_words(what).message(err)) from None


def advertise_address(listen: str, advertise: str | None, bound_port: int) -> str:
    """The host:port written into etcd.

    ``advertise`` wins when given (it must carry its own non-zero port). Otherwise the
    ``--listen`` host with the port actually bound (``--listen`` may say port 0). A wildcard
    listen host without ``advertise`` is refused: another machine cannot dial 0.0.0.0.
    """
    if advertise is not None:
        return parse_advertise(advertise)
    host = parse_host_port(listen, port_zero_allowed=True).host
    if is_wildcard_host(host):
        raise RecordError(
            f"--listen {listen} is every interface, which no frontend can dial: "
            "give --advertise HOST:PORT (e.g. the pod IP) when registering in etcd"
        )
    if not 0 < bound_port <= 65535:
        raise RecordError(f"no port to advertise (listening on port {bound_port})")
    return format_host_port(host, bound_port)


def parse_advertise(text: str) -> str:
    """``--advertise HOST:PORT``: a dialable host (not a wildcard) and a port in 1..65535."""
    address = _address(text, "--advertise")
    if is_wildcard_host(address.host):
        raise RecordError(f"--advertise must name an address others can dial, got {text!r}")
    return str(address)


def normalize_prefix(prefix: str) -> str:
    """A non-empty key prefix ending in ``/`` (so ``/a/workers`` never matches ``/a/workers2``)."""
    text = prefix.strip()
    if not text:
        raise RecordError("the etcd prefix must not be empty")
    if any(c.isspace() for c in text):
        raise RecordError(f"the etcd prefix must not contain spaces, got {prefix!r}")
    return text if text.endswith("/") else text + "/"


def record_key(prefix: str, address: str) -> bytes:
    """The etcd key of the worker at ``address`` (``prefix`` already normalized)."""
    return (prefix + address).encode()


def parse_etcd_endpoints(text: str) -> tuple[str, ...]:
    """``host:port[,host:port...]`` (an ``http://`` scheme is accepted and dropped) -> host:port
    strings. TLS endpoints are refused by name: this client speaks plaintext gRPC only."""
    endpoints: list[str] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        if item.startswith("https://"):
            raise RecordError(f"etcd endpoint {item!r}: TLS (https://) is not supported")
        item = item.removeprefix("http://").rstrip("/")
        endpoints.append(str(_address(item, "etcd endpoint")))
    if not endpoints:
        raise RecordError(f"expected at least one etcd endpoint host:port, got {text!r}")
    return tuple(dict.fromkeys(endpoints))


def encode_record(record: WorkerRecord) -> bytes:
    """The JSON value of a worker's key (keys sorted, so the same record gives the same bytes)."""
    body = {
        "address": record.address,
        "engine": record.engine,
        "model": record.model,
        "role": record.role,
        "data_parallel_size": record.data_parallel_size,
        "version": record.version,
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _field(body: Mapping[str, Any], name: str, kind: type, default: Any = None) -> Any:
    value = body.get(name, default)
    # bool is an int in Python; a JSON true is not a data-parallel size.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RecordError(f"field {name!r} must be a {kind.__name__}, got {value!r}")
    return value


def decode_record(raw: bytes) -> WorkerRecord:
    """A worker's key value -> WorkerRecord, or RecordError naming what is wrong.

    Unknown fields are ignored (a newer sidecar may add some); ``role``,
    ``data_parallel_size`` and ``version`` default when absent, the rest is required.
    """
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as err:
        raise RecordError(f"not JSON: {err}") from None
    if not isinstance(body, dict):
        raise RecordError(f"expected a JSON object, got {type(body).__name__}")
    address = _field(body, "address", str)
    parsed = _address(address, "address")
    if is_wildcard_host(parsed.host):
        raise RecordError(f"address {address!r} is not dialable")
    role = _field(body, "role", str, "agg")
    if not is_role(role):
        raise RecordError(f"field 'role' must be one of {', '.join(ROLES)}, got {role!r}")
    dp_size = _field(body, "data_parallel_size", int, 1)
    if dp_size < 1:
        raise RecordError(f"field 'data_parallel_size' must be >= 1, got {dp_size}")
    return WorkerRecord(
        address=str(parsed),
        engine=_field(body, "engine", str),
        model=_field(body, "model", str),
        role=role,
        data_parallel_size=dp_size,
        version=_field(body, "version", str, ""),
    )
