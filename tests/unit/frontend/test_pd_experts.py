"""Routed experts across prefill -> decode (``pd_experts``, ``disagg.decode_request``): the
prefill leg's rows of the prompt and the decode leg's rows of the output, asked from the
prompt's end, join into exactly what one aggregated SGLang engine answers; parts that do not
line up are refused, a missing part leaves no answer rather than half of one."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from testkit.routed_experts import ExpertsShape, encode_routed_experts, routed_experts

from sidecar_common.api import sidecar_pb2
from sidecar_frontend import disagg
from sidecar_frontend.pd_experts import LegExperts, Mismatch, decode_start, join, output_rows, prompt_rows

SHAPE = ExpertsShape(num_layers=2, top_k=2, num_experts=8)


def sglang_rows(tokens: list[int], start: int, shape: ExpertsShape, run_from: int = 0) -> bytes:
    """The bytes an SGLang server answers for a sequence (testkit's fake routing)."""
    return base64.b64decode(encode_routed_experts(routed_experts(tokens, start, shape, run_from)))


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 500), min_size=1, max_size=12),
    output=st.lists(st.integers(0, 500), min_size=1, max_size=12),
    start_at=st.floats(0, 1),
    layers=st.integers(1, 3),
    top_k=st.integers(1, 3),
)
def test_the_two_legs_join_into_what_one_aggregated_engine_answers(
    prompt: list[int], output: list[int], start_at: float, layers: int, top_k: int
) -> None:
    shape = ExpertsShape(num_layers=layers, top_k=top_k, num_experts=8)
    start = int(start_at * len(prompt))
    whole = prompt + output
    aggregated = sglang_rows(whole, start, shape)
    # The prefill server ran the prompt and sampled one token; the decode server, asked from
    # the prompt's end, answers the positions it ran (its prompt rows would be zeros).
    prefill = sglang_rows(prompt + output[:1], start, shape)
    decode = sglang_rows(whole, decode_start(len(prompt), start), shape, run_from=len(prompt))
    joined = join(
        prefill, decode, prompt_rows=prompt_rows(len(prompt), start), output_rows=output_rows(len(output))
    )
    assert joined == aggregated


@pytest.mark.parametrize(
    ("prompt", "start", "expected"),
    [(6, 0, 6), (6, 2, 6), (6, 6, 6), (6, 9, 9), (1, 0, 1)],
)
def test_the_decode_is_asked_from_the_prompts_end_or_a_later_start(
    prompt: int, start: int, expected: int
) -> None:
    assert decode_start(prompt, start) == expected


@pytest.mark.parametrize(
    ("prefill", "decode", "prompt", "output", "expected"),
    [
        (b"\x01" * 16, b"\x02" * 8, 2, 1, b"\x01" * 16 + b"\x02" * 8),  # 8-byte rows both sides
        (b"", b"\x02" * 8, 0, 1, b"\x02" * 8),  # the start is the prompt's end
        (None, b"\x02" * 8, 0, 1, b"\x02" * 8),  # ... and the prefill said nothing
        (b"\x01" * 8, b"", 1, 0, b"\x01" * 8),  # one output token: no decode rows
        (b"\x01" * 8, None, 1, 0, b"\x01" * 8),
        (None, b"\x02" * 8, 1, 1, None),  # the prefill's rows are missing: no answer
        (b"\x01" * 8, None, 1, 1, None),  # the decode's are
        (None, None, 0, 0, b""),
    ],
)
def test_join_table(
    prefill: bytes | None, decode: bytes | None, prompt: int, output: int, expected: bytes | None
) -> None:
    assert join(prefill, decode, prompt_rows=prompt, output_rows=output) == expected


@pytest.mark.parametrize(
    ("prefill", "decode", "prompt", "output", "words"),
    [
        (b"\x01" * 16, b"\x02" * 12, 2, 1, "8 bytes wide, the decode leg's 12"),
        (b"\x01" * 12, b"\x02" * 8, 2, 1, "not whole int32 rows"),  # 6 bytes a row
        (b"\x01" * 10, b"\x02" * 8, 4, 1, "not whole int32 rows"),
        (b"\x01" * 8, b"\x02" * 8, 0, 1, "for no positions"),
        (b"", b"\x02" * 8, 1, 1, "not whole int32 rows"),
    ],
)
def test_rows_that_do_not_line_up_are_a_mismatch(
    prefill: bytes, decode: bytes, prompt: int, output: int, words: str
) -> None:
    result = join(prefill, decode, prompt_rows=prompt, output_rows=output)
    assert isinstance(result, Mismatch)
    assert words in result.detail


def test_row_counts_follow_sglangs_positions() -> None:
    assert [prompt_rows(5, s) for s in (0, 2, 5, 7, -1)] == [5, 3, 0, 0, 5]
    assert [output_rows(n) for n in (0, 1, 2, 7)] == [0, 0, 1, 6]


def decode_outputs(tokens: list[list[int]], experts: bytes | None) -> list[sidecar_pb2.LLMEngineOutput]:
    outs = [sidecar_pb2.LLMEngineOutput(token_ids=chunk) for chunk in tokens]
    outs[-1].finish_reason = sidecar_pb2.LENGTH
    if experts is not None:
        outs[-1].routed_experts = experts
    return outs


def test_leg_experts_join_the_prefills_rows_into_the_decodes_terminal() -> None:
    prompt, output = [5, 6, 7, 8], [9, 10, 11]
    legs = LegExperts(prompt_tokens=len(prompt), start_len=1)
    prefill_terminal = sidecar_pb2.LLMEngineOutput(finish_reason=sidecar_pb2.LENGTH)
    prefill_terminal.routed_experts = sglang_rows(prompt + output[:1], 1, SHAPE)
    legs.from_prefill(sidecar_pb2.LLMEngineOutput())  # the handoff: nothing yet
    legs.from_prefill(prefill_terminal)
    outs = decode_outputs([[9], [10, 11]], sglang_rows(prompt + output, len(prompt), SHAPE, len(prompt)))
    assert not legs.needs_prefill(outs[0])
    assert legs.needs_prefill(outs[1])
    assert [legs.into_decode(o) for o in outs] == [None, None]
    assert outs[-1].routed_experts == sglang_rows(prompt + output, 1, SHAPE)
    assert not outs[0].HasField("routed_experts")


def test_leg_experts_leave_no_half_answer() -> None:
    legs = LegExperts(prompt_tokens=4, start_len=0)  # the prefill returned none
    [terminal] = decode_outputs([[9, 10]], sglang_rows([1, 2, 3, 4, 9, 10], 4, SHAPE, 4))
    assert not legs.needs_prefill(decode_outputs([[9]], None)[0])
    assert legs.into_decode(terminal) is None
    assert not terminal.HasField("routed_experts")


def test_leg_experts_refuse_rows_of_another_shape() -> None:
    legs = LegExperts(prompt_tokens=2, start_len=0)
    prefill_terminal = sidecar_pb2.LLMEngineOutput(finish_reason=sidecar_pb2.LENGTH)
    prefill_terminal.routed_experts = sglang_rows([1, 2, 3], 0, SHAPE)
    legs.from_prefill(prefill_terminal)
    wider = ExpertsShape(num_layers=3, top_k=2, num_experts=8)
    [terminal] = decode_outputs([[3, 4, 5]], sglang_rows([1, 2, 3, 4, 5], 2, wider, 2))
    assert isinstance(legs.into_decode(terminal), Mismatch)


@pytest.mark.parametrize(
    ("asked", "start", "sent"), [(True, 0, 5), (True, 2, 5), (False, 2, 2), (False, 0, 0)]
)
def test_the_decode_step_asks_the_experts_from_the_prompts_end(asked: bool, start: int, sent: int) -> None:
    request = sidecar_pb2.PreprocessedRequest(request_id="r", token_ids=[1, 2, 3, 4, 5])
    request.output_options.return_routed_experts = asked
    if start:
        request.output_options.routed_experts_start_len = start
    handoff = sidecar_pb2.BootstrapInfo(bootstrap_host="h", bootstrap_port=1, bootstrap_room=2)
    step = disagg.decode_request(request, handoff)
    assert step.output_options.routed_experts_start_len == sent
    # The prefill step keeps the client's start: it answers the prompt's rows from there.
    assert disagg.prefill_request(request).output_options.routed_experts_start_len == start
