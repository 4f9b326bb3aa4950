"""The wire under :class:`~sidecar_sglang.engine.SglangEngine`: what a transport does, no more.

SGLang is one engine reached over two framings of the same calls: its gRPC service
(:mod:`sidecar_sglang.grpc_transport`) and its HTTP API with Server-Sent Events
(:mod:`sidecar_sglang.http_transport`). A transport moves bytes and decodes its framing into
the shapes every SGLang rule reads (JSON objects, :class:`NativeEvent`); the rules themselves
(conversion, discovery, refusals, what an abort's echo means) are the engine's, written once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from sidecar_common.errors import SidecarError
from sidecar_common.pool import Clock, Deadline
from sidecar_server.engine import EngineHealth, FlushOutcome
from sidecar_server.engine_state import EngineStatus
from sidecar_sglang.convert_request import NativeRequest, Transport
from sidecar_sglang.convert_response import NativeEvent

__all__ = ["EngineFacts", "SglangTransport", "StreamCut"]


@dataclass(frozen=True)
class EngineFacts:
    """Model info, server info and the model cards, as JSON, whichever wire asked."""

    model: Mapping[str, object]
    server: Mapping[str, object]
    cards: Sequence[Mapping[str, object]]


class StreamCut(Exception):
    """The wire lost a generation's stream before its terminal.

    ``error`` is what that means, unless ``abort_echo`` is set and the sidecar had asked the
    engine to abort the request: then the cut is only the abort's echo.
    """

    def __init__(self, error: SidecarError, *, abort_echo: bool) -> None:
        super().__init__(error.message)
        self.error = error
        self.abort_echo = abort_echo


class SglangTransport(Protocol):
    """One SGLang engine's wire. Every call raises SidecarError on failure, except as noted."""

    kind: Transport  # what request conversion and discovery need to know
    clock: Clock  # the clock of the start-up deadline
    target: str  # the address dialled, as start-up errors name it
    host: str  # the engine's host as the sidecar reaches it (the bootstrap host's fallback)
    health_call: str  # the health call, as start-up errors name it
    # The wire tells when the engine admitted a generation (HTTP's response status), so that
    # a prefill can hand off before its first event.
    handoff_on_admission: bool

    def is_starting(self, error: BaseException) -> bool:
        """A failed health attempt worth another one within the start-up deadline."""
        ...

    async def connect(self, deadline: Deadline) -> None: ...

    async def check_health(self, timeout: float) -> None:
        """One start-up health attempt: returns when ready, raises (``NotReady`` or the wire's
        own error) while not."""
        ...

    async def probe_health(self, timeout: float) -> EngineHealth:
        """One probe for the health watch; TimeoutError when no answer came in time."""
        ...

    async def engine_facts(self, deadline: Deadline) -> EngineFacts: ...

    def stream(
        self, native: NativeRequest, *, cumulative: bool
    ) -> AbstractAsyncContextManager[AsyncIterator[NativeEvent]]:
        """Send the generation; inside the context, its decoded events. Reading may raise
        :class:`StreamCut`. Leaving the context normally means the terminal was read (the
        wire may keep its connection); leaving it by an exception closes the stream."""
        ...

    async def abort(self, rid: str, timeout: float) -> None: ...

    async def load(self, timeout: float) -> object:
        """The engine's load report as JSON (see ``discovery.loads_from_json``)."""
        ...

    async def engine_status(self, timeout: float) -> EngineStatus:
        """The engine's pause state and weight version, as far as this wire says them."""
        ...

    async def flush_cache(self, timeout: float) -> FlushOutcome:
        """Ask the engine to flush its cache: flushed or refused, in the engine's words."""
        ...

    async def close(self) -> None: ...
