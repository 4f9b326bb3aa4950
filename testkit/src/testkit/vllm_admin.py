"""The testkit vLLM engine's admin HTTP port: vLLM's RL endpoints, on a port of their own.

vLLM 0.34.0 serves pause, resume and weight versions only on its HTTP server, and only with
``VLLM_SERVER_DEV_MODE=1`` (``vllm/entrypoints/rl/online/api_router.py``); its gRPC server
(``vllm/entrypoints/launchers/grpc_server.py`` with smg-grpc-servicer) has none of them. The
testkit engine speaks gRPC, so it serves these routes on a separate port
(``VllmEngineConfig.admin_port``, ``testkit-engine vllm --admin-listen``), with vLLM's paths,
parameters and answers:

* ``POST /pause?mode=abort|wait|keep&clear_cache=true`` → ``{"status": "paused"}``
* ``POST /resume`` → ``{"status": "resumed"}``; ``GET /is_paused`` → ``{"is_paused": bool}``
* ``POST /update_weight_version {"new_version"}`` → ``{"success": true, "new_version"}``
* ``GET /weight_info`` → ``{"weight_version"}``
* ``POST /start_weight_update``, ``POST /update_weights {"update_info"}`` (accepted: the
  testkit has no weights to load), ``POST /finish_weight_update {"weight_version"?}`` (sets
  the version when given), each ``{"message"}`` as vLLM words it.

A bad parameter is a 400 in vLLM's error shape (the message is the testkit's).
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from aiohttp import web

__all__ = ["VLLM_PAUSE_MODES", "AdminEngine", "admin_app"]

# vLLM's PauseMode.
VLLM_PAUSE_MODES = ("abort", "wait", "keep")
_TRUE = frozenset({"1", "true", "on", "yes", "t", "y"})
_FALSE = frozenset({"0", "false", "off", "no", "f", "n"})


class AdminEngine(Protocol):
    """What the admin routes need of the engine."""

    @property
    def weight_version(self) -> str: ...
    @property
    def is_paused(self) -> bool: ...
    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None: ...
    def resume_generation(self) -> None: ...
    def update_weight_version(self, new_version: str) -> None: ...


def _bad(message: str, param: str | None) -> web.Response:
    body = {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}
    return web.json_response(body, status=400)


async def _body(request: web.Request) -> dict[str, Any] | None:
    raw = await request.read()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def admin_app(engine: AdminEngine) -> web.Application:
    async def pause(request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in VLLM_PAUSE_MODES:
            return _bad(f"mode: Input should be 'abort', 'wait' or 'keep', got {mode!r}", "mode")
        clear = request.query.get("clear_cache", "true").lower()
        if clear not in _TRUE | _FALSE:
            return _bad(f"clear_cache: Input should be a valid boolean, got {clear!r}", "clear_cache")
        await engine.pause_generation(mode, clear_cache=clear in _TRUE)
        return web.json_response({"status": "paused"})

    async def resume(_: web.Request) -> web.Response:
        engine.resume_generation()
        return web.json_response({"status": "resumed"})

    async def is_paused(_: web.Request) -> web.Response:
        return web.json_response({"is_paused": engine.is_paused})

    async def update_weight_version(request: web.Request) -> web.Response:
        body = await _body(request)
        version = None if body is None else body.get("new_version")
        if not isinstance(version, str):
            return _bad("new_version: Field required (a string)", "new_version")
        engine.update_weight_version(version)
        return web.json_response({"success": True, "new_version": version})

    async def weight_info(_: web.Request) -> web.Response:
        return web.json_response({"weight_version": engine.weight_version})

    async def start_weight_update(_: web.Request) -> web.Response:
        return web.json_response({"message": "Weight update started"})

    async def update_weights(request: web.Request) -> web.Response:
        body = await _body(request)
        if body is None or not isinstance(body.get("update_info"), dict):
            return _bad("update_info: Field required (an object)", "update_info")
        return web.json_response({"message": "Weights updated"})

    async def finish_weight_update(request: web.Request) -> web.Response:
        body = await _body(request)
        version = None if body is None else body.get("weight_version")
        if body is None or not (version is None or isinstance(version, str)):
            return _bad("weight_version: Input should be a valid string", "weight_version")
        if version is not None:
            engine.update_weight_version(version)
        return web.json_response({"message": "Weight update finished"})

    app = web.Application()
    r = app.router
    r.add_post("/pause", pause)
    r.add_post("/resume", resume)
    r.add_get("/is_paused", is_paused)
    r.add_post("/update_weight_version", update_weight_version)
    r.add_get("/weight_info", weight_info)
    r.add_post("/start_weight_update", start_weight_update)
    r.add_post("/update_weights", update_weights)
    r.add_post("/finish_weight_update", finish_weight_update)
    return app
