"""Bookkeeping the tests read, and the scheduler's capacity (FIFO admission).

Every request is visible from arrival to its end: ``waiting`` (queued behind capacity),
``running`` (admitted, producing tokens) and ``finished`` (with how it ended). A request the
engine still runs after its client left stays in ``running``, so a leak fails a test.
"""

from __future__ import annotations

import asyncio
import enum
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["TRACE_FIELDS", "Book", "FinishedRecord", "Outcome", "trace_fields"]

# The W3C trace context's header (and gRPC metadata) names, as an engine reads them (the
# sidecar keeps its own in sidecar_common.tracing: the engine is the other party).
TRACE_FIELDS = ("traceparent", "tracestate")


class Outcome(enum.Enum):
    FINISHED = "finished"  # ended with a normal terminal (stop / length)
    ABORTED = "aborted"  # stopped by an abort request
    CANCELLED = "cancelled"  # the client left (stream cancelled)
    FAULTED = "faulted"  # a fault plan ended it
    ERROR = "error"  # refused or failed with a status


def trace_fields(pairs: Iterable[tuple[str, str | bytes]]) -> dict[str, str]:
    """The trace context among header or metadata pairs (names matched case-insensitively)."""
    return {k.lower(): v for k, v in pairs if k.lower() in TRACE_FIELDS and isinstance(v, str)}


@dataclass(frozen=True)
class FinishedRecord:
    request_id: str
    outcome: Outcome
    detail: str = ""


@dataclass
class Book:
    """One engine's ledger. Not thread-safe: it lives on the engine's event loop."""

    max_running: int = 256
    # KV tokens the running requests may hold together; None = unbounded. A request that
    # alone exceeds it still runs when nothing else does (it could never start otherwise).
    kv_capacity: int | None = None
    received: list[tuple[str, object]] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    # The W3C trace context each request arrived with (traceparent, tracestate), by request
    # id; requests that carried none are not in it.
    trace_context: dict[str, dict[str, str]] = field(default_factory=dict)
    finished: list[FinishedRecord] = field(default_factory=list)
    # While True nothing is admitted (a paused scheduler): requests queue, none is promoted.
    admission_paused: bool = False
    _running: dict[str, int] = field(default_factory=dict)  # id -> tokens held in KV
    _waiting: OrderedDict[str, tuple[asyncio.Future[bool], int]] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.max_running < 1:
            raise ValueError("max_running must be >= 1")

    # -- what arrived ---------------------------------------------------------------------
    def record_request(self, request_id: str, message: object) -> None:
        self.received.append((request_id, message))

    def record_trace_context(self, request_id: str, fields: dict[str, str]) -> None:
        if fields:
            self.trace_context[request_id] = fields

    def record_aborts(self, request_ids: list[str]) -> None:
        self.aborts.extend(request_ids)

    def requests(self) -> list[object]:
        return [m for _, m in self.received]

    # -- live state -----------------------------------------------------------------------
    @property
    def running_count(self) -> int:
        return len(self._running)

    @property
    def waiting_count(self) -> int:
        return len(self._waiting)

    def running_ids(self) -> list[str]:
        return list(self._running)

    def waiting_ids(self) -> list[str]:
        return list(self._waiting)

    def is_live(self, request_id: str) -> bool:
        return request_id in self._running or request_id in self._waiting

    def used_tokens(self) -> int:
        return sum(self._running.values())

    def held_tokens(self, request_id: str) -> int | None:
        """The KV tokens a running request holds (its prompt and its output so far, as its
        engine last set them); None when it is not running. How a test sees a request's
        progress at the engine, also one whose client is told nothing before its answer."""
        return self._running.get(request_id)

    def set_tokens(self, request_id: str, tokens: int) -> None:
        if request_id in self._running:
            self._running[request_id] = tokens

    def outcome_of(self, request_id: str) -> Outcome | None:
        for rec in reversed(self.finished):
            if rec.request_id == request_id:
                return rec.outcome
        return None

    # -- scheduling -----------------------------------------------------------------------
    async def admit(self, request_id: str, tokens: int = 0) -> bool:
        """Wait (FIFO) for a running slot: True once running, False if aborted while waiting.

        The caller must call ``release`` in every case (also when this raises on cancel).
        """
        if self.is_live(request_id):
            raise ValueError(f"request {request_id!r} is already live")
        if not self._waiting and not self.admission_paused and self._fits(tokens):
            self._running[request_id] = tokens
            return True
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = (fut, tokens)
        return await fut

    def retract(self, request_id: str) -> asyncio.Future[bool]:
        """A running request goes back to the end of the queue, keeping the tokens it holds
        (SGLang's retraction); the future is True once it runs again, False if it is aborted
        while it waits (``abort_waiting``)."""
        tokens = self._running.pop(request_id)
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = (fut, tokens)
        self._promote()
        return fut

    def pause_admission(self) -> None:
        """Admit nothing until ``resume_admission`` (running requests keep their slots)."""
        self.admission_paused = True

    def resume_admission(self) -> None:
        self.admission_paused = False
        self._promote()

    def abort_waiting(self, request_id: str) -> bool:
        """Take a waiting request out of the queue; its ``admit`` returns False."""
        entry = self._waiting.pop(request_id, None)
        if entry is None:
            return False
        if not entry[0].done():
            entry[0].set_result(False)
        return True

    def release(self, request_id: str, outcome: Outcome, detail: str = "") -> None:
        """The request ended (however): free its slot or queue place and log the outcome."""
        self._running.pop(request_id, None)
        entry = self._waiting.pop(request_id, None)
        if entry is not None and not entry[0].done():
            entry[0].cancel()
        self.finished.append(FinishedRecord(request_id, outcome, detail))
        self._promote()

    def refused(self, request_id: str, outcome: Outcome, detail: str = "") -> None:
        """Log a request turned away before it was queued (a live one of that id is untouched)."""
        self.finished.append(FinishedRecord(request_id, outcome, detail))

    def _fits(self, tokens: int) -> bool:
        if len(self._running) >= self.max_running:
            return False
        if self.kv_capacity is None or not self._running:
            return True
        return self.used_tokens() + tokens <= self.kv_capacity

    def _promote(self) -> None:
        # FIFO: the head waits for room even if a later, smaller request would fit.
        while self._waiting and not self.admission_paused:
            rid, (fut, tokens) = next(iter(self._waiting.items()))
            if not fut.done() and not self._fits(tokens):
                return
            del self._waiting[rid]
            if not fut.done():
                # Take the slot now, before the waiter resumes, so nobody else takes it.
                self._running[rid] = tokens
                fut.set_result(True)
