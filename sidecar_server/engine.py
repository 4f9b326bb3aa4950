"""The Engine protocol: what every engine adapter gives the shared servicer.

An adapter owns its transport and its pure conversion; the servicer (``server.py``) and the
in-flight registry (``dispatch.py``) own everything request-lifecycle: private ids, the
decode hold, cancellation and the abort-exactly-once rule. So an adapter never decides when
to abort; it is told, through :meth:`Engine.abort`.

Every method raises :class:`sidecar_common.errors.SidecarError` and nothing else.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Final, Protocol, runtime_checkable

from sidecar_common.api import sidecar_pb2
from sidecar_server.engine_state import EngineStatus

__all__ = [
    "HEALTHY",
    "Engine",
    "EngineHealth",
    "EngineLoad",
    "EngineStatus",
    "FlushOutcome",
    "GenerateCall",
    "StatefulEngine",
]


@dataclass(frozen=True)
class EngineLoad:
    """The engine's own load figures, one entry per data-parallel rank."""

    ranks: tuple[sidecar_pb2.RankLoad, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class EngineHealth:
    """One health probe's answer: healthy, or not and why (in words for the operator's log
    lines). The reason travels with the answer, so concurrent probes cannot mix them up."""

    healthy: bool
    problem: str = ""

    @classmethod
    def unhealthy(cls, problem: str) -> EngineHealth:
        return cls(False, problem or "the health check answered not serving")


HEALTHY: Final = EngineHealth(True)


@dataclass(frozen=True)
class FlushOutcome:
    """The engine's answer to a cache flush: done or refused, and its own words."""

    flushed: bool
    message: str


@dataclass(frozen=True)
class GenerateCall:
    """One generation as the dispatcher hands it to an engine.

    ``private_id`` is unique among everything this sidecar ever sent the engine, and no
    private id is a prefix of another (SGLang matches abort rids by prefix).
    ``hold_cancel_until_first_token`` is set for the decode half of a disaggregated pair:
    a cancel that arrives before the first token waits for it (the KV transfer must
    complete) before the engine request is aborted.
    """

    request: sidecar_pb2.PreprocessedRequest
    private_id: str
    hold_cancel_until_first_token: bool = False
    # What the adapter's validate() returned for this request (its converted native
    # request): generate() takes it instead of converting the request a second time.
    native: object = None


@runtime_checkable
class Engine(Protocol):
    """An engine adapter. ``start`` once, then any number of concurrent calls, then ``close``."""

    @property
    def name(self) -> str:
        """``vllm`` or ``sglang``: the engine field of ModelInfo and the metrics label."""
        ...

    async def start(self) -> None:
        """Connect and discover within the shared startup deadline (CANNOT_CONNECT if not)."""
        ...

    def model_info(self) -> sidecar_pb2.ModelInfo:
        """What start() discovered. Only called after start() returned."""
        ...

    def validate(self, request: sidecar_pb2.PreprocessedRequest) -> object:
        """Refuse bad input before any engine call (INVALID_ARGUMENT naming the field).

        Pure: it is the request's one conversion, so a refused request never reaches the
        engine. What it returns (the native request, or None) comes back to generate()
        as ``GenerateCall.native``; only the private id is set there.
        """
        ...

    def generate(self, call: GenerateCall) -> AsyncIterator[sidecar_pb2.LLMEngineOutput]:
        """Stream the generation as LLMEngineOutput chunks.

        Contract: token_ids are deltas; each choice gets exactly one chunk with
        finish_reason set (its terminal), and the iterator ends after the last choice's
        terminal. Any failure is raised as SidecarError after the chunks already yielded.
        Closing the iterator early (``aclose``) releases the engine stream/connection; it
        does not abort: the dispatcher calls :meth:`abort` for that.
        """
        ...

    async def abort(self, private_id: str) -> None:
        """Ask the engine to stop that one request. Bounded in time; never raises for a
        request the engine no longer knows."""
        ...

    async def load(self) -> EngineLoad:
        """The engine's current load figures (may raise a SidecarError)."""
        ...

    async def health(self) -> EngineHealth:
        """One bounded health probe of the engine, for the background health watch: the
        engine's answer (unhealthy also when it cannot be reached, with why); no answer in
        time raises TimeoutError (a busy engine answers late, which is not unhealthy)."""
        ...

    async def close(self) -> None:
        """Release every channel/session. Idempotent."""
        ...


@runtime_checkable
class StatefulEngine(Protocol):
    """An engine adapter that also reads the engine's own state and flushes its cache (both
    engine clients; a test double may do neither: the server then reports no state and
    answers FlushCache UNIMPLEMENTED)."""

    async def status(self) -> EngineStatus:
        """One bounded reading of the engine's pause state and weight version (raises
        SidecarError when the engine does not answer, in time or at all)."""
        ...

    async def flush_cache(self) -> FlushOutcome:
        """Ask the engine to empty its prefix cache, bounded in time: flushed, or refused in
        the engine's words (raises SidecarError when the call itself fails)."""
        ...
