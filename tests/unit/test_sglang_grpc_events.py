"""Decoding SGLang's gRPC messages: only the keys a request needs, and cumulative logprob
lists parsed by their new tail with exactly the result of parsing them whole."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar_common.api import sglang_pb2, sidecar_pb2
from sidecar_common.errors import SidecarError
from sidecar_sglang.convert_request import NativeRequest, NativeSampling
from sidecar_sglang.convert_response import NativeEvent, ResponseState
from sidecar_sglang.grpc_events import ABSENT, CumulativeJsonList, GrpcEventDecoder


def native(**fields: Any) -> NativeRequest:
    base: dict[str, Any] = {"rid": "r", "input_ids": (1, 2, 3, 4), "sampling": NativeSampling()}
    base.update(fields)
    return NativeRequest(**base)


def full_parse(text: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return ABSENT


def same(a: object, b: object) -> bool:
    """Equality where NaN equals NaN (json.loads accepts NaN, and NaN != NaN)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a is b if a is ABSENT or b is ABSENT else a == b and type(a) is type(b)


# --- the suffix parse -----------------------------------------------------------------

logprob = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**70), 2**70) | st.none()
token_text = st.text(alphabet='ab,[]" \\\n{}:é', max_size=6) | st.none()
triple = st.tuples(logprob, st.integers(0, 2**32), token_text).map(list)
entry = triple | st.lists(triple, max_size=3) | st.none()
formats: st.SearchStrategy[dict[str, Any]] = st.sampled_from(
    [{"separators": (",", ":")}, {}, {"indent": 1}, {"separators": (" , ", " : ")}, {"ensure_ascii": False}]
)


def dumps(value: object, fmt: dict[str, Any]) -> str:
    return json.dumps(value, **fmt)


@st.composite
def cumulative_texts(draw: st.DrawFn) -> list[str]:
    """Texts of one key over a stream: mostly growing prefixes of one list, with some
    messages that are not an extension of the previous one (garbled, shrunk, rewritten,
    reformatted, padded) and must fall back to a full parse."""
    items = draw(st.lists(entry, max_size=12))
    fmt = draw(formats)
    cuts = sorted(draw(st.lists(st.integers(0, len(items)), min_size=1, max_size=8)))
    texts = [dumps(items[:cut], fmt) for cut in cuts]
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(texts)))
        base = texts[at - 1] if at > 0 else "[]"
        kind = draw(st.sampled_from(["garbage", "trailing-comma", "extend-last", "other", "pad", "shrink"]))
        if kind == "garbage":
            odd = draw(st.text(max_size=8))
        elif kind == "trailing-comma":
            odd = base.rstrip()[:-1] + ",]"
        elif kind == "extend-last":
            # The head matches but the last item goes on: "[1,2]" then "[1,23]".
            odd = base.rstrip()[:-1] + draw(st.sampled_from(["3]", "e5]", '"x"]', "] ]", ", 1] 2"]))
        elif kind == "other":
            odd = dumps(draw(st.lists(entry, max_size=4)) or draw(json_scalars), draw(formats))
        elif kind == "pad":
            odd = draw(st.sampled_from([" ", "\n", ""])) + base + draw(st.sampled_from([" ", "\n\t", ""]))
        else:
            odd = dumps(items[: max(0, len(items) // 2 - 1)], fmt)
        texts.insert(at, odd)
    return texts


json_scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=4)


@settings(max_examples=400)
@given(cumulative_texts())
def test_the_suffix_parse_gives_exactly_the_full_parse(texts: list[str]) -> None:
    parser = CumulativeJsonList()
    for text in texts:
        got = parser.parse(text)
        snapshot = json.loads(json.dumps(got)) if got is not ABSENT else ABSENT
        assert same(snapshot, full_parse(text)), text


@settings(max_examples=200)
@given(st.lists(entry, min_size=1, max_size=20), formats, st.data())
def test_an_extended_list_reuses_what_was_parsed(items: list[object], fmt: dict[str, Any], data: Any) -> None:
    # The point of the tail parse: the list already parsed is extended, not parsed again
    # (the same object comes back, grown), so a message costs what it adds.
    cuts = sorted(data.draw(st.lists(st.integers(1, len(items)), min_size=2, max_size=6)))
    parser = CumulativeJsonList()
    first = parser.parse(dumps(items[: cuts[0]], fmt))
    for cut in cuts[1:]:
        assert parser.parse(dumps(items[:cut], fmt)) is first
    assert same(first, json.loads(dumps(items[: cuts[-1]], fmt)))


@pytest.mark.parametrize(
    ("texts", "expected"),
    [
        (["[1,2]", "[1,23]"], [1, 23]),  # the head matches, the last number goes on
        (["[1,2]", "[1,2,]"], ABSENT),  # a trailing comma is not JSON
        (["[1,2]", "[1,2] ]"], ABSENT),
        (["[1,2]", "[1,2,3] x"], ABSENT),
        (["[1,2]", "[1,2,3]"], [1, 2, 3]),
        (["[1,2]", "[1, 2, 3]"], [1, 2, 3]),  # reformatted: no prefix, parsed whole
        (['["a]"]', '["a]","b,]"]'], ["a]", "b,]"]),  # brackets and commas inside strings
        (["[[1,2]]", "[[1,2],[3]]"], [[1, 2], [3]]),
        (["[]", "[1]"], [1]),
        (["[]", "[,1]"], ABSENT),  # an empty list has no item a comma could follow
        (["[1]", "[]"], []),
        (["[1] ", "[1] ", "[1,2] "], [1, 2]),
        (["[1]", "{bad", "[1,2]"], [1, 2]),
        (["[1]", "[1,2]", "[1]"], [1]),  # shrunk: parsed whole
        (["[1,2]", "[1,2,3"], ABSENT),
    ],
)
def test_suffix_parse_cases(texts: list[str], expected: object) -> None:
    parser = CumulativeJsonList()
    got: object = None
    for text in texts:
        got = parser.parse(text)
    assert same(got, expected)


# --- which keys are decoded -----------------------------------------------------------


def message(ids: list[int], meta: dict[str, object], finished: bool = False) -> sglang_pb2.GenerateResponse:
    return sglang_pb2.GenerateResponse(
        output_ids=ids,
        meta_info={k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()},
        finished=finished,
    )


def test_only_the_keys_the_request_reads_are_decoded() -> None:
    noise = {"id": "r", "e2e_latency": 0.5, "weight_version": "default", "spec_verify_ct": 3}
    counts = {"prompt_tokens": 4, "completion_tokens": 1, "cached_tokens": 0}
    lps = {"output_token_logprobs": [[-0.1, 5, None]], "input_token_logprobs": [[None, 1, None]]}
    plain = GrpcEventDecoder(native(), cumulative=True)
    event = plain.decode(message([5], {"finish_reason": None, **noise, **counts, **lps}))
    # Not finishing: neither the usage counts nor logprobs nobody asked for, nor the noise.
    assert event.meta == {"finish_reason": None}
    end = plain.decode(message([5], {"finish_reason": {"type": "length"}, **noise, **counts, **lps}, True))
    assert end.meta == {"finish_reason": {"type": "length"}, **counts}
    asked = GrpcEventDecoder(native(return_logprob=True, logprobs=0, prompt_logprobs=0), cumulative=False)
    assert asked.decode(message([5], {**noise, **lps})).meta == lps


@pytest.mark.parametrize("cumulative", [True, False])
def test_a_value_that_is_not_json_is_absent(cumulative: bool) -> None:
    decoder = GrpcEventDecoder(native(return_logprob=True, logprobs=1), cumulative=cumulative)
    event = decoder.decode(
        message(
            [4],
            {
                "finish_reason": '{"type": "length", "length": 1}',
                "prompt_tokens": "4",
                "cached_tokens": "{bad",
                "output_token_logprobs": "[[-0.1, 4, null]",
                "completion_tokens": "[" * 100_000,  # deeper than the parser's recursion limit
            },
            True,
        )
    )
    assert event.meta == {"finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 4}


@given(
    st.dictionaries(st.text(max_size=6), st.text(max_size=12), max_size=6),
    st.lists(st.integers(0, 9), max_size=4),
    st.booleans(),
)
def test_decoding_never_raises(meta: dict[str, str], ids: list[int], cumulative: bool) -> None:
    decoder = GrpcEventDecoder(
        native(return_logprob=True, logprobs=2, prompt_logprobs=1), cumulative=cumulative
    )
    event = decoder.decode(sglang_pb2.GenerateResponse(output_ids=ids, meta_info=meta, finished=True))
    for key, value in event.meta.items():
        assert same(value, full_parse(meta[key]))


# --- a whole stream: the same outputs as decoding every value whole ---------------------


def reference_event(msg: sglang_pb2.GenerateResponse) -> NativeEvent:
    """What the decoder replaced: every meta_info value parsed whole, on every message."""
    meta = {k: v for k, v in ((k, full_parse(t)) for k, t in msg.meta_info.items()) if v is not ABSENT}
    return NativeEvent(list(msg.output_ids), meta, msg.finished)


def outputs(request: NativeRequest, events: list[NativeEvent]) -> list[bytes] | str:
    state = ResponseState(request, cumulative=True)
    outs: list[sidecar_pb2.LLMEngineOutput] = []
    try:
        for event in events:
            outs.extend(state.feed(event, aborted_by_us=False))
    except SidecarError as err:
        return f"{err.reason}: {err.message}"
    return [o.SerializeToString(deterministic=True) for o in outs]


@settings(max_examples=150)
@given(
    st.lists(
        st.tuples(st.integers(0, 1000), st.floats(-20, 0), st.lists(st.integers(0, 1000), max_size=2)),
        min_size=1,
        max_size=24,
    ),
    st.data(),
    st.integers(0, 2),
    st.booleans(),
)
def test_a_cumulative_stream_converts_exactly_as_with_whole_parses(
    tokens: list[tuple[int, float, list[int]]], data: Any, top: int, prompt: bool
) -> None:
    ids = [t for t, _, _ in tokens]
    lps = [[lp, t, None] for t, lp, _ in tokens]
    tops = [[[lp - 1.0, alt, None] for alt in alts] for _, lp, alts in tokens]
    prompt_lps = [[None, 1, None], [-0.5, 2, None]]
    cuts = sorted({*data.draw(st.lists(st.integers(1, len(ids)), max_size=8)), len(ids)})
    messages = []
    for cut in cuts:
        last = cut == cuts[-1]
        meta: dict[str, object] = {
            "finish_reason": {"type": "length"} if last else None,
            "output_token_logprobs": lps[:cut],
            "output_top_logprobs": tops[:cut],
            "input_token_logprobs": prompt_lps,
            "completion_tokens": cut,
            "prompt_tokens": 4,
            "id": "r",
        }
        messages.append(message(ids[:cut], meta, last))
    request = native(return_logprob=True, logprobs=top, prompt_logprobs=0 if prompt else None)
    decoder = GrpcEventDecoder(request, cumulative=True)
    assert outputs(request, [decoder.decode(m) for m in messages]) == outputs(
        request, [reference_event(m) for m in messages]
    )
