"""``GET`` and ``POST /weight_version``: the fleet's newest weight version, read or set by an
admin call (issue 28, "Weight versions"). Mounted among the admin routes (``admin.py``), so the
same bearer token or loopback rule guards it.

``GET`` answers ``{"weight_version", "set_by_admin", "reported_weight_version",
"route_latest_weights", "mixed", "versions"}``: the newest version (None while no worker
reported one and none was set), whether an admin call set it, the newest by the workers'
reports alone, whether new requests go only to workers at it, whether the workers report
more than one version, and how many workers report each. ``POST`` takes
``{"weight_version": "..."}`` and answers the same: from then on the newest version is that one
and new requests go only to the workers at it (``fleet.py``), whatever the workers report next;
``{"weight_version": null}`` gives the choice back to the workers' reports.

With ``--processes`` above 1 the process that takes a POST hands the version to the parent,
which sends it to every process (and gives it to each process it starts or restarts); the POST
is answered once every serving process applied it (sidecar_frontend/membership_relay.py), so a
request sent after the answer is routed by it whichever process takes it. Every answer also
says which process gave it (``"process"``: each holds its own view of the workers).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Final, Protocol

from aiohttp import web

from sidecar_frontend.fleet import MAX_WEIGHT_VERSION_BYTES
from sidecar_frontend.membership import AdminError
from sidecar_frontend.workers import WorkerSet

__all__ = [
    "WEIGHT_VERSION_PATH",
    "VersionRelay",
    "parse_weight_version",
    "weight_version_body",
    "weight_version_handlers",
]

WEIGHT_VERSION_PATH: Final = "/weight_version"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class VersionRelay(Protocol):
    """One process of ``--processes N``: where a version set here goes (admin.py's
    ``RelayedControl``)."""

    @property
    def process(self) -> int:
        """This process's number."""
        ...

    async def set_weight_version(self, version: str | None) -> AdminError | None:
        """The version set in every process (None once this one holds it), or why not."""
        ...


def parse_weight_version(body: bytes) -> str | AdminError | None:
    """The version a POST body sets (None: back to the workers' reports), or why it is refused."""
    try:
        data = json.loads(body or b"null")
    except (ValueError, UnicodeDecodeError) as err:
        return AdminError(400, "BAD_REQUEST", f"the body is not JSON: {err}")
    if not isinstance(data, dict) or "weight_version" not in data:
        return AdminError(400, "BAD_REQUEST", 'the body must be {"weight_version": "..."} (or null)')
    version = data["weight_version"]
    if version is None:
        return None
    if not isinstance(version, str) or not version:
        return AdminError(400, "BAD_REQUEST", "weight_version must be a non-empty string, or null")
    if len(version.encode()) > MAX_WEIGHT_VERSION_BYTES:
        return AdminError(
            400, "BAD_REQUEST", f"weight_version is longer than {MAX_WEIGHT_VERSION_BYTES} bytes"
        )
    return version


def weight_version_body(workers: WorkerSet) -> dict[str, object]:
    """What GET (and a POST that succeeded) answers."""
    versions = workers.registry.versions
    return {
        "weight_version": versions.newest,
        "set_by_admin": versions.set_by_admin,
        "reported_weight_version": versions.reported,
        "route_latest_weights": versions.routes_by_version,
        "mixed": versions.mixed,
        "versions": dict(sorted(versions.counts().items())),
    }


def weight_version_handlers(workers: WorkerSet, relay: VersionRelay | None = None) -> dict[str, Handler]:
    """The path's handlers by method; ``relay``: the frontend runs several processes, this one
    among them."""

    def body() -> dict[str, object]:
        answer = weight_version_body(workers)
        if relay is not None:
            answer["process"] = relay.process
        return answer

    async def read(request: web.Request) -> web.StreamResponse:
        del request
        return _json(200, body())

    async def set_version(request: web.Request) -> web.StreamResponse:
        parsed = parse_weight_version(await request.read())
        if isinstance(parsed, AdminError):
            return _error(parsed)
        if relay is None:
            workers.set_weight_version(parsed)
        else:
            refused = await relay.set_weight_version(parsed)
            if refused is not None:
                return _error(refused)
        return _json(200, body())

    return {"GET": read, "POST": set_version}


def _json(status: int, body: object) -> web.Response:
    return web.Response(status=status, body=json.dumps(body).encode(), content_type="application/json")


def _error(error: AdminError) -> web.Response:
    return web.Response(status=error.status, body=error.json_body(), content_type="application/json")
