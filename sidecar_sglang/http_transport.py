"""SGLang's native HTTP API as a transport: ``POST /generate`` as Server-Sent Events (or, for
one answer, one JSON body), the info endpoints, ``/abort_request``, ``/health`` and
``/v1/loads``.

I/O and framing only: the request body is :func:`~sidecar_sglang.convert_request.to_http_json`'s,
:mod:`sidecar_sglang.sse` frames the byte stream, each event's JSON becomes a
:class:`NativeEvent`; a non-streaming request's answer is one JSON object, the one event. The
rules are :class:`SglangEngine`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Final

import aiohttp
import anyio
import structlog

from sidecar_common.endpoint import Endpoint
from sidecar_common.errors import FailureReason, SidecarError, protocol_error
from sidecar_common.pool import Clock, Deadline, NotReady, RetryPolicy, SystemClock, is_transient
from sidecar_common.tracing import outgoing_headers
from sidecar_server.config import SidecarConfig
from sidecar_server.engine import HEALTHY, EngineHealth, FlushOutcome
from sidecar_server.engine_client import EngineTimeouts
from sidecar_server.engine_state import EngineStatus, sglang_http_paused, weight_version_of
from sidecar_sglang.convert_request import NativeRequest, Transport, to_http_json
from sidecar_sglang.convert_response import NativeEvent, answer_error, error_from_http_status, event_from_http
from sidecar_sglang.engine import SglangEngine, random_room
from sidecar_sglang.sse import SseParser
from sidecar_sglang.transport import EngineFacts, StreamCut

__all__ = ["HTTP_TIMEOUTS", "HttpTransport", "over_http"]

_log = structlog.get_logger(__name__)

# SGLang's /health runs a one-token generation and looks for its answer only after sleeping
# one second, so it never answers in less than about 1 s: the shared 1.5 s left a loaded
# machine half a second of slack.
HTTP_TIMEOUTS: Final = EngineTimeouts(health=3.0)
# After the terminal, how long to wait for SGLang's ``[DONE]`` so the connection can be
# reused; past it the connection is closed instead.
_TRAILER_TIMEOUT: Final = 1.0
_ERROR_BODY_LIMIT: Final = 64 * 1024
_ERROR_BODY_TIMEOUT: Final = 5.0
_CONTROL_CONNECTIONS: Final = 4


def over_http(
    config: SidecarConfig,
    endpoint: Endpoint,
    *,
    clock: Clock | None = None,
    room: Callable[[], int] = random_room,
    timeouts: EngineTimeouts | None = None,
    vocab_size: int | None = None,
) -> SglangEngine:
    """The SGLang engine whose HTTP server (``--port``) is at ``endpoint``."""
    transport = HttpTransport(endpoint, config.pool.retry, clock=clock)
    return SglangEngine(
        config, transport, room=room, timeouts=timeouts or HTTP_TIMEOUTS, vocab_size=vocab_size
    )


def _error_words(body: bytes) -> str:
    """The message of an SGLang/FastAPI error body, else the body itself (shortened)."""
    text = body[:_ERROR_BODY_LIMIT].decode("utf-8", errors="replace")
    try:
        payload = json.loads(text)
    except ValueError:
        return text.strip()[:500] or "no details"
    if isinstance(payload, dict):
        for key in ("error", "detail", "message"):
            value = payload.get(key)
            if isinstance(value, dict) and "message" in value:
                return str(value["message"])
            if value is not None:
                return str(value)
    return text.strip()[:500]


def _json_or_none(body: bytes) -> object:
    """The JSON value of ``body``, or None when it is none (an empty or garbled body)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None


class _NotHealthy(NotReady):
    """``/health`` answered 5xx (SGLang's 503 while it starts): retried within the start-up
    deadline."""


class HttpTransport:
    """One SGLang HTTP server, through one aiohttp session for the generations and a small one
    for control calls."""

    def __init__(self, endpoint: Endpoint, retry: RetryPolicy, *, clock: Clock | None = None) -> None:
        self._base = endpoint.http_base_url
        self._retry = retry
        self.clock: Clock = clock or SystemClock()
        self.target = self._base
        self.host = endpoint.host
        self._session: aiohttp.ClientSession | None = None
        self._control_session: aiohttp.ClientSession | None = None

    kind: Transport = "http"
    health_call = "GET /health"
    # The response status says the engine admitted the generation, before its first event.
    handoff_on_admission = True

    def _new_session(self, limit: int) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=limit),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._retry.attempt_timeout),
        )

    def _http(self) -> aiohttp.ClientSession:
        """Generations: HTTP/1.1 holds one connection per stream, so any cap here would queue
        generations inside the sidecar, invisible to the engine's scheduler (which is where
        admission belongs). Hence no connection limit (aiohttp's 0)."""
        if self._session is None:
            self._session = self._new_session(0)
        return self._session

    def _control(self) -> aiohttp.ClientSession:
        """Aborts, health, load and discovery on connections of their own: an abort must not
        wait behind the very streams it is meant to stop."""
        if self._control_session is None:
            self._control_session = self._new_session(_CONTROL_CONNECTIONS)
        return self._control_session

    # ------------------------------------------------------------------- start-up and health

    def is_starting(self, error: BaseException) -> bool:
        """The shared rule, plus aiohttp's connection and truncated-body errors (an engine
        restarting under us)."""
        return is_transient(error) or isinstance(
            error, aiohttp.ClientConnectionError | aiohttp.ClientPayloadError
        )

    async def connect(self, deadline: Deadline) -> None:
        del deadline  # a connection is opened per call

    async def check_health(self, timeout: float) -> None:
        try:
            await self._health_check(timeout)
        except aiohttp.ClientResponseError as err:
            # No HTTP/1.1 answer at all (aiohttp could not parse a status line): a server of
            # another protocol, typically SGLang's gRPC port. A definite answer, not a
            # starting engine.
            first_line = " ".join(line.strip() for line in (err.message or "no status line").splitlines()[:2])
            raise protocol_error(
                "sglang",
                f"GET {self._base}/health: the server does not speak HTTP/1.1 ({first_line}); "
                "is this SGLang's gRPC port? Over HTTP, --http-endpoint is SGLang's HTTP server (--port)",
            ) from None

    async def _health_check(self, timeout: float) -> None:
        # asyncio's own timeout: the server's health watch runs this in a plain asyncio task
        # (see sidecar_common.rpc.probe).
        async with asyncio.timeout(timeout):
            async with self._control().get(f"{self._base}/health") as resp:
                if resp.status >= 500:
                    raise _NotHealthy(f"GET /health answered HTTP {resp.status}")
                if resp.status != 200:
                    # A definite answer, not a starting engine: no SGLang server there.
                    raise protocol_error("sglang", f"GET {self._base}/health answered HTTP {resp.status}")
                await resp.read()

    async def probe_health(self, timeout: float) -> EngineHealth:
        try:
            await self.check_health(timeout)
        except TimeoutError:
            # Late, not unhealthy (the server's watch tells the two apart).
            raise TimeoutError(f"GET /health: no answer within {timeout:g}s") from None
        except (aiohttp.ClientError, _NotHealthy) as err:
            return EngineHealth.unhealthy(f"GET /health: {err}")
        except SidecarError as err:
            return EngineHealth.unhealthy(err.message)
        return HEALTHY

    async def engine_facts(self, deadline: Deadline) -> EngineFacts:
        model = await self._get_json(("/model_info", "/get_model_info"), deadline)
        server = await self._get_json(("/server_info", "/get_server_info"), deadline)
        try:
            listed = await self._get_json(("/v1/models",), deadline)
        except SidecarError as err:
            # Without the model list the context length comes from server info instead.
            if err.reason is not FailureReason.INVALID_ARGUMENT:
                raise
            _log.warning("sglang /v1/models unavailable", error=err.message)
            listed = []
        if not isinstance(model, dict) or not isinstance(server, dict):
            raise protocol_error("sglang", "model or server info is not a JSON object")
        cards = listed.get("data", []) if isinstance(listed, dict) else listed
        return EngineFacts(
            model, server, [c for c in cards if isinstance(c, dict)] if isinstance(cards, list) else []
        )

    async def _get_json(
        self, paths: tuple[str, ...], deadline: Deadline | None, timeout: float = 0.0
    ) -> object:
        """GET the first of ``paths`` that exists (older servers only have the deprecated ones)."""
        if deadline is not None:
            timeout = min(self._retry.attempt_timeout, deadline.remaining())
        path, status, body = await self._control_call("GET", paths, timeout)
        if status != 200:
            raise error_from_http_status(status, _error_words(body), rpc=f"GET {path}")
        try:
            return json.loads(body)
        except ValueError:
            raise protocol_error("sglang", f"GET {path} is not JSON") from None

    # ------------------------------------------------------------------- requests

    @asynccontextmanager
    async def stream(
        self, native: NativeRequest, *, cumulative: bool
    ) -> AsyncIterator[AsyncIterator[NativeEvent]]:
        del cumulative  # every HTTP event is whole JSON: nothing to carry between events
        resp: aiohttp.ClientResponse | None = None
        reusable = False
        try:
            try:
                resp = await self._http().post(
                    f"{self._base}/generate", json=to_http_json(native), headers=outgoing_headers() or None
                )
            except aiohttp.ClientError as err:
                raise SidecarError(
                    FailureReason.CANNOT_CONNECT, f"Generate: POST /generate: {err!r}"
                ) from None
            if resp.status != 200:
                body = b""
                with anyio.move_on_after(_ERROR_BODY_TIMEOUT), contextlib.suppress(aiohttp.ClientError):
                    body = await resp.content.read(_ERROR_BODY_LIMIT)
                if native.stream:
                    raise error_from_http_status(resp.status, _error_words(body))
                raise answer_error(resp.status, _json_or_none(body), _error_words(body))
            if not native.stream:
                answer = self._answer(resp)
                try:
                    yield answer
                finally:
                    await answer.aclose()
                reusable = True  # the whole body was read
                return
            parser = SseParser()
            events = self._events(resp, parser)
            try:
                yield events
            finally:
                await events.aclose()
            # Left normally: the terminal was read.
            reusable = await self._drain_trailer(resp, parser)
        finally:
            if resp is not None:
                if reusable:
                    resp.release()
                else:
                    # An unfinished body cannot go back to the pool; closing also tells SGLang
                    # the client left.
                    resp.close()

    @staticmethod
    async def _answer(resp: aiohttp.ClientResponse) -> AsyncGenerator[NativeEvent]:
        """A non-streaming request's answer: one JSON object, read whole, its one event (which
        must be the terminal: SGLang answers only once the request is over)."""
        try:
            body = await resp.read()
        except aiohttp.ClientError as err:
            error = SidecarError(
                FailureReason.ENGINE_SHUTDOWN,
                f"Generate: reading SGLang's answer failed before its end: {err!r}",
            )
            raise StreamCut(error, abort_echo=True) from err
        payload = _json_or_none(body)
        if payload is None:
            raise protocol_error("sglang", "the answer to a non-streaming request is not JSON")
        event = event_from_http(payload)
        if not event.finished:
            raise protocol_error("sglang", "the answer to a non-streaming request has no finish_reason")
        yield event

    async def _events(self, resp: aiohttp.ClientResponse, parser: SseParser) -> AsyncGenerator[NativeEvent]:
        while True:
            try:
                chunk = await resp.content.readany()
            except aiohttp.ClientError as err:
                # The cause is what an operator needs (reset, truncated body...); after our own
                # abort the read error is only its echo.
                error = SidecarError(
                    FailureReason.ENGINE_SHUTDOWN,
                    f"Generate: reading the SGLang stream failed before its terminal: {err!r}",
                )
                raise StreamCut(error, abort_echo=True) from err
            if not chunk:
                return
            for data in parser.feed(chunk):
                if data.strip() == "[DONE]":
                    raise protocol_error("sglang", "[DONE] before a terminal event")
                try:
                    payload = json.loads(data)
                except ValueError:
                    raise protocol_error("sglang", "an event is not JSON") from None
                yield event_from_http(payload)

    async def _drain_trailer(self, resp: aiohttp.ClientResponse, parser: SseParser) -> bool:
        """Read up to ``[DONE]`` after the terminal, so the connection can be reused."""
        with anyio.move_on_after(_TRAILER_TIMEOUT):
            try:
                while True:
                    chunk = await resp.content.readany()
                    if not chunk:
                        return True
                    if any(d.strip() == "[DONE]" for d in parser.feed(chunk)):
                        return await resp.content.read() == b""
            except aiohttp.ClientError:
                return False
        return False

    async def abort(self, rid: str, timeout: float) -> None:
        body = {"rid": rid, "abort_all": False}
        path, status, answer = await self._control_call("POST", ("/abort_request",), timeout, body)
        if status != 200:
            raise error_from_http_status(status, _error_words(answer), rpc=f"POST {path}")

    async def _control_call(
        self, method: str, paths: tuple[str, ...], timeout: float, body: object = None
    ) -> tuple[str, int, bytes]:
        """One control call, to the first of ``paths`` that does not answer 404, all within
        ``timeout``: the path, its status and its body. No answer in time is
        CONNECTION_TIMEOUT, no connection CANNOT_CONNECT, each naming the path."""
        status, answer = 404, b""
        path = paths[0]
        try:
            with anyio.fail_after(timeout):
                for path in paths:
                    async with self._control().request(method, f"{self._base}{path}", json=body) as resp:
                        status, answer = resp.status, await resp.read()
                    if status != 404:
                        break
        except TimeoutError:
            raise SidecarError(
                FailureReason.CONNECTION_TIMEOUT, f"{method} {path}: no answer in {timeout:.3f}s"
            ) from None
        except aiohttp.ClientError as err:
            raise SidecarError(FailureReason.CANNOT_CONNECT, f"{method} {path}: {err!r}") from None
        return path, status, answer

    async def load(self, timeout: float) -> object:
        return await self._get_json(("/v1/loads",), None, timeout)

    async def engine_status(self, timeout: float) -> EngineStatus:
        """``/ready`` (then, when not ready, ``/ping``) and ``/model_info``'s weight version:
        SGLang's flag checks, which a pause leaves answering at once (never ``/health``, whose
        generation a pause holds)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        _, ready, _ = await self._control_call("GET", ("/ready",), timeout)
        ping = 0
        if ready != 200:
            _, ping, _ = await self._control_call("GET", ("/ping",), max(0.0, deadline - loop.time()))
        info = await self._get_json(
            ("/model_info", "/get_model_info"), None, max(0.0, deadline - loop.time())
        )
        version = weight_version_of(info) if isinstance(info, dict) else None
        return EngineStatus(paused=sglang_http_paused(ready, ping), weight_version=version)

    async def flush_cache(self, timeout: float) -> FlushOutcome:
        """``POST /flush_cache``: 200 flushed, 400 refused, each with SGLang's text."""
        path, status, answer = await self._control_call("POST", ("/flush_cache",), timeout)
        words = answer[:_ERROR_BODY_LIMIT].decode("utf-8", errors="replace").strip()
        if status == 200:
            return FlushOutcome(True, words)
        if status == 400:
            return FlushOutcome(False, words or "Flush cache failed.")
        raise error_from_http_status(status, _error_words(answer), rpc=f"POST {path}")

    async def close(self) -> None:
        sessions = (self._session, self._control_session)
        self._session = self._control_session = None
        for session in sessions:
            if session is not None:
                await session.close()
