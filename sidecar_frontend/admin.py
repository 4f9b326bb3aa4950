"""The membership API over HTTP: ``POST /workers``, ``GET /workers``, ``GET`` and ``DELETE
/workers/{id}`` (SMG's dialect), ``POST /add_worker?url=``, ``POST /remove_worker?url=``,
``GET /list_workers`` (vllm-router's and the older sglang-router's). The decisions are
:mod:`sidecar_frontend.membership`'s; this module reads requests, checks who calls, waits where
the legacy dialect waits, and logs each change.

Served on the frontend's HTTP port (:meth:`AdminApi.routes`), or on ``--admin-listen`` alone
(:meth:`AdminApi.app`). Every call first passes :func:`~sidecar_frontend.membership.admin_access`
(401 without the configured bearer token, 403 from off-host without one configured).

Where a change is applied is a :class:`MembershipControl`: :class:`LocalControl` for one
process; with ``--processes`` above 1, :class:`RelayedControl`, which hands the change to the
parent, and the parent to every process (sidecar_frontend/membership_relay.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Final, Protocol
from urllib.parse import unquote

import anyio
import structlog
from aiohttp import web

from sidecar_frontend.bare_children import BareSidecars
from sidecar_frontend.fanout import fanout_handlers
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
from sidecar_frontend.membership_relay import (
    Apply,
    Everywhere,
    Op,
    Refused,
    RelayRequest,
    SetVersion,
    VersionApplied,
    VersionDone,
    VersionRequest,
    left_line,
    parse_control,
    request_address,
    request_line,
    serving_line,
    version_applied_line,
    version_request_line,
)
from sidecar_frontend.registry import WorkerState
from sidecar_frontend.weight_version_api import WEIGHT_VERSION_PATH, weight_version_handlers
from sidecar_frontend.workers import WorkerSet

__all__ = [
    "LEGACY_ADD_WAIT",
    "PARENT_ANSWER_WAIT",
    "AdminApi",
    "LocalControl",
    "MembershipControl",
    "ParentLink",
    "RelayedControl",
    "keep_registered",
]

log = structlog.get_logger("sidecar_frontend.admin")

# The legacy /add_worker answers once the worker serves, as vllm-router and the older
# sglang-router do (they wait for its health up to --worker-startup-timeout-secs); this long at
# most, then the worker is removed again and the call fails.
LEGACY_ADD_WAIT: Final = 300.0
# How long a process of --processes N waits for its parent to relay a change (the parent
# answers at once; only a wedged parent is slower).
PARENT_ANSWER_WAIT: Final = 30.0

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


class MembershipControl(Protocol):
    """Where the API's changes are applied."""

    async def register(self, registration: Registration) -> AdminError | None:
        """None once the worker is registered (here: it serves once ready), or why not."""

    async def unregister(self, address: str) -> AdminError | str:
        """What happens to the worker (it drains, or stays), or why not."""

    async def serving_everywhere(self, address: str) -> bool:
        """Once the registered worker at ``address``, which serves in this process, has
        served in every process of the frontend: True; False when it was removed first."""


class LocalControl:
    """One frontend process: the changes apply to its own :class:`Membership`."""

    def __init__(self, membership: Membership) -> None:
        self.membership = membership

    async def register(self, registration: Registration) -> AdminError | None:
        return self.membership.register(registration)

    async def unregister(self, address: str) -> AdminError | str:
        return self.membership.unregister(address)

    async def serving_everywhere(self, address: str) -> bool:
        del address
        return True  # one process: serving here is serving everywhere


@dataclass(frozen=True)
class ParentLink:
    """One process of ``--processes N`` and its parent (sidecar_frontend/processes/child.py)."""

    index: int  # this process's number
    send: Callable[[bytes], None]  # one line to the parent (the status pipe)
    # Called once, on the event loop: the parent's lines are handed to this from then on (in
    # order, those that came before first).
    attach: Callable[[Callable[[bytes], None]], None]
    registrations: tuple[Registration, ...]  # the parent's list when this process started


class RelayedControl:
    """One process of ``--processes N``: a change goes to the parent, which applies it to every
    process (this one included) in one order; the call is answered once this process's own
    copy arrived (sidecar_frontend/membership_relay.py). Every change the parent sends is
    applied here through :meth:`deliver`, whoever asked for it. The fleet's weight version an
    admin call sets goes the same way (:meth:`set_weight_version`), applied here through
    ``apply_weight_version`` (the worker set's ``set_weight_version``) and said applied to the
    parent, which answers the asker once every serving process applied it. :meth:`report_serving`
    tells the parent when a registered worker first serves here, and the parent says when it
    serves in every process (:meth:`serving_everywhere`)."""

    def __init__(
        self,
        membership: Membership,
        link: ParentLink,
        answer_wait: float = PARENT_ANSWER_WAIT,
        apply_weight_version: Callable[[str | None], None] | None = None,
    ) -> None:
        self.membership = membership
        self._link = link
        self._apply_weight_version = apply_weight_version
        self._answer_wait = answer_wait
        self._numbers = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[AdminError | str | None]] = {}
        self._reporting: set[asyncio.Task[None]] = set()
        # Registered workers said to serve here (to the parent), and said by the parent to
        # serve in every process; each forgotten when its registration changes.
        self._said_serving: set[str] = set()
        self._everywhere: set[str] = set()
        self._everywhere_changed = anyio.Event()

    async def register(self, registration: Registration) -> AdminError | None:
        refusal = self.membership.refusal_to_register(registration)  # this process's view
        if refusal is not None:
            return refusal
        # A bare engine goes without its sidecar's address: the parent runs that sidecar.
        answer = await self._ask("register", request_address(registration), registration)
        return answer if isinstance(answer, AdminError) else None

    async def unregister(self, address: str) -> AdminError | str:
        refusal = self.membership.refusal_to_unregister(address)
        if refusal is not None:
            return refusal
        answer = await self._ask("unregister", address)
        return answer if answer is not None else f"worker {address} is no longer registered"

    async def serving_everywhere(self, address: str) -> bool:
        while True:
            changed = self._everywhere_changed
            if address in self._everywhere:
                return True
            if address not in self.membership.registered():
                return False
            await changed.wait()

    async def report_serving(self) -> None:
        """Tell the parent of each registered worker once it serves here (once per
        registration). Runs until cancelled."""
        workers = self.membership.workers
        while True:
            changed = workers.next_change()
            registered = self.membership.registered()
            self._said_serving.intersection_update(registered)
            for address in registered.keys() - self._said_serving:
                worker = workers.get(address)
                if worker is not None and worker.state is WorkerState.SERVING:
                    with contextlib.suppress(OSError):  # the parent is gone: so is this process, soon
                        self._link.send(serving_line(address))
                    self._said_serving.add(address)
            await changed.wait()

    def _everywhere_changes(self) -> None:
        self._everywhere_changed.set()
        self._everywhere_changed = anyio.Event()

    @property
    def process(self) -> int:
        """This process's number."""
        return self._link.index

    async def set_weight_version(self, version: str | None) -> AdminError | None:
        """Set the fleet's weight version in every process (None: back to the workers'
        reports); None once every serving process applied it, or why not."""
        answer = await self._ask_parent(
            lambda number: version_request_line(VersionRequest(number, version)), op="weight_version"
        )
        return answer if isinstance(answer, AdminError) else None

    async def _ask(
        self, op: Op, address: str, registration: Registration | None = None
    ) -> AdminError | str | None:
        return await self._ask_parent(
            lambda number: request_line(RelayRequest(number, op, address, registration)),
            op=op,
            worker=address,
        )

    async def _ask_parent(
        self, line: Callable[[int], bytes], *, op: str, worker: str | None = None
    ) -> AdminError | str | None:
        """Send the parent ``line(number)``; its answer to that number."""
        number = next(self._numbers)
        answer: asyncio.Future[AdminError | str | None] = asyncio.get_running_loop().create_future()
        self._waiting[number] = answer
        try:
            self._link.send(line(number))
            return await asyncio.wait_for(answer, self._answer_wait)
        except (TimeoutError, OSError) as err:
            log.error("the parent did not relay an admin change", op=op, worker=worker, error=repr(err))
            return AdminError(
                503, "UNAVAILABLE", f"the frontend's supervising process did not relay the change: {err!r}"
            )
        finally:
            self._waiting.pop(number, None)

    def deliver(self, line: bytes) -> None:
        """One line from the parent: a change to apply here, or the refusal of one asked here."""
        message = parse_control(line)
        if message is None:
            log.warning("ignoring a line from the parent that is not a membership change", line=line[:200])
            return
        if isinstance(message, Refused):
            self._answer(message.id, message.error)
            return
        if isinstance(message, Everywhere):
            if message.address in self.membership.registered():
                self._everywhere.add(message.address)
                self._everywhere_changes()
            return
        if isinstance(message, VersionDone):
            self._answer(message.id, None)
            return
        if isinstance(message, SetVersion):
            if self._apply_weight_version is not None:
                self._apply_weight_version(message.weight_version)
            if message.origin >= 0:  # an admin call's (-1: the version this process began with)
                with contextlib.suppress(OSError):  # the parent is gone: so is this process, soon
                    self._link.send(version_applied_line(VersionApplied(message.origin, message.id)))
            return
        outcome = self._apply(message)
        if message.origin == self._link.index:
            self._answer(message.id, outcome)

    def _apply(self, change: Apply) -> str | None:
        # A new registration, or none: what was said of the address is said again, or never.
        self._said_serving.discard(change.address)
        self._everywhere.discard(change.address)
        self._everywhere_changes()
        if change.op == "register" and change.registration is not None:
            self.membership.adopt(change.registration)
            log.info("worker registered", worker=change.address, url=change.registration.url, relayed=True)
            return None
        registration = self.membership.registration_at(change.address)
        outcome = self.membership.release(change.address)
        log.info("worker unregistered", worker=change.address, outcome=outcome, relayed=True)
        if registration is not None and registration.bare:
            # The parent stops this engine's sidecar once every process let go of it.
            task = asyncio.get_running_loop().create_task(self._report_left(change.address))
            self._reporting.add(task)
            task.add_done_callback(self._reporting.discard)
        return outcome

    async def _report_left(self, address: str) -> None:
        workers = self.membership.workers
        while True:
            changed = workers.next_change()
            if workers.get(address) is None:
                break
            await changed.wait()
        with contextlib.suppress(OSError):
            self._link.send(left_line(address))

    def _answer(self, number: int, answer: AdminError | str | None) -> None:
        waiting = self._waiting.get(number)
        if waiting is not None and not waiting.done():
            waiting.set_result(answer)


async def keep_registered(workers: WorkerSet, membership: Membership) -> None:
    """At each change of the worker set, add again a registered worker it does not hold (it
    ignored the add while it still drained that address). Runs until cancelled."""
    while True:
        changed = workers.next_change()
        for registration in membership.missing():
            workers.add_worker(registration.address, registration.role)
        await changed.wait()


class AdminApi:
    """The admin endpoints over one worker set and its :class:`Membership`."""

    def __init__(
        self,
        workers: WorkerSet,
        membership: Membership,
        *,
        token: str | None,
        control: MembershipControl | None = None,
        add_wait: float = LEGACY_ADD_WAIT,
        bare: BareSidecars | None = None,
    ) -> None:
        self.workers = workers
        # The sidecars run for bare engines (None: a bare engine is refused, 501).
        self.bare = bare
        self.membership = membership
        self.control: MembershipControl = control if control is not None else LocalControl(membership)
        self._token = token
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
            # The fleet's newest weight version (weight_version_api.py; issue 28).
            WEIGHT_VERSION_PATH: weight_version_handlers(
                self.workers, self.control if isinstance(self.control, RelayedControl) else None
            ),
            # /flush_cache and /get_loads over every worker (fanout.py).
            **fanout_handlers(self.workers, self.membership),
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
            return await handler(request)

        return handle

    # ---------------------------------------------------------------- SMG's dialect

    async def _create(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_registration(await request.read())
        if isinstance(parsed, AdminError):
            return _error(parsed)
        registered = await self._register(parsed)
        if isinstance(registered, AdminError):
            return _error(registered)
        location = f"/workers/{parsed.id}"
        ready = (
            f"the frontend starts its sidecar (grpc://{registered.worker_address}); it serves once that "
            "sidecar reached the engine"
            if registered.bare
            else "it serves once its sidecar is ready"
        )
        return _json(
            202,
            {
                "status": "accepted",
                "worker_id": parsed.id,
                "url": parsed.url,
                "location": location,
                "message": f"worker added: {ready} (GET /workers shows its state)",
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
        outcome = await self._unregister(address)
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
        registered = await self._register(parsed)
        if isinstance(registered, AdminError):
            return _text(400 if registered.status == 409 else registered.status, registered.message)
        problem = await self._until_serving(registered)
        if problem is not None:
            await self._unregister(registered.worker_address)
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
        outcome = await self._unregister(address)
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
                worker = self.workers.get(registration.worker_address)
                if worker is None:
                    return f"worker {registration.url} was removed before it served"
                if worker.state is WorkerState.SERVING:
                    # --processes N: a request after the answer may reach any process.
                    if await self.control.serving_everywhere(registration.worker_address):
                        return None
                    return f"worker {registration.url} was removed before it served"
                if worker.state is WorkerState.REFUSED:
                    return f"worker {registration.url} was refused: {worker.refusal_message}"
                await changed.wait()
        waited = f"{self._add_wait:g}s"
        return f"Timeout {waited} waiting for worker {registration.url} to serve; it was removed again"

    # ---------------------------------------------------------------- changes, logged

    async def _register(self, registration: Registration) -> Registration | AdminError:
        """The registration as held (a bare engine's: with its sidecar's address, that sidecar
        started), or why it is refused."""
        started_here = False
        if registration.bare and not isinstance(self.control, RelayedControl):
            refusal = self._bare_refusal(registration) or self.membership.refusal_to_register(registration)
            if refusal is not None:
                return refusal
            assert self.bare is not None  # _bare_refusal said so
            # No await between the check above and the registration below: a second call for
            # the same engine finds this one registered.
            registration = self.bare.start(registration)
            started_here = True
        # (--processes N: the parent checks a bare engine and runs its sidecar.)
        refusal = await self.control.register(registration)
        if refusal is not None:
            if self.bare is not None and started_here:
                await self.bare.stop(registration.worker_address)
            return refusal
        if registration.bare and registration.sidecar_address is None:
            held = [r for r in self.membership.registered().values() if r.id == registration.id]
            if not held:
                return AdminError(503, "UNAVAILABLE", f"worker {registration.url} left again at once")
            registration = held[0]
        log.info(
            "worker registered",
            worker=registration.worker_address,
            url=registration.url,
            worker_id=registration.id,
            role=registration.role,
            engine=registration.engine,
        )
        return registration

    def _bare_refusal(self, registration: Registration) -> AdminError | None:
        if self.bare is None:
            return AdminError(
                501,
                "NOT_IMPLEMENTED",
                f"url {registration.url!r} is a bare {registration.engine} engine: this frontend runs "
                f"no sidecar for bare engines here; start sidecar-{registration.engine} next to it and "
                "register the sidecar as grpc://HOST:PORT",
            )
        return self.bare.refusal(registration)

    async def _unregister(self, address: str) -> AdminError | str:
        outcome = await self.control.unregister(address)
        if not isinstance(outcome, AdminError):
            log.info("worker unregistered", worker=address, outcome=outcome)
            if self.bare is not None:
                # A bare engine's sidecar stops once its worker drained (no-op for any other).
                self.bare.stop_after_leaving(address)
        return outcome
