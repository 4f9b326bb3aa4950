"""The testkit's fake MoE routing (pure): SGLang's shape and encoding, and a pure function
of position and token id."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st
from testkit.routed_experts import (
    ExpertsShape,
    decode_routed_experts,
    encode_routed_experts,
    experts_at,
    routed_experts,
)

shapes = st.builds(
    lambda layers, k, extra: ExpertsShape(layers, k, k + extra),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(0, 12),
)
sequences = st.lists(st.integers(0, 32000), min_size=1, max_size=40)


@given(sequences, st.integers(0, 45), shapes)
def test_rows_cover_start_to_the_last_token_exclusive(
    tokens: list[int], start: int, shape: ExpertsShape
) -> None:
    rows = routed_experts(tokens, start, shape)
    assert len(rows) == max(0, len(tokens) - 1 - start)
    for row in rows:
        assert len(row) == shape.num_layers
        for layer in row:
            assert len(layer) == shape.top_k == len(set(layer))
            assert all(0 <= e < shape.num_experts for e in layer)


@given(sequences, sequences, shapes)
def test_a_row_depends_on_its_position_and_token_only(
    first: list[int], more: list[int], shape: ExpertsShape
) -> None:
    # The same prefix routes the same whatever follows it, and a later start is a suffix.
    whole = routed_experts(first + more, 0, shape)
    assert whole[: len(first) - 1] == routed_experts(first, 0, shape)
    assert routed_experts(first + more, len(first), shape) == whole[len(first) :]


@given(sequences, shapes)
def test_the_wire_form_round_trips(tokens: list[int], shape: ExpertsShape) -> None:
    rows = routed_experts(tokens, 0, shape)
    text = encode_routed_experts(rows)
    assert decode_routed_experts(text, shape) == rows
    assert len(base64.b64decode(text)) == 4 * len(rows) * shape.num_layers * shape.top_k


def test_encoding_is_int32_little_endian() -> None:
    assert base64.b64decode(encode_routed_experts([[[1, 258]]])) == b"\x01\x00\x00\x00\x02\x01\x00\x00"


def test_positions_tokens_and_layers_route_differently() -> None:
    shape = ExpertsShape(num_layers=2, top_k=2, num_experts=64)
    by_position = {experts_at(p, 500, 0, shape) for p in range(20)}
    by_token = {experts_at(3, t, 0, shape) for t in range(100, 120)}
    by_layer = {experts_at(3, 500, layer, shape) for layer in range(20)}
    assert min(len(by_position), len(by_token), len(by_layer)) > 10


@pytest.mark.parametrize(
    ("layers", "k", "experts", "why"),
    [(0, 1, 1, "num_layers and top_k"), (1, 0, 1, "num_layers and top_k"), (1, 3, 2, "num_experts must be")],
)
def test_shape_is_checked(layers: int, k: int, experts: int, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        ExpertsShape(layers, k, experts)
