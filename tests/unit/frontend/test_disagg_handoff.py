"""The frontend's side of the prefill -> decode handoff (sidecar_frontend.disagg): the typed
triple first, a 0.1 sidecar's Struct otherwise, and the decode request each one makes."""

from __future__ import annotations

import random

import pytest
from google.protobuf import struct_pb2

from sidecar_common import bootstrap_handoff
from sidecar_common.api import sidecar_pb2
from sidecar_common.bootstrap_handoff import ROOM_MAX
from sidecar_frontend import disagg


def triple(host: str = "10.0.0.5", port: int = 8998, room: int = 7) -> sidecar_pb2.BootstrapInfo:
    return sidecar_pb2.BootstrapInfo(bootstrap_host=host, bootstrap_port=port, bootstrap_room=room)


def test_the_frontend_takes_the_typed_handoff_first() -> None:
    out = sidecar_pb2.LLMEngineOutput()
    out.bootstrap_info.CopyFrom(triple(room=1))
    out.disaggregated_params.CopyFrom(bootstrap_handoff.to_struct(triple(room=2)))
    assert disagg.handoff_of(out) == triple(room=1)


def test_a_0_1_sidecars_struct_handoff_is_taken_as_it_is() -> None:
    out = sidecar_pb2.LLMEngineOutput()
    out.disaggregated_params.CopyFrom(bootstrap_handoff.to_struct(triple()))
    assert disagg.handoff_of(out) == bootstrap_handoff.to_struct(triple())
    assert disagg.handoff_of(sidecar_pb2.LLMEngineOutput(token_ids=[1])) is None


@pytest.mark.parametrize(
    "handoff",
    [triple(), bootstrap_handoff.to_struct(triple())],
    ids=["typed", "struct"],
)
def test_the_bootstrap_address_is_learned_from_either_form(handoff: disagg.Handoff) -> None:
    assert disagg.bootstrap_address(handoff) == disagg.BootstrapAddress("10.0.0.5", 8998)


@pytest.mark.parametrize(
    "handoff",
    [
        triple(host=""),
        triple(port=0),
        triple(port=65536),
        struct_pb2.Struct(),
        bootstrap_handoff.to_struct(triple(port=0)),
    ],
    ids=["no host", "port 0", "port beyond 65535", "empty struct", "struct with port 0"],
)
def test_a_handoff_that_names_no_address_teaches_none(handoff: disagg.Handoff) -> None:
    assert disagg.bootstrap_address(handoff) is None


def test_an_sglang_decode_carries_the_triple_as_bootstrap_info() -> None:
    # A 0.1 SGLang sidecar takes bootstrap_info on a decode request too (before prefill_result).
    request = sidecar_pb2.PreprocessedRequest(token_ids=[1, 2])
    step = disagg.decode_request(request, triple())
    assert step.bootstrap_info == triple()
    assert not step.HasField("prefill_result")


def test_a_struct_handoff_goes_back_untouched_in_prefill_result() -> None:
    params = struct_pb2.Struct()
    params.update({"remote_port": 5600, "remote_host": "p"})
    request = sidecar_pb2.PreprocessedRequest(token_ids=[1], bootstrap_info=triple())
    step = disagg.decode_request(request, params)
    assert step.prefill_result.disaggregated_params == params
    assert not step.HasField("bootstrap_info")


def test_a_chosen_room_fits_sglangs_signed_64_bits() -> None:
    rand = random.Random(3)
    rooms = {
        disagg.choose_bootstrap(disagg.BootstrapAddress("h", 1), rand).bootstrap_room for _ in range(200)
    }
    assert all(0 <= room <= ROOM_MAX for room in rooms)
    assert max(rooms) > 2**62  # drawn from the whole range
