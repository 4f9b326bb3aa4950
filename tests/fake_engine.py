"""A tiny in-process Engine for the servicer tests: scripted streams, recorded calls.

A script is a list of steps run in order for one request (chosen by its public id):
an ``LLMEngineOutput`` is yielded, an exception is raised, a :class:`Gate` is waited on,
and :data:`HANG` waits until the stream is closed. Without a script the request gets
``default_tokens`` tokens, one chunk each, then an EOS terminal, for every choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import SidecarError, invalid_argument
from sidecar_server.dispatch import choice_count
from sidecar_server.engine import HEALTHY, EngineHealth, EngineLoad, GenerateCall

__all__ = ["HANG", "FakeEngine", "Gate", "Step", "terminal", "tokens"]


@dataclass(frozen=True)
class Gate:
    event: anyio.Event


class _Hang:
    pass


HANG = _Hang()
Step = sidecar_pb2.LLMEngineOutput | BaseException | Gate | _Hang


def tokens(*ids: int, index: int = 0) -> sidecar_pb2.LLMEngineOutput:
    return sidecar_pb2.LLMEngineOutput(index=index, token_ids=list(ids))


def terminal(*ids: int, index: int = 0, reason: int = sidecar_pb2.EOS) -> sidecar_pb2.LLMEngineOutput:
    return sidecar_pb2.LLMEngineOutput(index=index, token_ids=list(ids), finish_reason=reason)  # type: ignore[arg-type]


@dataclass
class FakeEngine:
    default_tokens: int = 3
    scripts: dict[str, Sequence[Step]] = field(default_factory=dict)
    healthy_answer: bool = True
    load_ranks: tuple[sidecar_pb2.RankLoad, ...] = ()
    load_error: SidecarError | None = None
    # What happened, in order: (kind, private_id) with kind "generate" (called), "yield",
    # "abort" and "closed" (the stream's generator finished, however).
    events: list[tuple[str, str]] = field(default_factory=list)
    _changed: anyio.Event | None = None
    calls: list[GenerateCall] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    running: set[str] = field(default_factory=set)
    closed: bool = False
    abort_hangs: bool = False  # an engine whose abort call never answers
    abort_latency: float = 0.0  # a real abort is a network call: it is recorded when it lands
    abort_error: Exception | None = None  # an abort call the engine answers with this error
    # The server's handler task of each call, in arrival order (validate runs in it).
    handlers: list[asyncio.Task[object]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return "fake"

    async def start(self) -> None:
        return None

    def model_info(self) -> sidecar_pb2.ModelInfo:
        return sidecar_pb2.ModelInfo(engine="fake", served_model_name="fake-model", max_context_length=4096)

    def validate(self, request: sidecar_pb2.PreprocessedRequest) -> None:
        task = asyncio.current_task()
        if task is not None:
            self.handlers.append(task)
        if not request.token_ids:
            raise invalid_argument("token_ids", "must not be empty")

    def _default(self, request: sidecar_pb2.PreprocessedRequest) -> list[Step]:
        steps: list[Step] = []
        for index in range(choice_count(request)):
            steps.extend(tokens(100 + i, index=index) for i in range(self.default_tokens - 1))
            steps.append(terminal(100 + self.default_tokens - 1, index=index))
        return steps

    async def generate(self, call: GenerateCall) -> AsyncIterator[sidecar_pb2.LLMEngineOutput]:
        self.calls.append(call)
        pid = call.private_id
        self._record("generate", pid)
        steps = self.scripts.get(call.request.request_id)
        if steps is None:
            steps = self._default(call.request)
        self.running.add(pid)
        try:
            for step in steps:
                if isinstance(step, sidecar_pb2.LLMEngineOutput):
                    # A real engine suspends on its transport for every message.
                    await anyio.lowlevel.checkpoint()
                    self._record("yield", pid)
                    yield step
                elif isinstance(step, BaseException):
                    raise step
                elif isinstance(step, Gate):
                    await step.event.wait()
                else:
                    await anyio.sleep_forever()
        finally:
            self.running.discard(pid)
            self._record("closed", pid)

    async def abort(self, private_id: str) -> None:
        if self.abort_latency:
            await anyio.sleep(self.abort_latency)
        self.aborts.append(private_id)
        self._record("abort", private_id)
        if self.abort_hangs:
            await anyio.sleep_forever()
        if self.abort_error is not None:
            raise self.abort_error

    async def load(self) -> EngineLoad:
        if self.load_error is not None:
            raise self.load_error
        return EngineLoad(ranks=self.load_ranks)

    async def health(self) -> EngineHealth:
        return HEALTHY if self.healthy_answer else EngineHealth.unhealthy("")

    async def close(self) -> None:
        self.closed = True

    async def wait_for(self, what: str, count: int = 1, timeout: float = 5.0) -> None:
        """Wait until ``count`` events of that kind happened (fails the test after timeout)."""
        with anyio.fail_after(timeout):
            while sum(1 for kind, _ in self.events if kind == what) < count:
                if self._changed is None:
                    self._changed = anyio.Event()
                await self._changed.wait()

    async def wait_handler_cancelled(self, call: int = 0, timeout: float = 5.0) -> None:
        """Wait until the client's cancel reached the server's handler of that call, then let
        the loop turn until the handler has reacted (it is ready at once; anything it starts,
        such as an abort, runs within those turns). Turns, not time: a slow machine waits
        longer for the cancel but cannot skip the reaction."""
        with anyio.fail_after(timeout):
            while not self.handlers or self.handlers[call].cancelling() == 0:  # noqa: ASYNC110
                await anyio.sleep(0.001)
        for _ in range(20):
            await anyio.lowlevel.checkpoint()

    def _record(self, kind: str, private_id: str) -> None:
        self.events.append((kind, private_id))
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()
