"""Which weights made which tokens, and the routed experts, from SGLang's wires into
``LLMEngineOutput`` (docs/metadata.md): every field of both conversions, request and response,
and the refusals by name where a wire cannot carry a field."""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar_common.api import sglang_pb2, sidecar_pb2
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_common.structs import json_from_struct, value_from_json
from sidecar_sglang.convert_request import (
    NativeRequest,
    NativeSampling,
    RequestSettings,
    build_native,
    to_http_json,
)
from sidecar_sglang.convert_response import MAX_ROUTED_EXPERTS_BYTES, NativeEvent, ResponseState
from sidecar_sglang.grpc_events import GrpcEventDecoder
from sidecar_vllm.convert import to_generate_request

HTTP = RequestSettings(transport="http")
GRPC = RequestSettings(transport="grpc")


def request(**output: Any) -> sidecar_pb2.PreprocessedRequest:
    return sidecar_pb2.PreprocessedRequest(
        request_id="r", token_ids=[1, 2, 3, 4], output_options=sidecar_pb2.OutputOptions(**output)
    )


def native(**fields: Any) -> NativeRequest:
    base: dict[str, Any] = {"rid": "r", "input_ids": (1, 2, 3, 4), "sampling": NativeSampling()}
    base.update(fields)
    return NativeRequest(**base)


def run(state: ResponseState, events: list[NativeEvent]) -> list[sidecar_pb2.LLMEngineOutput]:
    outs: list[sidecar_pb2.LLMEngineOutput] = []
    for event in events:
        outs.extend(state.feed(event, aborted_by_us=False))
    return outs


def ev(ids: list[int], finish: object = None, **meta: object) -> NativeEvent:
    return NativeEvent(ids, {"finish_reason": finish, **meta}, finish is not None)


STOP = {"type": "stop", "matched": None}


def spans(*triples: tuple[str, int, int]) -> list[dict[str, object]]:
    return [{"version": v, "start": s, "end": e} for v, s, e in triples]


def as_tuples(out: sidecar_pb2.LLMEngineOutput) -> list[tuple[str, int, int]]:
    return [(s.version, s.start, s.end) for s in out.weight_versions]


# ------------------------------------------------------------------ request side


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ({}, {}),
        ({"return_routed_experts": True}, {"return_routed_experts": True}),
        (
            {"return_routed_experts": True, "routed_experts_start_len": 3},
            {"return_routed_experts": True, "routed_experts_start_len": 3},
        ),
        # SGLang checks the start with or without the flag: it goes as asked, a negative one too.
        ({"routed_experts_start_len": -1}, {"routed_experts_start_len": -1}),
        ({"return_routed_experts": False, "routed_experts_start_len": 0}, {"routed_experts_start_len": 0}),
    ],
)
def test_http_body_carries_the_routed_experts_fields(
    output: dict[str, Any], expected: dict[str, Any]
) -> None:
    body = to_http_json(build_native(request(**output), "p", HTTP, 0))
    carried = {k: body[k] for k in ("return_routed_experts", "routed_experts_start_len") if k in body}
    assert carried == expected


@pytest.mark.parametrize(
    ("output", "field"),
    [
        ({"return_routed_experts": True}, "output_options.return_routed_experts"),
        ({"routed_experts_start_len": 2}, "output_options.routed_experts_start_len"),
    ],
)
def test_grpc_wires_refuse_routed_experts_by_name(output: dict[str, Any], field: str) -> None:
    with pytest.raises(SidecarError) as sglang:
        build_native(request(**output), "p", GRPC, 0)
    assert sglang.value.reason is FailureReason.INVALID_ARGUMENT
    assert field in sglang.value.message
    with pytest.raises(SidecarError) as vllm:
        to_generate_request(request(**output), "p", mode="agg", supports_vision=False)
    assert vllm.value.reason is FailureReason.INVALID_ARGUMENT
    assert field in vllm.value.message


@pytest.mark.parametrize("output", [{}, {"return_routed_experts": False}, {"routed_experts_start_len": 0}])
def test_grpc_wires_accept_the_defaults(output: dict[str, Any]) -> None:
    build_native(request(**output), "p", GRPC, 0)
    to_generate_request(request(**output), "p", mode="agg", supports_vision=False)


# ------------------------------------------------------------------ response side


@pytest.mark.parametrize("cumulative", [True, False])
def test_every_output_says_its_version_and_the_terminal_its_spans(cumulative: bool) -> None:
    state = ResponseState(native(), cumulative=cumulative)
    second = [5, 6, 7] if cumulative else [6, 7]
    last = [5, 6, 7, 8] if cumulative else [8]
    outs = run(
        state,
        [
            ev([5], weight_version="default"),
            ev(second, weight_version="step-1"),
            ev(
                last,
                STOP,
                weight_version="step-1",
                completion_tokens=4,
                weight_versions=spans(("default", 0, 1), ("step-1", 1, 4)),
            ),
        ],
    )
    assert [o.weight_version for o in outs] == ["default", "step-1", "step-1"]
    assert [as_tuples(o) for o in outs] == [[], [], [("default", 0, 1), ("step-1", 1, 4)]]


def test_an_engine_that_does_not_say_leaves_the_fields_absent() -> None:
    outs = run(ResponseState(native(), cumulative=True), [ev([5]), ev([5, 6], STOP)])
    assert not any(o.HasField("weight_version") for o in outs)
    assert not any(o.weight_versions for o in outs)
    assert not any(o.HasField("routed_experts") for o in outs)


def test_no_output_tokens_is_one_empty_span() -> None:
    outs = run(
        ResponseState(native(), cumulative=True),
        [ev([], {"type": "length", "length": 0}, weight_versions=spans(("v", 0, 0)), weight_version="v")],
    )
    assert as_tuples(outs[-1]) == [("v", 0, 0)]


@pytest.mark.parametrize(
    "bad",
    [
        "not a list",
        [],
        spans(("a", 1, 3)),  # not from 0
        spans(("a", 0, 1), ("b", 2, 3)),  # a gap
        spans(("a", 0, 2), ("b", 1, 3)),  # an overlap
        spans(("a", 0, 2)),  # short of the output
        spans(("a", 0, 4)),  # past it
        spans(("a", 0, 0), ("b", 0, 3)),  # an empty span among tokens
        [{"version": 7, "start": 0, "end": 3}],
        [{"version": "a", "start": 0, "end": 3.5}],
        [["a", 0, 3]],
        spans(("x" * 1025, 0, 3)),
    ],
)
def test_malformed_spans_are_a_protocol_error(bad: object) -> None:
    state = ResponseState(native(), cumulative=True)
    with pytest.raises(SidecarError) as err:
        run(state, [ev([5, 6, 7], STOP, weight_versions=bad)])
    assert err.value.reason is FailureReason.PROTOCOL_ERROR


@pytest.mark.parametrize("bad", [7, "x" * 1025, ["v"]])
def test_a_malformed_version_label_is_a_protocol_error(bad: object) -> None:
    with pytest.raises(SidecarError) as err:
        run(ResponseState(native(), cumulative=True), [ev([5], weight_version=bad)])
    assert err.value.reason is FailureReason.PROTOCOL_ERROR


def int32s(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def test_routed_experts_are_decoded_to_their_bytes_when_asked() -> None:
    raw = int32s([3, 1, 4, 1, 5, 9])
    encoded = base64.b64encode(raw).decode()
    asked = run(
        ResponseState(native(return_routed_experts=True), cumulative=True),
        [ev([5]), ev([5, 6], STOP, routed_experts=encoded)],
    )
    assert asked[-1].routed_experts == raw
    assert not asked[0].HasField("routed_experts")
    not_asked = run(ResponseState(native(), cumulative=True), [ev([5, 6], STOP, routed_experts=encoded)])
    assert not not_asked[-1].HasField("routed_experts")


@pytest.mark.parametrize(
    "bad",
    [
        7,
        "not base64!",
        base64.b64encode(b"abc").decode(),  # 3 bytes: not whole int32s
        "A" * ((MAX_ROUTED_EXPERTS_BYTES + 2) // 3 * 4 + 4),  # past the bound
    ],
)
def test_malformed_routed_experts_are_a_protocol_error(bad: object) -> None:
    state = ResponseState(native(return_routed_experts=True), cumulative=True)
    with pytest.raises(SidecarError) as err:
        run(state, [ev([5, 6], STOP, routed_experts=bad)])
    assert err.value.reason is FailureReason.PROTOCOL_ERROR


def test_a_prefill_leg_carries_no_spans() -> None:
    state = ResponseState(native(prefill=True), cumulative=True)
    outs = run(state, [ev([5], STOP, weight_versions=spans(("v", 0, 1)), completion_tokens=1)])
    assert not outs[-1].weight_versions


# ------------------------------------------------------------------ gRPC: JSON text values


def grpc_message(ids: list[int], finished: bool, **meta: object) -> bytes:
    message = sglang_pb2.GenerateResponse(
        output_ids=ids, finished=finished, meta_info={k: json.dumps(v) for k, v in meta.items()}
    )
    return message.SerializeToString()


@pytest.mark.parametrize("cumulative", [True, False])
def test_grpc_messages_carry_the_version_and_spans(cumulative: bool) -> None:
    decoder = GrpcEventDecoder(native(), cumulative=cumulative)
    state = ResponseState(native(), cumulative=cumulative)
    first = decoder.decode(grpc_message([5], False, weight_version="default", finish_reason=None))
    outs = state.feed(first, aborted_by_us=False)
    last_ids = [5, 6] if cumulative else [6]
    last = decoder.decode(
        grpc_message(
            last_ids,
            True,
            weight_version="v2",
            finish_reason=STOP,
            completion_tokens=2,
            weight_versions=spans(("default", 0, 1), ("v2", 1, 2)),
        )
    )
    outs += state.feed(last, aborted_by_us=False)
    assert [o.weight_version for o in outs] == ["default", "v2"]
    assert as_tuples(outs[-1]) == [("default", 0, 1), ("v2", 1, 2)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 5)), min_size=1, max_size=6))
def test_any_tiling_the_engine_sends_arrives_unchanged(runs: list[tuple[str, int]]) -> None:
    triples: list[tuple[str, int, int]] = []
    at = 0
    for version, length in runs:
        triples.append((version, at, at + length))
        at += length
    state = ResponseState(native(), cumulative=True)
    outs = run(state, [ev(list(range(at)), STOP, weight_versions=spans(*triples))])
    assert as_tuples(outs[-1]) == triples


# ------------------------------------------------------------------ custom_params (extra_args)


def with_custom(params: object) -> sidecar_pb2.PreprocessedRequest:
    message = request()
    message.extra_args.fields["custom_params"].CopyFrom(value_from_json(params))  # type: ignore[arg-type]
    return message


def test_custom_params_reach_sglang_http_sampling_params_with_exact_numbers() -> None:
    params = {"__sglang_reasoning_end_token_ids": [151668, 7], "scale": 0.5, "on": True}
    body = to_http_json(build_native(with_custom(params), "p", HTTP, 0))
    sampling = body["sampling_params"]
    assert isinstance(sampling, dict)
    assert sampling["custom_params"] == params
    assert all(type(t) is int for t in sampling["custom_params"]["__sglang_reasoning_end_token_ids"])


def test_custom_params_are_refused_by_name_where_they_cannot_go() -> None:
    for call in (
        lambda: build_native(with_custom({"k": 1}), "p", GRPC, 0),
        lambda: to_generate_request(with_custom({"k": 1}), "p", mode="agg", supports_vision=False),
        lambda: build_native(with_custom([1, 2]), "p", HTTP, 0),
    ):
        with pytest.raises(SidecarError) as err:
            call()
        assert err.value.reason is FailureReason.INVALID_ARGUMENT
        assert "extra_args.custom_params" in err.value.message


# ------------------------------------------------------------------ sampling masks (extra_args)


def with_extra(**fields: object) -> sidecar_pb2.PreprocessedRequest:
    message = request()
    for key, value in fields.items():
        message.extra_args.fields[key].CopyFrom(value_from_json(value))  # type: ignore[arg-type]
    return message


def test_sampling_mask_fields_reach_sglang_http_as_top_level_fields() -> None:
    body = to_http_json(
        build_native(with_extra(return_sampling_mask=True, sampling_logprobs_mode="support"), "p", HTTP, 0)
    )
    assert (body["return_sampling_mask"], body["sampling_logprobs_mode"]) == (True, "support")
    plain = to_http_json(build_native(request(), "p", HTTP, 0))
    assert "return_sampling_mask" not in plain
    assert "sampling_logprobs_mode" not in plain


@pytest.mark.parametrize(
    ("fields", "named", "settings"),
    [
        ({"return_sampling_mask": True}, "extra_args.return_sampling_mask", GRPC),
        ({"sampling_logprobs_mode": "selected"}, "extra_args.sampling_logprobs_mode", GRPC),
        ({"return_sampling_mask": "yes"}, "extra_args.return_sampling_mask", HTTP),
        ({"sampling_logprobs_mode": "all"}, "extra_args.sampling_logprobs_mode", HTTP),
    ],
)
def test_sampling_mask_fields_refused_by_name(
    fields: dict[str, Any], named: str, settings: RequestSettings
) -> None:
    with pytest.raises(SidecarError) as err:
        build_native(with_extra(**fields), "p", settings, 0)
    assert err.value.reason is FailureReason.INVALID_ARGUMENT
    assert named in err.value.message
    with pytest.raises(SidecarError) as vllm:
        to_generate_request(with_extra(**fields), "p", mode="agg", supports_vision=False)
    assert named in vllm.value.message


@pytest.mark.parametrize("cumulative", [True, False])
def test_sampling_masks_are_split_per_output(cumulative: bool) -> None:
    state = ResponseState(native(return_sampling_mask=True), cumulative=cumulative)
    all_masks, all_lps = [[5, 9], [6], [7, 8]], [-0.5, -0.25, -1.0]
    first = ev([5], output_token_sampling_mask=all_masks[:1], output_token_sampling_logprobs=all_lps[:1])
    rest = ev(
        [5, 6, 7] if cumulative else [6, 7],
        STOP,
        output_token_sampling_mask=all_masks if cumulative else all_masks[1:],
        output_token_sampling_logprobs=all_lps if cumulative else all_lps[1:],
    )
    outs = run(state, [first, rest])
    got = [json_from_struct(o.engine_data) for o in outs]
    assert got == [
        {"sampling_mask": [[5, 9]], "sampling_logprobs": [-0.5]},
        {"sampling_mask": [[6], [7, 8]], "sampling_logprobs": [-0.25, -1.0]},
    ]


@pytest.mark.parametrize(
    ("masks", "logprobs"),
    [
        ([[5]], [-0.5, -1.0]),  # rows disagree
        ([[5], [6]], [-0.5]),
        ([["x"], [6]], [-0.5, -1.0]),
        ([[5], [-1]], [-0.5, -1.0]),
        ([[5], [6]], [-0.5, "y"]),
    ],
)
def test_malformed_sampling_masks_are_a_protocol_error(masks: object, logprobs: object) -> None:
    state = ResponseState(native(return_sampling_mask=True), cumulative=True)
    with pytest.raises(SidecarError) as err:
        run(
            state,
            [ev([5, 6], STOP, output_token_sampling_mask=masks, output_token_sampling_logprobs=logprobs)],
        )
    assert err.value.reason is FailureReason.PROTOCOL_ERROR
