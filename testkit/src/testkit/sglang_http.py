"""SGLang's native HTTP API (aiohttp.web) over the testkit engine.

As SGLang 0.5.23's FastAPI server: ``/generate`` streams Server-Sent Events
``data: {json}\\n\\n`` and ends with ``data: [DONE]\\n\\n`` (headers go out before the first
token); an error raised by the request (duplicate rid, too long...) is an event
``{"error": {message, type, code, retryable}}`` under HTTP 200, followed by ``[DONE]``; a body
that does not parse is a 400 before any stream. A client that disconnects is aborted only
after ``disconnect_abort_delay_secs`` (SGLang's background task waits 2 s).
"""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from testkit.book import trace_fields
from testkit.faults import parse_directive
from testkit.sglang_core import (
    PAUSE_MODES,
    Bootstrap,
    Chunk,
    Cut,
    Fail,
    NativeRequest,
    RequestRejected,
    RequestStream,
    StreamEvent,
)
from testkit.sglang_served import ServedEngine

__all__ = ["GRPC_TO_HTTP", "SglangHttpServer", "native_request_from_json"]

log = logging.getLogger("testkit.sglang.http")

# How a fault's gRPC code reads on this wire.
GRPC_TO_HTTP = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "OUT_OF_RANGE": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "ABORTED": 409,
    "RESOURCE_EXHAUSTED": 429,
    "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
_POLL_SECS = 0.05  # how often a waiting stream checks whether its client is still there


class _BadBody(ValueError):
    pass


class _Disconnected(Exception):
    pass


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _int(body: dict[str, Any], key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _BadBody(f"{key}: Input should be a valid integer")
    return v


def _float(body: dict[str, Any], key: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _BadBody(f"{key}: Input should be a valid number")
    return float(v)


def _logit_bias(sp: dict[str, Any]) -> tuple[tuple[str, float], ...] | None:
    v = sp.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict) or any(
        isinstance(b, bool) or not isinstance(b, int | float) for b in v.values()
    ):
        raise _BadBody("sampling_params.logit_bias: Input should be a valid dictionary of numbers")
    return tuple((str(k), float(b)) for k, b in v.items())


def _str(body: dict[str, Any], key: str) -> str | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise _BadBody(f"{key}: Input should be a valid string")
    return v


def _bool(body: dict[str, Any], key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _BadBody(f"{key}: Input should be a valid boolean")
    return v


def _ints(body: dict[str, Any], key: str) -> tuple[int, ...]:
    v = body.get(key)
    if v is None:
        return ()
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise _BadBody(f"{key}: Input should be a flat list of integers")
    return tuple(v)


# SamplingParams' keyword arguments in SGLang 0.5.23 (the HTTP seed is `sampling_seed`).
_SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens",
        "min_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "n",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "custom_params",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
    }
)


def native_request_from_json(body: object, rid: str, default_bootstrap_port: int) -> NativeRequest:
    """A /generate body → NativeRequest; _BadBody (HTTP 400) when a field has the wrong type."""
    if not isinstance(body, dict):
        raise _BadBody("Input should be a valid dictionary or object to extract fields from")
    if body.get("input_ids") is None:
        # The engine has no tokenizer: text prompts and embeddings cannot be served.
        raise _BadBody("input_ids: Field required (the testkit engine takes token ids only)")
    input_ids = _ints(body, "input_ids")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise _BadBody("sampling_params: Input should be a valid dictionary")
    stop = sp.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
        raise _BadBody("sampling_params.stop: Input should be a string or a list of strings")
    unknown = sorted(set(sp) - _SAMPLING_KEYS)
    if unknown:
        # SGLang builds SamplingParams(**sampling_params): an unknown key is a 400 there.
        raise _BadBody(f"sampling_params: unexpected keyword argument {unknown[0]!r}")
    seed = _int(sp, "sampling_seed")
    bootstrap = None
    host = body.get("bootstrap_host")
    room = _int(body, "bootstrap_room")
    port = _int(body, "bootstrap_port")
    if host is not None or room is not None:
        if not isinstance(host, str) or room is None:
            raise _BadBody("bootstrap_host and bootstrap_room go together")
        bootstrap = Bootstrap(host, default_bootstrap_port if port is None else port, room)
    top = _int(body, "top_logprobs_num")
    start = _int(body, "logprob_start_len")
    n = _int(sp, "n")
    return NativeRequest(
        rid=rid,
        input_ids=input_ids,
        wire="http",
        max_new_tokens=_int(sp, "max_new_tokens"),
        min_new_tokens=_int(sp, "min_new_tokens") or 0,
        stop=tuple(stop),
        stop_token_ids=_ints(sp, "stop_token_ids"),
        ignore_eos=_bool(sp, "ignore_eos"),
        n=1 if n is None else n,
        seed=seed,
        stream=_bool(body, "stream"),
        return_logprob=_bool(body, "return_logprob"),
        top_logprobs_num=top or 0,
        logprob_start_len=-1 if start is None else start,
        bootstrap=bootstrap,
        priority=_int(body, "priority"),
        routed_dp_rank=_int(body, "routed_dp_rank"),
        lora_path=_str(body, "lora_path"),
        cache_salt=_str(body, "cache_salt") or None,
        return_routed_experts=_bool(body, "return_routed_experts"),
        routed_experts_start_len=_int(body, "routed_experts_start_len") or 0,
        # SGLang's normalisation: an empty list is none; the rest is checked with the request.
        token_ids_logprob=body.get("token_ids_logprob") or None,
        temperature=_float(sp, "temperature"),
        top_p=_float(sp, "top_p"),
        top_k=_int(sp, "top_k"),
        min_p=_float(sp, "min_p"),
        frequency_penalty=_float(sp, "frequency_penalty"),
        presence_penalty=_float(sp, "presence_penalty"),
        repetition_penalty=_float(sp, "repetition_penalty"),
        logit_bias=_logit_bias(sp),
    )


def _bad_request(message: str) -> web.Response:
    # FastAPI's RequestValidationError, as SGLang renders it (400, not 422).
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return web.Response(status=400, body=_dumps(body), content_type="application/json")


async def _control_body(request: web.Request) -> dict[str, Any] | web.Response:
    """An admin call's JSON object body (empty: all defaults), or the 400 for one that is not."""
    raw = await request.read()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except ValueError as e:
        return _bad_request(f"JSON decode error: {e}")
    if not isinstance(body, dict):
        return _bad_request("Input should be a valid dictionary or object to extract fields from")
    return body


def _error_event(message: str, code: int) -> bytes:
    err = {"message": message, "type": "invalid_request_error", "code": code, "retryable": False}
    return b"data: " + _dumps({"error": err}) + b"\n\n"


class SglangHttpServer:
    def __init__(self, engine: ServedEngine, host: str, port: int) -> None:
        self._engine = engine
        self._host = host
        self.port = port
        self._runner: web.AppRunner | None = None
        self._active: dict[int, web.Request] = {}  # Request is not hashable

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_post("/generate", self._generate)
        r.add_put("/generate", self._generate)
        r.add_post("/abort_request", self._abort)
        for path in ("/health", "/health_generate"):
            r.add_get(path, self._health)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self._server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self._model_info)
        r.add_get("/v1/models", self._models)
        r.add_get("/v1/loads", self._loads)
        r.add_route("*", "/flush_cache", self._flush_cache)
        r.add_get("/ready", self._ready)
        r.add_get("/ping", self._ping)
        r.add_post("/pause_generation", self._pause)
        r.add_post("/continue_generation", self._continue)
        r.add_post("/update_weights_from_disk", self._update_weights)
        r.add_post("/update_weight_version", self._update_weight_version)
        # Not SGLang's: the testkit's own control surface for out-of-process tests.
        r.add_get("/testkit/state", self._state)
        r.add_post("/testkit/faults", self._add_fault)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self._host, self.port, reuse_address=True)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = int(runner.addresses[0][1])

    async def stop(self) -> None:
        """Stop at once: open streams are cut (as when the engine dies), not drained."""
        runner, self._runner = self._runner, None
        for request in list(self._active.values()):
            self._cut(request)
        if runner is not None:
            await runner.cleanup()

    # -- /generate --------------------------------------------------------------------
    async def _generate(self, request: web.Request) -> web.StreamResponse:
        engine = self._engine
        try:
            body = json.loads(await request.read())
        except ValueError as e:
            return _bad_request(f"JSON decode error: {e}")
        rid = body.get("rid") if isinstance(body, dict) else None
        if rid is not None and not isinstance(rid, str):
            return _bad_request("rid: Input should be a valid string (batches are not served)")
        rid = rid or engine.new_rid()
        engine.book.record_request(rid, body)
        engine.book.record_trace_context(rid, trace_fields(request.headers.items()))
        try:
            req = native_request_from_json(body, rid, engine.config.bootstrap_port)
        except _BadBody as e:
            return _bad_request(str(e))
        try:
            stream = engine.submit(req)
        except RequestRejected as e:
            if e.http_status >= 500 or not req.stream:
                return web.json_response(e.http_body, status=e.http_status)
            resp = await self._open_sse(request)
            await resp.write(_error_event(e.message, e.http_status))
            await resp.write(b"data: [DONE]\n\n")
            return resp
        self._active[id(request)] = request
        try:
            if req.stream:
                return await self._stream(request, stream)
            return await self._unary(request, stream)
        finally:
            self._active.pop(id(request), None)
            if engine.is_live(rid):
                engine.abort_later(rid, engine.config.disconnect_abort_delay_secs, source="http-disconnect")

    async def _open_sse(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        return resp

    async def _stream(self, request: web.Request, stream: RequestStream) -> web.StreamResponse:
        resp = await self._open_sse(request)
        try:
            while True:
                ev = await self._next(request, stream)
                if ev is None:
                    await resp.write(b"data: [DONE]\n\n")
                    return resp
                if isinstance(ev, Chunk):
                    await resp.write(b"data: " + _dumps(ev.out) + b"\n\n")
                elif isinstance(ev, Fail):
                    await resp.write(_error_event(ev.message, GRPC_TO_HTTP.get(ev.code, 500)))
                elif isinstance(ev, Cut):
                    self._cut(request)
                    return resp
        except (_Disconnected, ConnectionError):
            log.info("client of %s disconnected", stream.rid)
            return resp

    async def _unary(self, request: web.Request, stream: RequestStream) -> web.StreamResponse:
        try:
            return await self._unary_result(request, stream)
        except _Disconnected:
            log.info("client of %s disconnected", stream.rid)
            return web.Response(status=499)

    async def _unary_result(self, request: web.Request, stream: RequestStream) -> web.StreamResponse:
        last: dict[str, Any] | None = None
        while True:
            ev = await self._next(request, stream)
            if ev is None:
                return web.Response(body=_dumps(last), content_type="application/json")
            if isinstance(ev, Chunk):
                last = last or ev.out  # the terminal; a repeat after it is not a new response
            elif isinstance(ev, Fail):
                status = GRPC_TO_HTTP.get(ev.code, 500)
                return web.json_response({"error": {"message": ev.message}}, status=status)
            elif isinstance(ev, Cut):
                self._cut(request)
                return web.Response(status=500)

    @staticmethod
    def _cut(request: web.Request) -> None:
        # As SGLang when an unexpected exception escapes the stream: the connection drops.
        if request.transport is not None:
            request.transport.abort()

    @staticmethod
    async def _next(request: web.Request, stream: RequestStream) -> StreamEvent | None:
        """The next event; _Disconnected as soon as the client is gone (polled)."""
        get = asyncio.ensure_future(stream.next())
        try:
            while True:
                done, _ = await asyncio.wait({get}, timeout=_POLL_SECS)
                if done:
                    return get.result()
                if request.transport is None or request.transport.is_closing():
                    raise _Disconnected
        finally:
            if not get.done():
                get.cancel()

    # -- everything else --------------------------------------------------------------
    async def _abort(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read() or b"{}")
        except ValueError as e:
            return _bad_request(f"JSON decode error: {e}")
        if not isinstance(body, dict):
            return _bad_request("Input should be a valid dictionary")
        rid, abort_all = body.get("rid") or "", bool(body.get("abort_all", False))
        if not isinstance(rid, str):
            return _bad_request("rid: Input should be a valid string")
        engine = self._engine
        if abort_all:
            engine.abort("", True, source="http")
        elif rid and (engine.is_live(rid) or engine.config.tokenizer_workers > 1):
            engine.abort(rid, source="http")
        else:
            engine.note_ignored_abort(rid, source="http")
        return web.Response(status=200)

    async def _state(self, request: web.Request) -> web.StreamResponse:
        engine, book = self._engine, self._engine.book
        return web.json_response(
            {
                "running": book.running_ids(),
                "waiting": book.waiting_ids(),
                "received": [rid for rid, _ in book.received],
                "aborts": book.aborts,
                "finished": [
                    {"rid": f.request_id, "outcome": f.outcome.value, "detail": f.detail}
                    for f in book.finished
                ],
                "abort_log": [
                    {"rid": a.rid, "abort_all": a.abort_all, "source": a.source, "matched": list(a.matched)}
                    for a in engine.abort_log
                ],
                "bootstraps": {rid: list(b) for rid, b in engine.bootstraps.items()},
                "pause_mode": engine.pause_mode,
                "held": engine.held_count,
                "weight_version": engine.versions.current,
            }
        )

    async def _add_fault(self, request: web.Request) -> web.StreamResponse:
        """``{"match": "...", "directive": "close_after:2", "times": null}``."""
        try:
            body = json.loads(await request.read())
            match, times = body["match"], body.get("times")
            plan = parse_directive(body["directive"])
            self._engine.faults.add(match, plan, times)
        except (ValueError, KeyError, TypeError) as e:
            return _bad_request(f"bad fault: {e}")
        return web.Response(status=200)

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200 if await self._engine.health_probe() else 503)

    async def _ready(self, request: web.Request) -> web.StreamResponse:
        # SGLang's /ready: whether the server takes new requests (not while paused).
        engine = self._engine
        return web.Response(status=200 if engine.ready and engine.pause_mode is None else 503)

    async def _ping(self, request: web.Request) -> web.StreamResponse:
        # SGLang's /ping (the SageMaker check): is_healthy(), a flag, so 200 while paused too.
        return web.Response(status=200 if self._engine.ready else 503)

    # -- pause, continue, weights (SGLang's admin endpoints; no admin key configured) -------
    async def _pause(self, request: web.Request) -> web.StreamResponse:
        body = await _control_body(request)
        if isinstance(body, web.Response):
            return body
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return _bad_request("mode: Input should be 'abort', 'retract' or 'in_place'")
        await self._engine.pause_generation(mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.StreamResponse:
        body = await _control_body(request)
        if isinstance(body, web.Response):
            return body
        self._engine.continue_generation()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _update_weights(self, request: web.Request) -> web.StreamResponse:
        body = await _control_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            model_path = body.get("model_path")
            if not isinstance(model_path, str):
                raise _BadBody("model_path: Field required (a string)")
            version = _str(body, "weight_version")
            abort_all = _bool(body, "abort_all_requests")
            flush = body.get("flush_cache", True)
            if not isinstance(flush, bool):
                raise _BadBody("flush_cache: Input should be a valid boolean")
        except _BadBody as e:
            return _bad_request(str(e))
        success, message, paused = await self._engine.update_weights_from_disk(
            model_path, weight_version=version, abort_all_requests=abort_all, flush_cache=flush
        )
        answer = {"success": success, "message": message, "num_paused_requests": paused}
        return web.json_response(answer, status=200 if success else 400)

    async def _update_weight_version(self, request: web.Request) -> web.StreamResponse:
        body = await _control_body(request)
        if isinstance(body, web.Response):
            return body
        version = body.get("new_version")
        abort_all = body.get("abort_all_requests", True)
        if not isinstance(version, str):
            return _bad_request("new_version: Field required (a string)")
        if not isinstance(abort_all, bool):
            return _bad_request("abort_all_requests: Input should be a valid boolean")
        self._engine.update_weight_version(version, abort_all_requests=abort_all)
        answer = {"success": True, "message": f"Weight version updated to {version}", "new_version": version}
        return web.json_response(answer)

    async def _server_info(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self._engine.server_info(http=True))

    async def _flush_cache(self, request: web.Request) -> web.StreamResponse:
        # SGLang's texts (GET or POST; 400 while requests run or wait).
        if request.method not in ("GET", "POST"):
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "POST"])
        if self._engine.flush_cache():
            text = (
                "Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n"
            )
            return web.Response(text=text)
        return web.Response(status=400, text="Flush cache failed.\n")

    async def _model_info(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self._engine.model_info(http=True))

    async def _models(self, request: web.Request) -> web.StreamResponse:
        cfg = self._engine.config
        card = {
            "id": cfg.model_name,
            "object": "model",
            "created": int(self._engine.server_info(http=True)["startup_time"]),
            "owned_by": "sglang",
            "root": cfg.model_name,
            "parent": None,
            "max_model_len": cfg.context_length,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def _loads(self, request: web.Request) -> web.StreamResponse:
        raw = request.query.get("dp_rank")
        try:
            rank = None if raw is None else int(raw)
        except ValueError:
            return _bad_request("dp_rank: Input should be a valid integer")
        return web.json_response(
            {
                "timestamp": datetime.now(UTC).isoformat(),
                "version": self._engine.server_info(http=True)["version"],
                "accelerator": None,
                "num_accelerators": 1,
                "loads": self._engine.loads(rank),
            }
        )
