"""An SGLang prefill's terminal carries its routed experts (the prompt's rows, which SGLang's
prefill server answers once its KV transfer is done) for the frontend to join with the
decode's; checked as any terminal's are, and only when asked."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from sidecar_common.errors import FailureReason, SidecarError
from sidecar_sglang.convert_request import Bootstrap, NativeRequest, NativeSampling
from sidecar_sglang.convert_response import NativeEvent, ResponseState

BOOTSTRAP = Bootstrap("10.1.1.1", 8998, 77)
ROWS = bytes(range(48))  # 3 prompt positions of 2 layers x 2 experts, int32 each


def prefill(**fields: Any) -> ResponseState:
    request = NativeRequest(
        rid="r",
        input_ids=(1, 2, 3, 4),
        sampling=NativeSampling(),
        prefill=True,
        bootstrap=BOOTSTRAP,
        **fields,
    )
    return ResponseState(request, cumulative=True)


def final(**meta: object) -> NativeEvent:
    return NativeEvent([9], {"finish_reason": {"type": "length", "length": 0}, **meta}, True)


@pytest.mark.parametrize("earlier", [[], [NativeEvent([9], {"finish_reason": None}, False)]])
def test_the_prefill_terminal_carries_the_prompts_rows(earlier: list[NativeEvent]) -> None:
    state = prefill(return_routed_experts=True, routed_experts_start_len=1)
    for event in earlier:
        assert state.feed(event, aborted_by_us=False) == []
    [terminal] = state.feed(final(routed_experts=base64.b64encode(ROWS).decode()), aborted_by_us=False)
    assert terminal.routed_experts == ROWS
    assert terminal.HasField("bootstrap_info")
    assert list(terminal.token_ids) == []  # the prefill's token is the decode's to send


def test_no_rows_asked_or_none_sent_none_carried() -> None:
    [terminal] = prefill().feed(final(routed_experts=base64.b64encode(ROWS).decode()), aborted_by_us=False)
    assert not terminal.HasField("routed_experts")
    [terminal] = prefill(return_routed_experts=True).feed(final(), aborted_by_us=False)
    assert not terminal.HasField("routed_experts")
    # SGLang's empty string (the start is the prompt's end): no rows, still an answer.
    [terminal] = prefill(return_routed_experts=True).feed(final(routed_experts=""), aborted_by_us=False)
    assert terminal.HasField("routed_experts")
    assert terminal.routed_experts == b""


@pytest.mark.parametrize("bad", ["not base64!", base64.b64encode(b"\x01\x02\x03").decode(), 7])
def test_malformed_prefill_rows_are_a_protocol_error(bad: object) -> None:
    with pytest.raises(SidecarError) as info:
        prefill(return_routed_experts=True).feed(final(routed_experts=bad), aborted_by_us=False)
    assert info.value.reason is FailureReason.PROTOCOL_ERROR
