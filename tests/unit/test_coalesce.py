"""Merging chunks never changes what a frontend reconstructs from the stream."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar_common.api import sidecar_pb2
from sidecar_server.coalesce import coalesce, merge_outputs

Out = sidecar_pb2.LLMEngineOutput


def chunk(index: int = 0, tokens: tuple[int, ...] = (), text: str | None = None, **kw: object) -> Out:
    out = Out(index=index, token_ids=list(tokens), **kw)  # type: ignore[arg-type]
    out.log_probs.extend(-0.5 * t for t in tokens)
    for t in tokens:
        out.top_logprobs.add().entries.add(token_id=t, logprob=-0.5 * t)
    if text is not None:
        out.text = text
    return out


def test_merge_concatenates_in_order_and_takes_the_terminal() -> None:
    usage = sidecar_pb2.CompletionUsage(prompt_tokens=3, completion_tokens=4, total_tokens=7)
    parts = [
        chunk(tokens=(1, 2), text="ab", cum_log_probs=-1.0),
        chunk(tokens=(3,)),
        chunk(
            tokens=(4,),
            text="d",
            cum_log_probs=-3.0,
            finish_reason=sidecar_pb2.STOP,
            stop_string="d",
            completion_usage=usage,
        ),
    ]
    merged = merge_outputs(parts)
    assert list(merged.token_ids) == [1, 2, 3, 4]
    assert list(merged.log_probs) == [-0.5, -1.0, -1.5, -2.0]
    assert [e.entries[0].token_id for e in merged.top_logprobs] == [1, 2, 3, 4]
    assert merged.text == "abd"
    assert merged.cum_log_probs == -3.0
    assert merged.finish_reason == sidecar_pb2.STOP
    assert merged.stop_string == "d"
    assert merged.completion_usage == usage


def test_merge_keeps_text_presence() -> None:
    assert not merge_outputs([chunk(tokens=(1,)), chunk(tokens=(2,))]).HasField("text")
    held_back = merge_outputs([chunk(tokens=(1,), text=""), chunk(tokens=(2,))])
    assert held_back.HasField("text")
    assert held_back.text == ""


def test_merge_stop_token_and_cum_logprob_last_set() -> None:
    merged = merge_outputs(
        [
            chunk(tokens=(1,), cum_log_probs=-1.0),
            chunk(tokens=(9,), finish_reason=sidecar_pb2.STOP, stop_token_id=9),
        ]
    )
    assert merged.stop_token_id == 9
    assert merged.cum_log_probs == -1.0


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ([], "merge_outputs needs at least one chunk"),
        ([chunk(0, (1,)), chunk(1, (2,))], "merge_outputs got chunks of different choices"),
        (
            [chunk(0, (1,), finish_reason=sidecar_pb2.EOS), chunk(0, (2,))],
            "only the last chunk of a merge may be terminal",
        ),
    ],
)
def test_merge_refuses_caller_bugs(parts: list[Out], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        merge_outputs(parts)


def test_merging_one_chunk_gives_that_chunk_for_its_choice() -> None:
    only = chunk(2, (7, 8), text="xy", finish_reason=sidecar_pb2.LENGTH)
    assert merge_outputs([only]) == only


def test_coalesce_groups_by_choice_in_first_appearance_order() -> None:
    batch = [chunk(1, (10,)), chunk(0, (1,)), chunk(1, (11,)), chunk(0, (2,), finish_reason=sidecar_pb2.EOS)]
    merged = coalesce(batch)
    assert [(m.index, list(m.token_ids)) for m in merged] == [(1, [10, 11]), (0, [1, 2])]
    assert merged[1].finish_reason == sidecar_pb2.EOS


def test_coalesce_never_merges_past_a_terminal() -> None:
    batch = [chunk(0, (1,), finish_reason=sidecar_pb2.EOS), chunk(0, (2,))]
    assert [list(m.token_ids) for m in coalesce(batch)] == [[1], [2]]


@dataclass
class Stream:
    chunks: list[Out]
    n: int


@st.composite
def streams(draw: st.DrawFn) -> Stream:
    n = draw(st.integers(1, 3))
    per_choice: list[list[Out]] = []
    for index in range(n):
        parts = draw(
            st.lists(
                st.tuples(
                    st.lists(st.integers(0, 1000), max_size=3), st.one_of(st.none(), st.text(max_size=3))
                ),
                min_size=1,
                max_size=6,
            )
        )
        outs = [chunk(index, tuple(tokens), text) for tokens, text in parts]
        outs[-1].finish_reason = draw(
            st.sampled_from([sidecar_pb2.EOS, sidecar_pb2.LENGTH, sidecar_pb2.STOP])
        )
        per_choice.append(outs)
    # A random interleaving that keeps each choice's own order.
    order = draw(st.permutations([i for i, outs in enumerate(per_choice) for _ in outs]))
    cursors = [0] * n
    merged: list[Out] = []
    for i in order:
        merged.append(per_choice[i][cursors[i]])
        cursors[i] += 1
    return Stream(merged, n)


Reconstructed = tuple[list[int], list[float], str | None, list[sidecar_pb2.FinishReason.ValueType]]


def reconstruct(outs: list[Out], n: int) -> list[Reconstructed]:
    result = []
    for index in range(n):
        mine = [o for o in outs if o.index == index]
        texts = [o.text for o in mine if o.HasField("text")]
        result.append(
            (
                [t for o in mine for t in o.token_ids],
                [lp for o in mine for lp in o.log_probs],
                "".join(texts) if texts else None,
                [o.finish_reason for o in mine if o.finish_reason != sidecar_pb2.UNSPECIFIED],
            )
        )
    return result


@settings(deadline=None)
@given(stream=streams(), data=st.data())
def test_any_split_coalesced_reconstructs_the_same_stream(stream: Stream, data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(stream.chunks) - 1)))))
    bounds = [0, *[c for c in cuts if c < len(stream.chunks)], len(stream.chunks)]
    sent: list[Out] = []
    for lo, hi in itertools.pairwise(bounds):
        sent.extend(coalesce(stream.chunks[lo:hi]))
    assert reconstruct(sent, stream.n) == reconstruct(stream.chunks, stream.n)
    for index in range(stream.n):
        mine = [o for o in sent if o.index == index]
        # The single terminal is still each choice's last message.
        assert mine[-1].finish_reason != sidecar_pb2.UNSPECIFIED
        assert all(o.finish_reason == sidecar_pb2.UNSPECIFIED for o in mine[:-1])
    assert len(sent) <= len(stream.chunks)


def reference_merge(parts: list[Out]) -> Out:
    """The merge rule spelled out field by field (what merge_outputs must equal)."""
    merged = Out(index=parts[0].index, finish_reason=parts[-1].finish_reason)
    texts = [p.text for p in parts if p.HasField("text")]
    if texts:
        merged.text = "".join(texts)
    for p in parts:
        merged.token_ids.extend(p.token_ids)
        merged.log_probs.extend(p.log_probs)
        merged.top_logprobs.extend(p.top_logprobs)
        if p.HasField("cum_log_probs"):
            merged.cum_log_probs = p.cum_log_probs
        if p.HasField("completion_usage"):
            merged.completion_usage.CopyFrom(p.completion_usage)
        if p.HasField("engine_data"):
            merged.engine_data.CopyFrom(p.engine_data)
        if p.HasField("disaggregated_params"):
            merged.disaggregated_params.CopyFrom(p.disaggregated_params)
        if p.HasField("bootstrap_info"):
            merged.bootstrap_info.CopyFrom(p.bootstrap_info)
        if p.prompt_logprobs:
            del merged.prompt_logprobs[:]
            merged.prompt_logprobs.extend(p.prompt_logprobs)
    which = parts[-1].WhichOneof("stop_reason")
    if which == "stop_token_id":
        merged.stop_token_id = parts[-1].stop_token_id
    elif which == "stop_string":
        merged.stop_string = parts[-1].stop_string
    return merged


@st.composite
def rich_parts(draw: st.DrawFn) -> list[Out]:
    count = draw(st.integers(2, 5))
    parts = []
    for _ in range(count):
        out = chunk(
            0, tuple(draw(st.lists(st.integers(0, 99), max_size=3))), draw(st.none() | st.text(max_size=2))
        )
        if draw(st.booleans()):
            out.cum_log_probs = draw(st.floats(-10, 0))
        if draw(st.booleans()):
            # Misplaced extras (not only on the terminal): the last one set wins, whole.
            usage = out.completion_usage
            usage.prompt_tokens = draw(st.integers(0, 9))
            usage.completion_tokens = draw(st.integers(0, 9))
            if draw(st.booleans()):
                usage.cached_tokens = draw(st.integers(0, 9))
        if draw(st.booleans()):
            out.engine_data.update({draw(st.sampled_from("ab")): draw(st.integers(0, 9))})
        if draw(st.booleans()):
            info = out.bootstrap_info
            info.bootstrap_host = draw(st.sampled_from(["", "p1", "p2"]))
            info.bootstrap_room = draw(st.integers(0, 9))
        for _ in range(draw(st.integers(0, 2))):
            position = out.prompt_logprobs.add()
            for token in draw(st.lists(st.integers(0, 9), max_size=2)):
                position.entries.add(token_id=token, logprob=-float(token))
        if draw(st.booleans()):
            # A stop reason on a non-terminal part is not the merge's (only the terminal's is).
            if draw(st.booleans()):
                out.stop_token_id = draw(st.integers(0, 9))
            else:
                out.stop_string = draw(st.text(max_size=2))
        parts.append(out)
    if draw(st.booleans()):
        parts[-1].finish_reason = sidecar_pb2.STOP
    return parts


@settings(deadline=None)
@given(parts=rich_parts())
def test_merge_equals_the_field_by_field_rule(parts: list[Out]) -> None:
    assert merge_outputs(parts) == reference_merge(parts)


def test_merge_concatenates_the_chosen_ids_logprobs_of_every_token() -> None:
    # SGLang's token_ids_logprob rows ride on each chunk with its tokens (not in engine_data,
    # whose last setter wins): a merge keeps every one, in order.
    parts = []
    for token, lp in ((5, -1.0), (6, -2.0)):
        part = sidecar_pb2.LLMEngineOutput(token_ids=[token])
        part.token_ids_logprobs.add().entries.add(token_id=7, logprob=lp)
        parts.append(part)
    merged = merge_outputs(parts)
    assert [row.entries[0].logprob for row in merged.token_ids_logprobs] == [-1.0, -2.0]
