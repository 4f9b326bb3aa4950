"""The membership API over HTTP: ``POST /workers``, ``GET /workers``, ``GET`` and ``DELETE
/workers/{id}`` (SMG's dialect), ``POST /add_worker?url=``, ``POST /remove_worker?url=``,
``GET /list_workers`` (vllm-router's and the older sglang-router's). The decisions are
:mod:`sidecar_frontend.membership`'s; this module reads requests, checks who calls, waits where
the legacy dialect waits, and logs each change.

Served on the frontend's HTTP port (:meth:`AdminApi.routes`), or on ``--admin-listen`` alone
(:meth:`AdminApi.app`). Every call first passes :func:`~sidecar_frontend.membership.admin_access`
(401 without the configured bearer token, 403 from off-host without one configured).

With ``--processes`` above 1 each process holds its own worker set and a call reaches one of
them: every admin call is refused (501, saying so) rather than registering a worker with some
processes only.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Final
from urllib.parse import unquote

import anyio
import structlog
from aiohttp import web

from sidecar_frontend.membership import (
    AdminError,
    Membership,
    Registration,
    admin_access,
    parse_registration,
    registration_from,
    worker_list,
    worker_row,
)
from sidecar_frontend.registry import WorkerState
from sidecar_frontend.workers import WorkerSet

__all__ = ["ADMIN_PATHS", "LEGACY_ADD_WAIT", "AdminApi"]

log = structlog.get_logger("sidecar_frontend.admin")

# The legacy /add_worker answers once the worker serves, as vllm-router and the older
# sglang-router do (they wait for its health up to --worker-startup-timeout-secs); this long at
# most, then the worker is removed again and the call fails.
LEGACY_ADD_WAIT: Final = 300.0
ADMIN_PATHS: Final = ("/workers", "/workers/{worker_id}", "/add_worker", "/remove_worker", "/list_workers")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(status: int, body: object, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status, body=json.dumps(body).encode(), content_type="application/json", headers=headers
    )


def _error(error: AdminError) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return web.Response(
        status=error.status, body=error.json_body(), content_type="application/json", headers=headers
    )


def _text(status: int, text: str) -> web.Response:
    return web.Response(status=status, text=text)


class AdminApi:
    """The admin endpoints over one worker set and its :class:`Membership`."""

    def __init__(
        self,
        workers: WorkerSet,
        membership: Membership,
        *,
        token: str | None,
        processes: int = 1,
        add_wait: float = LEGACY_ADD_WAIT,
    ) -> None:
        self.workers = workers
        self.membership = membership
        self._token = token
        self._processes = processes
        self._add_wait = add_wait

    # ---------------------------------------------------------------- routes

    def routes(self) -> list[web.RouteDef]:
        """One route per path, every method: a method the path does not take is a 405."""
        methods: dict[str, dict[str, Handler]] = {
            "/workers": {"GET": self._list, "POST": self._create},
            "/workers/{worker_id:.+}": {"GET": self._get, "DELETE": self._delete},
            "/add_worker": {"POST": self._legacy_add},
            "/remove_worker": {"POST": self._legacy_remove},
            "/list_workers": {"GET": self._legacy_list},
        }
        return [web.route("*", path, self._guarded(by_method)) for path, by_method in methods.items()]

    def app(self) -> web.Application:
        """The admin endpoints alone (``--admin-listen``); any other path is a JSON 404."""
        app = web.Application()
        app.add_routes(self.routes())

        async def not_found(request: web.Request) -> web.StreamResponse:
            return _error(AdminError(404, "NOT_FOUND", f"no admin route for {request.path}"))

        app.router.add_route("*", "/{path:.*}", not_found)
        return app

    def _guarded(self, by_method: Mapping[str, Handler]) -> Handler:
        allowed = ", ".join(sorted(by_method))

        async def handle(request: web.Request) -> web.StreamResponse:
            refusal = admin_access(self._token, request.headers.get("Authorization"), request.remote)
            if refusal is not None:
                log.warning(
                    "admin call refused",
                    path=request.path,
                    method=request.method,
                    peer=request.remote,
                    status=refusal.status,
                )
                return _error(refusal)
            handler = by_method.get(request.method)
            if handler is None:
                wrong = AdminError(405, "METHOD_NOT_ALLOWED", f"method {request.method} is not allowed")
                response = _error(wrong)
                response.headers["Allow"] = allowed
                return response
            if self._processes > 1:
                return _error(
                    AdminError(
                        501,
                        "NOT_IMPLEMENTED",
                        f"the membership API needs --processes 1: this frontend runs {self._processes} "
                        "processes, each with its own workers, and a call would reach only one of them",
                    )
                )
            return await handler(request)

        return handle

    # ---------------------------------------------------------------- SMG's dialect

    async def _create(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_registration(await request.read())
        if isinstance(parsed, AdminError):
            return _error(parsed)
        refusal = self._register(parsed)
        if refusal is not None:
            return _error(refusal)
        location = f"/workers/{parsed.id}"
        return _json(
            202,
            {
                "status": "accepted",
                "worker_id": parsed.id,
                "url": parsed.url,
                "location": location,
                "message": "worker added: it serves once its sidecar is ready (GET /workers shows its state)",
            },
            {"Location": location},
        )

    async def _list(self, request: web.Request) -> web.StreamResponse:
        model = request.query.get("model")
        return _json(200, worker_list(self.workers.workers(), self.membership, model))

    async def _get(self, request: web.Request) -> web.StreamResponse:
        key = request.match_info["worker_id"]
        address = self.membership.find(unquote(key))
        worker = self.workers.get(address) if address is not None else None
        if worker is None:
            return _error(AdminError(404, "WORKER_NOT_FOUND", f"Worker {key} not found"))
        return _json(200, worker_row(worker, self.membership))

    async def _delete(self, request: web.Request) -> web.StreamResponse:
        key = request.match_info["worker_id"]
        address = self.membership.find(unquote(key))
        if address is None:
            return _error(AdminError(404, "WORKER_NOT_FOUND", f"Worker {key} not found"))
        worker_id = self.membership.id_of(address)
        url = self.membership.url_of(address)
        outcome = self._unregister(address)
        if isinstance(outcome, AdminError):
            return _error(outcome)
        return _json(202, {"status": "accepted", "worker_id": worker_id, "url": url, "message": outcome})

    # ---------------------------------------------------------------- the legacy dialect

    async def _legacy_add(self, request: web.Request) -> web.StreamResponse:
        url = request.query.get("url")
        if not url:
            return _text(400, "the url query parameter is required: /add_worker?url=grpc://HOST:PORT")
        parsed = registration_from({"url": url})
        if isinstance(parsed, AdminError):
            return _text(parsed.status, parsed.message)
        refusal = self._register(parsed)
        if refusal is not None:
            return _text(400 if refusal.status == 409 else refusal.status, refusal.message)
        problem = await self._until_serving(parsed)
        if problem is not None:
            self._unregister(parsed.address)
            return _text(400, problem)
        return _text(200, f"Successfully added worker: {parsed.url}")

    async def _legacy_remove(self, request: web.Request) -> web.StreamResponse:
        url = request.query.get("url")
        if not url:
            return _text(400, "the url query parameter is required: /remove_worker?url=grpc://HOST:PORT")
        address = self.membership.find(url)
        if address is None:
            # The legacy routers answer 200 for an unknown worker too (removing is idempotent).
            return _text(200, f"worker {url} was not registered: nothing to remove")
        outcome = self._unregister(address)
        if isinstance(outcome, AdminError):
            # Removing a worker that is already leaving changes nothing: 200, as the legacy
            # routers answer a removal of a worker they no longer hold.
            return _text(200 if outcome.code == "WORKER_DRAINING" else outcome.status, outcome.message)
        return _text(200, f"Successfully removed worker: {url}")

    async def _legacy_list(self, request: web.Request) -> web.StreamResponse:
        del request
        return _json(200, {"urls": [self.membership.url_of(w.address) for w in self.workers.workers()]})

    async def _until_serving(self, registration: Registration) -> str | None:
        """None once the worker serves; why not when it was refused (its role or model) or
        did not serve within the wait."""
        with anyio.move_on_after(self._add_wait):
            while True:
                changed = self.workers.next_change()
                worker = self.workers.get(registration.address)
                if worker is None:
                    return f"worker {registration.url} was removed before it served"
                if worker.state is WorkerState.SERVING:
                    return None
                if worker.state is WorkerState.REFUSED:
                    return f"worker {registration.url} was refused: {worker.refusal_message}"
                await changed.wait()
        waited = f"{self._add_wait:g}s"
        return f"Timeout {waited} waiting for worker {registration.url} to serve; it was removed again"

    # ---------------------------------------------------------------- changes, logged

    def _register(self, registration: Registration) -> AdminError | None:
        refusal = self.membership.register(registration)
        if refusal is None:
            log.info(
                "worker registered",
                worker=registration.address,
                url=registration.url,
                worker_id=registration.id,
                role=registration.role,
            )
        return refusal

    def _unregister(self, address: str) -> AdminError | str:
        outcome = self.membership.unregister(address)
        if not isinstance(outcome, AdminError):
            log.info("worker unregistered", worker=address, outcome=outcome)
        return outcome
