"""The in-flight registry: private ids, cancellation by public id, and abort-exactly-once.

Pure parts (``make_private_id``, ``ChoiceTracker``) are separated from the
I/O parts (``Registry``, ``Generation``) so that the id and stream rules are property-tested.

The abort rule (docs/architecture.md): a generation that ends without every choice's
terminal is aborted on the engine exactly once, before its stream is closed; a generation
that received every terminal is never aborted.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import re
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason, SidecarError, protocol_error
from sidecar_server.engine import Engine, GenerateCall

__all__ = [
    "PRIVATE_ID_HEAD_LEN",
    "CancelCause",
    "ChoiceTracker",
    "Generation",
    "Inflight",
    "PrivateIds",
    "Registry",
    "choice_count",
    "make_private_id",
    "new_public_id",
    "run_to_completion",
]

_log = structlog.get_logger(__name__)

# 8 hex nonce + 12 hex counter: every private id starts with a head of this fixed width,
# so two different heads differ within it and no id is a prefix of another.
PRIVATE_ID_HEAD_LEN = 20
_PUBLIC_TAIL_MAX = 64
_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]")


def make_private_id(nonce: str, counter: int, public_id: str) -> str:
    """``<nonce:8 hex><counter:12 hex>-<sanitized public id, at most 64 chars>``.

    The public tail is for humans reading engine logs and for fault plans keyed on the
    request id; uniqueness and prefix-freedom come from the head alone.
    """
    if len(nonce) != 8 or counter < 0 or counter >= 1 << 48:
        raise ValueError("nonce must be 8 hex chars and counter fit in 12 hex digits")
    tail = _UNSAFE.sub("_", public_id)[:_PUBLIC_TAIL_MAX]
    return f"{nonce}{counter:012x}-{tail}"


class PrivateIds:
    """Private ids for one process: a random nonce per process, then a counter."""

    def __init__(self, nonce: str | None = None) -> None:
        self._nonce = nonce if nonce is not None else secrets.token_hex(4)
        self._counter = itertools.count()

    def next(self, public_id: str) -> str:
        return make_private_id(self._nonce, next(self._counter), public_id)


def new_public_id() -> str:
    """The id the sidecar makes when the frontend sent none."""
    return uuid.uuid4().hex


def choice_count(request: sidecar_pb2.PreprocessedRequest) -> int:
    opts = request.sampling_options
    if request.HasField("sampling_options") and opts.HasField("n") and opts.n > 0:
        return opts.n
    return 1


class ChoiceTracker:
    """The one per-choice record of a generation's stream, shared by the pump and the writer.

    The engine side (:meth:`observe`, every engine chunk) checks the stream shape every engine
    shares: a choice index in range, nothing after a choice's terminal. The frontend side
    (:meth:`delivered`, every message written) counts what the frontend was sent: tokens per
    choice (the base of the CANCELLED terminals after Abort) and terminals. Two facts differ on
    purpose: ``complete`` (every terminal arrived: never abort) and ``delivered_all`` (every
    terminal was written: the call ends OK). Counts only: no token id is kept.
    """

    __slots__ = (
        "_arrived",
        "_engine",
        "_open",
        "_sent",
        "_undelivered",
        "last_finish",
        "n",
        "saw_token_or_terminal",
        "stalled",
        "tokens",
    )

    def __init__(self, engine: str, n: int) -> None:
        self._engine = engine
        self.n = n
        self._arrived = bytearray(n)  # 1: that choice's terminal came from the engine
        self._open = n  # choices whose terminal has not arrived
        self._sent = bytearray(n)  # 1: that choice's terminal was written to the frontend
        self._undelivered = n
        self.tokens = [0] * n  # tokens written to the frontend, per choice
        self.saw_token_or_terminal = False
        self.last_finish: int = sidecar_pb2.UNSPECIFIED
        # A write never completed and was cut: the frontend stopped reading. Nothing more can
        # be written on this call (grpc still holds that message), only its status.
        self.stalled = False

    @property
    def complete(self) -> bool:
        """Every choice's terminal arrived from the engine: the engine request is over."""
        return self._open == 0

    @property
    def delivered_all(self) -> bool:
        """Every choice's terminal was handed to the frontend: the call's outcome is OK."""
        return self._undelivered == 0

    @property
    def completion_tokens(self) -> int:
        return sum(self.tokens)

    def observe(self, out: sidecar_pb2.LLMEngineOutput) -> None:
        """An engine chunk. Raises PROTOCOL_ERROR for one the contract does not allow."""
        # Once per engine chunk: each field is read once.
        index = out.index
        if index >= self.n:
            raise protocol_error(self._engine, f"choice index {index} with n={self.n}")
        arrived = self._arrived
        if arrived[index]:
            raise protocol_error(self._engine, f"chunk after the terminal of choice {index}")
        if out.finish_reason != sidecar_pb2.UNSPECIFIED:
            self.saw_token_or_terminal = True
            arrived[index] = 1
            self._open -= 1
        elif not self.saw_token_or_terminal and out.token_ids:
            self.saw_token_or_terminal = True

    def delivered(self, out: sidecar_pb2.LLMEngineOutput) -> None:
        """A message handed to the frontend (already checked by :meth:`observe`, or one of
        :meth:`cancelled_terminals`)."""
        index = out.index
        self.tokens[index] += len(out.token_ids)
        finish = out.finish_reason
        if finish != sidecar_pb2.UNSPECIFIED:
            self._sent[index] = 1
            self._undelivered -= 1
            self.last_finish = finish

    def last_finish_reason(self) -> str:
        """The name of the last terminal sent (a metrics label)."""
        return sidecar_pb2.FinishReason.Name(self.last_finish)  # type: ignore[arg-type]

    def cancelled_terminals(self, prompt_tokens: int) -> list[sidecar_pb2.LLMEngineOutput]:
        """One CANCELLED terminal for each choice that has not sent its own."""
        outs = []
        for index in range(self.n):
            if self._sent[index]:
                continue
            completion = self.tokens[index]
            usage = sidecar_pb2.CompletionUsage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion,
                total_tokens=prompt_tokens + completion,
            )
            outs.append(
                sidecar_pb2.LLMEngineOutput(
                    index=index, finish_reason=sidecar_pb2.CANCELLED, completion_usage=usage
                )
            )
        return outs


async def run_to_completion(cleanup: Coroutine[Any, Any, None]) -> None:
    """Run a bounded cleanup to its end even if the caller is cancelled meanwhile.

    anyio's shield stops anyio cancellations only: grpc.aio cancels a handler's task
    natively, possibly more than once, and each cancel would cut an engine abort short.
    The cleanup runs as its own task; a cancel that arrived while waiting for it is
    re-raised once it is done, also one that lands as the cleanup finishes.
    """
    task = asyncio.ensure_future(cleanup)
    cancelled = False
    while True:
        try:
            await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            cancelled = True
            if task.done():
                break
    if cancelled:
        raise asyncio.CancelledError


class CancelCause(enum.Enum):
    ABORT_RPC = "abort_rpc"
    DRAIN = "drain"


@dataclass(eq=False)
class Inflight:
    """One registered generation. ``scope`` wraps its relay; cancelling it stops the relay.

    ``answer_on_abort`` (set for a generation whose caller wants one answer): an Abort RPC asks
    the engine to end it rather than cancelling the relay, so the engine's answer, with the
    tokens made so far, still reaches the caller (as the real servers answer an aborted
    non-streaming request); the relay is cancelled if that answer has not come by a deadline."""

    public_id: str
    private_id: str
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    cause: CancelCause | None = None
    answer_on_abort: Callable[[], Awaitable[None]] | None = None

    def cancel(self, cause: CancelCause) -> None:
        if self.cause is None:
            self.cause = cause
        self.scope.cancel()

    async def end_with_answer(self, grace: float) -> None:
        """Abort on the engine and let its answer through; the relay is cancelled ``grace``
        seconds from now if it is still running (the engine did not answer its abort)."""
        if self.answer_on_abort is None:
            self.cancel(CancelCause.ABORT_RPC)
            return
        if self.cause is None:
            self.cause = CancelCause.ABORT_RPC
        self.scope.deadline = min(self.scope.deadline, anyio.current_time() + grace)
        await self.answer_on_abort()


class Registry:
    """Every generation in flight at this sidecar, by public id."""

    def __init__(self) -> None:
        self._ids = PrivateIds()
        self._entries: set[Inflight] = set()
        # Created by a waiter (so the registry can be built outside an event loop).
        self._idle: anyio.Event | None = None

    @property
    def inflight(self) -> int:
        return len(self._entries)

    def register(self, public_id: str) -> Inflight:
        entry = Inflight(public_id, self._ids.next(public_id))
        self._entries.add(entry)
        return entry

    def unregister(self, entry: Inflight) -> None:
        self._entries.discard(entry)
        if not self._entries and self._idle is not None:
            self._idle.set()
            self._idle = None

    async def abort_public(self, public_id: str, grace: float) -> int:
        """End every in-flight generation with that public id (:meth:`Inflight.end_with_answer`:
        cancelled, or aborted on the engine with ``grace`` for its answer); how many there were."""
        hits = [e for e in self._entries if e.public_id == public_id]
        for entry in hits:
            await entry.end_with_answer(grace)
        return len(hits)

    def cancel_all(self) -> int:
        entries = list(self._entries)
        for entry in entries:
            entry.cancel(CancelCause.DRAIN)
        return len(entries)

    async def wait_idle(self, seconds: float) -> bool:
        """Wait until nothing is in flight, at most ``seconds``; True if idle."""
        if not self._entries:
            return True
        if self._idle is None:
            self._idle = anyio.Event()
        idle = self._idle
        with anyio.move_on_after(seconds):
            await idle.wait()
        return not self._entries


class Generation:
    """One engine stream and the abort-exactly-once rule for its private id."""

    def __init__(
        self,
        engine: Engine,
        call: GenerateCall,
        *,
        abort_timeout: float = 5.0,
    ) -> None:
        self.engine = engine
        self.call = call
        self.tracker = ChoiceTracker(engine.name, choice_count(call.request))
        self.error: SidecarError | None = None
        self._abort_timeout = abort_timeout
        self._aborted = False
        # How the engine abort ended ("ok", "failed", "timed_out"); None: not sent.
        self.abort_outcome: str | None = None
        self._stream: AsyncIterator[sidecar_pb2.LLMEngineOutput] | None = None
        self._log = _log.bind(private_id=call.private_id, public_id=call.request.request_id)

    @property
    def private_id(self) -> str:
        return self.call.private_id

    @property
    def complete(self) -> bool:
        return self.tracker.complete

    @property
    def aborted(self) -> bool:
        return self._aborted

    @property
    def hold_pending(self) -> bool:
        """A cancel now must wait for the first token (decode half of a disaggregated pair)."""
        return (
            self.call.hold_cancel_until_first_token
            and not self.tracker.saw_token_or_terminal
            and self.error is None
        )

    def stream(self) -> AsyncIterator[sidecar_pb2.LLMEngineOutput]:
        if self._stream is None:
            self._stream = aiter(self.engine.generate(self.call))
        return self._stream

    async def abort_once(self) -> None:
        """Abort on the engine unless already done or every terminal arrived.

        Shielded and bounded: it runs in cleanup paths that are themselves being cancelled.
        """
        if self._aborted or self.tracker.complete:
            return
        self._aborted = True
        with anyio.CancelScope(shield=True), anyio.move_on_after(self._abort_timeout) as scope:
            try:
                await self.engine.abort(self.private_id)
                self.abort_outcome = "ok"
            except Exception as exc:
                # The abort is best effort: the generation is already over for the client.
                self.abort_outcome = "failed"
                error = str(exc) if isinstance(exc, SidecarError) else repr(exc)
                self._log.warning("engine abort failed", error=error)
        if scope.cancelled_caught:
            self.abort_outcome = "timed_out"
            self._log.warning("engine abort timed out", timeout=self._abort_timeout)

    async def close_stream(self) -> None:
        """Release the engine stream (after any abort). Bounded, never raises."""
        stream = self._stream
        aclose = getattr(stream, "aclose", None)
        if aclose is None:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(self._abort_timeout):
            try:
                await aclose()
            except Exception as exc:
                self._log.debug("engine stream close failed", error=repr(exc))

    def fail(self, error: SidecarError) -> None:
        if self.error is None:
            self.error = error

    def ended_early(self) -> SidecarError:
        return SidecarError(
            FailureReason.ENGINE_SHUTDOWN,
            f"{self.engine.name} stream ended before every choice finished",
        )
