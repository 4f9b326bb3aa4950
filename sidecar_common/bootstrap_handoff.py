"""SGLang's prefill -> decode handoff on the sidecar.v1 wire (pure): the one owner of its shapes.

An SGLang prefill and its decode meet at the prefill engine's bootstrap server, in a room:
the triple (host, port, room). The prefill sidecar hands it over in
``LLMEngineOutput.bootstrap_info`` and the frontend passes it to the decode sidecar in
``PreprocessedRequest.bootstrap_info``. Sidecars and frontends of 0.1 carried the triple in a
``Struct`` instead (``disaggregated_params`` out, ``prefill_result.disaggregated_params`` back),
``{"bootstrap_host": str, "bootstrap_port": int, "bootstrap_room": "<decimal>"}``: through
0.2.x the prefill sidecar writes both and both sides read the Struct where the typed field is
absent (docs/api.md, "Struct shapes kept for one release").
"""

from __future__ import annotations

from typing import Final

from google.protobuf import struct_pb2

from sidecar_common.api import sidecar_pb2
from sidecar_common.limits import exact_integer

__all__ = [
    "HOST_KEY",
    "PORT_KEY",
    "PORT_MAX",
    "ROOM_KEY",
    "ROOM_MAX",
    "HandoffError",
    "attach",
    "from_struct",
    "to_struct",
]

HOST_KEY: Final = "bootstrap_host"
PORT_KEY: Final = "bootstrap_port"
ROOM_KEY: Final = "bootstrap_room"
# SGLang takes the port as an int32 and draws rooms as signed 64-bit integers.
PORT_MAX: Final = 2**31 - 1
ROOM_MAX: Final = 2**63 - 1


class HandoffError(ValueError):
    """A Struct handoff that is not a triple: ``key`` names the entry, ``problem`` says why."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


def to_struct(info: sidecar_pb2.BootstrapInfo) -> struct_pb2.Struct:
    """The triple in the 0.1 Struct shape. The room is decimal text: a Struct number is a
    double, and a room up to 2^63-1 would not survive one."""
    params = struct_pb2.Struct()
    params.update(
        {
            HOST_KEY: info.bootstrap_host,
            PORT_KEY: info.bootstrap_port,
            ROOM_KEY: str(info.bootstrap_room),
        }
    )
    return params


def from_struct(params: struct_pb2.Struct) -> sidecar_pb2.BootstrapInfo:
    """The triple of a 0.1 Struct handoff: the port and room as exact numbers or decimal
    text, within SGLang's ranges. Raises :class:`HandoffError`; a blank host is the caller's to
    judge (it may be a typed field's too)."""
    fields = params.fields
    for key in (HOST_KEY, PORT_KEY, ROOM_KEY):
        if key not in fields:
            raise HandoffError(key, "is missing")
    host = fields[HOST_KEY]
    if host.WhichOneof("kind") != "string_value":
        raise HandoffError(HOST_KEY, "must be a string")
    return sidecar_pb2.BootstrapInfo(
        bootstrap_host=host.string_value,
        bootstrap_port=_integer(fields[PORT_KEY], PORT_KEY, PORT_MAX),
        bootstrap_room=_integer(fields[ROOM_KEY], ROOM_KEY, ROOM_MAX),
    )


def _integer(value: struct_pb2.Value, key: str, maximum: int) -> int:
    kind = value.WhichOneof("kind")
    given: object = None
    if kind == "number_value":
        given = value.number_value
    elif kind == "string_value":
        given = value.string_value
    number = exact_integer(given)
    if number is None:
        raise HandoffError(key, "must be an integer")
    if not 0 <= number <= maximum:
        raise HandoffError(key, f"{number} is out of range (0..{maximum})")
    return number


def attach(out: sidecar_pb2.LLMEngineOutput, info: sidecar_pb2.BootstrapInfo) -> None:
    """Put a prefill's handoff on ``out``: the typed field, and for 0.1 frontends the Struct
    (through 0.2.x)."""
    out.bootstrap_info.CopyFrom(info)
    out.disaggregated_params.CopyFrom(to_struct(info))
