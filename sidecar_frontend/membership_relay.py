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
   that took the call answers it once its own copy arrives (``origin`` and ``id`` say whose).
4. A process the parent starts (or restarts) gets the list in its spec.

Lines are JSON, one message each; a line that does not parse is not a message (None).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from sidecar_common.disaggregation import is_role
from sidecar_frontend.membership import ENGINES, AdminError, Registration, already_registered

__all__ = [
    "Apply",
    "Refused",
    "RelayBook",
    "RelayRequest",
    "apply_line",
    "parse_control",
    "parse_request",
    "refused_line",
    "request_line",
]

Op = Literal["register", "unregister"]


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


def _registration_dict(registration: Registration) -> dict[str, object]:
    return {
        "url": registration.url,
        "address": registration.address,
        "role": registration.role,
        "engine": registration.engine,
        "bootstrap_port": registration.bootstrap_port,
        "sidecar_address": registration.sidecar_address,
    }


def _registration(data: object) -> Registration | None:
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
    if registration.bare and sidecar is None:
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


def _change(data: Mapping[str, Any]) -> tuple[Op, str, Registration | None] | None:
    op, address = data.get("op"), data.get("address")
    if op not in ("register", "unregister") or not isinstance(address, str):
        return None
    if op == "unregister":
        return "unregister", address, None
    registration = _registration(data.get("registration"))
    if registration is None or registration.worker_address != address:
        return None
    return "register", address, registration


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
    change, number = _change(data), _whole(data.get("id"))
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


def parse_control(line: bytes) -> Apply | Refused | None:
    """A line the parent wrote to a process (None for anything else)."""
    data = _object(line)
    if data is None:
        return None
    number = _whole(data.get("id"))
    if number is None:
        return None
    if data.get("op") == "refused":
        status, code, message = _whole(data.get("status")), data.get("code"), data.get("message")
        if status is None or not isinstance(code, str) or not isinstance(message, str):
            return None
        return Refused(number, AdminError(status, code, message))
    change, origin = _change(data), _whole(data.get("origin"))
    if change is None or origin is None:
        return None
    op, address, registration = change
    return Apply(op, address, origin, number, registration)


class RelayBook:
    """The parent's list of the API's registrations, the one every process follows."""

    def __init__(self) -> None:
        self._registrations: dict[str, Registration] = {}

    def registrations(self) -> tuple[Registration, ...]:
        """In the order they were registered (a new process's spec)."""
        return tuple(self._registrations.values())

    def decide(self, origin: int, request: RelayRequest) -> Apply | Refused:
        """Record ``request`` from process ``origin`` and return the change for every process,
        or refuse it (the list already holds the worker, or does not)."""
        address = request.address
        if request.op == "register":
            held = self._registrations.get(address)
            if held is not None:
                return Refused(request.id, already_registered(held))
            assert request.registration is not None  # parse_request guarantees it
            self._registrations[address] = request.registration
            return Apply("register", address, origin, request.id, request.registration)
        if address not in self._registrations:
            return Refused(request.id, AdminError(404, "WORKER_NOT_FOUND", f"no worker {address}"))
        del self._registrations[address]
        return Apply("unregister", address, origin, request.id)
