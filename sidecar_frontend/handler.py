"""The one HTTP handler, whatever the format: routing, cancellation, delivery, metrics.

Formats are pure plugins (``formats/base.py``); this module does their I/O. For a generate
route it parses with the plugin, runs every sub-request on a worker concurrently (one task
group per HTTP request), feeds each ``LLMEngineOutput`` to the plugin's encoder and writes
what it returns (SSE: chunked, one write per event; unary: the encoder's reply at the end).

Cancellation, owned here:
- the client goes away: aiohttp cancels the handler; the task group cancels each gRPC call,
  and the sidecar aborts the engine request (exactly once: that is the sidecar's rule);
- ``request_timeout``: the same cancellation, then ``encoder.on_failure(DEADLINE)`` for each
  sub-request still running;
- abort by id: every sub-request in flight under that public id (whichever client and
  worker) has its call cancelled, then ``encoder.on_failure(CANCELLED)``. Cancelling the call
  is enough: the sidecar aborts on cancel, so no ``Abort`` RPC is sent.

A worker failure is given to :class:`attempts.Attempts`, which decides whether the
sub-request runs again on another worker: a retry when nothing was delivered yet, a migration
(continuation from the delivered tokens) after that. With prefill workers in the set, an
attempt is disaggregated: prefill, then decode with the prefill's handoff (``disagg.py``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import anyio
import grpc
import structlog
from aiohttp import web
from anyio.abc import TaskGroup
from google.protobuf import struct_pb2

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason
from sidecar_common.tracing import SpanKind, Tracing, from_headers, outgoing_metadata
from sidecar_frontend import disagg
from sidecar_frontend.attempts import Attempts, Finish, Refusal, failure_from_rpc_error
from sidecar_frontend.formats.base import (
    SSE_CONTENT_TYPE,
    AbortCall,
    Encoder,
    Format,
    FormatContext,
    GenerateCall,
    HttpReply,
    Route,
    RouteKind,
    WorkerFailure,
    requested_model,
)
from sidecar_frontend.metrics import Metrics
from sidecar_frontend.migration import DEFAULT_MIGRATION_LIMIT
from sidecar_frontend.workers import Worker, WorkerSet

__all__ = ["DEFAULT_MAX_BODY_BYTES", "Frontend", "HandlerConfig"]

DEFAULT_MAX_BODY_BYTES: Final = 64 * 1024 * 1024
# A gRPC deadline a little past our own: only a backstop, our deadline speaks first.
_GRPC_DEADLINE_SLACK: Final = 5.0

log = structlog.get_logger("sidecar_frontend.handler")


def _new_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class HandlerConfig:
    request_timeout: float | None = 3600.0  # None: no deadline
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    sglang_incremental_streaming_output: bool = False
    migration_limit: int = DEFAULT_MIGRATION_LIMIT
    # How long a retry or a migration waits for a worker to serve when none does (workers
    # restarting or being replaced): the gap an SRE expects a fleet to bridge.
    worker_wait: float = 5.0


@dataclass(eq=False)
class _SubCall:
    """One sub-request in flight: what abort by id reaches."""

    public_id: str
    exchange: _Exchange
    index: int
    scope: anyio.CancelScope | None = None
    aborted: bool = False

    def abort(self) -> None:
        self.aborted = True
        if self.scope is not None:
            self.scope.cancel()


class Frontend:
    """The handler's state: formats, workers, the abort registry, in-flight exchanges."""

    def __init__(
        self,
        formats: Sequence[Format],
        workers: WorkerSet,
        config: HandlerConfig | None = None,
        *,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        new_id: Callable[[], str] = _new_id,
        rand: random.Random | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        if not formats:
            raise ValueError("at least one format is needed")
        self.formats = tuple(formats)
        self.workers = workers
        self.config = config if config is not None else HandlerConfig()
        self.metrics = metrics
        self.clock = clock
        self.new_id = new_id
        self._by_id: dict[str, set[_SubCall]] = {}
        self._exchanges: set[_Exchange] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.rand = rand if rand is not None else random.Random()
        self.tracing = tracing if tracing is not None else Tracing()
        # Each SGLang prefill worker's bootstrap server, learned from its first handoff.
        self.bootstraps: dict[str, disagg.BootstrapAddress] = {}

    # ---------------------------------------------------------------- the app

    def build_app(self) -> web.Application:
        """One route per (method, path); the first format to declare one owns it."""
        app = web.Application(client_max_size=self.config.max_body_bytes)
        taken: dict[tuple[str, str], str] = {}
        paths: dict[str, Format] = {}
        for fmt in self.formats:
            for route in fmt.routes:
                for method in route.methods:
                    key = (method.upper(), route.path)
                    if key in taken:
                        continue
                    taken[key] = fmt.name
                    app.router.add_route(key[0], route.path, self._endpoint(fmt, route))
                paths.setdefault(route.path, fmt)
        for path, fmt in paths.items():
            # Registered last, so it only answers the methods no format declared.
            allowed = ", ".join(sorted(method for method, p in taken if p == path))
            app.router.add_route("*", path, self._wrong_method(fmt, allowed))
        # Any other path: the web framework's 404, in the first format's shape (both
        # FastAPI servers answer {"detail": "Not Found"} as application/json).
        app.router.add_route("*", "/{path:.*}", self._not_found(self.formats[0], frozenset(paths)))
        return app

    @property
    def inflight(self) -> int:
        """HTTP generate requests being served."""
        return len(self._exchanges)

    def inflight_ids(self) -> frozenset[str]:
        return frozenset(self._by_id)

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def stop_all(self, failure: WorkerFailure) -> None:
        """End every exchange now, reporting ``failure`` for what was still running."""
        for exchange in list(self._exchanges):
            exchange.stop(failure, "shutdown")

    def abort(self, call: AbortCall) -> int:
        """Cancel every sub-request in flight under the ids ``call`` names; how many."""
        if call.all_requests:
            targets = [sub for subs in self._by_id.values() for sub in subs]
        else:
            targets = [sub for rid in call.request_ids for sub in self._by_id.get(rid, ())]
        for sub in targets:
            sub.abort()
        return len(targets)

    def context(self, model: sidecar_pb2.ModelInfo | None = None) -> FormatContext:
        """What a format may consult; ``model`` is the one the request runs on (default: the
        one a request that names none runs on)."""
        if model is None:
            model = self.workers.model
        return FormatContext(
            wall_time=time.time(),
            model_info=model or sidecar_pb2.ModelInfo(),
            new_id=self.new_id,
            sglang_incremental_streaming_output=self.config.sglang_incremental_streaming_output,
            inflight_ids=self.inflight_ids(),
            models=tuple(self.workers.models().values()),
        )

    def unavailable(self) -> tuple[str, str]:
        """Why no generation can be placed now: (reason, message for the client)."""
        misconfigured = self.workers.misconfiguration()
        if misconfigured is not None:
            return "MISCONFIGURED", f"the fleet is misconfigured: {misconfigured}"
        return FailureReason.NO_WORKER.value, "no worker is serving"

    # ---------------------------------------------------------------- endpoints

    def _endpoint(self, fmt: Format, route: Route) -> Callable[[web.Request], Any]:
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                if route.kind is RouteKind.INFO:
                    return self._info(fmt, route)
                body = await _read_body(request)
                if body is None:
                    limit = self.config.max_body_bytes
                    reply = fmt.error_reply(413, f"request body larger than {limit} bytes")
                    if route.kind is RouteKind.GENERATE:
                        self._refused(fmt, "invalid", "BODY_TOO_LARGE", self.clock(), reply, request.headers)
                    return _response(reply)
                if route.kind is RouteKind.ABORT:
                    return self._abort(fmt, route, body, request.headers)
                with self.tracing.span(
                    f"POST {route.path}",
                    from_headers(request.headers),
                    kind=SpanKind.SERVER,
                    attributes={"http.route": route.path, "llm.format": fmt.name},
                ) as span:
                    response = await self._generate(fmt, route, body, request)
                    if span is not None:
                        span.set_attribute("http.response.status_code", response.status)
                    return response
            except (asyncio.CancelledError, ConnectionError):
                raise
            except Exception:
                log.exception("handler failed", format=fmt.name, path=route.path)
                return _response(fmt.error_reply(500, "internal error in the frontend"))

        return handle

    def _wrong_method(self, fmt: Format, allowed: str) -> Callable[[web.Request], Any]:
        async def handle(request: web.Request) -> web.StreamResponse:
            # Starlette names the route's methods in an Allow header, as HTTP asks of a 405.
            reply = fmt.error_reply(405, f"method {request.method} is not allowed")
            return _response(reply, (("Allow", allowed),))

        return handle

    def _not_found(self, fmt: Format, paths: frozenset[str]) -> Callable[[web.Request], Any]:
        async def handle(request: web.Request) -> web.StreamResponse:
            path = request.path
            other = path.rstrip("/") if path.endswith("/") else path + "/"
            if path != "/" and other in paths:
                # Starlette's redirect_slashes (on in both servers): the route without (or
                # with) the trailing slash, as a 307 that keeps the method and the body.
                query = f"?{request.query_string}" if request.query_string else ""
                location = f"{request.scheme}://{request.host}{other}{query}"
                return web.Response(status=307, headers={"Location": location})
            return _response(fmt.error_reply(404, f"no route for {path}"))

        return handle

    def _info(self, fmt: Format, route: Route) -> web.StreamResponse:
        # Nothing about the model is known before a worker serves it.
        if not self.workers.routable():
            return _response(fmt.error_reply(503, self.unavailable()[1]))
        return _response(fmt.info(route, self.context()))

    def _abort(self, fmt: Format, route: Route, body: bytes, headers: Mapping[str, str]) -> web.Response:
        parsed = fmt.parse_abort(route, body, headers)
        if isinstance(parsed, HttpReply):
            return _response(parsed)
        count = self.abort(parsed)
        log.info(
            "abort", format=fmt.name, ids=list(parsed.request_ids), all=parsed.all_requests, aborted=count
        )
        return _response(fmt.abort_reply(route, parsed, count))

    async def _generate(
        self, fmt: Format, route: Route, body: bytes, request: web.Request
    ) -> web.StreamResponse:
        started_at = self.clock()
        models = self.workers.models()
        # With one model every request runs on it (a format that checks the name, as vLLM
        # does, refuses another); with several, the request's `model` chooses.
        named = requested_model(body) if len(models) > 1 else None
        unknown = named is not None and named not in models
        model = named if named is not None and not unknown else self.workers.default_model()
        parsed = fmt.parse_generate(
            route, body, request.headers, self.context(models.get(model) if model is not None else None)
        )
        if named is not None and unknown and not (isinstance(parsed, HttpReply) and parsed.status != 404):
            # The body's own faults answer first (vLLM checks the model after the body), then
            # the model no worker serves, naming every one that is served.
            reply = fmt.model_not_found(named, list(models))
            self._refused(fmt, "invalid", "MODEL_NOT_FOUND", started_at, reply, request.headers, body)
            return _response(reply)
        if isinstance(parsed, HttpReply):
            reason = "MODEL_NOT_FOUND" if parsed.status == 404 else "INVALID_REQUEST"
            self._refused(fmt, "invalid", reason, started_at, parsed, request.headers, body)
            return _response(parsed)
        if model is None:
            reason, message = self.unavailable()
            reply = fmt.error_reply(503, message)
            ids = sorted({r.request_id for r in parsed.requests})
            self._refused(fmt, "unavailable", reason, started_at, reply, request.headers, request_ids=ids)
            return _response(reply)
        exchange = _Exchange(self, fmt, parsed, fmt.new_encoder(parsed, started_at), started_at, model)
        self._exchanges.add(exchange)
        self._idle.clear()
        try:
            return await exchange.serve(request)
        finally:
            self._exchanges.discard(exchange)
            if not self._exchanges:
                self._idle.set()

    def _refused(
        self,
        fmt: Format,
        outcome: str,
        reason: str,
        started_at: float,
        reply: HttpReply,
        headers: Mapping[str, str],
        body: bytes = b"",
        request_ids: Sequence[str] = (),
    ) -> None:
        """The metrics and the one ``request`` line of a request answered without a worker:
        why (the reason and the words the client got) and the request's id."""
        duration = self.clock() - started_at
        if self.metrics is not None:
            self.metrics.request(
                fmt.name, outcome, reason, prompt_tokens=0, completion_tokens=0, ttft=None, duration=duration
            )
        ids = list(request_ids) or _client_request_ids(body, headers)
        log.info(
            "request",
            format=fmt.name,
            request_id=(ids[0] if len(ids) == 1 else ids) if ids else None,
            outcome=outcome,
            reason=reason,
            status=reply.status,
            error=_reply_message(reply),
            duration_ms=_ms(duration),
        )

    # ---------------------------------------------------------------- registry

    def _register(self, sub: _SubCall) -> None:
        self._by_id.setdefault(sub.public_id, set()).add(sub)

    def _unregister(self, sub: _SubCall) -> None:
        subs = self._by_id.get(sub.public_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._by_id[sub.public_id]

    def _lease_changed(self, worker: Worker) -> None:
        if self.metrics is not None:
            self.metrics.set_worker_inflight(worker.address, worker.inflight)

    def _worker_failed(self, worker: Worker, failure: WorkerFailure) -> None:
        if self.metrics is not None:
            self.metrics.worker_failed(worker.address, failure.reason.value)


@dataclass(eq=False)
class _Exchange:
    """One HTTP generate request: its sub-requests, its encoder, its response."""

    frontend: Frontend
    fmt: Format
    call: GenerateCall
    encoder: Encoder
    started_at: float
    model: str = ""  # what every sub-request runs on (its workers serve it)
    response: web.StreamResponse | None = None
    ended: list[bool] = field(default_factory=list)
    attempts: list[Attempts] = field(default_factory=list)
    workers_used: list[str] = field(default_factory=list)
    retries: int = 0
    migrations: int = 0
    first_output_at: float | None = None
    outcome: str = "ok"
    reason: str = "NONE"  # why it did not end ok (a failure reason, or the frontend's own)
    client_gone: bool = False
    # Per sub-request: the move (retry or migration) decided after a failure, counted once
    # a worker takes it.
    moving: dict[int, tuple[str, WorkerFailure]] = field(default_factory=dict)
    _scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    _stop_failure: WorkerFailure | None = None
    _write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _group: TaskGroup | None = None
    _http_request: web.Request | None = None
    # A stream refused before its first bytes, answered as a plain reply (see
    # GenerateCall.refused_before_stream).
    refused_before_stream: bool = False

    def stop(self, failure: WorkerFailure, outcome: str) -> None:
        """End the exchange: cancel what runs, report ``failure`` for it."""
        if self._stop_failure is None:
            self._stop_failure = failure
            self.outcome = outcome
            self.reason = failure.reason.value
        self._scope.cancel()

    async def serve(self, request: web.Request) -> web.StreamResponse:
        call = self.call
        count = len(call.requests)
        self.ended = [False] * count
        limit = self.frontend.config.migration_limit
        self.attempts = [Attempts(r, limit) for r in call.requests]
        status = 200
        try:
            if call.stream:
                self._http_request = request
                if not call.refused_before_stream:
                    await self._start_stream()
            await self._run_all()
            if call.stream and not self.refused_before_stream:
                if not self.client_gone:
                    await self._write(self.encoder.close())
                if self.response is None:
                    # Held for the first bytes, and the client left before any: no stream.
                    raise ConnectionResetError("the client left before the stream started")
                await self.response.write_eof()
                return self.response
            reply = self.encoder.reply()
            status = reply.status
            return _response(reply, call.headers)
        except (asyncio.CancelledError, ConnectionError):
            self.client_gone = True
            self.outcome, self.reason = "disconnected", "CLIENT_GONE"
            raise
        finally:
            self._log(status)

    async def _run_all(self) -> None:
        timeout = self.frontend.config.request_timeout
        with self._scope:
            if timeout is not None:
                self._scope.deadline = anyio.current_time() + timeout
            async with anyio.create_task_group() as group:
                self._group = group
                for index, sub_request in enumerate(self.call.requests):
                    group.start_soon(self._run_one, index, sub_request)
        if self._scope.cancelled_caught and not self.client_gone:
            failure = self._stop_failure
            if failure is None:
                failure = WorkerFailure.of(FailureReason.DEADLINE, f"request timed out after {timeout:g}s")
                self.outcome, self.reason = "timeout", failure.reason.value
            for index, ended in enumerate(self.ended):
                if not ended and not self.encoder.aborted:
                    self.ended[index] = True
                    await self._write_failure(index, failure)

    async def _run_one(self, index: int, request: sidecar_pb2.PreprocessedRequest) -> None:
        frontend = self.frontend
        sub = _SubCall(request.request_id, self, index)
        frontend._register(sub)
        attempts = self.attempts[index]
        current = request
        tried: list[str] = []
        failure: WorkerFailure | None = None
        previous: WorkerFailure | None = None
        try:
            while True:
                if sub.aborted:
                    failure = WorkerFailure.of(FailureReason.CANCELLED, "aborted by request id")
                    break
                with anyio.CancelScope() as scope:
                    sub.scope = scope
                    failure = await self._attempt(current, index, attempts, tried)
                sub.scope = None
                if scope.cancelled_caught:
                    failure = WorkerFailure.of(FailureReason.CANCELLED, "aborted by request id")
                    break
                if failure is None:
                    break
                if failure.reason is FailureReason.NO_WORKER:
                    move = self.moving.pop(index, None)
                    if move is not None and move[0] == "migrated":
                        self._migration_outcome("no_worker", index, move[1], tried)
                    # Say why the last worker failed rather than that no other one was left.
                    failure = previous or failure
                    break
                previous = failure
                delivered = attempts.progress.delivered
                following = attempts.after_failure(failure)
                if isinstance(following, Finish):
                    # The budget was spent before the terminal came: end it as LENGTH.
                    await self._deliver_output(index, attempts.finish(following))
                    self._migration_outcome("length", index, failure, tried)
                    failure = None
                    break
                if isinstance(following, Refusal):
                    if delivered:
                        self._migration_outcome(following.reason.name.lower(), index, failure, tried)
                    break
                current = following
                # Counted once another worker takes it (``_placed``), or as no_worker.
                self.moving[index] = ("migrated" if delivered else "retry", failure)
        finally:
            sub.scope = None
            frontend._unregister(sub)
            self.moving.pop(index, None)
        self.ended[index] = True
        if failure is not None:
            if failure.reason is FailureReason.CANCELLED and sub.aborted and self.outcome == "ok":
                self.outcome, self.reason = "aborted", failure.reason.value
            elif self.outcome == "ok":
                self.outcome = "unavailable" if failure.reason is FailureReason.NO_WORKER else "error"
                self.reason = failure.reason.value
            if not self.encoder.aborted:
                await self._write_failure(index, failure)
            if self.encoder.aborted and self._group is not None:
                self._group.cancel_scope.cancel()

    def _migration_outcome(
        self, outcome: str, index: int, failure: WorkerFailure, tried: list[str], to: str | None = None
    ) -> None:
        metrics = self.frontend.metrics
        if metrics is not None:
            metrics.migrated(self.fmt.name, outcome)
        attempts = self.attempts[index]
        log.info(
            "migration",
            request_id=attempts.request.request_id,
            outcome=outcome,
            worker=tried[-1] if tried else None,
            to=to,
            reason=failure.reason.value,
            error=failure.message,
            delivered_tokens=len(attempts.migration.delivered_tokens),
            migrations=attempts.migration.migrations,
        )

    def _placed(self, index: int, chosen: Sequence[Worker], tried: list[str]) -> None:
        """A worker took sub-request ``index``: the retry or migration decided after its last
        failure (if any) happened, and is counted now."""
        move = self.moving.pop(index, None)
        if move is None:
            return
        kind, failure = move
        to = chosen[-1].address
        if kind == "migrated":
            self.migrations += 1
            self._migration_outcome("migrated", index, failure, tried, to)
            return
        self.retries += 1
        if self.frontend.metrics is not None:
            self.frontend.metrics.retried(self.fmt.name)
        log.info(
            "retrying on another worker",
            request_id=self.attempts[index].request.request_id,
            worker=tried[-1] if tried else None,
            to=to,
            reason=failure.reason.value,
            error=failure.message,
        )

    def _pick(self, role: str, tried: list[str], patient: bool) -> Worker | None:
        """A worker of ``role``, preferring one this sub-request has not tried; else, when
        ``patient``, any but the last one that failed (a restarted worker comes back under its
        old address)."""
        workers = self.frontend.workers
        worker = workers.pick(role, exclude=frozenset(tried), model=self.model)
        if worker is None and tried and patient:
            worker = workers.pick(role, exclude=frozenset(tried[-1:]), model=self.model)
        return worker

    async def _attempt(
        self, request: sidecar_pb2.PreprocessedRequest, index: int, attempts: Attempts, tried: list[str]
    ) -> WorkerFailure | None:
        """One attempt: aggregated, or prefill then decode when the set has prefill workers."""
        chosen = await self._choose(tried, attempts.patient)
        if chosen is None:
            return WorkerFailure.of(FailureReason.NO_WORKER, f"no worker is serving {self.model}")
        self._placed(index, chosen, tried)
        self.workers_used.extend(w.address for w in chosen)
        tried.extend(w.address for w in chosen)
        if len(chosen) == 2:
            prefill, decode = chosen
            return await self._disaggregated(prefill, decode, request, index, attempts)
        return await self._decode(chosen[0], request, index, attempts)

    async def _choose(self, tried: list[str], patient: bool) -> tuple[Worker] | tuple[Worker, Worker] | None:
        """A prefill and a decode worker while both roles serve, else an aggregated one. When
        none serves, a retry or a migration waits (bounded) for one to, unless it must not
        (``patient`` False: after a worker answered busy, see ``attempts.py``)."""
        workers = self.frontend.workers
        wait = self.frontend.config.worker_wait if tried and patient else 0.0
        with anyio.move_on_after(wait):
            while True:
                changed = workers.next_change()
                if workers.has_serving("prefill", self.model) and workers.has_serving("decode", self.model):
                    prefill = self._pick("prefill", tried, patient)
                    decode = self._pick("decode", tried, patient)
                    if prefill is not None and decode is not None:
                        return prefill, decode
                worker = self._pick("agg", tried, patient)
                if worker is not None:
                    return (worker,)
                await changed.wait()
        return None

    async def _decode(
        self, worker: Worker, request: sidecar_pb2.PreprocessedRequest, index: int, attempts: Attempts
    ) -> WorkerFailure | None:
        """A call whose outputs go to the client; None when every choice's terminal arrived."""

        async def deliver(output: sidecar_pb2.LLMEngineOutput) -> WorkerFailure | None:
            if output.finish_reason == sidecar_pb2.CANCELLED and not worker.eligible:
                # Nobody here aborted it: the worker is going away (drained, stopped) and its
                # engine ended the request. That is the worker's failure, not the client's
                # abort: what came with it is delivered, the rest continues elsewhere.
                if output.token_ids:
                    partial = sidecar_pb2.LLMEngineOutput()
                    partial.CopyFrom(output)
                    for name in ("finish_reason", "stop_reason", "completion_usage", "engine_data"):
                        partial.ClearField(name)
                    await self._deliver_output(index, attempts.delivered(partial))
                return WorkerFailure.of(
                    FailureReason.ENGINE_SHUTDOWN,
                    f"worker {worker.address} is going away: its engine aborted",
                )
            await self._deliver_output(index, attempts.delivered(output))
            return None

        failure = await self._call(worker, request, deliver)
        if failure is None and not attempts.complete:
            failure = WorkerFailure.of(
                FailureReason.PROTOCOL_ERROR, f"worker {worker.address} ended the stream early"
            )
            self.frontend._worker_failed(worker, failure)
        return failure

    async def _disaggregated(
        self,
        prefill: Worker,
        decode: Worker,
        request: sidecar_pb2.PreprocessedRequest,
        index: int,
        attempts: Attempts,
    ) -> WorkerFailure | None:
        """Prefill on ``prefill``, decode on ``decode`` with its handoff. Whichever step fails
        first cancels the other (each cancelled call is aborted by its sidecar); a prefill the
        engine aborted ends the sub-request as cancelled, with no decode step."""
        frontend = self.frontend
        style = disagg.style_of(prefill.model)
        handoff: list[struct_pb2.Struct] = []
        ready = anyio.Event()
        prefill_failure: list[WorkerFailure] = []
        prefill_cancelled: list[sidecar_pb2.LLMEngineOutput] = []
        decode_failure: WorkerFailure | None = None
        step = disagg.prefill_request(request)
        known = frontend.bootstraps.get(prefill.address) if style is disagg.Style.BOOTSTRAP else None
        if known is not None:
            info = disagg.choose_bootstrap(known, frontend.rand)
            step = disagg.prefill_request(request, info)
            handoff.append(disagg.bootstrap_params(info))
            ready.set()

        async def take(output: sidecar_pb2.LLMEngineOutput) -> WorkerFailure | None:
            if output.HasField("disaggregated_params") and not handoff:
                handoff.append(output.disaggregated_params)
                if style is disagg.Style.BOOTSTRAP:
                    learned = disagg.bootstrap_address(output.disaggregated_params)
                    if learned is not None:
                        frontend.bootstraps[prefill.address] = learned
                ready.set()
            elif output.finish_reason == sidecar_pb2.CANCELLED and not handoff:
                prefill_cancelled.append(output)
            return None

        async def run_prefill(group: TaskGroup) -> None:
            failure = await self._call(prefill, step, take)
            if failure is None and not handoff and not prefill_cancelled:
                failure = WorkerFailure.of(
                    FailureReason.PROTOCOL_ERROR, f"prefill worker {prefill.address} gave no handoff"
                )
                frontend._worker_failed(prefill, failure)
            if failure is not None:
                prefill_failure.append(failure)
                group.cancel_scope.cancel()
            ready.set()

        async with anyio.create_task_group() as group:
            group.start_soon(run_prefill, group)
            await ready.wait()
            if handoff:
                decode_failure = await self._decode(
                    decode, disagg.decode_request(request, handoff[0]), index, attempts
                )
                if decode_failure is not None:
                    group.cancel_scope.cancel()
        if prefill_failure:
            return prefill_failure[0]
        if prefill_cancelled and not handoff:
            await self._deliver_output(index, attempts.delivered(prefill_cancelled[0]))
            return None
        return decode_failure

    async def _deliver_output(self, index: int, output: sidecar_pb2.LLMEngineOutput) -> None:
        now = self.frontend.clock()
        if self.first_output_at is None:
            self.first_output_at = now
        data = self.encoder.on_output(index, output, now)
        if data:
            await self._write(data)

    async def _call(
        self,
        worker: Worker,
        request: sidecar_pb2.PreprocessedRequest,
        consume: Callable[[sidecar_pb2.LLMEngineOutput], Awaitable[WorkerFailure | None]],
    ) -> WorkerFailure | None:
        """One Generate call on ``worker``, each output to ``consume``; the call's failure, if any.
        Leaving early (a cancel) cancels the call, and the sidecar aborts the engine request."""
        frontend = self.frontend
        timeout = frontend.config.request_timeout
        grpc_timeout = None if timeout is None else timeout + _GRPC_DEADLINE_SLACK
        metrics = frontend.metrics
        began = frontend.clock()
        first = True
        failure: WorkerFailure | None = None
        try:
            with (
                worker.lease(frontend._lease_changed),
                frontend.tracing.span(
                    "sidecar.v1.Worker/Generate",
                    kind=SpanKind.CLIENT,
                    attributes={"server.address": worker.address, "llm.request_id": request.request_id},
                ),
            ):
                call = worker.stub().Generate(request, timeout=grpc_timeout, metadata=outgoing_metadata())
                try:
                    async for output in call:
                        if first:
                            first = False
                            if metrics is not None:
                                metrics.worker_first_output(worker.address, frontend.clock() - began)
                        failure = await consume(output)
                        if failure is not None:
                            return failure
                except grpc.RpcError as err:
                    failure = failure_from_rpc_error(err)
                    return failure
                finally:
                    # A no-op once the stream ended; otherwise the sidecar aborts the engine request.
                    call.cancel()
            return None
        finally:
            if metrics is not None:
                metrics.worker_call(worker.address, frontend.clock() - began)
                if failure is not None:
                    metrics.worker_failed(worker.address, failure.reason.value)

    async def _start_stream(self) -> None:
        """Send the stream's 200 and headers (at once, or with its first bytes when held)."""
        assert self._http_request is not None
        response = web.StreamResponse(
            status=200, headers={"Content-Type": SSE_CONTENT_TYPE, "Cache-Control": "no-cache"}
        )
        for name, value in self.call.headers:
            response.headers[name] = value
        response.enable_chunked_encoding()
        await response.prepare(self._http_request)
        self.response = response

    async def _write_failure(self, index: int, failure: WorkerFailure) -> None:
        data = self.encoder.on_failure(index, failure, self.frontend.clock())
        if (
            self.call.stream
            and self.response is None
            and self.encoder.aborted
            and failure.reason in self.call.refused_before_stream
        ):
            # Nothing was sent yet and the failure ended the response: the server's own answer
            # to it comes before any stream, so it is the plain reply (``serve``).
            self.refused_before_stream = True
            return
        await self._write(data)

    async def _write(self, data: bytes) -> None:
        if not data or self.client_gone or (self.response is None and not self.call.stream):
            return
        try:
            async with self._write_lock:
                if self.response is None:
                    if self.refused_before_stream:
                        return
                    await self._start_stream()
                assert self.response is not None
                await self.response.write(data)
        except ConnectionError:
            # The client is gone: stop every sub-request (their calls are cancelled).
            self.client_gone = True
            self.outcome, self.reason = "disconnected", "CLIENT_GONE"
            self._scope.cancel()

    def _log(self, status: int) -> None:
        frontend = self.frontend
        duration = frontend.clock() - self.started_at
        prompt = sum(len(r.token_ids) for r in self.call.requests)
        completion = sum(a.progress.completion_tokens() for a in self.attempts)
        ttft = None if self.first_output_at is None else self.first_output_at - self.started_at
        if frontend.metrics is not None:
            frontend.metrics.request(
                self.fmt.name,
                self.outcome,
                self.reason,
                prompt_tokens=prompt,
                completion_tokens=completion,
                ttft=ttft,
                duration=duration,
            )
        ids = sorted({r.request_id for r in self.call.requests})
        log.info(
            "request",
            format=self.fmt.name,
            request_id=ids[0] if len(ids) == 1 else ids,
            model=self.model,
            stream=self.call.stream,
            sub_requests=len(self.call.requests),
            outcome=self.outcome,
            reason=self.reason,
            status=status,
            prompt_tokens=prompt,
            completion_tokens=completion,
            ttft_ms=None if ttft is None else _ms(ttft),
            duration_ms=_ms(duration),
            workers=sorted(set(self.workers_used)),
            retries=self.retries,
            migrations=self.migrations,
        )


async def _read_body(request: web.Request) -> bytes | None:
    """The body, or None when it is larger than the app's ``client_max_size``."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        return None


def _response(reply: HttpReply, extra: tuple[tuple[str, str], ...] = ()) -> web.Response:
    response = web.Response(status=reply.status, body=reply.body)
    if reply.body or reply.content_type:
        response.headers["Content-Type"] = reply.content_type
    for name, value in (*reply.headers, *extra):
        response.headers[name] = value
    return response


def _client_request_ids(body: bytes, headers: Mapping[str, str]) -> list[str]:
    """The id a refused request's client gave, if any: vLLM's ``X-Request-Id`` header or
    ``request_id``, SGLang's ``rid`` (a string or a list of them). Read only on refusals."""
    header = next((v for k, v in headers.items() if k.lower() == "x-request-id"), None)
    if header:
        return [header]
    if not body:
        return []
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return []
    if not isinstance(data, dict):
        return []
    for key in ("rid", "request_id"):
        value = data.get(key)
        if isinstance(value, str) and value:
            return [value]
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return [str(v) for v in value]
    return []


def _reply_message(reply: HttpReply, limit: int = 500) -> str | None:
    """The words a refusal gave the client, from whichever shape the format uses
    (``{"error": {"message"}}``, ``{"message"}``, ``{"detail"}``), cut to ``limit``."""
    try:
        data = json.loads(reply.body) if reply.body else None
    except (ValueError, RecursionError):
        data = None
    text: object = None
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict):
            text = error.get("message")
        elif isinstance(error, str):
            text = error
        if text is None:
            text = data.get("message", data.get("detail"))
    if text is None:
        text = reply.body.decode(errors="replace") if reply.body else None
    if text is None:
        return None
    words = text if isinstance(text, str) else json.dumps(text, ensure_ascii=False)
    return words if len(words) <= limit else words[:limit] + "…"


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)
