"""What both SGLang transports share around a request: discovery state, validation, and the
opening of a generation (native request + response state machine). I/O stays in the
transport modules."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import ErrorReason, SidecarError
from sidecar_server.config import SidecarConfig
from sidecar_server.engine import GenerateCall
from sidecar_sglang.convert_request import NativeRequest, RequestSettings, Transport, build_native
from sidecar_sglang.convert_response import ResponseState
from sidecar_sglang.discovery import Discovered

__all__ = ["SglangAdapterBase", "random_room"]


def random_room() -> int:
    """A bootstrap room in [0, 2^63), for a prefill request that names none."""
    return secrets.randbelow(2**63)


class SglangAdapterBase:
    """Discovery results and request opening, the same over gRPC and HTTP."""

    def __init__(self, config: SidecarConfig, transport: Transport, room: Callable[[], int]) -> None:
        self._config = config
        self._room = room
        self._found: Discovered | None = None
        self._settings = RequestSettings(mode=config.disaggregation_mode, transport=transport)
        # private id -> "the sidecar asked the engine to abort it", for live generations only.
        self._live: dict[str, bool] = {}

    @property
    def name(self) -> str:
        return "sglang"

    def model_info(self) -> sidecar_pb2.ModelInfo:
        if self._found is None:
            raise SidecarError(ErrorReason.ENGINE_SHUTDOWN, "the sglang engine is not discovered yet")
        return self._found.model_info

    def validate(self, request: sidecar_pb2.PreprocessedRequest) -> NativeRequest:
        # The private id is not drawn yet (generate() sets it); the room is this request's.
        return build_native(request, "validate", self._settings, room=self._room())

    def _open(self, call: GenerateCall) -> tuple[NativeRequest, ResponseState]:
        """The native request and its response state machine; registers the generation as
        live (not aborted by us) until the transport's ``finally`` forgets it."""
        if isinstance(call.native, NativeRequest):
            native = dataclasses.replace(call.native, rid=call.private_id)
        else:
            native = build_native(call.request, call.private_id, self._settings, room=self._room())
        incremental = self._found.incremental if self._found is not None else False
        self._live[call.private_id] = False
        return native, ResponseState(native, cumulative=not incremental)
