"""Weight-version spans across a migrated generation (``weight_spans``, ``migration``): the
client's terminal says which weights made each of its output tokens, over the whole output,
however many legs made it; a generation that never moved gets exactly what its worker sent."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.migration import Migration
from sidecar_frontend.weight_spans import Span, merged

# One output: (tokens, the version that made them); one leg: its outputs, in order.
Output = tuple[int, str]
Leg = list[Output]

VERSIONS = st.sampled_from(["v1", "v2", "v3"])
OUTPUTS = st.lists(st.tuples(st.integers(0, 4), VERSIONS), min_size=0, max_size=5)


def spans_of_outputs(outputs: Leg) -> list[Span]:
    """The spans an engine writes on its terminal for these outputs (SGLang merges)."""
    spans: list[Span] = []
    at = 0
    for count, version in outputs:
        spans.append(Span(version, at, at + count))
        at += count
    joined = merged(spans)
    return joined or [Span(outputs[-1][1] if outputs else "v1", 0, 0)]


def engine_outputs(leg: Leg, first_token: int) -> list[sidecar_pb2.LLMEngineOutput]:
    """A leg's outputs, each labelled with its version; the last is the terminal with spans."""
    outs = []
    token = first_token
    for count, version in leg:
        outs.append(
            sidecar_pb2.LLMEngineOutput(token_ids=range(token, token + count), weight_version=version)
        )
        token += count
    if not outs:
        outs.append(sidecar_pb2.LLMEngineOutput(weight_version="v1"))
    terminal = outs[-1]
    terminal.finish_reason = sidecar_pb2.LENGTH
    spans = spans_of_outputs(leg)
    terminal.weight_versions.extend(
        sidecar_pb2.WeightVersionSpan(version=s.version, start=s.start, end=s.end) for s in spans
    )
    # SGLang labels a final output with its last span's version.
    terminal.weight_version = spans[-1].version
    return outs


def request(max_tokens: int, **output: object) -> sidecar_pb2.PreprocessedRequest:
    return sidecar_pb2.PreprocessedRequest(
        token_ids=[1, 2, 3],
        stop_conditions=sidecar_pb2.StopConditions(max_tokens=max_tokens),
        output_options=sidecar_pb2.OutputOptions(**output),  # type: ignore[arg-type]
    )


def run(legs: list[Leg]) -> tuple[list[sidecar_pb2.LLMEngineOutput], list[str]]:
    """Every leg but the last fails after delivering its outputs (not its terminal); the last
    ends. The client's outputs, and each delivered token's version, in order."""
    total = sum(count for leg in legs for count, _ in leg)
    migration = Migration(request(total + 1), limit=len(legs))
    given_outputs: list[sidecar_pb2.LLMEngineOutput] = []
    truth: list[str] = []
    for k, leg in enumerate(legs):
        outs = engine_outputs(leg, len(truth))
        last = k == len(legs) - 1
        for out in outs if last else [o for o in outs if o.token_ids]:
            if not last:
                out.finish_reason = sidecar_pb2.UNSPECIFIED
                del out.weight_versions[:]
            given_outputs.append(migration.delivered(out))
        truth += [version for count, version in leg for _ in range(count)]
        if not last:
            following = migration.after_failure(migratable=True)
            assert isinstance(following, sidecar_pb2.PreprocessedRequest)
    return given_outputs, truth


def tuples(output: sidecar_pb2.LLMEngineOutput) -> list[tuple[str, int, int]]:
    return [(s.version, s.start, s.end) for s in output.weight_versions]


@settings(max_examples=300, deadline=None)
@given(st.lists(OUTPUTS, min_size=1, max_size=4))
def test_joined_spans_tile_the_whole_output_by_the_weights_that_made_each_token(legs: list[Leg]) -> None:
    outs, truth = run(legs)
    terminal = outs[-1]
    spans = tuples(terminal)
    if not truth:
        # No output token at all: the last leg's one empty span, as the engine wrote it.
        assert [(s, e) for _, s, e in spans] == [(0, 0)]
        return
    # Contiguous from 0 to the end of the output: no gap, no overlap, nothing empty.
    assert spans[0][1] == 0
    assert spans[-1][2] == len(truth)
    assert all(a[2] == b[1] for a, b in itertools.pairwise(spans))
    assert all(start < end for _, start, end in spans)
    # Adjacent spans of one version are merged, as SGLang merges them.
    assert all(a[0] != b[0] for a, b in itertools.pairwise(spans))
    # Every token is labelled by the weights that made it.
    labels = [version for version, start, end in spans for _ in range(start, end)]
    assert labels == truth
    assert terminal.weight_version == spans[-1][0]


@settings(max_examples=200, deadline=None)
@given(OUTPUTS)
def test_a_generation_that_never_moved_gets_exactly_what_its_worker_sent(leg: Leg) -> None:
    total = sum(count for count, _ in leg)
    migration = Migration(request(total + 1, return_routed_experts=True, routed_experts_start_len=1))
    for out in engine_outputs(leg, 0):
        if out.finish_reason:
            out.routed_experts = b"\x01\x00\x00\x00" * (3 + total - 2)
        sent = sidecar_pb2.LLMEngineOutput()
        sent.CopyFrom(out)
        assert migration.delivered(out) == sent


def test_an_unlabelled_output_before_the_last_leg_leaves_the_spans_unsaid() -> None:
    migration = Migration(request(10))
    migration.delivered(sidecar_pb2.LLMEngineOutput(token_ids=[7, 8]))  # no label
    assert isinstance(migration.after_failure(migratable=True), sidecar_pb2.PreprocessedRequest)
    terminal = sidecar_pb2.LLMEngineOutput(
        token_ids=[9],
        finish_reason=sidecar_pb2.STOP,
        weight_version="v2",
        weight_versions=[sidecar_pb2.WeightVersionSpan(version="v2", start=0, end=1)],
    )
    given_output = migration.delivered(terminal)
    assert list(given_output.weight_versions) == []
    assert given_output.weight_version == "v2"


def test_unlabelled_outputs_of_the_last_leg_do_not_matter_its_spans_cover_them() -> None:
    migration = Migration(request(10))
    migration.delivered(sidecar_pb2.LLMEngineOutput(token_ids=[7, 8], weight_version="v1"))
    assert isinstance(migration.after_failure(migratable=True), sidecar_pb2.PreprocessedRequest)
    migration.delivered(sidecar_pb2.LLMEngineOutput(token_ids=[9]))  # no label
    terminal = sidecar_pb2.LLMEngineOutput(
        token_ids=[10],
        finish_reason=sidecar_pb2.STOP,
        weight_versions=[sidecar_pb2.WeightVersionSpan(version="v2", start=0, end=2)],
    )
    assert tuples(migration.delivered(terminal)) == [("v1", 0, 2), ("v2", 2, 4)]


@pytest.mark.parametrize("start", [None, 0, 2])
def test_a_continuation_asks_routed_experts_from_the_original_start(start: int | None) -> None:
    # The first attempt returned none (they come on its terminal only, which it never sent):
    # the continuation's prompt holds every delivered token, so from the original start its
    # rows cover the whole sequence, and its bytes are the client's answer as they are.
    options: dict[str, object] = {"return_routed_experts": True}
    if start is not None:
        options["routed_experts_start_len"] = start
    migration = Migration(request(10, **options))
    migration.delivered(sidecar_pb2.LLMEngineOutput(token_ids=[7, 8], weight_version="v1"))
    following = migration.after_failure(migratable=True)
    assert isinstance(following, sidecar_pb2.PreprocessedRequest)
    assert list(following.token_ids) == [1, 2, 3, 7, 8]
    assert following.output_options.return_routed_experts
    assert following.output_options.HasField("routed_experts_start_len") == (start is not None)
    assert following.output_options.routed_experts_start_len == (start or 0)
    rows = bytes(range(4 * 6))
    terminal = sidecar_pb2.LLMEngineOutput(token_ids=[9], finish_reason=sidecar_pb2.STOP, routed_experts=rows)
    assert migration.delivered(terminal).routed_experts == rows
