"""Resume on request, the pure parts: the header's values, and an aborted leg's one answer
split by the weights that made its tokens (each piece labelled, nothing lost or reordered)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.resume import RESUME_HEADER, by_span, resume_wanted


@pytest.mark.parametrize(
    ("value", "default", "wanted"),
    [
        (None, False, False),
        (None, True, True),
        ("true", False, True),
        (" Yes ", False, True),
        ("1", False, True),
        ("on", False, True),
        ("false", True, False),
        ("0", True, False),
        ("no", True, False),
        ("OFF", True, False),
    ],
)
def test_the_header_decides_else_the_frontends_default(
    value: str | None, default: bool, wanted: bool
) -> None:
    assert resume_wanted(value, default) is wanted


def test_another_value_is_refused_naming_the_header() -> None:
    why = resume_wanted("maybe", True)
    assert isinstance(why, str)
    assert RESUME_HEADER in why
    assert "maybe" in why


def _partial(ids: list[int], cuts: list[int], versions: list[str]) -> sidecar_pb2.LLMEngineOutput:
    out = sidecar_pb2.LLMEngineOutput(token_ids=ids, log_probs=[-float(i) for i in range(len(ids))])
    bounds = [0, *cuts, len(ids)]
    for (start, end), version in zip(itertools.pairwise(bounds), versions, strict=False):
        out.weight_versions.add(version=version, start=start, end=end)
    out.weight_version = versions[-1]
    out.routed_experts = b"\x01\x00\x00\x00"
    return out


@st.composite
def aborted_answers(draw: st.DrawFn) -> tuple[sidecar_pb2.LLMEngineOutput, list[str]]:
    ids = draw(st.lists(st.integers(0, 50_000), min_size=1, max_size=40))
    cuts = sorted(draw(st.sets(st.integers(1, len(ids) - 1), max_size=4))) if len(ids) > 1 else []
    versions = [f"v{i}" for i in range(len(cuts) + 1)]
    return _partial(ids, cuts, versions), versions


@given(aborted_answers())
def test_pieces_keep_every_token_in_order_each_labelled_by_its_weights(
    answer: tuple[sidecar_pb2.LLMEngineOutput, list[str]],
) -> None:
    partial, versions = answer
    pieces = by_span(partial)
    assert [i for p in pieces for i in p.token_ids] == list(partial.token_ids)
    assert [x for p in pieces for x in p.log_probs] == list(partial.log_probs)
    labels = [label for p in pieces for label in [p.weight_version] * len(p.token_ids)]
    expected = [s.version for s in partial.weight_versions for _ in range(s.start, s.end)]
    assert labels == expected
    assert all(not p.weight_versions and not p.HasField("routed_experts") for p in pieces)
    assert len(pieces) == len(versions)


def test_an_output_whose_spans_do_not_tile_it_is_one_piece_with_its_own_label() -> None:
    """A streamed leg's terminal: its spans cover the whole leg, more than its own tokens."""
    out = sidecar_pb2.LLMEngineOutput(token_ids=[5, 6], weight_version="v2")
    out.weight_versions.add(version="v1", start=0, end=7)
    out.weight_versions.add(version="v2", start=7, end=9)
    (piece,) = by_span(out)
    assert list(piece.token_ids) == [5, 6]
    assert piece.weight_version == "v2"
    assert not piece.weight_versions
