"""SGLang response conversion: one state machine for both wires (docs/sglang.md "Response
conversion"), in cumulative and incremental modes."""

from __future__ import annotations

from typing import Any, Final

import pytest
from google.protobuf import json_format
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar_common import bootstrap_handoff
from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import EngineOrigin, FailureReason, SidecarError
from sidecar_sglang.convert_request import Bootstrap, NativeRequest, NativeSampling, handoff_info
from sidecar_sglang.convert_response import (
    NativeEvent,
    ResponseState,
    error_from_http_status,
    event_from_http,
)


def native(**fields: Any) -> NativeRequest:
    base: dict[str, Any] = {"rid": "r", "input_ids": (1, 2, 3, 4), "sampling": NativeSampling()}
    base.update(fields)
    return NativeRequest(**base)


def ev(ids: list[int], finish: object = None, finished: bool | None = None, **meta: object) -> NativeEvent:
    m: dict[str, object] = {"finish_reason": finish, **meta}
    return NativeEvent(ids, m, finish is not None if finished is None else finished)


def run(state: ResponseState, events: list[NativeEvent]) -> list[sidecar_pb2.LLMEngineOutput]:
    outs: list[sidecar_pb2.LLMEngineOutput] = []
    for event in events:
        outs.extend(state.feed(event, aborted_by_us=False))
    return outs


def stop(matched: object = None) -> dict[str, object]:
    return {"type": "stop", "matched": matched}


def test_cumulative_deltas_and_usage() -> None:
    state = ResponseState(native(), cumulative=True)
    outs = run(
        state,
        [ev([5]), ev([5, 6, 7]), ev([5, 6, 7, 8], stop(), prompt_tokens=4, cached_tokens=9)],
    )
    assert [list(o.token_ids) for o in outs] == [[5], [6, 7], [8]]
    terminal = outs[-1]
    assert terminal.finish_reason == sidecar_pb2.STOP
    assert terminal.WhichOneof("stop_reason") is None
    usage = terminal.completion_usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens, usage.cached_tokens) == (
        4,
        4,
        8,
        4,
    )
    assert state.done


def test_incremental_deltas() -> None:
    outs = run(
        ResponseState(native(), cumulative=False),
        [ev([5]), ev([6, 7]), ev([8], {"type": "length", "length": 4})],
    )
    assert [list(o.token_ids) for o in outs] == [[5], [6, 7], [8]]
    assert outs[-1].finish_reason == sidecar_pb2.LENGTH


def test_cached_absent_stays_absent() -> None:
    outs = run(ResponseState(native(), cumulative=False), [ev([5], "length", prompt_tokens=4)])
    assert not outs[0].completion_usage.HasField("cached_tokens")


@pytest.mark.parametrize(
    ("matched", "kind", "value"),
    [
        ("END", "stop_string", "END"),
        (19, "stop_token_id", 19),
        (2, None, None),  # EOS / hidden: never a stop reason
        (None, None, None),
    ],
)
def test_stop_reasons(matched: object, kind: str | None, value: object) -> None:
    request = native(user_stop_token_ids=frozenset({19}))
    (out,) = run(ResponseState(request, cumulative=False), [ev([9], stop(matched))])
    assert out.finish_reason == sidecar_pb2.STOP
    assert out.WhichOneof("stop_reason") == kind
    if kind is not None:
        assert getattr(out, kind) == value


def test_stop_without_matched_key_and_bare_string() -> None:
    (a,) = run(ResponseState(native(), cumulative=False), [ev([9], {"type": "stop"})])
    (b,) = run(ResponseState(native(), cumulative=False), [ev([9], "stop")])
    for out in (a, b):
        assert out.finish_reason == sidecar_pb2.STOP
        assert out.WhichOneof("stop_reason") is None


@pytest.mark.parametrize("finish", [None, {"type": "weird"}, 42, "done", {"matched": 1}])
def test_finished_without_known_finish_reason_is_protocol_error(finish: object) -> None:
    state = ResponseState(native(), cumulative=False)
    with pytest.raises(SidecarError) as info:
        state.feed(ev([1], finish, finished=True), aborted_by_us=False)
    assert info.value.reason is FailureReason.PROTOCOL_ERROR
    assert "missing finish_reason" in info.value.message


PAUSE_ABORT = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
QUEUE_ABORT = {"type": "abort", "message": "Abort in waiting queue"}


def test_abort_we_asked_for_is_a_cancelled_terminal_with_the_tokens_so_far() -> None:
    state = ResponseState(native(), cumulative=True)
    state.feed(ev([1]), aborted_by_us=False)
    (terminal,) = state.feed(ev([1, 2, 3], {"type": "abort", "message": "Abort"}), aborted_by_us=True)
    assert terminal.finish_reason == sidecar_pb2.CANCELLED
    assert list(terminal.token_ids) == [2, 3]
    assert terminal.completion_usage.completion_tokens == 3


@pytest.mark.parametrize("finish", [PAUSE_ABORT, QUEUE_ABORT])
def test_an_abort_without_a_status_is_answered_as_sglang_answers_it(finish: dict[str, object]) -> None:
    """A pause's abort (or an abort request's): the output so far, its usage and spans, as a
    CANCELLED terminal (a non-streaming answer: every id at once)."""
    spans = [{"version": "v1", "start": 0, "end": 2}, {"version": "v2", "start": 2, "end": 3}]
    event = ev(
        [7, 8, 9], finish, prompt_tokens=4, completion_tokens=3, weight_version="v2", weight_versions=spans
    )
    (terminal,) = ResponseState(native(), cumulative=True).feed(event, aborted_by_us=False)
    assert terminal.finish_reason == sidecar_pb2.CANCELLED
    assert list(terminal.token_ids) == [7, 8, 9]
    usage = terminal.completion_usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (4, 3, 7)
    assert terminal.weight_version == "v2"
    assert [(s.version, s.start, s.end) for s in terminal.weight_versions] == [("v1", 0, 2), ("v2", 2, 3)]


@pytest.mark.parametrize(
    ("ids", "reported", "forwarded"),
    [
        ([6], 2, []),  # a queued or held request's abort repeats the last id it sent
        ([7], 3, [7]),  # the step in flight's token rides on a scheduler abort
        ([], 2, []),
    ],
)
def test_an_incremental_abort_forwards_only_new_ids(
    ids: list[int], reported: int, forwarded: list[int]
) -> None:
    state = ResponseState(native(), cumulative=False)
    run(state, [ev([5]), ev([6])])
    (terminal,) = state.feed(ev(ids, PAUSE_ABORT, completion_tokens=reported), aborted_by_us=False)
    assert terminal.finish_reason == sidecar_pb2.CANCELLED
    assert list(terminal.token_ids) == forwarded
    assert terminal.completion_usage.completion_tokens == 2 + len(forwarded)


def test_a_prefill_abort_is_still_an_error() -> None:
    state = ResponseState(native(prefill=True), cumulative=True)
    with pytest.raises(SidecarError) as info:
        state.feed(ev([], PAUSE_ABORT), aborted_by_us=False)
    assert info.value.reason is FailureReason.UNKNOWN


@pytest.mark.parametrize(
    ("status", "reason", "exact"),
    [
        (400, FailureReason.INVALID_ARGUMENT, True),
        (503, FailureReason.OVERLOADED, True),
        (None, FailureReason.UNKNOWN, False),
        (500, FailureReason.UNKNOWN, False),
        (502, FailureReason.UNKNOWN, False),
    ],
)
def test_engine_abort_keeps_engine_words(status: int | None, reason: FailureReason, exact: bool) -> None:
    finish = {"type": "abort", "message": "prompt too long", "status_code": status, "err_type": "BadRequest"}
    with pytest.raises(SidecarError) as info:
        ResponseState(native(), cumulative=False).feed(ev([], finish), aborted_by_us=False)
    assert info.value.reason is reason
    if exact:
        # A refusal (4xx) or a busy engine (503): SGLang's sentence as it is, its origin beside.
        assert info.value.message == "prompt too long"
        assert info.value.origin == EngineOrigin("Generate", f"abort status_code={status}")
        return
    assert info.value.origin is None
    assert "prompt too long" in info.value.message
    assert "type=abort" in info.value.message
    if status is not None:
        assert f"status_code={status}" in info.value.message
        assert "err_type=BadRequest" in info.value.message


def test_completion_count_mismatch_on_terminal_is_protocol_error() -> None:
    state = ResponseState(native(), cumulative=True)
    run(state, [ev([5, 6])])
    with pytest.raises(SidecarError) as info:
        state.feed(ev([5, 6, 7], "length", completion_tokens=4), aborted_by_us=False)
    assert info.value.reason is FailureReason.PROTOCOL_ERROR
    ok = ResponseState(native(), cumulative=True)
    assert run(ok, [ev([5, 6, 7], "length", completion_tokens=3)])[0].completion_usage.completion_tokens == 3


@pytest.mark.parametrize(
    "meta",
    [
        {"output_token_logprobs": [[10**400, 5, None]]},
        {"output_token_logprobs": [[-0.1, 2**40, None]]},
        {"output_token_logprobs": [[-0.1, 5, None]], "output_top_logprobs": [[[-0.2, -3, None]]]},
    ],
)
def test_out_of_range_logprob_entries_are_protocol_errors(meta: dict[str, Any]) -> None:
    state = ResponseState(native(return_logprob=True, logprobs=1), cumulative=False)
    with pytest.raises(SidecarError) as info:
        state.feed(ev([5], **meta), aborted_by_us=False)
    assert info.value.reason is FailureReason.PROTOCOL_ERROR


def test_out_of_range_usage_numbers_fall_back_or_stay_absent() -> None:
    (out,) = run(
        ResponseState(native(), cumulative=False),
        [ev([5], "length", prompt_tokens=2**40, cached_tokens=2**40)],
    )
    assert out.completion_usage.prompt_tokens == 4
    assert out.completion_usage.cached_tokens == 4


def test_end_of_stream_errors() -> None:
    state = ResponseState(native(), cumulative=False)
    assert state.end_of_stream(aborted_by_us=False).reason is FailureReason.ENGINE_SHUTDOWN
    assert state.end_of_stream(aborted_by_us=True).reason is FailureReason.CANCELLED


def triple(lp: float, tid: int) -> list[object]:
    return [lp, tid, None]


def test_logprobs_cumulative_sliced_sampled_first() -> None:
    request = native(return_logprob=True, logprobs=1)
    lps = [triple(-0.1, 5), triple(-0.2, 6)]
    tops = [[triple(-0.1, 5), triple(-2.0, 9)], [triple(-1.0, 7), triple(-0.2, 6)]]
    state = ResponseState(request, cumulative=True)
    outs = run(
        state,
        [
            ev([5], output_token_logprobs=lps[:1], output_top_logprobs=tops[:1]),
            ev([5, 6], "length", output_token_logprobs=lps, output_top_logprobs=tops),
        ],
    )
    assert [list(o.log_probs) for o in outs] == [[-0.1], [-0.2]]
    first = outs[0].top_logprobs[0].entries
    assert [(e.token_id, e.HasField("rank")) for e in first] == [(5, True)]
    second = outs[1].top_logprobs[0].entries
    assert [e.token_id for e in second] == [6, 7]
    assert second[1].rank == 1


PROMPT_META: Final[dict[str, Any]] = {
    "input_token_logprobs": [[None, 1, None], triple(-0.5, 2)],
    "input_top_logprobs": [None, [triple(-0.3, 8)]],
}


def _prompt_rows(out: sidecar_pb2.LLMEngineOutput) -> list[list[float] | None]:
    data = out.engine_data.fields["prompt_logprobs"].list_value.values
    return [
        None
        if v.WhichOneof("kind") == "null_value"
        else [e.struct_value.fields["token_id"].number_value for e in v.list_value.values]
        for v in data
    ]


@pytest.mark.parametrize("cumulative", [False, True])
def test_prompt_logprobs_come_once_with_the_first_output_after_the_engine_sent_them(cumulative: bool) -> None:
    # SGLang sends the prompt's logprobs with its first event after prefill (and repeats them).
    request = native(return_logprob=True, prompt_logprobs=1)
    events = [ev([5], **PROMPT_META), ev([5, 6] if cumulative else [6], "length", **PROMPT_META)]
    outs = run(ResponseState(request, cumulative=cumulative), events)
    assert _prompt_rows(outs[0]) == [None, [2, 8]]
    assert [[(e.token_id, e.logprob) for e in p.entries] for p in outs[0].prompt_logprobs] == [
        [],
        [(2, -0.5), (8, -0.3)],
    ]
    assert not outs[-1].HasField("engine_data"), "once"
    assert not outs[-1].prompt_logprobs, "once"
    assert not outs[0].log_probs  # output logprobs were not asked


def test_prompt_logprobs_wait_for_an_output_that_can_carry_them() -> None:
    request = native(return_logprob=True, prompt_logprobs=1)
    outs = run(ResponseState(request, cumulative=False), [ev([], **PROMPT_META), ev([6], "length")])
    (terminal,) = outs
    assert _prompt_rows(terminal) == [None, [2, 8]]


def test_prompt_logprobs_not_asked_are_not_sent() -> None:
    outs = run(ResponseState(native(return_logprob=True), cumulative=False), [ev([5], **PROMPT_META)])
    assert not any(o.HasField("engine_data") for o in outs)


def test_prefill_grpc_ignores_chunks_and_hands_off() -> None:
    bootstrap = Bootstrap("10.1.1.1", 8998, 2**63 - 1)
    state = ResponseState(native(prefill=True, bootstrap=bootstrap), cumulative=True)
    outs = run(state, [ev([5]), ev([5], "length", prompt_tokens=4)])
    (terminal,) = outs
    assert list(terminal.token_ids) == []
    assert (terminal.completion_usage.prompt_tokens, terminal.completion_usage.completion_tokens) == (4, 0)
    triple = handoff_info(bootstrap)
    assert terminal.bootstrap_info == triple
    assert state.handoff().bootstrap_info == triple
    # For 0.1 frontends, through 0.2.x: the same triple in the Struct they read.
    assert terminal.disaggregated_params == bootstrap_handoff.to_struct(triple)
    assert state.handoff().disaggregated_params == bootstrap_handoff.to_struct(triple)
    assert state.handoff().finish_reason == sidecar_pb2.UNSPECIFIED


def test_text_deltas_cumulative_and_incremental() -> None:
    cum = ResponseState(native(), cumulative=True)
    outs = run(
        cum,
        [NativeEvent([5], {}, False, "he"), NativeEvent([5, 6], {"finish_reason": "length"}, True, "hello")],
    )
    assert [o.text for o in outs] == ["he", "llo"]
    inc = ResponseState(native(), cumulative=False)
    outs = run(
        inc, [NativeEvent([5], {}, False, ""), NativeEvent([6], {"finish_reason": "length"}, True, "x")]
    )
    assert [o.text for o in outs] == ["", "x"]
    assert outs[0].HasField("text")


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        ("400", FailureReason.INVALID_ARGUMENT),
        (" 503 ", FailureReason.CANNOT_CONNECT),
        ("²", FailureReason.UNKNOWN),  # a digit int() refuses: no code, so the default 500
        ("--400", FailureReason.UNKNOWN),
        ("", FailureReason.UNKNOWN),
    ],
)
def test_http_error_codes_given_as_text(code: str, reason: FailureReason) -> None:
    with pytest.raises(SidecarError) as info:
        event_from_http({"error": {"message": "boom", "code": code}})
    assert info.value.reason is reason


def test_http_events() -> None:
    event = event_from_http({"text": "a", "output_ids": [1], "meta_info": {"finish_reason": None}})
    assert (event.finished, event.text, list(event.output_ids)) == (False, "a", [1])
    with pytest.raises(SidecarError) as info:
        event_from_http({"error": {"message": "bad input", "type": "invalid_request_error", "code": 400}})
    assert info.value.reason is FailureReason.INVALID_ARGUMENT
    assert "bad input" in info.value.message
    with pytest.raises(SidecarError) as info:
        event_from_http([1, 2])
    assert info.value.reason is FailureReason.PROTOCOL_ERROR


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (400, FailureReason.INVALID_ARGUMENT),
        (404, FailureReason.INVALID_ARGUMENT),
        (401, FailureReason.UNKNOWN),
        (403, FailureReason.UNKNOWN),
        (500, FailureReason.UNKNOWN),
        (502, FailureReason.CANNOT_CONNECT),
        (503, FailureReason.CANNOT_CONNECT),
        (504, FailureReason.CANNOT_CONNECT),
        (505, FailureReason.UNKNOWN),
    ],
)
def test_http_status_table(status: int, reason: FailureReason) -> None:
    error = error_from_http_status(status, "words")
    assert error.reason is reason
    assert "words" in error.message


# --- properties -----------------------------------------------------------------------


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    ids = draw(st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=30))
    cuts = sorted(draw(st.lists(st.integers(0, len(ids)), max_size=6)))
    return ids, cuts


@given(streams(), st.booleans())
def test_deltas_concatenate_to_engine_ids(stream: tuple[list[int], list[int]], cumulative: bool) -> None:
    ids, cuts = stream
    bounds = [*cuts, len(ids)]
    events: list[NativeEvent] = []
    previous = 0
    for i, end in enumerate(bounds):
        last = i == len(bounds) - 1
        chunk = ids[:end] if cumulative else ids[previous:end]
        events.append(ev(chunk, "length" if last else None))
        previous = end
    state = ResponseState(native(), cumulative=cumulative)
    outs = run(state, events)
    assert [t for o in outs for t in o.token_ids] == ids
    assert sum(o.finish_reason != sidecar_pb2.UNSPECIFIED for o in outs) == 1
    assert outs[-1].finish_reason == sidecar_pb2.LENGTH
    assert outs[-1].completion_usage.completion_tokens == len(ids)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
# Shapes close to logprob lists, so the property reaches the entry checks.
triple_like = st.lists(
    st.integers(-5, 2**33) | st.floats() | st.none() | st.integers(), min_size=2, max_size=3
)
triples_like = st.lists(triple_like | st.lists(triple_like, max_size=3) | st.none(), max_size=4)
meta_keys = st.sampled_from(
    [
        "finish_reason",
        "prompt_tokens",
        "cached_tokens",
        "output_token_logprobs",
        "output_top_logprobs",
        "input_token_logprobs",
        "input_top_logprobs",
        "id",
    ]
)


@settings(max_examples=300)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(-3, 50), min_size=0, max_size=4),
            st.dictionaries(meta_keys, json_values | triples_like, max_size=5),
            st.booleans(),
        ),
        max_size=5,
    ),
    st.booleans(),
    st.booleans(),
)
def test_arbitrary_meta_raises_only_sidecar_errors(
    events: list[tuple[list[int], dict[str, object], bool]], cumulative: bool, logprobs: bool
) -> None:
    request = native(
        return_logprob=logprobs, logprobs=2 if logprobs else None, prompt_logprobs=1 if logprobs else None
    )
    state = ResponseState(request, cumulative=cumulative)
    terminals = 0
    try:
        for ids, meta, finished in events:
            for out in state.feed(NativeEvent(ids, meta, finished), aborted_by_us=False):
                terminals += out.finish_reason != sidecar_pb2.UNSPECIFIED
    except SidecarError:
        return
    assert terminals <= 1


@settings(max_examples=200)
@given(
    st.lists(st.integers(0, 100), min_size=1, max_size=4),
    st.lists(st.lists(triple_like, max_size=3) | st.none() | json_values, max_size=4),
    st.integers(0, 3),
)
def test_arbitrary_top_alternatives_raise_only_sidecar_errors(
    ids: list[int], tops: list[Any], limit: int
) -> None:
    """Valid sampled entries, anything at all as the alternatives."""
    request = native(return_logprob=True, logprobs=limit)
    meta: dict[str, Any] = {
        "output_token_logprobs": [[-0.5, t, None] for t in ids],
        "output_top_logprobs": tops,
    }
    try:
        (out,) = ResponseState(request, cumulative=False).feed(ev(ids, "length", **meta), aborted_by_us=False)
    except SidecarError:
        return
    assert [top.entries[0].token_id for top in out.top_logprobs] == ids
    assert all(len(top.entries) <= limit + 1 for top in out.top_logprobs)


# ------------------------------------------------- aborted prefill, long cumulative streams

PREFILL_BOOTSTRAP = Bootstrap("10.1.1.1", 8998, 77)


@pytest.mark.parametrize("cumulative", [True, False])
def test_a_prefill_aborted_at_our_request_is_cancelled_and_hands_nothing_off(cumulative: bool) -> None:
    state = ResponseState(native(prefill=True, bootstrap=PREFILL_BOOTSTRAP), cumulative=cumulative)
    assert run(state, [ev([5])]) == []
    with pytest.raises(SidecarError) as info:
        state.feed(ev([5], {"type": "abort", "message": "Abort"}), aborted_by_us=True)
    assert info.value.reason is FailureReason.CANCELLED
    assert state.done, "nothing after the abort may produce a terminal (with its handoff)"


@pytest.mark.parametrize(
    ("status", "reason"),
    [(None, FailureReason.UNKNOWN), (503, FailureReason.OVERLOADED), (400, FailureReason.INVALID_ARGUMENT)],
)
def test_a_prefill_the_engine_aborted_on_its_own_keeps_the_engines_error(
    status: int | None, reason: FailureReason
) -> None:
    state = ResponseState(native(prefill=True, bootstrap=PREFILL_BOOTSTRAP), cumulative=True)
    finish = {"type": "abort", "message": "scheduler is shutting down", "status_code": status}
    with pytest.raises(SidecarError) as info:
        state.feed(ev([5], finish), aborted_by_us=False)
    assert info.value.reason is reason
    assert "scheduler is shutting down" in info.value.message


def test_cumulative_text_and_ids_over_many_events_give_exact_deltas() -> None:
    state = ResponseState(native(), cumulative=True)
    texts = ["he", "hello", "hello wor", "hello world", "hello world!"]
    ids = [[5], [5, 6], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8, 9]]
    events = [NativeEvent(i, {}, False, t) for i, t in zip(ids[:-1], texts[:-1], strict=True)]
    events.append(NativeEvent(ids[-1], {"finish_reason": "length"}, True, texts[-1]))
    outs = run(state, events)
    assert [o.text for o in outs] == ["he", "llo", " wor", "ld", "!"]
    assert [list(o.token_ids) for o in outs] == [[5], [6], [7, 8], [], [9]]
    assert "".join(o.text for o in outs) == texts[-1]
    assert outs[-1].completion_usage.completion_tokens == 5


@pytest.mark.parametrize("cumulative", [True, False])
def test_sglangs_own_prompt_tokens_are_reported_when_they_differ_from_the_request(cumulative: bool) -> None:
    # The request carried 4 ids; the engine counted 7 (e.g. a multimodal prompt expanded).
    state = ResponseState(native(), cumulative=cumulative)
    (out,) = run(state, [ev([5], "length", prompt_tokens=7, cached_tokens=3)])
    usage = out.completion_usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens, usage.cached_tokens) == (
        7,
        1,
        8,
        3,
    )


def _chosen(out: sidecar_pb2.LLMEngineOutput, key: str = "token_ids_logprobs") -> Any:
    if key == "token_ids_logprobs":
        return [
            [{"token_id": e.token_id, "logprob": e.logprob} for e in row.entries]
            for row in out.token_ids_logprobs
        ]
    return json_format.MessageToDict(out.engine_data).get(key)


@pytest.mark.parametrize("cumulative", [False, True])
def test_token_ids_logprobs_ride_with_their_tokens_and_the_prompt_rows_once(cumulative: bool) -> None:
    request = native(return_logprob=True, logprobs=0, prompt_logprobs=0, token_ids_logprob=(7,))
    rows = [[[-1.0, 7, None]], [[-2.0, 7, None]]]
    first: dict[str, Any] = {
        "output_token_logprobs": [triple(-0.1, 5)],
        "output_token_ids_logprobs": rows[:1],
        "input_token_logprobs": [[None, 1, None], triple(-0.5, 2)],
        "input_token_ids_logprobs": [None, [[-3.0, 7, None]]],
    }
    second: dict[str, Any] = {
        "output_token_logprobs": [triple(-0.1, 5), triple(-0.2, 6)] if cumulative else [triple(-0.2, 6)],
        "output_token_ids_logprobs": rows if cumulative else rows[1:],
    }
    outs = run(
        ResponseState(request, cumulative=cumulative),
        [ev([5], **first), ev([5, 6] if cumulative else [6], "length", **second)],
    )
    assert _chosen(outs[0]) == [[{"token_id": 7, "logprob": -1.0}]]
    assert _chosen(outs[0], "prompt_token_ids_logprobs") == [None, [{"token_id": 7, "logprob": -3.0}]]
    assert _chosen(outs[1]) == [[{"token_id": 7, "logprob": -2.0}]]
    assert _chosen(outs[1], "prompt_token_ids_logprobs") is None


def test_a_prompt_only_terminal_carries_the_row_after_the_prompt() -> None:
    request = native(return_logprob=True, logprobs=0, token_ids_logprob=(7,))
    meta: dict[str, Any] = {"output_token_logprobs": [], "output_token_ids_logprobs": [[[-2.0, 7, None]]]}
    (end,) = run(ResponseState(request, cumulative=True), [ev([], "length", **meta)])
    assert list(end.token_ids) == []
    assert _chosen(end) == [[{"token_id": 7, "logprob": -2.0}]]


def test_token_ids_logprobs_short_of_the_tokens_are_malformed() -> None:
    request = native(return_logprob=True, logprobs=0, token_ids_logprob=(7,))
    meta: dict[str, Any] = {"output_token_logprobs": [triple(-0.1, 5)], "output_token_ids_logprobs": []}
    with pytest.raises(SidecarError) as info:
        run(ResponseState(request, cumulative=False), [ev([5], **meta)])
    assert (
        info.value.message == "invalid sglang response: output_token_ids_logprobs has 0 entries for 1 tokens"
    )
