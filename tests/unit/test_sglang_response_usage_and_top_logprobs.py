"""SGLang response conversion: a reported zero cached count is carried (not dropped), and a
malformed alternative names the list it came from."""

from __future__ import annotations

import pytest

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_sglang.convert_request import NativeRequest, NativeSampling
from sidecar_sglang.convert_response import NativeEvent, ResponseState


def native(**fields: object) -> NativeRequest:
    return NativeRequest(rid="r", input_ids=(1, 2, 3, 4), sampling=NativeSampling(), **fields)  # type: ignore[arg-type]


def terminal(cached: object) -> sidecar_pb2.LLMEngineOutput:
    state = ResponseState(native(), cumulative=False)
    meta: dict[str, object] = {"finish_reason": "length", "prompt_tokens": 4, "cached_tokens": cached}
    (out,) = state.feed(NativeEvent([5], meta, True), aborted_by_us=False)
    return out


def test_zero_cached_tokens_is_reported_as_zero() -> None:
    usage = terminal(0).completion_usage
    assert usage.HasField("cached_tokens")
    assert usage.cached_tokens == 0


def test_one_cached_token_is_reported() -> None:
    usage = terminal(1).completion_usage
    assert usage.HasField("cached_tokens")
    assert usage.cached_tokens == 1


def test_a_negative_cached_count_is_left_out() -> None:
    assert not terminal(-1).completion_usage.HasField("cached_tokens")


def test_a_malformed_alternative_names_output_top_logprobs() -> None:
    state = ResponseState(native(return_logprob=True, logprobs=1), cumulative=False)
    meta: dict[str, object] = {
        "finish_reason": None,
        "output_token_logprobs": [[-0.1, 5, None]],
        "output_top_logprobs": [[[-0.2, -3, None]]],
    }
    with pytest.raises(SidecarError) as info:
        state.feed(NativeEvent([5], meta, False), aborted_by_us=False)
    assert info.value.reason is FailureReason.PROTOCOL_ERROR
    assert info.value.message == (
        "invalid sglang response: output_top_logprobs entry [-0.2, -3, None] is not [logprob, token_id, text]"
    )
