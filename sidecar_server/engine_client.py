"""The skeleton every engine client shares, whatever its engine and wire.

An engine client implements the :class:`~sidecar_server.engine.Engine` protocol. What is the
same for all of them lives here, once: start-up within one deadline (connect, wait for the
engine's health, discover), the "not discovered yet" refusal, and the time bounds of the
control calls (abort, load, the health probe). A subclass supplies only what is true of its
engine: its calls (the ``_``-prefixed hooks), its conversion (``validate``, ``generate``) and
its discovery rules.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import structlog

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_common.pool import Clock, Deadline, is_transient, retry_until_deadline
from sidecar_server.config import SidecarConfig
from sidecar_server.engine import EngineHealth, EngineLoad, FlushOutcome, GenerateCall
from sidecar_server.engine_state import EngineStatus

__all__ = ["Discovery", "EngineClient", "EngineTimeouts"]

_log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class EngineTimeouts:
    """How long each control call to the engine may take, in seconds.

    ``health`` bounds one probe of the background health watch (the server's own bound,
    ``health_probe_timeout``, sits above it); ``abort`` one abort (the dispatcher's
    ``abort_timeout`` sits above it); ``load`` one load report; ``status`` one reading of the
    engine's pause state and weight version; ``flush`` one cache flush.
    """

    abort: float = 2.0
    health: float = 1.5
    load: float = 2.0
    status: float = 2.0
    flush: float = 30.0


@dataclass(frozen=True)
class Discovery:
    """What start-up learnt: the ModelInfo, and the engine facts its log line adds."""

    info: sidecar_pb2.ModelInfo
    log_fields: Mapping[str, object] = field(default_factory=dict)


class EngineClient(ABC):
    """One engine, ``start``-ed once, then any number of concurrent calls, then ``close``-d.

    Every method raises :class:`SidecarError` and nothing else (the hooks included).
    """

    def __init__(self, config: SidecarConfig, *, clock: Clock, timeouts: EngineTimeouts) -> None:
        self._config = config
        self._clock = clock
        self.timeouts = timeouts
        self._discovery: Discovery | None = None

    # ------------------------------------------------------------------- the Engine protocol

    @property
    @abstractmethod
    def name(self) -> str:
        """``vllm`` or ``sglang``: the engine field of ModelInfo and the metrics label."""

    async def start(self) -> None:
        # One deadline for the connection, the health wait and discovery (docs/common.md).
        deadline = Deadline.start(self._clock, self._config.pool.startup_deadline)
        await self._connect(deadline)
        await retry_until_deadline(
            f"{self.name} engine {self._target} ({self._health_call})",
            self._check_health,
            deadline,
            self._config.pool.retry,
            transient=self._is_starting,
        )
        found = await self._discover(deadline)
        self._discovery = found
        _log.info(
            f"{self.name} engine discovered",
            served_model_name=found.info.served_model_name,
            **found.log_fields,
            elapsed=round(deadline.elapsed(), 3),
        )

    def model_info(self) -> sidecar_pb2.ModelInfo:
        if self._discovery is None:
            raise SidecarError(FailureReason.ENGINE_SHUTDOWN, f"the {self.name} engine is not discovered yet")
        return self._discovery.info

    @abstractmethod
    def validate(self, request: sidecar_pb2.PreprocessedRequest) -> object:
        """The request's one conversion (see :meth:`Engine.validate`)."""

    @abstractmethod
    def generate(self, call: GenerateCall) -> AsyncIterator[sidecar_pb2.LLMEngineOutput]:
        """The generation's stream (see :meth:`Engine.generate`)."""

    async def abort(self, private_id: str) -> None:
        await self._abort(private_id, self.timeouts.abort)

    async def load(self) -> EngineLoad:
        return await self._load(self.timeouts.load)

    async def health(self) -> EngineHealth:
        return await self._probe_health(self.timeouts.health)

    async def status(self) -> EngineStatus:
        return await self._status(self.timeouts.status)

    async def flush_cache(self) -> FlushOutcome:
        return await self._flush_cache(self.timeouts.flush)

    @abstractmethod
    async def close(self) -> None:
        """Release every channel or session. Idempotent."""

    # ------------------------------------------------------------------- what an engine supplies

    @property
    @abstractmethod
    def _target(self) -> str:
        """The address dialled, as start-up errors name it."""

    @property
    def _health_call(self) -> str:
        """The health call, as start-up errors name it."""
        return "HealthCheck"

    def _is_starting(self, error: BaseException) -> bool:
        """A failed health attempt worth another one within the start-up deadline."""
        return is_transient(error)

    async def _connect(self, deadline: Deadline) -> None:
        """Open the connections, within ``deadline`` (nothing to do for a wire that opens them
        per call)."""
        del deadline

    @abstractmethod
    async def _check_health(self, timeout: float) -> None:
        """One health attempt at start-up: returns when the engine is ready; raises
        ``NotReady`` (or a transport error) while it is not."""

    @abstractmethod
    async def _discover(self, deadline: Deadline) -> Discovery:
        """What the engine is, asked within what is left of ``deadline``."""

    @abstractmethod
    async def _probe_health(self, timeout: float) -> EngineHealth:
        """One probe for the health watch, bounded by ``timeout``; raises TimeoutError when
        the engine did not answer in time."""

    @abstractmethod
    async def _abort(self, private_id: str, timeout: float) -> None:
        """Abort that one request; never raises for an id the engine no longer knows."""

    @abstractmethod
    async def _load(self, timeout: float) -> EngineLoad:
        """The engine's load figures, bounded by ``timeout``."""

    @abstractmethod
    async def _status(self, timeout: float) -> EngineStatus:
        """The engine's pause state and weight version, bounded by ``timeout``."""

    @abstractmethod
    async def _flush_cache(self, timeout: float) -> FlushOutcome:
        """The engine's answer to a cache flush, bounded by ``timeout``."""
