"""Decoding SGLang's gRPC messages: only the keys a request needs, and cumulative logprob
lists parsed by their new tail with exactly the result of parsing them whole."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar_common.api import sglang_pb2, sidecar_pb2
from sidecar_common.errors import FailureReason, SidecarError
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
        got = parser.parse(text.encode())
        snapshot = json.loads(json.dumps(got)) if got is not ABSENT else ABSENT
        assert same(snapshot, full_parse(text)), text


@settings(max_examples=200)
@given(st.lists(entry, min_size=1, max_size=20), formats, st.data())
def test_an_extended_list_reuses_what_was_parsed(items: list[object], fmt: dict[str, Any], data: Any) -> None:
    # The point of the tail parse: the list already parsed is extended, not parsed again
    # (the same object comes back, grown), so a message costs what it adds.
    cuts = sorted(data.draw(st.lists(st.integers(1, len(items)), min_size=2, max_size=6)))
    parser = CumulativeJsonList()
    first = parser.parse(dumps(items[: cuts[0]], fmt).encode())
    for cut in cuts[1:]:
        assert parser.parse(dumps(items[:cut], fmt).encode()) is first
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
        got = parser.parse(text.encode())
    assert same(got, expected)


# --- which keys are decoded -----------------------------------------------------------


def message(ids: list[int], meta: dict[str, object], finished: bool = False) -> bytes:
    return sglang_pb2.GenerateResponse(
        output_ids=ids,
        meta_info={k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()},
        finished=finished,
    ).SerializeToString()


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
    event = decoder.decode(
        sglang_pb2.GenerateResponse(output_ids=ids, meta_info=meta, finished=True).SerializeToString()
    )
    for key, value in event.meta.items():
        assert same(value, full_parse(meta[key]))


# --- a whole stream: the same outputs as decoding every value whole ---------------------


def reference_event(raw: bytes) -> NativeEvent:
    """What the decoder replaced: the generated class's parse, and every meta_info value
    parsed whole, on every message."""
    msg = sglang_pb2.GenerateResponse.FromString(raw)
    meta = {k: v for k, v in ((k, full_parse(t)) for k, t in msg.meta_info.items()) if v is not ABSENT}
    return NativeEvent(list(msg.output_ids), meta, msg.finished)


def outputs(
    request: NativeRequest, messages: list[bytes], decode: Callable[[bytes], NativeEvent]
) -> list[bytes] | str:
    """The stream's outputs, each message decoded just before it is fed (as the engine
    adapter does: an event's lists may grow with the next decode)."""
    state = ResponseState(request, cumulative=True)
    outs: list[sidecar_pb2.LLMEngineOutput] = []
    try:
        for raw in messages:
            outs.extend(state.feed(decode(raw), aborted_by_us=False))
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
    assert outputs(request, messages, decoder.decode) == outputs(request, messages, reference_event)


# --- the wire: what the generated class would read ------------------------------------


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


unknown_fields = st.lists(
    st.sampled_from(
        [
            varint(9 << 3) + varint(2**40),  # varint
            varint((10 << 3) | 5) + b"abcd",  # fixed32
            varint((12 << 3) | 1) + b"abcdefgh",  # fixed64
            varint((11 << 3) | 2) + varint(3) + b"xyz",  # length-delimited
        ]
    ),
    max_size=3,
)
int32s = st.integers(-(2**31), 2**31 - 1)
ALL_KEYS = ("finish_reason", "completion_tokens", "prompt_tokens", "cached_tokens", "output_token_logprobs",
            "output_top_logprobs", "input_token_logprobs", "input_top_logprobs")  # fmt: skip


@st.composite
def wire_messages(draw: st.DrawFn) -> list[tuple[bytes, list[int], dict[str, str], bool]]:
    """A stream of messages, encoded as protobuf may encode them: ids packed (usually
    growing, as in cumulative mode), unpacked or split into runs; unknown fields between."""
    ids = draw(st.lists(int32s, max_size=12))
    stream = []
    for cut in sorted(draw(st.lists(st.integers(0, len(ids)), min_size=1, max_size=5))):
        now = ids[:cut] if draw(st.booleans()) else draw(st.lists(int32s, max_size=4))
        values = st.text(max_size=10) | st.lists(st.integers(0, 9), max_size=4).map(json.dumps)
        meta = draw(st.dictionaries(st.sampled_from([*ALL_KEYS, "id"]), values, max_size=5))
        finished = draw(st.booleans())
        shape = draw(st.sampled_from(["generated", "unpacked", "two-runs"]))
        if shape == "generated":
            body = sglang_pb2.GenerateResponse(output_ids=now, meta_info=meta, finished=finished)
            raw = body.SerializeToString()
        else:
            parts: list[bytes] = []
            if shape == "unpacked":
                parts += [varint(1 << 3) + varint(i) for i in now]
            else:
                half = len(now) // 2
                for run in (now[:half], now[half:]):
                    packed = b"".join(varint(i) for i in run)
                    parts.append(varint((1 << 3) | 2) + varint(len(packed)) + packed)
            rest = sglang_pb2.GenerateResponse(meta_info=meta, finished=finished).SerializeToString()
            raw = b"".join(parts) + rest
        extra = b"".join(draw(unknown_fields))
        stream.append((extra + raw, now, meta, finished))
    return stream


@settings(max_examples=300)
@given(wire_messages(), st.booleans())
def test_the_wire_reads_as_the_generated_class_reads_it(
    stream: list[tuple[bytes, list[int], dict[str, str], bool]], cumulative: bool
) -> None:
    request = native(return_logprob=True, logprobs=2, prompt_logprobs=1)
    decoder = GrpcEventDecoder(request, cumulative=cumulative)
    for raw, ids, meta, finished in stream:
        reference = sglang_pb2.GenerateResponse.FromString(raw)
        assert (list(reference.output_ids), dict(reference.meta_info), reference.finished) == (
            ids,
            meta,
            finished,
        )
        event = decoder.decode(raw)
        assert list(event.output_ids) == ids
        assert event.finished == finished
        terminal = finished or full_parse(meta.get("finish_reason", "null")) not in (None, ABSENT)
        wanted = [k for k in ALL_KEYS if k in meta and (terminal or k not in ALL_KEYS[1:4])]
        expected = {k: full_parse(meta[k]) for k in wanted if full_parse(meta[k]) is not ABSENT}
        assert same(event.meta, expected)


@pytest.mark.parametrize(
    "raw",
    [
        b"\x0a\x05\x01",  # packed ids longer than the message
        b"\x12\x04\x0a\x09ab",  # a map entry whose key runs past it
        b"\x18",  # a tag with no value
        b"\x0b",  # a group (wire type 3): never in proto3
        b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",  # a varint longer than 64 bits
    ],
)
def test_bytes_that_are_not_a_generate_response_are_a_protocol_error(raw: bytes) -> None:
    decoder = GrpcEventDecoder(native(return_logprob=True, logprobs=0), cumulative=True)
    with pytest.raises(SidecarError) as info:
        decoder.decode(raw)
    assert info.value.reason is FailureReason.PROTOCOL_ERROR


@given(st.binary(max_size=40), st.booleans())
def test_any_bytes_decode_or_are_a_protocol_error(raw: bytes, cumulative: bool) -> None:
    decoder = GrpcEventDecoder(
        native(return_logprob=True, logprobs=0, prompt_logprobs=0), cumulative=cumulative
    )
    reason = None
    try:
        decoder.decode(raw)
    except SidecarError as err:
        reason = err.reason
    assert reason in (None, FailureReason.PROTOCOL_ERROR)


def test_a_repeated_map_key_keeps_the_last_value() -> None:
    first = sglang_pb2.GenerateResponse(meta_info={"finish_reason": '"stop"'}).SerializeToString()
    second = sglang_pb2.GenerateResponse(meta_info={"finish_reason": '"length"'}).SerializeToString()
    event = GrpcEventDecoder(native(), cumulative=True).decode(first + second)
    assert event.meta == {"finish_reason": "length"}


def test_a_map_entry_that_repeats_its_value_keeps_the_last_one() -> None:
    def field(number: int, payload: bytes) -> bytes:
        return varint((number << 3) | 2) + varint(len(payload)) + payload

    entry = field(1, b"finish_reason") + field(2, b'"stop"') + field(2, b'"length"')
    raw = field(2, entry) + varint(9 << 3) + varint(1)
    assert dict(sglang_pb2.GenerateResponse.FromString(raw).meta_info) == {"finish_reason": '"length"'}
    event = GrpcEventDecoder(native(), cumulative=True).decode(raw)
    assert event.meta == {"finish_reason": "length"}
