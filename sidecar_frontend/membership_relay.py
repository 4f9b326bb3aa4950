"""The membership API across ``--processes N`` (pure: the messages and the parent's book; no
I/O). Each process holds its own worker set, and an admin call reaches one of them; a change
must reach them all, including a process restarted later. So:

1. The process that took the call checks it against its own view (the body, a worker its
   discovery lists or still drains: the refusals of one process), then sends a
   :class:`RelayRequest` to the parent on its status pipe.
2. The parent holds the one list of registrations (:class:`RelayBook`). It refuses a request
   its list contradicts (:class:`Refused`, to that process only) or records it and sends the
   change to every process on its stdin (:class:`Apply`, in one order for all).
3. Every process applies each change as it comes (``Membership.adopt`` / ``release``); the one
   that took the call answers it once its own copy arrives (``origin`` and ``id`` say whose;
   ``/add_worker`` waits longer, see "Serving everywhere" below).
4. A process the parent starts (or restarts) gets the list in its spec.

The fleet's weight version an admin call sets (``POST /weight_version``) goes the same way: a
:class:`VersionRequest` to the parent, which records it (:attr:`RelayBook.weight_version`) and
sends a :class:`SetVersion` to every process (never refused); a process started later gets the
recorded version in its spec. Each process tells the parent once it applied the version
(:class:`VersionApplied`), and the parent tells the asking process (:class:`VersionDone`) once
every process that was serving did: the call is answered then, so that a request sent after
the answer is routed by the new version whichever process takes it.

A bare engine (its sidecar run by the frontend): the asking process sends the registration
without a sidecar address; the parent, which runs one sidecar per engine for all the
processes, picks that address (:meth:`RelayBook.decide`'s ``sidecar_address``) and sends the
registration with it. After its removal each process tells the parent once its worker set let
go of the worker (:func:`left_line`); the parent stops that sidecar once every process did.

Serving everywhere: each process tells the parent when a registered worker first serves there
(:func:`serving_line`, once per registration, and again in a restarted process). Once every
process has, the parent tells them all (:class:`Everywhere`). The legacy ``/add_worker``
answers only then: after its answer, any process a request reaches serves the worker.

Lines are JSON, one message each; a line that does not parse is not a message (None).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any, Final, Literal

from sidecar_common.disaggregation import is_role
from sidecar_frontend.fleet import MAX_WEIGHT_VERSION_BYTES
from sidecar_frontend.membership import ENGINES, AdminError, Registration, already_registered

__all__ = [
    "Apply",
    "Everywhere",
    "Refused",
    "RelayBook",
    "RelayRequest",
    "SetVersion",
    "VersionApplied",
    "VersionDone",
    "VersionRequest",
    "apply_line",
    "everywhere_line",
    "left_line",
    "parse_control",
    "parse_left",
    "parse_request",
    "parse_serving",
    "parse_version_applied",
    "parse_version_request",
    "refused_line",
    "request_address",
    "request_line",
    "serving_line",
    "set_version_line",
    "version_applied_line",
    "version_done_line",
    "version_request_line",
]

Op = Literal["register", "unregister"]

# Version calls the parent holds at most while processes apply them (each is answered or
# given up by its asker within the answer wait; a process that never applies one is killed
# by the liveness watch, which ends its waits).
MAX_UNAPPLIED: Final = 1024


@dataclass(frozen=True)
class RelayRequest:
    """A process to the parent: one change an admin call asks for."""

    id: int  # the asking process's own number for the call
    op: Op
    address: str
    registration: Registration | None = None  # for "register"


@dataclass(frozen=True)
class Apply:
    """The parent to every process: a change to apply, in the parent's order."""

    op: Op
    address: str
    origin: int  # the process that took the call
    id: int  # its number for the call
    registration: Registration | None = None


@dataclass(frozen=True)
class Refused:
    """The parent to the process that took the call: its list contradicts the change."""

    id: int
    error: AdminError


@dataclass(frozen=True)
class VersionRequest:
    """A process to the parent: an admin call sets the fleet's weight version (None: back to
    the workers' reports)."""

    id: int  # the asking process's own number for the call
    weight_version: str | None


@dataclass(frozen=True)
class SetVersion:
    """The parent to every process: the fleet's weight version an admin call set, in the
    parent's order among the membership changes."""

    weight_version: str | None
    origin: int  # the process that took the call (-1: none, the version a process starts with)
    id: int  # its number for the call


@dataclass(frozen=True)
class VersionApplied:
    """A process to the parent: it applied the version of call ``id`` of process ``origin``."""

    origin: int
    id: int


@dataclass(frozen=True)
class VersionDone:
    """The parent to the process that took call ``id``: every serving process applied its
    version."""

    id: int


@dataclass(frozen=True)
class Everywhere:
    """The parent to every process: every process has served the registered worker at
    ``address``."""

    address: str


def _registration_dict(registration: Registration) -> dict[str, object]:
    return {
        "url": registration.url,
        "address": registration.address,
        "role": registration.role,
        "engine": registration.engine,
        "bootstrap_port": registration.bootstrap_port,
        "sidecar_address": registration.sidecar_address,
    }


def _registration(data: object, *, sidecar_needed: bool = True) -> Registration | None:
    if not isinstance(data, Mapping):
        return None
    url, address, role, engine = (data.get(k) for k in ("url", "address", "role", "engine"))
    port = data.get("bootstrap_port")
    sidecar = data.get("sidecar_address")
    if not (sidecar is None or isinstance(sidecar, str)):
        return None
    if not (isinstance(url, str) and isinstance(address, str) and isinstance(role, str) and is_role(role)):
        return None
    if engine not in ENGINES or not (port is None or (isinstance(port, int) and not isinstance(port, bool))):
        return None
    registration = Registration(url, address, role, engine, port, sidecar)
    if registration.bare and sidecar is None and sidecar_needed:
        return None  # a bare engine is dialled at its sidecar's address: it must have one
    return registration


def _line(payload: Mapping[str, object]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode() + b"\n"


def _object(line: bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _change(data: Mapping[str, Any], *, request: bool) -> tuple[Op, str, Registration | None] | None:
    op, address = data.get("op"), data.get("address")
    if op not in ("register", "unregister") or not isinstance(address, str):
        return None
    if op == "unregister":
        return "unregister", address, None
    # A request may hold a bare engine without its sidecar's address (the parent picks it).
    registration = _registration(data.get("registration"), sidecar_needed=not request)
    if registration is None or request_address(registration) != address:
        return None
    return "register", address, registration


def request_address(registration: Registration) -> str:
    """The address a change names: the worker set's, or a bare engine's own until its sidecar
    has one."""
    if registration.bare and registration.sidecar_address is None:
        return registration.address
    return registration.worker_address


def _whole(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def request_line(request: RelayRequest) -> bytes:
    payload: dict[str, object] = {
        "event": "admin",
        "id": request.id,
        "op": request.op,
        "address": request.address,
    }
    if request.registration is not None:
        payload["registration"] = _registration_dict(request.registration)
    return _line(payload)


def parse_request(line: bytes) -> RelayRequest | None:
    """A process's status line as an admin request (None for any other line)."""
    data = _object(line)
    if data is None or data.get("event") != "admin":
        return None
    change, number = _change(data, request=True), _whole(data.get("id"))
    if change is None or number is None:
        return None
    op, address, registration = change
    return RelayRequest(number, op, address, registration)


def apply_line(apply: Apply) -> bytes:
    payload: dict[str, object] = {
        "op": apply.op,
        "address": apply.address,
        "origin": apply.origin,
        "id": apply.id,
    }
    if apply.registration is not None:
        payload["registration"] = _registration_dict(apply.registration)
    return _line(payload)


def refused_line(refused: Refused) -> bytes:
    error = refused.error
    return _line(
        {
            "op": "refused",
            "id": refused.id,
            "status": error.status,
            "code": error.code,
            "message": error.message,
        }
    )


def left_line(address: str) -> bytes:
    """A process to the parent: its worker set no longer holds the worker at ``address``
    (removed through the API, drained)."""
    return _line({"event": "left", "address": address})


def _named_address(line: bytes, event: str) -> str | None:
    """The address a process's line of ``event`` names (None for any other line)."""
    data = _object(line)
    if data is None or data.get("event") != event:
        return None
    address = data.get("address")
    return address if isinstance(address, str) else None


def parse_left(line: bytes) -> str | None:
    """The address a process's ``left`` line names (None for any other line)."""
    return _named_address(line, "left")


def serving_line(address: str) -> bytes:
    """A process to the parent: the registered worker at ``address`` serves here (the first
    time since this process adopted its registration)."""
    return _line({"event": "serving", "address": address})


def parse_serving(line: bytes) -> str | None:
    """The address a process's ``serving`` line names (None for any other line)."""
    return _named_address(line, "serving")


def everywhere_line(everywhere: Everywhere) -> bytes:
    return _line({"op": "everywhere", "address": everywhere.address})


def _version(data: Mapping[str, Any]) -> tuple[str | None] | None:
    """The ``weight_version`` a line holds, in a 1-tuple (its absence or a version no admin
    call could set: None)."""
    if "weight_version" not in data:
        return None
    version = data["weight_version"]
    if version is None:
        return (None,)
    if not isinstance(version, str) or not version or len(version.encode()) > MAX_WEIGHT_VERSION_BYTES:
        return None
    return (version,)


def version_request_line(request: VersionRequest) -> bytes:
    return _line({"event": "weight_version", "id": request.id, "weight_version": request.weight_version})


def version_applied_line(applied: VersionApplied) -> bytes:
    return _line({"event": "version_applied", "origin": applied.origin, "id": applied.id})


def parse_version_applied(line: bytes) -> VersionApplied | None:
    """A process's status line as a :class:`VersionApplied` (None for any other line)."""
    data = _object(line)
    if data is None or data.get("event") != "version_applied":
        return None
    origin, number = _whole(data.get("origin")), _whole(data.get("id"))
    if origin is None or number is None:
        return None
    return VersionApplied(origin, number)


def version_done_line(done: VersionDone) -> bytes:
    return _line({"op": "version_done", "id": done.id})


def parse_version_request(line: bytes) -> VersionRequest | None:
    """A process's status line as a weight-version request (None for any other line)."""
    data = _object(line)
    if data is None or data.get("event") != "weight_version":
        return None
    number, version = _whole(data.get("id")), _version(data)
    if number is None or version is None:
        return None
    return VersionRequest(number, version[0])


def set_version_line(change: SetVersion) -> bytes:
    return _line(
        {
            "op": "weight_version",
            "origin": change.origin,
            "id": change.id,
            "weight_version": change.weight_version,
        }
    )


def parse_control(line: bytes) -> Apply | Refused | SetVersion | VersionDone | Everywhere | None:
    """A line the parent wrote to a process (None for anything else)."""
    data = _object(line)
    if data is None:
        return None
    if data.get("op") == "everywhere":
        address = data.get("address")
        return Everywhere(address) if isinstance(address, str) else None
    number = _whole(data.get("id"))
    if number is None:
        return None
    if data.get("op") == "version_done":
        return VersionDone(number)
    if data.get("op") == "weight_version":
        origin, version = _whole(data.get("origin")), _version(data)
        if origin is None or version is None:
            return None
        return SetVersion(version[0], origin, number)
    if data.get("op") == "refused":
        status, code, message = _whole(data.get("status")), data.get("code"), data.get("message")
        if status is None or not isinstance(code, str) or not isinstance(message, str):
            return None
        return Refused(number, AdminError(status, code, message))
    change, origin = _change(data, request=False), _whole(data.get("origin"))
    if change is None or origin is None:
        return None
    op, address, registration = change
    return Apply(op, address, origin, number, registration)


class RelayBook:
    """The parent's list of the API's registrations, the one every process follows."""

    def __init__(self) -> None:
        self._registrations: dict[str, Registration] = {}
        self._weight_version: str | None = None
        # For each registration, the processes (by number) that said its worker serves there.
        self._serving: dict[str, set[int]] = {}
        # For each version call (asking process, its number), the processes yet to apply it.
        self._unapplied: dict[tuple[int, int], set[int]] = {}

    @property
    def weight_version(self) -> str | None:
        """The fleet's weight version the last admin call set (None: none, or given back to
        the workers' reports): a new process's spec."""
        return self._weight_version

    def set_version(
        self, origin: int, request: VersionRequest, serving: Collection[int]
    ) -> tuple[SetVersion, VersionDone | None]:
        """Record the version ``request`` from process ``origin`` sets: the change for every
        process, and the answer for ``origin`` if none of the processes ``serving`` (those the
        call waits for) is left to apply it (else :meth:`applied` gives it later)."""
        self._weight_version = request.weight_version
        change = SetVersion(request.weight_version, origin, request.id)
        waiting = set(serving)
        if not waiting:
            return change, VersionDone(request.id)
        while len(self._unapplied) >= MAX_UNAPPLIED:  # the oldest call's asker gave up long ago
            del self._unapplied[next(iter(self._unapplied))]
        self._unapplied[(origin, request.id)] = waiting
        return change, None

    def applied(self, index: int, applied: VersionApplied) -> tuple[int, VersionDone] | None:
        """Process ``index`` applied a version: the answer for the asking process (its number
        and the message) once every process the call waits for did; None until then."""
        key = (applied.origin, applied.id)
        waiting = self._unapplied.get(key)
        if waiting is None:
            return None
        waiting.discard(index)
        if waiting:
            return None
        del self._unapplied[key]
        return applied.origin, VersionDone(applied.id)

    def registrations(self) -> tuple[Registration, ...]:
        """In the order they were registered (a new process's spec)."""
        return tuple(self._registrations.values())

    def refusal(self, request: RelayRequest) -> Refused | None:
        """Why the list refuses ``request`` (the worker, or its engine, is held already; or
        is not, for a removal), or None."""
        address = request.address
        if request.op == "register":
            assert request.registration is not None  # parse_request guarantees it
            wanted = request.registration.id
            for held in self._registrations.values():
                if held.id == wanted or held.worker_address == address:
                    return Refused(request.id, already_registered(held))
            return None
        if address not in self._registrations:
            return Refused(request.id, AdminError(404, "WORKER_NOT_FOUND", f"no worker {address}"))
        return None

    def decide(
        self, origin: int, request: RelayRequest, sidecar_address: str | None = None
    ) -> Apply | Refused:
        """Record ``request`` from process ``origin`` and return the change for every process,
        or refuse it (:meth:`refusal`). A bare engine's registration takes
        ``sidecar_address``, the address of the sidecar the parent runs for it."""
        refused = self.refusal(request)
        if refused is not None:
            return refused
        address = request.address
        if request.op == "register":
            registration = request.registration
            assert registration is not None
            if registration.bare and registration.sidecar_address is None:
                if sidecar_address is None:
                    raise ValueError(f"the bare engine {registration.url!r} needs its sidecar's address")
                registration = replace(registration, sidecar_address=sidecar_address)
                address = sidecar_address
            self._registrations[address] = registration
            self._serving[address] = set()
            return Apply("register", address, origin, request.id, registration)
        del self._registrations[address]
        del self._serving[address]
        return Apply("unregister", address, origin, request.id)

    def serving(self, index: int, address: str, processes: int) -> Everywhere | None:
        """Process ``index`` of ``processes`` said the worker at ``address`` serves there. The
        message for every process when that made every one of them say so; None otherwise
        (already said, the worker no longer registered, or a process that has not said so)."""
        said = self._serving.get(address)
        if said is None or index in said or not 0 <= index < processes:
            return None
        said.add(index)
        return Everywhere(address) if len(said) == processes else None

    def gone(self, index: int) -> list[tuple[int, VersionDone]]:
        """Process ``index`` ended: what it said no longer holds (its next run says it again),
        a version call it asked has nobody to answer, and one that waited for it waits no more
        (its next run starts with the recorded version). The answers now due, as
        :meth:`applied` gives them."""
        for said in self._serving.values():
            said.discard(index)
        due: list[tuple[int, VersionDone]] = []
        for key, waiting in list(self._unapplied.items()):
            waiting.discard(index)
            if key[0] == index or not waiting:
                del self._unapplied[key]
                if key[0] != index:
                    due.append((key[0], VersionDone(key[1])))
        return due
