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
  The handoff is ``LLMEngineOutput.bootstrap_info`` and goes to the decode as
  ``bootstrap_info``; a 0.1 sidecar's Struct handoff goes back untouched in ``prefill_result``
  (``sidecar_common.bootstrap_handoff`` owns both shapes).

The client sees only the decode's outputs; the prefill's are the frontend's business, except
its routed experts (the prompt's rows), which the decode's terminal gets joined in front of its
own (``pd_experts``). No I/O here: the handler runs the calls.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass
from typing import Final

from google.protobuf import struct_pb2

from sidecar_common import bootstrap_handoff
from sidecar_common.api import sidecar_pb2
from sidecar_frontend import pd_experts

__all__ = [
    "BootstrapAddress",
    "Handoff",
    "Style",
    "bootstrap_address",
    "choose_bootstrap",
    "decode_request",
    "handoff_of",
    "prefill_request",
    "style_of",
]

Handoff = sidecar_pb2.BootstrapInfo | struct_pb2.Struct
"""What a prefill hands its decode: SGLang's triple, or an opaque Struct (vLLM's
``kv_transfer_params``, or a 0.1 SGLang sidecar's triple), passed back untouched."""

_PORTS: Final = range(1, 65536)


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
    room = rand.randrange(bootstrap_handoff.ROOM_MAX + 1)
    return sidecar_pb2.BootstrapInfo(
        bootstrap_host=address.host, bootstrap_port=address.port, bootstrap_room=room
    )


def handoff_of(output: sidecar_pb2.LLMEngineOutput) -> Handoff | None:
    """The handoff a prefill output carries, or None: the typed triple where the sidecar sent
    one, else the Struct."""
    if output.HasField("bootstrap_info"):
        return output.bootstrap_info
    if output.HasField("disaggregated_params"):
        return output.disaggregated_params
    return None


def bootstrap_address(handoff: Handoff) -> BootstrapAddress | None:
    """The bootstrap host and port named in an SGLang handoff, or None when it names none."""
    if isinstance(handoff, struct_pb2.Struct):
        try:
            handoff = bootstrap_handoff.from_struct(handoff)
        except bootstrap_handoff.HandoffError:
            return None
    if not handoff.bootstrap_host or handoff.bootstrap_port not in _PORTS:
        return None
    return BootstrapAddress(handoff.bootstrap_host, handoff.bootstrap_port)


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
    request: sidecar_pb2.PreprocessedRequest, handoff: Handoff
) -> sidecar_pb2.PreprocessedRequest:
    """The decode step: the request with the prefill's handoff (SGLang's triple as
    ``bootstrap_info``, which 0.1 sidecars take too; a Struct in ``prefill_result``). Asked for
    routed experts, it asks them from the prompt's end: the decode never runs the prompt, the
    prefill answers those rows (``pd_experts``)."""
    step = sidecar_pb2.PreprocessedRequest()
    step.CopyFrom(request)
    step.ClearField("bootstrap_info")
    step.ClearField("prefill_result")
    options = step.output_options
    if options.return_routed_experts:
        options.routed_experts_start_len = pd_experts.decode_start(
            len(step.token_ids), options.routed_experts_start_len
        )
    if isinstance(handoff, sidecar_pb2.BootstrapInfo):
        step.bootstrap_info.CopyFrom(handoff)
    else:
        step.prefill_result.disaggregated_params.CopyFrom(handoff)
    return step
