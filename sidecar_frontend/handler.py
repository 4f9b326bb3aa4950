"""The one HTTP handler, whatever the format: the routes, and what is answered without a worker.

Formats are pure plugins (``formats/base.py``); this module and ``exchange.py`` do their I/O.
:class:`Frontend` builds the aiohttp app from the formats' routes: the info routes, abort by id
(``exchange.AbortRegistry``), the body limit, 404 and 405 in the format's shape, and for a
generate route the parse, the model choice and the refusals no worker needs to see. A parsed
request becomes an :class:`~sidecar_frontend.exchange.Exchange` (the HTTP side of the request:
fan-out, writes, its log line), whose sub-requests run on the frontend's
:class:`~sidecar_frontend.attempt_runner.AttemptRunner` (worker choice, the gRPC call, the
prefill -> decode step, retries and migrations).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Callable, KeysView, Mapping, Sequence
from typing import Any, Final

import anyio
import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason, RefusalReason
from sidecar_common.tracing import SpanKind, Tracing, from_headers, outgoing_metadata
from sidecar_frontend import disagg
from sidecar_frontend.admission.gate import REFUSAL_STATUS, Gate, Pass, refusal_headers
from sidecar_frontend.admission.state import Refused
from sidecar_frontend.admission.who import Who, estimated_tokens, read_who, sequences
from sidecar_frontend.attempt_runner import AttemptRunner
from sidecar_frontend.config import DEFAULT_MAX_BODY_BYTES, HandlerConfig
from sidecar_frontend.exchange import AbortRegistry, AnsweredAbort, Exchange, http_response, ms
from sidecar_frontend.formats.base import (
    AbortCall,
    Format,
    FormatContext,
    GenerateCall,
    HttpReply,
    Route,
    RouteKind,
    WorkerFailure,
)
from sidecar_frontend.metrics import Metrics
from sidecar_frontend.migration import resume_refusal
from sidecar_frontend.placement import CallWatch, WorkerChoice
from sidecar_frontend.resume import RESUME_HEADER, resume_wanted
from sidecar_frontend.retry_budget import RetryBudget
from sidecar_frontend.workers import WorkerSet

__all__ = ["DEFAULT_MAX_BODY_BYTES", "Frontend", "HandlerConfig"]


log = structlog.get_logger("sidecar_frontend.handler")

# How long an aborted non-streaming call waits for its engine's answer (the tokens made so far)
# before it is cancelled without it: the sidecar's own abort deadline (5 s) and some slack.
ABORT_ANSWER_GRACE: Final = 10.0


def _new_id() -> str:
    return uuid.uuid4().hex


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
        choice: WorkerChoice | None = None,
        watch: CallWatch | None = None,
        gate: Gate | None = None,
        middlewares: Sequence[Middleware] = (),
    ) -> None:
        if not formats:
            raise ValueError("at least one format is needed")
        self.formats = tuple(formats)
        self.workers = workers
        self.config = config if config is not None else HandlerConfig()
        self.metrics = metrics
        self.clock = clock
        self.new_id = new_id
        self.registry = AbortRegistry()
        self._exchanges: set[Exchange] = set()
        # Generate requests past their parse: waiting for admission or being served. The frontend
        # is idle (its drain is over) when none is left.
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.tracing = tracing if tracing is not None else Tracing()
        # Admission (sidecar_frontend/admission/): None: every request goes straight to a worker.
        self.gate = gate
        # What every request goes through before its route (routing's session header).
        self.middlewares = tuple(middlewares)
        # ``choice``: the routing policy (default: the worker set's least loaded of two);
        # ``watch``: what it follows of each call (sidecar_frontend/routing/choice.py).
        self.runner = AttemptRunner(
            workers,
            self.config,
            choice=choice,
            watch=watch,
            metrics=metrics,
            clock=clock,
            rand=rand,
            tracing=self.tracing,
            misbehaviour=workers.misbehaviour,
            retry_budget=RetryBudget(self.config.retry_budget),
        )

    @property
    def bootstraps(self) -> Mapping[str, disagg.BootstrapAddress]:
        """Each SGLang prefill worker's bootstrap server, learned from its first handoff."""
        return self.runner.bootstraps

    # ---------------------------------------------------------------- the app

    def build_app(self, extra_routes: Sequence[web.RouteDef] = ()) -> web.Application:
        """One route per (method, path); the first format to declare one owns it.
        ``extra_routes``: routes of the frontend's own (the admin API), before the 404."""
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=self.middlewares)
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
        app.add_routes(extra_routes)
        # Any other path: the web framework's 404, in the first format's shape (both
        # FastAPI servers answer {"detail": "Not Found"} as application/json).
        app.router.add_route("*", "/{path:.*}", self._not_found(self.formats[0], frozenset(paths)))
        return app

    @property
    def inflight(self) -> int:
        """HTTP generate requests being served."""
        return len(self._exchanges)

    @property
    def exchanges(self) -> tuple[Exchange, ...]:
        """The generate requests being served (each with its stream's backpressure figures)."""
        return tuple(self._exchanges)

    def inflight_ids(self) -> KeysView[str]:
        return self.registry.ids()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def stop_all(self, failure: WorkerFailure) -> None:
        """End every exchange now, reporting ``failure`` for what was still running; a request
        still waiting for admission is refused (503)."""
        if self.gate is not None:
            self.gate.close(Refused(RefusalReason.NO_CAPACITY, 1, "the frontend is shutting down"))
        for exchange in list(self._exchanges):
            exchange.stop(failure, "shutdown")

    async def abort(self, call: AbortCall) -> int:
        """Abort every sub-request in flight under the ids ``call`` names; how many. A call that
        asked its worker for one answer keeps it: its sidecar gets an Abort (all such sent at
        once, each bounded by :data:`ABORT_ANSWER_GRACE`), and one that cannot be delivered is
        cancelled instead (exchange.AbortRegistry)."""
        count, answered = self.registry.abort(call, anyio.current_time(), ABORT_ANSWER_GRACE)
        if answered:
            async with anyio.create_task_group() as group:
                for item in answered:
                    group.start_soon(self._send_abort, item)
        return count

    async def _send_abort(self, item: AnsweredAbort) -> None:
        request = sidecar_pb2.AbortRequest(request_id=item.request_id)
        try:
            with anyio.fail_after(ABORT_ANSWER_GRACE):
                await item.worker.stub().Abort(
                    request, timeout=ABORT_ANSWER_GRACE, metadata=outgoing_metadata()
                )
        except Exception as err:  # any failure: the call is cancelled, as without an answer
            log.warning(
                "abort not delivered to the worker: its call is cancelled",
                worker=item.worker.address,
                request_id=item.request_id,
                error=repr(err),
            )
            item.sub.abort()

    def context(self, model: sidecar_pb2.ModelInfo | None = None) -> FormatContext:
        """What a format may consult; ``model`` is the one the request runs on (default: the
        one a request that names none runs on)."""
        if model is None:
            model = self.workers.model
        return FormatContext(
            wall_time=time.time(),
            model_info=model or sidecar_pb2.ModelInfo(),
            new_id=self.new_id,
            inflight_ids=self.inflight_ids(),
            models=tuple(self.workers.models().values()),
            weight_version=self.workers.registry.versions.newest,
        )

    def unavailable(self) -> tuple[FailureReason | RefusalReason, str]:
        """Why no generation can be placed now: (reason, message for the client)."""
        misconfigured = self.workers.misconfiguration()
        if misconfigured is not None:
            return RefusalReason.MISCONFIGURED, f"the fleet is misconfigured: {misconfigured}"
        return FailureReason.NO_WORKER, "no worker is serving"

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
                        self._refused(
                            fmt, "invalid", RefusalReason.BODY_TOO_LARGE, self.clock(), reply, request.headers
                        )
                    return http_response(reply)
                if route.kind is RouteKind.ABORT:
                    return await self._abort(fmt, route, body, request.headers)
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
                return http_response(fmt.error_reply(500, "internal error in the frontend"))

        return handle

    def _wrong_method(self, fmt: Format, allowed: str) -> Callable[[web.Request], Any]:
        async def handle(request: web.Request) -> web.StreamResponse:
            # Starlette names the route's methods in an Allow header, as HTTP asks of a 405.
            reply = fmt.error_reply(405, f"method {request.method} is not allowed")
            return http_response(reply, (("Allow", allowed),))

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
            return http_response(fmt.error_reply(404, f"no route for {path}"))

        return handle

    def _info(self, fmt: Format, route: Route) -> web.StreamResponse:
        # Nothing about the model is known before a worker serves it.
        if not self.workers.routable():
            return http_response(fmt.error_reply(503, self.unavailable()[1]))
        return http_response(fmt.info(route, self.context()))

    async def _abort(
        self, fmt: Format, route: Route, body: bytes, headers: Mapping[str, str]
    ) -> web.Response:
        parsed = fmt.parse_abort(route, body, headers)
        if isinstance(parsed, HttpReply):
            return http_response(parsed)
        count = await self.abort(parsed)
        log.info(
            "abort", format=fmt.name, ids=list(parsed.request_ids), all=parsed.all_requests, aborted=count
        )
        return http_response(fmt.abort_reply(route, parsed, count))

    async def _generate(
        self, fmt: Format, route: Route, body: bytes, request: web.Request
    ) -> web.StreamResponse:
        started_at = self.clock()
        models = self.workers.models()
        # The body is parsed once; the parse says which model it names.
        read = fmt.read_generate(route, body, request.headers)
        if isinstance(read, HttpReply):
            return self._invalid(fmt, started_at, read, request.headers, body)
        # With one model every request runs on it (a format that checks the name, as vLLM
        # does, refuses another); with several, the request's `model` chooses.
        named = read.model if len(models) > 1 else None
        unknown = named is not None and named not in models
        model = named if named is not None and not unknown else self.workers.default_model()
        parsed = fmt.parse_generate(
            route, read, request.headers, self.context(models.get(model) if model is not None else None)
        )
        if named is not None and unknown and not (isinstance(parsed, HttpReply) and parsed.status != 404):
            # The body's own faults answer first (vLLM checks the model after the body), then
            # the model no worker serves, naming every one that is served.
            reply = fmt.model_not_found(named, list(models))
            return self._invalid(fmt, started_at, reply, request.headers, body, read.data)
        if isinstance(parsed, HttpReply):
            return self._invalid(fmt, started_at, parsed, request.headers, body, read.data)
        resume = resume_wanted(request.headers.get(RESUME_HEADER), self.config.resume_on_abort)
        if isinstance(resume, str):
            return self._invalid(
                fmt, started_at, fmt.error_reply(400, resume), request.headers, body, read.data
            )
        if model is None:
            why, message = self.unavailable()
            reply = fmt.error_reply(503, message)
            ids = sorted({r.request_id for r in parsed.requests})
            self._refused(fmt, "unavailable", why, started_at, reply, request.headers, request_ids=ids)
            # Workers may come back: the client may try again after a second, as after any 503.
            return http_response(reply, (("Retry-After", "1"),))
        self._active += 1
        self._idle.clear()
        try:
            return await self._admit_and_serve(fmt, parsed, model, started_at, request, resume)
        finally:
            self._active -= 1
            if not self._active:
                self._idle.set()

    async def _admit_and_serve(
        self,
        fmt: Format,
        parsed: GenerateCall,
        model: str,
        started_at: float,
        request: web.Request,
        resume: bool = False,
    ) -> web.StreamResponse:
        """Admission (when on), the hold while the model's workers are all paused, then the
        exchange: a stream's status is sent only once it was admitted and a worker takes it, so
        a refusal is a real 429 or 503, never an error inside a 200 stream."""
        passed: Pass | None = None
        if self.gate is not None:
            who = read_who(fmt.name, request.headers, list(parsed.requests), self.gate.config.who)
            if isinstance(who, tuple):
                name, why = who
                reply = fmt.error_reply(400, f"header {name}: {why}")
                return self._invalid(fmt, started_at, reply, request.headers, b"")
            try:
                entered = await self.gate.enter(
                    model, who, estimated_tokens(parsed.requests), sequences(parsed.requests)
                )
            except asyncio.CancelledError:
                self._left_while_queued(fmt, parsed, started_at, who)
                raise
            if isinstance(entered, Refused):
                return self._admission_refused(fmt, parsed, started_at, request.headers, who, entered)
            passed = entered
            _consume_priority(parsed, self.workers.models().get(model))
        if self.workers.held(model):
            held = await self._hold(fmt, parsed, model, started_at, request.headers, passed)
            if held is not None:
                return held
        exchange = Exchange(
            self.runner,
            self.registry,
            fmt,
            parsed,
            fmt.new_encoder(parsed, started_at),
            started_at,
            model,
            request_timeout=self.config.request_timeout,
            metrics=self.metrics,
            clock=self.clock,
            resume_on_abort=resume,
        )
        if passed is not None:
            exchange.admission = passed
            if self._preemptible(parsed, model):
                passed.allow_preemption(exchange.preempt)
        self._exchanges.add(exchange)
        try:
            return await exchange.serve(request)
        finally:
            self._exchanges.discard(exchange)
            if passed is not None:
                passed.release(exchange.used_tokens())

    async def _hold(
        self,
        fmt: Format,
        parsed: GenerateCall,
        model: str,
        started_at: float,
        headers: Mapping[str, str],
        passed: Pass | None,
    ) -> web.Response | None:
        """Every worker of ``model`` is paused (or none is at the newest weight version): the
        request waits here, a stream's status too, until one takes new requests (None: it goes
        on), or is answered 503 with the reason past --paused-hold-secs (``WorkerSet.hold``). A
        client that leaves meanwhile takes it away at once; its admission is given back."""
        ids = sorted({r.request_id for r in parsed.requests})
        try:
            why = await self.workers.hold(model)
        except asyncio.CancelledError:
            if passed is not None:
                passed.release(0)
            self._refused(
                fmt, "disconnected", "CLIENT_GONE", started_at, None, {}, request_ids=ids, held=True
            )
            raise
        if why is None:
            return None
        if passed is not None:
            passed.release(0)
        reply = fmt.error_reply(503, why)
        self._refused(
            fmt, "unavailable", FailureReason.NO_WORKER, started_at, reply, headers, request_ids=ids
        )
        return http_response(reply, (("Retry-After", "1"),))

    def _preemptible(self, parsed: GenerateCall, model: str) -> bool:
        """Whether admission may preempt this request (when preemption is on): every
        sub-request can resume from its delivered tokens (no guided decoding, no ``n > 1``),
        and the model is not served disaggregated (not preempted in this version)."""
        assert self.gate is not None
        if self.gate.config.preempt_after is None:
            return False
        if self.workers.has_serving("prefill", model):
            return False
        return all(resume_refusal(sub_request) is None for sub_request in parsed.requests)

    def _left_while_queued(self, fmt: Format, parsed: GenerateCall, started_at: float, who: Who) -> None:
        """The client left while its request waited for admission (no engine saw it): counted
        and logged as any request whose client left."""
        ids = sorted({r.request_id for r in parsed.requests})
        self._refused(
            fmt,
            "disconnected",
            "CLIENT_GONE",
            started_at,
            None,
            {},
            request_ids=ids,
            tenant=who.tenant,
            urgency=who.urgency,
            queued=True,
        )

    def _admission_refused(
        self,
        fmt: Format,
        parsed: GenerateCall,
        started_at: float,
        headers: Mapping[str, str],
        who: Who,
        refused: Refused,
    ) -> web.Response:
        """A 429 or 503 in the format's shape, with ``Retry-After`` and the reason in a header
        and in the words; one ``request`` line with the tenant and the measured values."""
        status = REFUSAL_STATUS[refused.reason]
        words = {
            RefusalReason.QUEUE_FULL: "too many requests are waiting",
            RefusalReason.QUEUE_TIMEOUT: "no worker had room in time",
            RefusalReason.QUEUE_PUSHED_OUT: "too many requests of this tenant are waiting",
            RefusalReason.RATE_LIMITED: "over the rate limit",
            RefusalReason.NO_CAPACITY: "no capacity",
        }[refused.reason]
        reply = fmt.error_reply(status, f"{words} ({refused.reason.value.lower()}): {refused.detail}")
        ids = sorted({r.request_id for r in parsed.requests})
        self._refused(
            fmt,
            "refused",
            refused.reason,
            started_at,
            reply,
            headers,
            request_ids=ids,
            tenant=who.tenant,
            urgency=who.urgency,
            retry_after=refused.retry_after,
        )
        return http_response(reply, refusal_headers(refused))

    def _invalid(
        self,
        fmt: Format,
        started_at: float,
        reply: HttpReply,
        headers: Mapping[str, str],
        body: bytes,
        data: object = None,
    ) -> web.Response:
        """A refusal of the request itself (a 404: the model it names is served by no worker)."""
        reason = RefusalReason.MODEL_NOT_FOUND if reply.status == 404 else RefusalReason.INVALID_REQUEST
        self._refused(fmt, "invalid", reason, started_at, reply, headers, body, data)
        return http_response(reply)

    def _refused(
        self,
        fmt: Format,
        outcome: str,
        reason: FailureReason | RefusalReason | str,
        started_at: float,
        reply: HttpReply | None,
        headers: Mapping[str, str],
        body: bytes = b"",
        data: object = None,
        request_ids: Sequence[str] = (),
        **measured: object,
    ) -> None:
        """The metrics and the one ``request`` line of a request that ended without a worker:
        why (the reason and, when it was answered, the words the client got; ``reply`` None:
        its client left first) and the request's id (``data``: the body as the format parsed
        it, if it did)."""
        duration = self.clock() - started_at
        why = reason if isinstance(reason, str) else reason.value
        answer = {} if reply is None else {"status": reply.status, "error": _reply_message(reply)}
        if self.metrics is not None:
            self.metrics.request(
                fmt.name,
                outcome,
                why,
                prompt_tokens=0,
                completion_tokens=0,
                ttft=None,
                duration=duration,
            )
        ids = list(request_ids) or _client_request_ids(body, data, headers)
        log.info(
            "request",
            format=fmt.name,
            request_id=(ids[0] if len(ids) == 1 else ids) if ids else None,
            outcome=outcome,
            reason=why,
            **answer,
            duration_ms=ms(duration),
            **measured,
        )


def _consume_priority(parsed: GenerateCall, model: sidecar_pb2.ModelInfo | None) -> None:
    """The admission queue honoured the request's priority. vLLM's gRPC wire cannot carry one
    (its sidecar refuses a priority other than 0), so on a vLLM worker the engine then schedules
    the request at its default: the field is taken off rather than refused. SGLang's wire
    carries it: its engine's own priority scheduling (when on) sees it too."""
    if model is not None and model.engine == "vllm":
        for sub_request in parsed.requests:
            sub_request.routing.ClearField("priority")


async def _read_body(request: web.Request) -> bytes | None:
    """The body, or None when it is larger than the app's ``client_max_size``."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        return None


def _client_request_ids(body: bytes, data: object, headers: Mapping[str, str]) -> list[str]:
    """The id a refused request's client gave, if any: vLLM's ``X-Request-Id`` header or
    ``request_id``, SGLang's ``rid`` (a string or a list of them). Read only on refusals:
    from ``data``, the body the format parsed, when that is a JSON object; else from the
    bytes (a body the format refused before parsing it, or did not parse as JSON)."""
    header = next((v for k, v in headers.items() if k.lower() == "x-request-id"), None)
    if header:
        return [header]
    if not isinstance(data, dict):
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
