"""The SGLang engine over its native HTTP API (``POST /generate`` as Server-Sent Events).

I/O only: the request body, the event rules and discovery are the same pure code the gRPC
transport uses; :mod:`sidecar_sglang.sse` frames the byte stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Final

import aiohttp
import anyio
import structlog

from sidecar_common.api import sidecar_pb2
from sidecar_common.endpoint import Endpoint
from sidecar_common.errors import ErrorReason, SidecarError, protocol_error
from sidecar_common.pool import Clock, Deadline, NotReady, SystemClock, is_transient, retry_until_deadline
from sidecar_common.tracing import outgoing_headers
from sidecar_server.config import SidecarConfig
from sidecar_server.engine import EngineLoad, GenerateCall
from sidecar_sglang.adapter import SglangAdapterBase, random_room
from sidecar_sglang.convert_request import to_http_json
from sidecar_sglang.convert_response import error_from_http_status, event_from_http
from sidecar_sglang.discovery import discover, loads_from_json
from sidecar_sglang.sse import SseParser

__all__ = ["ABORT_TIMEOUT", "HEALTH_TIMEOUT", "LOAD_TIMEOUT", "SglangHttpEngine"]

_log = structlog.get_logger(__name__)

ABORT_TIMEOUT: Final = 2.0
# SGLang's /health runs a one-token generation and looks for its answer only after sleeping
# one second, so it never answers in less than about 1 s: 1.5 s left a loaded machine half a
# second of slack.
HEALTH_TIMEOUT: Final = 3.0
LOAD_TIMEOUT: Final = 2.0
# After the terminal, how long to wait for SGLang's ``[DONE]`` so the connection can be
# reused; past it the connection is closed instead.
_TRAILER_TIMEOUT: Final = 1.0
_ERROR_BODY_LIMIT: Final = 64 * 1024
_ERROR_BODY_TIMEOUT: Final = 5.0
_CONTROL_CONNECTIONS: Final = 4


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


class _NotHealthy(NotReady):
    """``/health`` answered 5xx (SGLang's 503 while it starts): retried within the start-up
    deadline."""


def _starting(error: BaseException) -> bool:
    """Worth another start-up attempt: the shared rule, plus aiohttp's connection and
    truncated-body errors (an engine restarting under us)."""
    return is_transient(error) or isinstance(
        error, aiohttp.ClientConnectionError | aiohttp.ClientPayloadError
    )


class SglangHttpEngine(SglangAdapterBase):
    """One SGLang engine's HTTP server (``--port``), through one aiohttp session for the
    generations and a small one for control calls."""

    def __init__(
        self,
        config: SidecarConfig,
        endpoint: Endpoint,
        *,
        clock: Clock | None = None,
        room: Callable[[], int] = random_room,
    ) -> None:
        super().__init__(config, "http", room)
        self._endpoint = endpoint
        self._base = endpoint.http_base_url
        self._clock: Clock = clock or SystemClock()
        self._session: aiohttp.ClientSession | None = None
        self._control_session: aiohttp.ClientSession | None = None
        self.health_problem: str | None = None  # why the last health probe failed

    def _new_session(self, limit: int) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=limit),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._config.pool.retry.attempt_timeout),
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

    # ------------------------------------------------------------------- start-up

    async def start(self) -> None:
        deadline = Deadline.start(self._clock, self._config.pool.startup_deadline)
        await retry_until_deadline(
            f"sglang engine {self._base} (GET /health)",
            self._health_attempt,
            deadline,
            self._config.pool.retry,
            transient=_starting,
        )
        model = await self._get_json(("/model_info", "/get_model_info"), deadline)
        server = await self._get_json(("/server_info", "/get_server_info"), deadline)
        try:
            listed = await self._get_json(("/v1/models",), deadline)
        except SidecarError as err:
            # Without the model list the context length comes from server info instead.
            if err.reason is not ErrorReason.INVALID_ARGUMENT:
                raise
            _log.warning("sglang /v1/models unavailable", error=err.message)
            listed = []
        if not isinstance(model, dict) or not isinstance(server, dict):
            raise protocol_error("sglang", "model or server info is not a JSON object")
        cards = listed.get("data", []) if isinstance(listed, dict) else listed
        self._found = discover(
            model,
            server,
            [c for c in cards if isinstance(c, dict)] if isinstance(cards, list) else [],
            expected_mode=self._config.disaggregation_mode,
            transport="http",
            engine_host=self._endpoint.host,
        )
        self._settings = self._found.settings
        _log.info(
            "sglang engine discovered",
            transport="http",
            served_model_name=self._found.model_info.served_model_name,
            incremental=self._found.incremental,
            disaggregation_mode=self._found.model_info.disaggregation_mode,
            elapsed=round(deadline.elapsed(), 3),
        )

    async def _health_attempt(self, timeout: float) -> None:
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

    async def _get_json(
        self, paths: tuple[str, ...], deadline: Deadline | None, timeout: float = 0.0
    ) -> object:
        """GET the first of ``paths`` that exists (older servers only have the deprecated ones)."""
        if deadline is not None:
            timeout = min(self._config.pool.retry.attempt_timeout, deadline.remaining())
        status, body = 404, b""
        path = paths[0]
        try:
            with anyio.fail_after(timeout):
                for path in paths:
                    async with self._control().get(f"{self._base}{path}") as resp:
                        status, body = resp.status, await resp.read()
                    if status != 404:
                        break
        except TimeoutError:
            raise SidecarError(
                ErrorReason.CONNECTION_TIMEOUT, f"GET {path}: no answer in {timeout:.3f}s"
            ) from None
        except aiohttp.ClientError as err:
            raise SidecarError(ErrorReason.CANNOT_CONNECT, f"GET {path}: {err!r}") from None
        if status != 200:
            raise error_from_http_status(status, _error_words(body), rpc=f"GET {path}")
        try:
            return json.loads(body)
        except ValueError:
            raise protocol_error("sglang", f"GET {path} is not JSON") from None

    # ------------------------------------------------------------------- requests

    async def generate(self, call: GenerateCall) -> AsyncIterator[sidecar_pb2.LLMEngineOutput]:
        pid = call.private_id
        native, state = self._open(call)
        resp: aiohttp.ClientResponse | None = None
        reusable = False
        try:
            try:
                resp = await self._http().post(
                    f"{self._base}/generate", json=to_http_json(native), headers=outgoing_headers() or None
                )
            except aiohttp.ClientError as err:
                raise SidecarError(ErrorReason.CANNOT_CONNECT, f"Generate: POST /generate: {err!r}") from None
            if resp.status != 200:
                body = b""
                with anyio.move_on_after(_ERROR_BODY_TIMEOUT), contextlib.suppress(aiohttp.ClientError):
                    body = await resp.content.read(_ERROR_BODY_LIMIT)
                raise error_from_http_status(resp.status, _error_words(body))
            if native.prefill:
                # Decode can start its KV transfer as soon as prefill is admitted.
                yield state.handoff()
            parser = SseParser()
            while True:
                try:
                    chunk = await resp.content.readany()
                except aiohttp.ClientError as err:
                    if self._live.get(pid, False):
                        # Our own abort cut the stream: the read error is its echo.
                        raise state.end_of_stream(aborted_by_us=True) from None
                    # The cause is what an operator needs (reset, truncated body...).
                    raise SidecarError(
                        ErrorReason.ENGINE_SHUTDOWN,
                        f"Generate: reading the SGLang stream failed before its terminal: {err!r}",
                    ) from err
                if not chunk:
                    raise state.end_of_stream(aborted_by_us=self._live.get(pid, False))
                for data in parser.feed(chunk):
                    if data.strip() == "[DONE]":
                        raise protocol_error("sglang", "[DONE] before a terminal event")
                    try:
                        payload = json.loads(data)
                    except ValueError:
                        raise protocol_error("sglang", "an event is not JSON") from None
                    for out in state.feed(event_from_http(payload), aborted_by_us=self._live.get(pid, False)):
                        yield out
                    if state.done:
                        break
                if state.done:
                    break
            reusable = await self._drain_trailer(resp, parser)
        finally:
            self._live.pop(pid, None)
            if resp is not None:
                if reusable:
                    resp.release()
                else:
                    # An unfinished body cannot go back to the pool; closing also tells SGLang
                    # the client left.
                    resp.close()

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

    async def abort(self, private_id: str) -> None:
        if not private_id:
            # SGLang matches rids by prefix: an empty rid would abort everything.
            return
        if private_id in self._live:
            self._live[private_id] = True
        # SGLang answers 200 for a rid it no longer knows, so a failure here is a real one:
        # raised for the dispatcher to log and count as a failed abort.
        body = {"rid": private_id, "abort_all": False}
        try:
            with anyio.fail_after(ABORT_TIMEOUT):
                async with self._control().post(f"{self._base}/abort_request", json=body) as resp:
                    answer = await resp.read()
                    status = resp.status
        except TimeoutError:
            raise SidecarError(
                ErrorReason.CONNECTION_TIMEOUT, f"POST /abort_request: no answer in {ABORT_TIMEOUT:g}s"
            ) from None
        except aiohttp.ClientError as err:
            raise SidecarError(ErrorReason.CANNOT_CONNECT, f"POST /abort_request: {err!r}") from None
        if status != 200:
            raise error_from_http_status(status, _error_words(answer), rpc="POST /abort_request")

    async def load(self) -> EngineLoad:
        return EngineLoad(ranks=loads_from_json(await self._get_json(("/v1/loads",), None, LOAD_TIMEOUT)))

    async def healthy(self) -> bool:
        try:
            await self._health_attempt(HEALTH_TIMEOUT)
        except TimeoutError:
            # Late, not unhealthy (the server's watch tells the two apart). Read by the
            # server's health watch for its log lines.
            self.health_problem = f"GET /health: no answer within {HEALTH_TIMEOUT:g}s"
            raise TimeoutError(self.health_problem) from None
        except (aiohttp.ClientError, _NotHealthy) as err:
            self.health_problem = f"GET /health: {err}"
            return False
        except SidecarError as err:
            self.health_problem = err.message
            return False
        return True

    async def close(self) -> None:
        sessions = (self._session, self._control_session)
        self._session = self._control_session = None
        for session in sessions:
            if session is not None:
                await session.close()
