"""Disaggregated prefill -> decode: the requests of each step and the handoff between them (pure).

A disaggregated attempt runs the request on a prefill worker (a sidecar in ``prefill`` mode)
and then on a decode worker, with the handoff the prefill produced. Two styles, chosen by the
prefill worker's engine (``ModelInfo.engine``):

* ``SEQUENTIAL`` (vLLM): the prefill's terminal carries ``disaggregated_params`` (vLLM's
  ``kv_transfer_params``); the decode request carries it back as
  ``prefill_result.disaggregated_params``.
* ``BOOTSTRAP`` (SGLang): prefill and decode meet at the prefill engine's bootstrap server,
  under a room the frontend draws (below 2^63), so both run at once. The sidecar reports no
  bootstrap address in ``ModelInfo``: the frontend learns it from the first handoff of each
  prefill worker (the sidecar fills in its engine's bootstrap host and port when the request
  names none; over SGLang's HTTP transport that handoff comes as soon as the engine accepted
  the request). From then on the triple is chosen up front and the decode starts with it.

The client sees only the decode's outputs; the prefill's are the frontend's business. No I/O
here: the handler runs the calls.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass
from typing import Final

from google.protobuf import struct_pb2

from sidecar_common.api import sidecar_pb2

__all__ = [
    "ROOM_LIMIT",
    "BootstrapAddress",
    "Style",
    "bootstrap_address",
    "bootstrap_params",
    "choose_bootstrap",
    "decode_request",
    "prefill_request",
    "style_of",
]

ROOM_LIMIT: Final = 2**63  # SGLang's rooms are signed 64-bit


class Style(enum.Enum):
    SEQUENTIAL = "sequential"
    BOOTSTRAP = "bootstrap"


@dataclass(frozen=True)
class BootstrapAddress:
    host: str
    port: int


def style_of(model: sidecar_pb2.ModelInfo | None) -> Style:
    """SGLang's engines meet at a bootstrap server; every other engine hands off in sequence."""
    if model is not None and model.engine == "sglang":
        return Style.BOOTSTRAP
    return Style.SEQUENTIAL


def choose_bootstrap(address: BootstrapAddress, rand: random.Random) -> sidecar_pb2.BootstrapInfo:
    return sidecar_pb2.BootstrapInfo(
        bootstrap_host=address.host, bootstrap_port=address.port, bootstrap_room=rand.randrange(ROOM_LIMIT)
    )


def bootstrap_params(info: sidecar_pb2.BootstrapInfo) -> struct_pb2.Struct:
    """The triple as a handoff (the room as a decimal string: a Struct number is a double)."""
    params = struct_pb2.Struct()
    params.update(
        {
            "bootstrap_host": info.bootstrap_host,
            "bootstrap_port": info.bootstrap_port,
            "bootstrap_room": str(info.bootstrap_room),
        }
    )
    return params


def bootstrap_address(params: struct_pb2.Struct) -> BootstrapAddress | None:
    """The bootstrap host and port named in an SGLang handoff, or None when it names none."""
    fields = params.fields
    host = fields.get("bootstrap_host")
    port = fields.get("bootstrap_port")
    if host is None or port is None or host.WhichOneof("kind") != "string_value" or not host.string_value:
        return None
    kind = port.WhichOneof("kind")
    if kind == "number_value" and port.number_value.is_integer():
        number = int(port.number_value)
    elif kind == "string_value" and port.string_value.isdigit():
        number = int(port.string_value)
    else:
        return None
    if not 0 < number < 65536:
        return None
    return BootstrapAddress(host.string_value, number)


def prefill_request(
    request: sidecar_pb2.PreprocessedRequest, bootstrap: sidecar_pb2.BootstrapInfo | None = None
) -> sidecar_pb2.PreprocessedRequest:
    """The prefill step: the same request (the prefill sidecar forces its own token budget)."""
    step = sidecar_pb2.PreprocessedRequest()
    step.CopyFrom(request)
    step.ClearField("prefill_result")
    step.ClearField("bootstrap_info")
    if bootstrap is not None:
        step.bootstrap_info.CopyFrom(bootstrap)
    return step


def decode_request(
    request: sidecar_pb2.PreprocessedRequest, handoff: struct_pb2.Struct
) -> sidecar_pb2.PreprocessedRequest:
    """The decode step: the request with the prefill's handoff, passed back untouched."""
    step = sidecar_pb2.PreprocessedRequest()
    step.CopyFrom(request)
    step.ClearField("bootstrap_info")
    step.prefill_result.disaggregated_params.CopyFrom(handoff)
    return step
