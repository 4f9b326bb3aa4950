"""The sessions' HTTP side (docs/frontend.md, "Sessions"): the middleware that reads a
request's session header, and ``/finish_session``.

``POST /finish_session?session_id=ID`` releases a session, answered as vllm-router answers it
(its ``server::finish_session``, run against version 0.1.17): 200 with
``{"status":"ok","session_id":ID}`` whether or not the session was held (SkyRL and prime-rl
call it on every trajectory's end, best effort), 400 in plain text when ``session_id`` is
missing or given twice, 405 with ``Allow: POST`` for another method. SMG has no such endpoint:
its sessions are released by idleness only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from sidecar_frontend.routing.sessions import session_of
from sidecar_frontend.routing.sessions_choice import CURRENT_SESSION, Sessions

__all__ = ["FINISH_SESSION_PATH", "finish_session_routes", "session_middleware"]

FINISH_SESSION_PATH = "/finish_session"


def session_middleware(headers: Sequence[str]) -> Middleware:
    """Sets :data:`CURRENT_SESSION` from the first of ``headers`` a request carries, for the
    handling of that request."""
    names = tuple(headers)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        session = session_of(request.headers, names)
        if session is None:
            return await handler(request)
        token = CURRENT_SESSION.set(session)
        try:
            return await handler(request)
        finally:
            CURRENT_SESSION.reset(token)

    return middleware


def finish_session_routes(sessions: Sessions) -> list[web.RouteDef]:
    """``/finish_session``, every method (another than POST is answered 405 as vllm-router does)."""

    async def finish(request: web.Request) -> web.StreamResponse:
        if request.method != "POST":
            return web.Response(status=405, headers={"Allow": "POST"})
        values = request.query.getall("session_id", [])
        if len(values) != 1:
            why = "missing" if not values else "duplicate"
            text = f"Failed to deserialize query string: {why} field `session_id`"
            return web.Response(status=400, text=text)
        session = values[0]
        sessions.finish(session)
        body = json.dumps({"status": "ok", "session_id": session}, separators=(",", ":"), ensure_ascii=False)
        return web.Response(body=body.encode(), content_type="application/json")

    return [web.route("*", FINISH_SESSION_PATH, finish)]
