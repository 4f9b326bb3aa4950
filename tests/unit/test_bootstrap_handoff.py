"""sidecar_common.bootstrap_handoff: SGLang's triple as the typed BootstrapInfo and as the 0.1
Struct, both ways, exactly."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import struct_pb2
from hypothesis import given
from hypothesis import strategies as st

from sidecar_common import bootstrap_handoff
from sidecar_common.api import sidecar_pb2
from sidecar_common.bootstrap_handoff import PORT_MAX, ROOM_MAX, HandoffError


def triple(host: str = "10.0.0.5", port: int = 8998, room: int = 7) -> sidecar_pb2.BootstrapInfo:
    return sidecar_pb2.BootstrapInfo(bootstrap_host=host, bootstrap_port=port, bootstrap_room=room)


def received(params: struct_pb2.Struct) -> struct_pb2.Struct:
    return struct_pb2.Struct.FromString(params.SerializeToString())


@given(host=st.text(min_size=1, max_size=20), port=st.integers(0, PORT_MAX), room=st.integers(0, ROOM_MAX))
def test_the_struct_round_trips_every_triple_exactly(host: str, port: int, room: int) -> None:
    # A room near 2^63 does not survive a double: the Struct carries it as text.
    info = triple(host, port, room)
    assert bootstrap_handoff.from_struct(received(bootstrap_handoff.to_struct(info))) == info


def test_the_struct_is_the_0_1_shape() -> None:
    params = bootstrap_handoff.to_struct(triple(room=2**63 - 1))
    assert dict(params) == {
        "bootstrap_host": "10.0.0.5",
        "bootstrap_port": 8998,
        "bootstrap_room": "9223372036854775807",
    }


BASE: dict[str, Any] = {"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": "2"}
REFUSED: list[tuple[dict[str, Any], str, str]] = [
    ({"bootstrap_host": None}, "bootstrap_host", "is missing"),
    ({"bootstrap_port": None}, "bootstrap_port", "is missing"),
    ({"bootstrap_room": None}, "bootstrap_room", "is missing"),
    ({"bootstrap_host": 5}, "bootstrap_host", "must be a string"),
    ({"bootstrap_port": 1.5}, "bootstrap_port", "must be an integer"),
    ({"bootstrap_port": "eighty"}, "bootstrap_port", "must be an integer"),
    ({"bootstrap_room": True}, "bootstrap_room", "must be an integer"),
    ({"bootstrap_port": -1}, "bootstrap_port", "-1 is out of range (0..2147483647)"),
    ({"bootstrap_port": 2**31}, "bootstrap_port", "2147483648 is out of range (0..2147483647)"),
    (
        {"bootstrap_room": str(2**63)},
        "bootstrap_room",
        "9223372036854775808 is out of range (0..9223372036854775807)",
    ),
]


@pytest.mark.parametrize(("change", "key", "problem"), REFUSED)
def test_a_struct_that_is_not_a_triple_is_refused_by_name(
    change: dict[str, Any], key: str, problem: str
) -> None:
    params = struct_pb2.Struct()
    params.update({k: v for k, v in {**BASE, **change}.items() if v is not None})
    with pytest.raises(HandoffError) as raised:
        bootstrap_handoff.from_struct(params)
    assert (raised.value.key, raised.value.problem) == (key, problem)


def test_exact_numbers_and_decimal_text_are_both_taken() -> None:
    params = struct_pb2.Struct()
    params.update({"bootstrap_host": "h", "bootstrap_port": "8998", "bootstrap_room": 5.0})
    assert bootstrap_handoff.from_struct(params) == triple("h", 8998, 5)


def test_attach_writes_the_typed_field_and_the_0_1_struct() -> None:
    out = sidecar_pb2.LLMEngineOutput()
    bootstrap_handoff.attach(out, triple())
    assert out.bootstrap_info == triple()
    assert out.disaggregated_params == bootstrap_handoff.to_struct(triple())
