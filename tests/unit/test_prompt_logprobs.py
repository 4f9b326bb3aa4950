"""sidecar_common.prompt_logprobs: the typed field and the two 0.1 Struct shapes convert into
each other without loss (round trips), an absent value stays apart from an explicit zero, and
a reader prefers the typed field."""

from __future__ import annotations

import math
from typing import Any

import pytest
from google.protobuf import struct_pb2
from hypothesis import given
from hypothesis import strategies as st

from sidecar_common import prompt_logprobs
from sidecar_common.api import sidecar_pb2
from sidecar_common.prompt_logprobs import Shape, from_struct_rows, to_struct_rows
from sidecar_common.structs import JSON, json_from_value

TOKENS = st.integers(0, 2**32 - 1)
LOGPROBS = st.floats(-1e6, 0.0, allow_nan=False) | st.just(0.0) | st.just(-0.0)
RANKS = st.none() | st.integers(0, 2**32 - 1)


entry = prompt_logprobs.candidate


def position(*entries: sidecar_pb2.TopLogprob) -> sidecar_pb2.TopLogprobs:
    return sidecar_pb2.TopLogprobs(entries=entries)


@st.composite
def prompts_with_positions(
    draw: st.DrawFn, *, ranked: bool
) -> tuple[list[int], list[sidecar_pb2.TopLogprobs]]:
    """A prompt and its positions as a sidecar sends them: per position none, or the prompt
    token first then alternatives with distinct ids."""
    prompt = draw(st.lists(TOKENS, min_size=1, max_size=6))
    positions = []
    for token in prompt:
        if draw(st.booleans()):
            positions.append(position())
            continue
        others = [t for t in draw(st.lists(TOKENS, unique=True, max_size=4)) if t != token]
        ranks = RANKS if ranked else st.none()
        positions.append(position(*(entry(t, draw(LOGPROBS), draw(ranks)) for t in (token, *others))))
    return prompt, positions


def over_the_wire(rows: list[JSON]) -> JSON:
    """The rows as a Struct value that crossed the wire, read back as JSON."""
    struct = struct_pb2.Struct()
    struct.update({"rows": rows})
    received = struct_pb2.Struct.FromString(struct.SerializeToString())
    return json_from_value(received.fields["rows"])


@given(case=prompts_with_positions(ranked=False))
def test_listed_shape_round_trips_exactly(case: tuple[list[int], list[sidecar_pb2.TopLogprobs]]) -> None:
    prompt, positions = case
    back = from_struct_rows(over_the_wire(to_struct_rows(positions, Shape.LISTED)), prompt)
    assert back == positions


@given(case=prompts_with_positions(ranked=True))
def test_by_token_shape_round_trips_with_the_prompt_token_first(
    case: tuple[list[int], list[sidecar_pb2.TopLogprobs]],
) -> None:
    # A Struct keeps no key order: the prompt puts its token first, the others are a set.
    prompt, positions = case
    back = from_struct_rows(over_the_wire(to_struct_rows(positions, Shape.BY_TOKEN)), prompt)
    assert back is not None
    assert len(back) == len(positions)
    for got, sent in zip(back, positions, strict=True):
        assert got.entries[:1] == sent.entries[:1]
        key = lambda e: e.token_id  # noqa: E731
        assert sorted(got.entries[1:], key=key) == sorted(sent.entries[1:], key=key)


def test_absent_and_explicit_zero_stay_apart() -> None:
    positions = [
        position(),  # no logprobs at this position (JSON null)
        position(entry(5, 0.0, 0), entry(6, -1.0)),  # logprob 0 and rank 0 given; 6 has no rank
    ]
    rows = to_struct_rows(positions, Shape.BY_TOKEN)
    assert rows == [None, {"5": {"logprob": 0.0, "rank": 0}, "6": {"logprob": -1.0}}]
    back = from_struct_rows(over_the_wire(rows), [4, 5])
    assert back is not None
    assert not back[0].entries
    assert back[1].entries[0].HasField("rank")
    assert back[1].entries[0].rank == 0
    assert back[1].entries[0].logprob == 0.0
    assert not back[1].entries[1].HasField("rank")
    assert to_struct_rows(positions, Shape.LISTED) == [
        None,
        [{"token_id": 5, "logprob": 0.0}, {"token_id": 6, "logprob": -1.0}],
    ]


LEGACY_ROWS: list[tuple[str, JSON, list[list[tuple[int, float, int | None]]] | None]] = [
    ("not a list", {"0": None}, None),
    ("null and the empty list", [None, []], [[], []]),
    ("a number where a position goes", [3], [[]]),
    ("by token, rank known", [{"7": {"logprob": -0.5, "rank": 2}}], [[(7, -0.5, 2)]]),
    (
        "listed",
        [[{"token_id": 7, "logprob": -0.5}, {"token_id": 8, "logprob": -1}]],
        [[(7, -0.5, None), (8, -1.0, None)]],
    ),
    (
        "a logprob that is no number reads as NaN",
        [[{"token_id": 7}], {"8": {"logprob": "x"}}],
        [[(7, math.nan, None)], [(8, math.nan, None)]],
    ),
    (
        "a rank that is no uint32 is absent",
        [{"7": {"logprob": -1, "rank": -1}, "8": {"logprob": -1, "rank": True}}],
        [[(7, -1.0, None), (8, -1.0, None)]],
    ),
    (
        "token ids that are not uint32 are left out",
        [{"-1": {"logprob": -1}, "x": {"logprob": -1}, "4294967296": {"logprob": -1}}],
        [[]],
    ),
    (
        "listed items without an id are left out",
        [[{"token_id": True, "logprob": -1}, {"logprob": -1}, 5, {"token_id": 2**32}]],
        [[]],
    ),
    ("a by-token candidate that is no object is left out", [{"7": -1.0}], [[]]),
]


@pytest.mark.parametrize(("rows", "expected"), [c[1:] for c in LEGACY_ROWS], ids=[c[0] for c in LEGACY_ROWS])
def test_legacy_rows_read_as(rows: JSON, expected: list[list[tuple[int, float, int | None]]] | None) -> None:
    got = from_struct_rows(rows)
    if expected is None:
        assert got is None
        return
    assert got is not None
    seen = [[(e.token_id, e.logprob, e.rank if e.HasField("rank") else None) for e in p.entries] for p in got]
    assert len(seen) == len(expected)
    for got_row, want_row in zip(seen, expected, strict=True):
        assert len(got_row) == len(want_row)
        for (token, lp, rank), (want_token, want_lp, want_rank) in zip(got_row, want_row, strict=True):
            assert (token, rank) == (want_token, want_rank)
            assert (math.isnan(lp) and math.isnan(want_lp)) or lp == want_lp


def test_a_negative_zero_is_written_as_zero_as_a_struct_reads_it_back() -> None:
    written = entry(1, -0.0)
    assert math.copysign(1.0, written.logprob) == 1.0
    assert over_the_wire([-0.0]) == [0]


def test_by_token_rows_keep_the_first_of_a_repeated_token() -> None:
    rows = to_struct_rows([position(entry(5, -1.0, 1), entry(5, -2.0, 2))], Shape.BY_TOKEN)
    assert rows == [{"5": {"logprob": -1.0, "rank": 1}}]


@pytest.mark.parametrize("shape", list(Shape))
def test_attach_writes_the_typed_field_and_the_struct_of_the_shape(shape: Shape) -> None:
    positions = [position(), position(entry(5, -0.25, 1), entry(9, -2.0, 2))]
    out = sidecar_pb2.LLMEngineOutput()
    prompt_logprobs.attach(out, positions, shape)
    assert list(out.prompt_logprobs) == positions
    assert json_from_value(out.engine_data.fields["prompt_logprobs"]) == to_struct_rows(positions, shape)


def _with_struct(rows: Any) -> sidecar_pb2.LLMEngineOutput:
    out = sidecar_pb2.LLMEngineOutput()
    out.engine_data.update({"prompt_logprobs": rows})
    return out


def test_the_reader_prefers_the_typed_field() -> None:
    out = _with_struct([None, [{"token_id": 1, "logprob": -9.0}]])
    out.prompt_logprobs.extend([position(), position(entry(1, -1.0))])
    assert prompt_logprobs.carried(out)
    assert list(prompt_logprobs.of_output(out) or ()) == list(out.prompt_logprobs)


def test_the_reader_falls_back_to_a_0_1_sidecars_struct() -> None:
    out = _with_struct([None, {"3": {"logprob": -1.0}, "1": {"logprob": -0.5, "rank": 1}}])
    got = prompt_logprobs.of_output(out, [0, 1])
    assert got is not None
    assert [[(e.token_id, e.logprob) for e in p.entries] for p in got] == [[], [(1, -0.5), (3, -1.0)]]


def test_without_either_form_nothing_is_carried() -> None:
    out = sidecar_pb2.LLMEngineOutput(token_ids=[1])
    out.engine_data.update({"other": 1})
    assert not prompt_logprobs.carried(out)
    assert prompt_logprobs.of_output(out) is None
    assert prompt_logprobs.of_output(sidecar_pb2.LLMEngineOutput()) is None


def test_an_unreadable_struct_is_carried_but_reads_as_none() -> None:
    # A non-finite number cannot cross to JSON: the position list is unreadable, as before.
    out = _with_struct([[{"token_id": 1, "logprob": float("-inf")}]])
    assert prompt_logprobs.carried(out)
    assert prompt_logprobs.of_output(out) is None
    assert prompt_logprobs.of_output(_with_struct({"not": "a list"})) is None


@pytest.mark.parametrize("shape", list(Shape))
def test_truncate_cuts_both_forms(shape: Shape) -> None:
    positions = [position(entry(t, -1.0)) for t in (1, 2, 3)]
    out = sidecar_pb2.LLMEngineOutput()
    prompt_logprobs.attach(out, positions, shape)
    prompt_logprobs.truncate(out, 2)
    assert list(out.prompt_logprobs) == positions[:2]
    assert json_from_value(out.engine_data.fields["prompt_logprobs"]) == to_struct_rows(positions[:2], shape)
