"""The membership API's decisions (pure: no I/O, no clock, no logging): what a registration
body means, each worker's id, who may call, which source lists each worker, and the rows
``GET /workers`` answers. The HTTP side is :mod:`sidecar_frontend.admin`.

The dialects (docs/rl.md has the details and where they were read):

- SMG (sgl-model-gateway, formerly sglang-router; slime, Miles): ``POST /workers`` with a JSON
  body ``{"url", "worker_type", "bootstrap_port", ...}`` answers 202 with ``worker_id`` and a
  ``Location``; ``GET /workers`` answers ``{"workers": [...], "total", "stats"}``;
  ``DELETE /workers/{worker_id}``; errors are ``{"error", "code"}``.
- vllm-router (SkyRL, prime-rl) and the older sglang-router: ``POST /add_worker?url=``,
  ``POST /remove_worker?url=``, ``GET /list_workers`` (``{"urls": [...]}``), plain-text answers.

A worker's id is a UUID (SMG's ids are UUIDs, and its clients check that) derived from the
worker's canonical URL (:func:`worker_id`): the same in every frontend process and across
restarts, so a trainer can compute it, and two frontends agree on it.

Ownership (:class:`Membership`): a worker is listed by discovery (``--worker``, DNS, etcd) or
registered through the API, and each source lets go only of what it listed. A discovered
address cannot be registered (409) nor deleted through the API (409); a registered worker is
removed only by the API, even when discovery later lists and drops the same address. A worker
leaves (drains, then is forgotten) once no source lists it.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol
from urllib.parse import urlsplit

import anyio

from sidecar_common.disaggregation import Role
from sidecar_common.endpoint import HostPortError, HostPortWords, parse_host_port
from sidecar_frontend.registry import Worker, WorkerState

__all__ = [
    "BODY_FIELDS",
    "ENGINES",
    "WORKER_TYPES",
    "AdminError",
    "Engine",
    "Membership",
    "Registration",
    "WorkerSink",
    "admin_access",
    "already_registered",
    "canonical_url",
    "is_loopback",
    "parse_registration",
    "parse_worker_url",
    "registration_from",
    "worker_id",
    "worker_list",
    "worker_row",
]

Engine = Literal["sidecar", "sglang", "vllm"]
ENGINES: Final[tuple[Engine, ...]] = ("sidecar", "sglang", "vllm")
# SMG's worker types, and the frontend's role for each (SMG's "encode" has none here).
WORKER_TYPES: Final[Mapping[str, Role]] = {"regular": "agg", "prefill": "prefill", "decode": "decode"}
_WORKER_TYPE_OF_ROLE: Final[Mapping[str, str]] = {role: name for name, role in WORKER_TYPES.items()}
# What a POST /workers body may hold; any other field is refused by name, not ignored.
BODY_FIELDS: Final = ("url", "worker_type", "bootstrap_port", "engine")

_URL_WORDS: Final = HostPortWords(
    not_host_port="url {text!r} is not SCHEME://HOST:PORT",
    brackets="url {text!r}: unbalanced brackets around an IPv6 address",
    unbracketed_ipv6="url {text!r}: an IPv6 address goes in brackets, as grpc://[::1]:50051",
    bad_host="url {text!r}: {detail!r} is not a host name or address",
    bad_port="url {text!r}: the port is not a number",
    port_out_of_range="url {text!r}: the port is not between 1 and 65535",
)


@dataclass(frozen=True)
class AdminError:
    """An admin call refused: its status, SMG's error ``code`` and the words."""

    status: int
    code: str
    message: str

    def json_body(self) -> bytes:
        """SMG's error shape, ``{"error", "code"}``."""
        return json.dumps({"error": self.message, "code": self.code}).encode()


def _bad(message: str) -> AdminError:
    return AdminError(400, "BAD_REQUEST", message)


# ------------------------------------------------------------------------------ URLs and ids


@dataclass(frozen=True)
class WorkerUrl:
    scheme: Literal["grpc", "http"]
    address: str  # host:port as the worker set dials it (IPv6 in brackets)


def parse_worker_url(text: str) -> WorkerUrl | AdminError:
    """``grpc://HOST:PORT`` (a sidecar) or ``http://HOST:PORT`` (a bare engine), a trailing
    ``/`` allowed; anything else is refused with the reason."""
    try:
        parts = urlsplit(text.strip())
    except ValueError as err:
        return _bad(f"url {text!r}: {err}")
    scheme = parts.scheme.lower()
    if scheme in ("grpcs", "https"):
        return _bad(
            f"url {text!r}: the frontend dials workers over TLS when it has --worker-tls-ca, "
            f"whatever the URL says; give the worker as {'grpc' if scheme == 'grpcs' else 'http'}://HOST:PORT"
        )
    if scheme not in ("grpc", "http"):
        return _bad(
            f"url {text!r}: expected grpc://HOST:PORT (a sidecar) or http://HOST:PORT (a bare engine)"
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment or "@" in parts.netloc:
        return _bad(f"url {text!r}: expected only {scheme}://HOST:PORT (no user, path or query)")
    try:
        address = parse_host_port(parts.netloc, port_zero_allowed=False)
    except HostPortError as err:
        return _bad(_URL_WORDS.message(HostPortError(err.problem, text, err.detail)))
    return WorkerUrl("grpc" if scheme == "grpc" else "http", address.target)


def canonical_url(scheme: str, address: str) -> str:
    """``scheme://host:port``, the form ids are made from."""
    return f"{scheme}://{address}"


def worker_id(url: str) -> str:
    """The id of the worker at ``url`` (canonical, :func:`canonical_url`): a name-based UUID
    (RFC 4122 version 5, URL namespace), the same wherever and whenever it is computed."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, url))


# ------------------------------------------------------------------------------ bodies


@dataclass(frozen=True)
class Registration:
    """A worker registered through the API: a sidecar (``engine`` ``sidecar``), or a bare engine
    (``sglang``, ``vllm``) whose sidecar the frontend runs (sidecar_frontend/bare_children.py)."""

    url: str  # as the caller gave it (listed back as given: callers find their worker by it)
    address: str  # host:port of the URL: the sidecar's, or the bare engine's
    role: Role
    engine: Engine
    bootstrap_port: int | None = None
    # A bare engine's: where the sidecar the frontend runs for it listens (host:port), once
    # chosen; the worker set dials this.
    sidecar_address: str | None = None

    @property
    def scheme(self) -> str:
        return "http" if urlsplit(self.url.strip()).scheme.lower() == "http" else "grpc"

    @property
    def bare(self) -> bool:
        """A bare engine: the frontend runs its sidecar."""
        return self.engine != "sidecar"

    @property
    def worker_address(self) -> str:
        """The address the worker set dials: the sidecar's (a bare engine's: the managed one)."""
        if not self.bare:
            return self.address
        if self.sidecar_address is None:
            raise ValueError(f"the bare engine {self.url!r} has no sidecar address yet")
        return self.sidecar_address

    @property
    def id(self) -> str:
        return worker_id(canonical_url(self.scheme, self.address))

    @property
    def worker_type(self) -> str:
        return _WORKER_TYPE_OF_ROLE[self.role]


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def parse_registration(body: bytes) -> Registration | AdminError:
    """A ``POST /workers`` body -> the registration, or why it is refused (400). A bare
    engine's registration has no ``sidecar_address`` yet: the frontend picks it when it starts
    the engine's sidecar."""
    try:
        data = json.loads(body) if body.strip() else None
    except (ValueError, RecursionError) as err:
        return _bad(f"the body is not JSON: {err}")
    if not isinstance(data, dict):
        return _bad(f"the body must be a JSON object with at least url, got {_json_type(data)}")
    return registration_from(data)


def registration_from(data: Mapping[str, Any]) -> Registration | AdminError:
    """A decoded body (``POST /workers``) or query (``/add_worker``) -> the registration."""
    unknown = sorted(set(data) - set(BODY_FIELDS))
    if unknown:
        return _bad(
            f"unsupported field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: "
            f"this frontend takes {', '.join(BODY_FIELDS)}"
        )
    url = data.get("url")
    if url is None:
        return _bad("url is required: grpc://HOST:PORT for a sidecar")
    if not isinstance(url, str):
        return _bad(f"url must be a string, got {_json_type(url)}")
    parsed = parse_worker_url(url)
    if isinstance(parsed, AdminError):
        return parsed
    worker_type = data.get("worker_type")
    if worker_type is None:
        worker_type = "regular"
    if not isinstance(worker_type, str) or worker_type not in WORKER_TYPES:
        shown = worker_type if isinstance(worker_type, str) else _json_type(worker_type)
        return _bad(f"worker_type must be one of {', '.join(WORKER_TYPES)}, got {shown!r}")
    engine = data.get("engine")
    if engine is not None and (not isinstance(engine, str) or engine not in ENGINES):
        shown = engine if isinstance(engine, str) else _json_type(engine)
        return _bad(f"engine must be one of {', '.join(ENGINES)}, got {shown!r}")
    if parsed.scheme == "http" and engine == "sidecar":
        return _bad(f"url {url!r}: a sidecar is reached over gRPC, as grpc://HOST:PORT")
    if parsed.scheme == "http" and engine == "vllm":
        return _bad(
            f"url {url!r} is vLLM's HTTP server, which no sidecar here speaks: start vLLM's gRPC "
            "server (vllm serve MODEL --grpc) and register grpc://HOST:PORT with engine vllm, "
            "or run sidecar-vllm beside it and register the sidecar"
        )
    # Without engine: a grpc:// URL is a sidecar, an http:// one a bare SGLang server.
    kind: Engine = engine if engine is not None else ("sglang" if parsed.scheme == "http" else "sidecar")
    bootstrap_port = data.get("bootstrap_port")
    if bootstrap_port is not None:
        if isinstance(bootstrap_port, bool) or not isinstance(bootstrap_port, int):
            return _bad(f"bootstrap_port must be a whole number, got {_json_type(bootstrap_port)}")
        if not 1 <= bootstrap_port <= 65535:
            return _bad(f"bootstrap_port must be between 1 and 65535, got {bootstrap_port}")
        if worker_type != "prefill":
            return _bad("bootstrap_port is a prefill server's: only with worker_type prefill")
        if kind == "sidecar":
            return _bad(
                "bootstrap_port: a sidecar learns its engine's bootstrap port from the engine "
                "itself; leave it out for a grpc:// URL"
            )
        if kind == "vllm":
            return _bad("bootstrap_port is an SGLang prefill server's; leave it out for engine vllm")
    return Registration(url.strip(), parsed.address, WORKER_TYPES[worker_type], kind, bootstrap_port)


# ------------------------------------------------------------------------------ who may call


def is_loopback(peer: str | None) -> bool:
    """Whether ``peer`` (an IP address as the connection reports it) is this host's loopback,
    an IPv4-mapped IPv6 loopback included."""
    if not peer:
        return False
    try:
        address = ipaddress.ip_address(peer.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def admin_access(token: str | None, authorization: str | None, peer: str | None) -> AdminError | None:
    """None when the call may proceed. With a token configured the call needs
    ``Authorization: Bearer <token>`` (else 401), from anywhere, loopback included; without
    one, only a loopback peer may call (else 403)."""
    if token is None:
        if is_loopback(peer):
            return None
        return AdminError(
            403,
            "FORBIDDEN",
            "admin calls are answered only from this host's loopback while the frontend has no "
            "--admin-token (SIDECAR_FRONTEND_ADMIN_TOKEN); set one and send it as a bearer token",
        )
    scheme, _, credentials = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not credentials.strip():
        return AdminError(
            401, "UNAUTHORIZED", "admin calls need the header Authorization: Bearer <admin token>"
        )
    if not hmac.compare_digest(credentials.strip().encode(), token.encode()):
        return AdminError(401, "UNAUTHORIZED", "the bearer token is not this frontend's admin token")
    return None


# ------------------------------------------------------------------------------ who lists what


class WorkerSink(Protocol):
    """What :class:`Membership` drives: the frontend's worker set."""

    def add_worker(self, address: str, role: str = "agg") -> None: ...

    def drain_worker(self, address: str) -> None: ...

    def addresses(self) -> frozenset[str]: ...

    def next_change(self) -> anyio.Event: ...

    def get(self, address: str) -> Worker | None: ...


@dataclass
class Membership:
    """Between the worker set and its two sources: discovery (through the
    :class:`~sidecar_frontend.discovery.DiscoverySink` methods ``add_worker`` /
    ``drain_worker`` / ``addresses`` / ``next_change``) and the admin API (``register`` /
    ``unregister``). Each source lets go only of the workers it listed; a worker is drained once
    none lists it. ``source`` names discovery in answers (``static``, ``dns``, ``etcd``)."""

    workers: WorkerSink
    source: str = "static"
    _registered: dict[str, Registration] = field(default_factory=dict)  # by address
    _discovered: dict[str, str] = field(default_factory=dict)  # address -> role
    # Registrations the API removed whose workers may still be draining: still listed with the
    # URL they were registered under (forgotten lazily once the set no longer holds them).
    _leaving: dict[str, Registration] = field(default_factory=dict)

    # -------------------------------------------------------------- discovery's face

    def add_worker(self, address: str, role: str = "agg") -> None:
        self._discovered[address] = role
        if address not in self._registered:
            self.workers.add_worker(address, role)

    def drain_worker(self, address: str) -> None:
        self._discovered.pop(address, None)
        if address not in self._registered:
            self.workers.drain_worker(address)

    def addresses(self) -> frozenset[str]:
        return self.workers.addresses()

    def next_change(self) -> anyio.Event:
        return self.workers.next_change()

    # -------------------------------------------------------------- the API's face

    def registered(self) -> Mapping[str, Registration]:
        """The API's registrations, by address."""
        return self._registered

    def _registration_of(self, address: str) -> Registration | None:
        """The registration of a registered worker, or of one the API removed that drains."""
        registration = self._registered.get(address)
        if registration is not None:
            return registration
        leaving = self._leaving.get(address)
        if leaving is not None and self.workers.get(address) is None:
            del self._leaving[address]
            return None
        return leaving

    def source_of(self, address: str) -> str:
        """``api`` for a worker the API registered (draining after its removal included),
        else the discovery mode that listed it."""
        return "api" if self._registration_of(address) is not None else self.source

    def registration_at(self, address: str) -> Registration | None:
        """The registration of the worker at ``address`` (the worker set's), one the API
        removed that still drains included; None for a worker discovery listed."""
        return self._registration_of(address)

    def refusal_to_register(self, registration: Registration) -> AdminError | None:
        """Why ``registration`` cannot be added now (409), or None. A bare engine is known by
        its URL's id (its sidecar's address is picked once this says yes)."""
        for other in self._registered.values():
            if other.id == registration.id:
                return already_registered(other)
        for address, leaving in list(self._leaving.items()):
            # (A sidecar's address is its id: the check below says it, in its words.)
            if leaving.bare and leaving.id == registration.id and self._registration_of(address) is not None:
                return AdminError(
                    409,
                    "WORKER_DRAINING",
                    f"worker {leaving.url} is still draining after its removal; register it again "
                    "once GET /workers no longer lists it",
                )
        if registration.bare and registration.sidecar_address is None:
            return None
        address = registration.worker_address
        held = self._registered.get(address)
        if held is not None:
            return already_registered(held)
        worker = self.workers.get(address)
        if worker is not None and worker.state is WorkerState.DRAINING:
            return AdminError(
                409,
                "WORKER_DRAINING",
                f"worker {address} is still draining after its removal; register it again once "
                "GET /workers no longer lists it",
            )
        if worker is not None or address in self._discovered:
            return AdminError(
                409,
                "WORKER_FROM_DISCOVERY",
                f"worker {address} is already listed by --discovery {self.source}; it cannot also be "
                "registered through the API",
            )
        return None

    def register(self, registration: Registration) -> AdminError | None:
        """Add ``registration`` to the worker set (it serves once ready), or why not (409)."""
        refusal = self.refusal_to_register(registration)
        if refusal is not None:
            return refusal
        self.adopt(registration)
        return None

    def adopt(self, registration: Registration) -> None:
        """Hold ``registration`` whatever this process's view (``--processes N``: the parent
        decided it for every process; a worker still draining here is added once it left,
        by :meth:`missing`'s reconcile)."""
        address = registration.worker_address
        self._registered[address] = registration
        self._leaving.pop(address, None)
        self.workers.add_worker(address, registration.role)

    def missing(self) -> list[Registration]:
        """Registrations whose worker the set does not hold (it ignored the add while it
        still drained the address); the caller adds them again."""
        held = self.workers.addresses()
        return [r for r in self._registered.values() if r.worker_address not in held]

    def refusal_to_unregister(self, address: str) -> AdminError | None:
        """Why the worker at ``address`` cannot be removed through the API (404, 409), or None."""
        if address in self._registered:
            return None
        worker = self.workers.get(address)
        if worker is None:
            return AdminError(404, "WORKER_NOT_FOUND", f"no worker {address}")
        if worker.state is WorkerState.DRAINING and address not in self._discovered:
            return AdminError(
                409,
                "WORKER_DRAINING",
                f"worker {self.url_of(address)} is already draining: it leaves once the requests in "
                "flight there finish",
            )
        return AdminError(
            409,
            "WORKER_FROM_DISCOVERY",
            f"worker {address} was listed by --discovery {self.source}, not registered through the "
            "API: it leaves when discovery stops listing it",
        )

    def unregister(self, address: str) -> AdminError | str:
        """Let go of the registration at ``address``: what happens to the worker (its in-flight
        requests finish, then it leaves; or it stays because discovery lists it too), or why
        not (404, 409)."""
        refusal = self.refusal_to_unregister(address)
        if refusal is not None:
            return refusal
        return self.release(address)

    def release(self, address: str) -> str:
        """Let go of the registration at ``address`` (``--processes N``: decided by the parent
        for every process): what happens to the worker here."""
        registration = self._registered.pop(address, None)
        if registration is None:
            return f"worker {address} is not registered here"
        if address in self._discovered:
            return (
                f"worker {registration.url} is no longer registered through the API; it stays, "
                f"as --discovery {self.source} lists it too"
            )
        self._leaving[address] = registration
        self.workers.drain_worker(address)
        return f"worker {registration.url} is draining: requests in flight there finish, then it leaves"

    def find(self, key: str) -> str | None:
        """The address of the worker ``key`` names: its id, its URL (as registered, or
        ``grpc://HOST:PORT``) or its ``HOST:PORT`` (a bare engine's: the engine's); None when
        no worker is known by it."""
        # The worker set's address -> the URL its id is made from, and the HOST:PORT it goes by.
        known: dict[str, tuple[str, str]] = {}
        for address in {*self.workers.addresses(), *self._registered}:
            given = self._registration_of(address)
            if given is None:
                known[address] = (canonical_url("grpc", address), address)
            else:
                known[address] = (canonical_url(given.scheme, given.address), given.address)
        text = key.strip()
        for address, (url, named) in known.items():
            given = self._registration_of(address)
            if text in (worker_id(url), url, named, address) or (given is not None and text == given.url):
                return address
        parsed = parse_worker_url(text)
        if not isinstance(parsed, AdminError):
            for address, (_, named) in known.items():
                if parsed.address == named:
                    return address
        return None

    def url_of(self, address: str) -> str:
        registration = self._registration_of(address)
        return registration.url if registration is not None else canonical_url("grpc", address)

    def id_of(self, address: str) -> str:
        registration = self._registration_of(address)
        if registration is not None:
            return registration.id
        return worker_id(canonical_url("grpc", address))


def already_registered(registration: Registration) -> AdminError:
    return AdminError(
        409,
        "WORKER_ALREADY_EXISTS",
        f"worker {registration.url} is already registered with id {registration.id}; "
        f"DELETE /workers/{registration.id} first to register it again",
    )


# ------------------------------------------------------------------------------ GET /workers


def worker_row(worker: Worker, membership: Membership) -> dict[str, object]:
    """One worker as ``GET /workers`` lists it: SMG's fields (``id``, ``url``, ``worker_type``,
    ``model_id``, ``is_healthy``, ``load``) and the frontend's (``state``, ``model``,
    ``weight_version``, ``source``, the engine's load figures)."""
    address = worker.address
    registration = membership.registration_at(address)
    row: dict[str, object] = {
        "id": membership.id_of(address),
        "url": membership.url_of(address),
        "worker_type": _WORKER_TYPE_OF_ROLE[worker.role],
        # "paused" or "pending" for a serving worker paused or behind the newest weight version.
        "state": worker.listed_state,
        "is_healthy": worker.eligible,
        "ejected": worker.ejected_until is not None,
        "model": worker.served_model or None,
        "model_id": worker.served_model or None,
        "engine": _engine_of(worker, registration),
        "weight_version": worker.weight_version,
        "load": worker.score(),
        "running_requests": worker.running_requests,
        "waiting_requests": worker.waiting_requests,
        "kv_usage": worker.kv_usage,
        "source": membership.source_of(address),
    }
    if registration is not None and registration.bare:
        # The sidecar the frontend runs for this bare engine (docs/rl.md).
        row["sidecar"] = canonical_url("grpc", registration.worker_address)
    if worker.refusal is not None:
        row["refusal"] = worker.refusal_message
    return row


def _engine_of(worker: Worker, registration: Registration | None) -> str | None:
    """The engine kind the sidecar reports, else (a bare engine whose sidecar did not answer
    yet) the registration's."""
    if worker.model is not None and worker.model.engine:
        return worker.model.engine
    if registration is not None and registration.bare:
        return registration.engine
    return None


def worker_list(
    workers: Iterable[Worker], membership: Membership, model: str | None = None
) -> dict[str, object]:
    """``GET /workers``: ``{"workers", "total", "stats"}`` as SMG answers, optionally only the
    workers serving ``model``."""
    rows = [worker_row(w, membership) for w in workers if model is None or w.served_model == model]
    counts = dict.fromkeys(WORKER_TYPES, 0)
    for row in rows:
        counts[str(row["worker_type"])] += 1
    return {
        "workers": rows,
        "total": len(rows),
        "stats": {f"{name}_count": count for name, count in counts.items()},
    }
