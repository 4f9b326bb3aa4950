"""The testkit engines' weight-version spans (pure): SGLang's change records and vLLM's span
starts both label every output token with the version in force when it was produced."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from testkit.weight_versions import (
    VersionChange,
    WeightVersionSpan,
    sglang_meta,
    sglang_spans,
    spans_of_labels,
    vllm_spans,
    vllm_track,
)

S = WeightVersionSpan


@pytest.mark.parametrize(
    ("changes", "current", "tokens", "spans"),
    [
        ([], "default", 0, [S("default", 0, 0)]),  # nothing generated: one empty span
        ([], "v1", 5, [S("v1", 0, 5)]),
        ([VersionChange("v1", 3)], "v2", 5, [S("v1", 0, 3), S("v2", 3, 5)]),
        # A change that found the request with no new tokens since the last adds nothing.
        ([VersionChange("v1", 3), VersionChange("v2", 3)], "v3", 5, [S("v1", 0, 3), S("v3", 3, 5)]),
        # Back to a version already in force: the spans merge.
        ([VersionChange("v1", 2), VersionChange("v2", 2)], "v1", 4, [S("v1", 0, 4)]),
        # Output cut below a recorded change (SGLang truncates events on a retract of embeds).
        ([VersionChange("v1", 6)], "v2", 4, [S("v1", 0, 4)]),
        # The version changed after the last token: the current one gets no span.
        ([VersionChange("v1", 4)], "v2", 4, [S("v1", 0, 4)]),
    ],
)
def test_sglang_spans(changes: list[VersionChange], current: str, tokens: int, spans: list[S]) -> None:
    assert sglang_spans(changes, current, tokens) == spans


def test_sglang_meta_reports_the_spans_and_the_last_version() -> None:
    shown, version = sglang_meta([S("v1", 0, 3), S("v2", 3, 5)], 5)
    assert shown == [{"version": "v1", "start": 0, "end": 3}, {"version": "v2", "start": 3, "end": 5}]
    assert version == "v2"
    # No tokens: the first span still shows, empty.
    assert sglang_meta([S("v7", 0, 0)], 0) == ([{"version": "v7", "start": 0, "end": 0}], "v7")


def test_vllm_spans() -> None:
    starts = vllm_track((), "a", 0)
    starts = vllm_track(starts, "a", 2)  # same version: no new span
    starts = vllm_track(starts, "b", 3)
    assert vllm_spans(starts, 5) == [S("a", 0, 3), S("b", 3, 5)]
    assert vllm_spans((), 0) == []
    assert vllm_spans((), 4) is None  # tokens no version labelled


# A history: per engine step, the version then in force and the tokens the step produced.
histories = st.lists(
    st.tuples(st.sampled_from(["default", "v1", "v2", "v3"]), st.integers(min_value=0, max_value=3)),
    max_size=30,
)


def labels_of(history: list[tuple[str, int]]) -> list[str]:
    return [version for version, made in history for _ in range(made)]


@given(histories)
def test_sglang_changes_label_each_token_with_the_version_that_made_it(
    history: list[tuple[str, int]],
) -> None:
    # The scheduler records a change on a request that has output when the version moves.
    changes: list[VersionChange] = []
    current, tokens = "default", 0
    for version, made in history:
        if version != current:
            if tokens:
                changes.append(VersionChange(current, tokens))
            current = version
        tokens += made
    labels = labels_of(history)
    spans = sglang_spans(changes, current, tokens)
    if labels:
        assert spans == spans_of_labels(labels)
    else:
        assert spans == [S(current, 0, 0)]


@given(histories)
def test_vllm_starts_label_each_token_with_the_version_that_made_it(history: list[tuple[str, int]]) -> None:
    starts: tuple[tuple[str, int], ...] = ()
    tokens = 0
    for version, made in history:
        if made:  # only a step that brought the request tokens is tracked
            starts = vllm_track(starts, version, tokens)
        tokens += made
    assert vllm_spans(starts, tokens) == spans_of_labels(labels_of(history))


@given(st.lists(st.sampled_from("abc"), max_size=40))
def test_spans_cover_the_output_contiguously(labels: list[str]) -> None:
    spans = spans_of_labels(labels)
    assert [s.start for s in spans[1:]] == [s.end for s in spans[:-1]]
    assert all(s.start < s.end for s in spans)
    assert all(a.version != b.version for a, b in itertools.pairwise(spans))
    assert (spans[0].start, spans[-1].end) == (0, len(labels)) if labels else spans == []
