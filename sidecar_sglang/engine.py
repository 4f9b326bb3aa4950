"""The SGLang engine client: one engine over either of SGLang's wires.

What SGLang does is written here once, whatever the wire: the request's one conversion, the
response state machine, discovery's rules, the abort rules (an empty rid would abort
everything; the stream cut that follows our own abort is its echo). The wire is a
:class:`~sidecar_sglang.transport.SglangTransport`; the skeleton (start-up, time bounds) is
:class:`~sidecar_server.engine_client.EngineClient`'s.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import AsyncIterator, Callable

from sidecar_common.api import sidecar_pb2
from sidecar_common.pool import Deadline
from sidecar_server.config import SidecarConfig
from sidecar_server.engine import EngineHealth, EngineLoad, FlushOutcome, GenerateCall
from sidecar_server.engine_client import Discovery, EngineClient, EngineTimeouts
from sidecar_server.engine_state import EngineStatus
from sidecar_sglang.convert_request import NativeRequest, RequestSettings, build_native
from sidecar_sglang.convert_response import ResponseState
from sidecar_sglang.discovery import discover, loads_from_json
from sidecar_sglang.transport import SglangTransport, StreamCut

__all__ = ["SglangEngine", "random_room"]


def random_room() -> int:
    """A bootstrap room in [0, 2^63), for a prefill request that names none."""
    return secrets.randbelow(2**63)


class SglangEngine(EngineClient):
    """One SGLang engine behind ``transport``."""

    def __init__(
        self,
        config: SidecarConfig,
        transport: SglangTransport,
        *,
        timeouts: EngineTimeouts | None = None,
        room: Callable[[], int] = random_room,
        vocab_size: int | None = None,
    ) -> None:
        """``vocab_size``: the model's, as the operator gave it (``--vocab-size``); SGLang
        reports it on none of its info calls."""
        super().__init__(config, clock=transport.clock, timeouts=timeouts or EngineTimeouts())
        self._transport = transport
        self._room = room
        self._settings = RequestSettings(mode=config.disaggregation_mode, transport=transport.kind)
        self._incremental = False
        self._vocab_size = vocab_size
        # private id -> "the sidecar asked the engine to abort it", for live generations only.
        self._live: dict[str, bool] = {}

    @property
    def name(self) -> str:
        return "sglang"

    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size as the operator gave it (``--vocab-size``), else None."""
        return self._vocab_size

    # ------------------------------------------------------------------- start-up

    @property
    def _target(self) -> str:
        return self._transport.target

    @property
    def _health_call(self) -> str:
        return self._transport.health_call

    def _is_starting(self, error: BaseException) -> bool:
        return self._transport.is_starting(error)

    async def _connect(self, deadline: Deadline) -> None:
        await self._transport.connect(deadline)

    async def _check_health(self, timeout: float) -> None:
        await self._transport.check_health(timeout)

    async def _discover(self, deadline: Deadline) -> Discovery:
        facts = await self._transport.engine_facts(deadline)
        found = discover(
            facts.model,
            facts.server,
            facts.cards,
            expected_mode=self._config.disaggregation_mode,
            transport=self._transport.kind,
            engine_host=self._transport.host,
        )
        self._settings = found.settings
        if self._vocab_size is not None:
            found.model_info.vocab_size = self._vocab_size
            self._settings = dataclasses.replace(found.settings, vocab_size=self._vocab_size)
        self._incremental = found.incremental
        return Discovery(
            found.model_info,
            {
                "transport": self._transport.kind,
                "incremental": found.incremental,
                "disaggregation_mode": found.model_info.disaggregation_mode,
            },
        )

    # ------------------------------------------------------------------- requests

    def validate(self, request: sidecar_pb2.PreprocessedRequest) -> NativeRequest:
        # The private id is not drawn yet (generate() sets it); the room is this request's.
        return build_native(request, "validate", self._settings, room=self._room())

    def _aborted_by_us(self, private_id: str) -> bool:
        return self._live.get(private_id, False)

    async def generate(self, call: GenerateCall) -> AsyncIterator[sidecar_pb2.LLMEngineOutput]:
        pid = call.private_id
        if isinstance(call.native, NativeRequest):
            native = dataclasses.replace(call.native, rid=pid)
        else:
            native = build_native(call.request, pid, self._settings, room=self._room())
        # One answer is whole whatever the server's streaming mode: "cumulative" (one event).
        state = ResponseState(native, cumulative=not self._incremental or not native.stream)
        self._live[pid] = False
        try:
            async with self._transport.stream(native, cumulative=state.cumulative) as events:
                if native.prefill and self._transport.handoff_on_admission:
                    # Decode can start its KV transfer as soon as prefill is admitted.
                    yield state.handoff()
                async for event in events:
                    for out in state.feed(event, aborted_by_us=self._aborted_by_us(pid)):
                        yield out
                    if state.done:
                        break
                else:
                    raise state.end_of_stream(aborted_by_us=self._aborted_by_us(pid))
        except StreamCut as cut:
            if cut.abort_echo and self._aborted_by_us(pid):
                raise state.end_of_stream(aborted_by_us=True) from None
            raise cut.error from cut.__cause__
        finally:
            self._live.pop(pid, None)

    async def _abort(self, private_id: str, timeout: float) -> None:
        if not private_id:
            # SGLang matches rids by prefix: an empty rid would abort everything.
            return
        if private_id in self._live:
            self._live[private_id] = True
        # SGLang answers OK for a rid it no longer knows, so a failure here is a real one:
        # raised for the dispatcher to log and count as a failed abort.
        await self._transport.abort(private_id, timeout)

    async def _load(self, timeout: float) -> EngineLoad:
        return EngineLoad(ranks=loads_from_json(await self._transport.load(timeout)))

    async def _probe_health(self, timeout: float) -> EngineHealth:
        return await self._transport.probe_health(timeout)

    async def _status(self, timeout: float) -> EngineStatus:
        return await self._transport.engine_status(timeout)

    async def _flush_cache(self, timeout: float) -> FlushOutcome:
        return await self._transport.flush_cache(timeout)

    async def close(self) -> None:
        await self._transport.close()
