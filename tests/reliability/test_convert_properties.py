"""Arbitrary native engine messages through the response state machines: typed errors only.

tests/unit already feeds arbitrary vLLM messages (test_vllm_properties) and arbitrary SGLang
meta_info dicts and gRPC messages (test_sglang_convert_response). What they miss is the SGLang
HTTP wire's first step: an SSE ``data:`` payload of any JSON shape (not an object, no
meta_info, ids of any type, error objects with any code) through ``event_from_http`` and on
into ``ResponseState``.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import SidecarError
from sidecar_sglang.convert_request import NativeRequest, NativeSampling
from sidecar_sglang.convert_response import ResponseState, event_from_http

texts = st.text(max_size=8)
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | texts
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=10,
)
finish_reasons = st.none() | st.fixed_dictionaries(
    {"type": st.sampled_from(["stop", "length", "abort", "weird"]) | texts},
    optional={"matched": json_values, "message": json_values, "status_code": json_values},
)
metas = st.fixed_dictionaries(
    {},
    optional={
        "finish_reason": finish_reasons | json_values,
        "prompt_tokens": json_values,
        "completion_tokens": json_values,
        "cached_tokens": json_values,
        "id": json_values,
    },
)
events = st.one_of(
    json_values,  # anything at all
    st.fixed_dictionaries(
        {},
        optional={
            "text": json_values,
            "output_ids": st.lists(st.integers(-5, 2**33) | json_values, max_size=5) | json_values,
            "meta_info": metas | json_values,
        },
    ),
    st.fixed_dictionaries(
        {
            "error": json_values
            | st.fixed_dictionaries({}, optional={"message": json_values, "code": json_values})
        }
    ),
)


def native() -> NativeRequest:
    return NativeRequest(rid="r", input_ids=(1, 2, 3, 4), sampling=NativeSampling())


@settings(max_examples=400, deadline=None)
@given(st.lists(events, max_size=6), st.booleans(), st.booleans())
def test_arbitrary_sse_payloads_raise_only_sidecar_errors(
    payloads: list[Any], cumulative: bool, aborted_by_us: bool
) -> None:
    state = ResponseState(native(), cumulative=cumulative)
    terminals = 0
    try:
        for payload in payloads:
            event = event_from_http(payload)
            for out in state.feed(event, aborted_by_us=aborted_by_us):
                assert isinstance(out, sidecar_pb2.LLMEngineOutput)
                terminals += out.finish_reason != sidecar_pb2.UNSPECIFIED
        if payloads:
            error = state.end_of_stream(aborted_by_us=aborted_by_us)
            assert isinstance(error, SidecarError)
    except SidecarError:
        return
    assert terminals <= 1


def test_an_error_code_of_non_decimal_digits_is_a_typed_error() -> None:
    with pytest.raises(SidecarError):
        event_from_http({"error": {"message": "boom", "code": "²"}})
