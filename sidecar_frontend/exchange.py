"""One HTTP generate request, the HTTP side: its lifecycle, fan-out, writes, log line, metrics.

An :class:`Exchange` runs every sub-request of a parsed :class:`GenerateCall` concurrently (one
task group per HTTP request: the n > 1 choices of vLLM, the prompts of an SGLang batch), each
on the :class:`~sidecar_frontend.attempt_runner.AttemptRunner`, feeds every output to the
format's encoder and writes what it returns (SSE: chunked, one write per event; unary: the
encoder's reply at the end). It knows no format and no worker.

Cancellation, owned here:
- the client goes away: aiohttp cancels the handler; the task group cancels each gRPC call,
  and the sidecar aborts the engine request (exactly once: that is the sidecar's rule);
- ``request_timeout``: the same cancellation, then ``encoder.on_failure(DEADLINE)`` for each
  sub-request still running;
- abort by id (:class:`AbortRegistry`): every sub-request in flight under that public id
  (whichever client and worker) has its call cancelled, then ``encoder.on_failure(CANCELLED)``.
  Cancelling the call is enough: the sidecar aborts on cancel. A call that asked its worker
  for one answer (a non-streaming request) is not cancelled: its sidecar gets an ``Abort``
  and the engine's answer, with the tokens made so far, reaches the client (the handler sends
  those, :class:`AnsweredAbort`); it is cancelled after a grace if no answer came.
- preemption (admission took the request's slots back for a more urgent one, ``preempt``):
  every sub-request's current attempt is cancelled the same way, and each waits for the
  request's readmission (its ``admission``), then goes on from what it delivered: the client
  sees a pause, never an error.

A client that reads slower than the stream comes (backpressure, owned here): each stream's
HTTP transport buffers at most :data:`STREAM_WRITE_BUFFER` bytes before it pauses (plus the
event that crossed the mark). While it is paused, an encoder that can hold
(``base.HoldingEncoder``) takes up to :data:`HOLD_TOKENS` tokens into its state without
writing them, and one task waits for the client to read everything, then writes what was held,
one event per choice carrying all of it; past :data:`HOLD_TOKENS` (or with an encoder that
cannot hold, after any write into a paused transport) the output's delivery waits for the
client, so the attempt runner stops reading the worker's gRPC stream: grpc's flow control
(a fixed per-stream window, ``sidecar_common.pool``) then stops the sidecar, whose relay
buffer is bounded (``sidecar_server.relay``) and stops reading the engine. A client that keeps
up never pauses the transport, so its events are written as they come, one per output.

Whatever fails inside (an output the format cannot encode, a bug), the response ends: a
streamed one is ended (its chunked body finished) and the request is recorded ``error``,
never ``ok``; each such failure is logged with its traceback.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, KeysView
from dataclasses import dataclass, field
from typing import Final, Protocol, cast

import anyio
import structlog
from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from anyio.abc import TaskGroup

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason
from sidecar_frontend.admission.state import Preemption
from sidecar_frontend.admission.who import Who
from sidecar_frontend.attempt_runner import AttemptRunner, OutputNotEncoded, SubCall, Tally
from sidecar_frontend.attempts import Attempts
from sidecar_frontend.formats.base import (
    SSE_CONTENT_TYPE,
    AbortCall,
    Encoder,
    Format,
    GenerateCall,
    HoldingEncoder,
    HttpReply,
    WorkerFailure,
)
from sidecar_frontend.metrics import Metrics
from sidecar_frontend.workers import Worker

__all__ = [
    "HOLD_TOKENS",
    "STREAM_WRITE_BUFFER",
    "AbortRegistry",
    "AnsweredAbort",
    "Exchange",
    "Readmission",
    "http_response",
    "ms",
]

# A stream's HTTP transport pauses once it buffers more than this (asyncio's default mark), and
# resumes once the client has read all of it.
STREAM_WRITE_BUFFER: Final = 64 * 1024
# Tokens an encoder may hold for a paused client before the delivery waits for the client.
HOLD_TOKENS: Final = 256

log = structlog.get_logger("sidecar_frontend.handler")


class AbortRegistry:
    """The sub-requests in flight, by the public id a client can abort them by."""

    def __init__(self) -> None:
        self._by_id: dict[str, set[SubCall]] = {}

    def add(self, sub: SubCall) -> None:
        self._by_id.setdefault(sub.public_id, set()).add(sub)

    def discard(self, sub: SubCall) -> None:
        subs = self._by_id.get(sub.public_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._by_id[sub.public_id]

    def ids(self) -> KeysView[str]:
        """The ids in flight: a live view (what is added or discarded later shows in it)."""
        return self._by_id.keys()

    def abort(self, call: AbortCall, now: float, grace: float) -> tuple[int, list[AnsweredAbort]]:
        """Abort every sub-request in flight under the ids ``call`` names
        (:meth:`SubCall.abort_for_answer`): how many, and the aborts to send to sidecars so
        that calls asking for one answer still get it."""
        if call.all_requests:
            targets = [sub for subs in self._by_id.values() for sub in subs]
        elif call.by_prefix:
            named = {rid for rid in call.request_ids if rid in self._by_id}
            targets = [
                sub
                for public_id, subs in self._by_id.items()
                if any(public_id.startswith(rid) for rid in named)
                for sub in subs
            ]
        else:
            targets = [sub for rid in call.request_ids for sub in self._by_id.get(rid, ())]
        answered = []
        for sub in targets:
            unary = sub.abort_for_answer(now, grace)
            if unary is not None:
                answered.append(AnsweredAbort(sub, *unary))
        return len(targets), answered


@dataclass(frozen=True)
class AnsweredAbort:
    """An Abort to send to ``worker`` for the call ``request_id`` of ``sub``; if it cannot be
    sent, ``sub`` is cancelled instead (:meth:`SubCall.abort`)."""

    sub: SubCall
    worker: Worker
    request_id: str


class Readmission(Protocol):
    """The request's admission, as far as a preemption goes and its log line tells (the gate's
    ``Pass``)."""

    # Who it is (tenant, urgency) and the seconds it waited in the queue before it ran.
    who: Who
    waited: float

    @property
    def preemption(self) -> Preemption | None:
        """Why its slots were taken back, until it is admitted again."""

    async def readmit(self) -> bool:
        """Wait until admitted again (at once when not preempted); False: never (shutdown)."""


@dataclass(eq=False)
class Exchange:
    """One HTTP generate request: its sub-requests, its encoder, its response."""

    runner: AttemptRunner
    registry: AbortRegistry
    fmt: Format
    call: GenerateCall
    encoder: Encoder
    started_at: float
    model: str = ""  # what every sub-request runs on (its workers serve it)
    # Its sub-requests go on after their engine aborted them on their own (resume.py).
    resume_on_abort: bool = False
    request_timeout: float | None = None
    metrics: Metrics | None = None
    clock: Callable[[], float] = time.monotonic
    response: web.StreamResponse | None = None
    ended: list[bool] = field(default_factory=list)
    attempts: list[Attempts] = field(default_factory=list)
    tally: Tally = field(default_factory=Tally)
    first_output_at: float | None = None
    outcome: str = "ok"
    reason: str = "NONE"  # why it did not end ok (a failure reason, or the frontend's own)
    client_gone: bool = False
    # One cancel scope per piece of the run (each sub-request, a flush of held tokens): a stop
    # cancels them all (see _own_scope).
    _owned: list[anyio.CancelScope] = field(default_factory=list)
    _run_stopped: bool = False  # stop(), the client leaving or an abort: every owned scope cancelled
    _run_deadline: float = float("inf")
    _aborting: bool = False  # the encoder ended the response: the other pieces were cancelled
    _pieces_left: int = 0  # sub-requests in tasks of their own still running
    _pieces_done: asyncio.Event | None = None  # set when none is left (made only if there are)
    _stop_failure: WorkerFailure | None = None
    _write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _group: TaskGroup | None = None
    _http_request: web.Request | None = None
    # A stream refused before its first bytes, answered as a plain reply (see
    # GenerateCall.refused_before_stream).
    refused_before_stream: bool = False
    # Its admission, when admission is on (set before serve).
    admission: Readmission | None = None
    # Its sub-requests running now.
    _subs: set[SubCall] = field(default_factory=set)
    # Backpressure (module docstring). What the stream's transport held after a write, at most
    # (the figure a test of a stalled client reads); how often a write waited for the client.
    peak_buffered: int = 0
    reader_waits: int = 0
    # Tokens the encoder holds for the paused client now, and the task that writes them.
    held_tokens: int = 0
    _flushed: asyncio.Event | None = None
    _holder: HoldingEncoder | None = None
    # The stream's connection, once its response started.
    _protocol: BaseProtocol | None = None
    _transport: asyncio.Transport | None = None

    def __post_init__(self) -> None:
        # Its methods looked up rather than isinstance on the runtime-checkable protocol,
        # which costs ~15 µs a request.
        encoder = self.encoder
        if callable(getattr(encoder, "hold", None)) and callable(getattr(encoder, "flush", None)):
            self._holder = cast(HoldingEncoder, encoder)

    @property
    def format_name(self) -> str:
        return self.fmt.name

    def stop(self, failure: WorkerFailure, outcome: str) -> None:
        """End the exchange: cancel what runs, report ``failure`` for it."""
        if self._stop_failure is None:
            self._stop_failure = failure
            self.outcome = outcome
            self.reason = failure.reason.value
        self._cancel_run()

    def _own_scope(self, *, task: bool) -> anyio.CancelScope:
        """The cancel scope of one piece of the run, with the request's deadline. A stop cancels
        these, never a scope around them: a child task that ends cancelled leaves anyio (4.16)
        a reference cycle holding its whole stack (the CancelledError its task group's callback
        keeps), garbage for the collector, whose passes stop every stream
        (test_request_cycles.py); a child whose own scope caught the cancel ends normally. So a
        piece in a task of its own (``task``) is shielded from the task group's cancel too
        (a cancel visible from outside would pass its own scope), and :meth:`_run_all` stops
        every piece itself when the run ends early."""
        scope = anyio.CancelScope(deadline=self._run_deadline, shield=task)
        if self._run_stopped:
            scope.cancel()
        self._owned.append(scope)
        return scope

    def _cancel_run(self) -> None:
        self._run_stopped = True
        for scope in self._owned:
            scope.cancel()

    def preempt(self, cause: Preemption) -> None:
        """Admission took the request's slots back: each running sub-request stops its attempt
        (its engine request aborted) and waits to be admitted again (``attempt_runner.py``)."""
        for sub in list(self._subs):
            sub.preempt(cause)

    @property
    def preemption(self) -> Preemption | None:
        return None if self.admission is None else self.admission.preemption

    async def readmit(self) -> bool:
        return True if self.admission is None else await self.admission.readmit()

    async def serve(self, request: web.Request) -> web.StreamResponse:
        call = self.call
        count = len(call.requests)
        self.ended = [False] * count
        self.attempts = [self.runner.attempts(r) for r in call.requests]
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
            return http_response(reply, call.headers)
        except (asyncio.CancelledError, ConnectionError):
            self.client_gone = True
            self.outcome, self.reason = "disconnected", "CLIENT_GONE"
            raise
        except Exception as exc:
            # A bug: never a request that ended well, and never a stream left open.
            self.outcome, self.reason = "error", FailureReason.UNKNOWN.value
            if self.response is None or self.client_gone:
                raise  # nothing was sent: the handler answers its 500
            log.error("request failed in the frontend: stream ended", request_id=self._ids(), exc_info=exc)
            status = self.response.status
            try:
                await self.response.write_eof()
            except ConnectionError:
                self.client_gone = True
            return self.response
        finally:
            self._log(status)

    async def deliver(self, index: int, output: sidecar_pb2.LLMEngineOutput) -> None:
        now = self.clock()
        if self.first_output_at is None:
            self.first_output_at = now
        holder = self._holder
        hold = holder is not None and self._paused()
        try:
            if hold:
                assert holder is not None
                data = holder.hold(index, output, now)
            else:
                data = self.encoder.on_output(index, output, now)
        except Exception as exc:
            # The runner reports it as the worker's (logged at error, rate-limited per worker):
            # the traceback is here for whoever debugs the format.
            log.debug("output not encoded", request_id=self.call.requests[index].request_id, exc_info=exc)
            raise OutputNotEncoded(
                f"{self.fmt.name} could not encode an output: {type(exc).__name__}: {exc}"
            ) from exc
        if hold:
            await self._held(len(output.token_ids), data)
        elif data:
            await self._write(data)

    def _paused(self) -> bool:
        """The client is behind: the stream's transport paused (it holds more than it should)."""
        protocol = self._protocol
        return protocol is not None and protocol.writing_paused

    async def _held(self, tokens: int, data: bytes) -> None:
        """The encoder took an output while the client is behind: a task writes what it holds
        once the client has read the rest; past HOLD_TOKENS this delivery waits for that."""
        self.held_tokens += tokens
        flushed = self._flushed
        if flushed is None and self._group is not None:
            flushed = self._flushed = asyncio.Event()
            self._group.start_soon(self._flush_owned, flushed)
        if data:
            await self._write(data)  # a choice's end: it never waits in the encoder
        if flushed is not None and self.held_tokens >= HOLD_TOKENS:
            await flushed.wait()

    async def _flush_owned(self, flushed: asyncio.Event) -> None:
        # One per pause of a slow client, so not kept: whether the run was stopped is read
        # from the sub-requests' scopes.
        with self._own_scope(task=True) as scope:
            await self._flush_when_read(flushed)
        self._owned.remove(scope)

    async def _flush_when_read(self, flushed: asyncio.Event) -> None:
        assert self._holder is not None
        assert self._http_request is not None
        try:
            self.reader_waits += 1
            await self._http_request.writer.drain()
        except ConnectionError:
            self._client_left()
        finally:
            self._flushed = None
            self.held_tokens = 0
            flushed.set()
        await self._write(self._holder.flush(self.clock()))

    async def _run_all(self) -> None:
        timeout = self.request_timeout
        if timeout is not None:
            self._run_deadline = anyio.current_time() + timeout
        async with anyio.create_task_group() as group:
            self._group = group  # for sub-requests, and for a flush of held tokens
            try:
                if len(self.call.requests) == 1:
                    # The common case runs in this task: no task to start.
                    with self._own_scope(task=False):
                        await self._run_one(0, self.call.requests[0])
                else:
                    # This task waits for them here, inside the task group's body, so that its
                    # own cancel reaches the handler below before the group's __aexit__.
                    done = self._pieces_done = asyncio.Event()
                    self._pieces_left = len(self.call.requests)
                    for index, sub_request in enumerate(self.call.requests):
                        group.start_soon(self._run_owned, index, sub_request)
                    await done.wait()
            except BaseException:
                # This task was cancelled (the client left: aiohttp cancels its handler) or a
                # piece failed: every piece stops by its own scope, before the task group's
                # cancel (which the shielded pieces do not see).
                self._cancel_run()
                raise
        stopped = any(scope.cancelled_caught for scope in self._owned) and not self._aborting
        if stopped and not self.client_gone:
            failure = self._stop_failure
            if failure is None:
                failure = WorkerFailure.of(FailureReason.DEADLINE, f"request timed out after {timeout:g}s")
                self.outcome, self.reason = "timeout", failure.reason.value
            for index, ended in enumerate(self.ended):
                if not ended and not self.encoder.aborted:
                    self.ended[index] = True
                    await self._write_failure(index, failure)

    async def _run_owned(self, index: int, request: sidecar_pb2.PreprocessedRequest) -> None:
        try:
            with self._own_scope(task=True):
                await self._run_one(index, request)
        finally:
            self._pieces_left -= 1
            if self._pieces_left == 0 and self._pieces_done is not None:
                self._pieces_done.set()

    async def _run_one(self, index: int, request: sidecar_pb2.PreprocessedRequest) -> None:
        sub = SubCall(request.request_id, index, self.attempts[index], resume_on_abort=self.resume_on_abort)
        self.registry.add(sub)
        self._subs.add(sub)
        try:
            failure = await self.runner.run(sub, self)
        except Exception as exc:
            # A bug in the runner or below: this sub-request fails as such, the others go on.
            log.error(
                "sub-request failed in the frontend",
                request_id=request.request_id,
                workers=self.tally.workers,
                exc_info=exc,
            )
            failure = WorkerFailure.of(
                FailureReason.UNKNOWN, f"internal error in the frontend: {type(exc).__name__}"
            )
        finally:
            sub.scope = None
            self.registry.discard(sub)
            self._subs.discard(sub)
        self.ended[index] = True
        if failure is not None:
            if failure.reason is FailureReason.CANCELLED and sub.aborted and self.outcome == "ok":
                self.outcome, self.reason = "aborted", failure.reason.value
            elif self.outcome == "ok":
                self.outcome = "unavailable" if failure.reason is FailureReason.NO_WORKER else "error"
                self.reason = failure.reason.value
            if not self.encoder.aborted:
                await self._write_failure(index, failure)
            if self.encoder.aborted and not self._aborting:
                # The response is over: the other pieces stop (each by its own scope).
                self._aborting = True
                self._cancel_run()

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
        transport = self._http_request.transport
        if transport is not None:
            # Paused past the mark; resumed only once the client read everything, so that what
            # was held while it was behind goes out in as few events as possible.
            transport.set_write_buffer_limits(high=STREAM_WRITE_BUFFER, low=0)
            self._transport = transport
            self._protocol = self._http_request.protocol
        self.response = response

    async def _write_failure(self, index: int, failure: WorkerFailure) -> None:
        data = self.encoder.on_failure(index, failure, self.clock())
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
            transport, protocol = self._transport, self._protocol
            if transport is not None:
                buffered = transport.get_write_buffer_size()
                if buffered > self.peak_buffered:
                    self.peak_buffered = buffered
            if self._holder is None and protocol is not None and protocol.writing_paused:
                # An encoder that cannot hold: this delivery waits for the client.
                assert self._http_request is not None
                self.reader_waits += 1
                await self._http_request.writer.drain()
        except ConnectionError:
            self._client_left()

    def _client_left(self) -> None:
        """The client is gone: stop every sub-request (their calls are cancelled)."""
        self.client_gone = True
        self.outcome, self.reason = "disconnected", "CLIENT_GONE"
        self._cancel_run()

    def used_tokens(self) -> int:
        """Prompt and completion tokens of every sub-request so far: what it really cost."""
        prompt = sum(len(r.token_ids) for r in self.call.requests)
        return prompt + sum(a.progress.completion_tokens() for a in self.attempts)

    def _log(self, status: int) -> None:
        duration = self.clock() - self.started_at
        prompt = sum(len(r.token_ids) for r in self.call.requests)
        completion = sum(a.progress.completion_tokens() for a in self.attempts)
        ttft = None if self.first_output_at is None else self.first_output_at - self.started_at
        if self.metrics is not None:
            self.metrics.request(
                self.fmt.name,
                self.outcome,
                self.reason,
                prompt_tokens=prompt,
                completion_tokens=completion,
                ttft=ttft,
                duration=duration,
            )
        log.info(
            "request",
            format=self.fmt.name,
            request_id=self._ids(),
            model=self.model,
            stream=self.call.stream,
            sub_requests=len(self.call.requests),
            outcome=self.outcome,
            reason=self.reason,
            status=status,
            prompt_tokens=prompt,
            completion_tokens=completion,
            ttft_ms=None if ttft is None else ms(ttft),
            duration_ms=ms(duration),
            workers=sorted(set(self.tally.workers)),
            retries=self.tally.retries,
            migrations=self.tally.migrations,
            preemptions=self.tally.preemptions,
            **self._admission_fields(),
        )

    def _admission_fields(self) -> dict[str, object]:
        """Its tenant, urgency and wait in the admission queue (nothing with admission off): a
        slow first token is then told apart as queueing or serving."""
        admission = self.admission
        if admission is None:
            return {}
        return {
            "tenant": admission.who.tenant,
            "urgency": admission.who.urgency,
            "queued_ms": ms(admission.waited),
        }

    def _ids(self) -> str | list[str]:
        ids = sorted({r.request_id for r in self.call.requests})
        return ids[0] if len(ids) == 1 else ids


def http_response(reply: HttpReply, extra: Iterable[tuple[str, str]] = ()) -> web.Response:
    response = web.Response(status=reply.status, body=reply.body)
    if reply.body or reply.content_type:
        response.headers["Content-Type"] = reply.content_type
    for name, value in (*reply.headers, *extra):
        response.headers[name] = value
    return response


def ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)
