"""SGLang response conversion: the exact protocol error an operator reads for each malformed
engine stream, and the stream rules the survivors of the mutation run showed untested
(prompt logprobs that incremental streams send once, a terminal known only by its
finish_reason, a text field left absent when the engine sent none)."""

from __future__ import annotations

from typing import Any

import pytest

from sidecar_common.errors import FailureReason, SidecarError
from sidecar_sglang.convert_response import NativeEvent, ResponseState
from tests.unit.test_sglang_convert_response import ev, native, run, triple

LOGPROBS: dict[str, Any] = {"return_logprob": True, "logprobs": 1}
LONG = "x" * 300


def _error(events: list[NativeEvent], *, cumulative: bool = False, **request: Any) -> str:
    state = ResponseState(native(**request), cumulative=cumulative)
    *before, last = events
    run(state, before)
    with pytest.raises(SidecarError) as info:
        state.feed(last, aborted_by_us=False)
    assert info.value.reason is FailureReason.PROTOCOL_ERROR
    return info.value.message


# (events, cumulative, request fields, the message after "invalid sglang response: ")
ROWS: dict[str, tuple[list[NativeEvent], bool, dict[str, Any], str]] = {
    "id not an integer": ([ev(["7"])], False, {}, "output id '7' is not an integer"),  # type: ignore[list-item]
    "id a boolean": ([ev([True])], False, {}, "output id True is not an integer"),
    "id a float": ([ev([1.5])], False, {}, "output id 1.5 is not an integer"),  # type: ignore[list-item]
    "id negative": ([ev([3, -1])], False, {}, "output id -1 is negative or too large"),
    "id too large": ([ev([2**32])], False, {}, "output id 4294967296 is negative or too large"),
    "cumulative ids shrank": (
        [ev([5, 6]), ev([5])],
        True,
        {},
        "cumulative output_ids shrank from 2 to 1",
    ),
    "no finish reason": ([ev([5], finished=True)], False, {}, "missing finish_reason"),
    "unknown finish reason": (
        [ev([5], {"type": "eos"})],
        False,
        {},
        'missing finish_reason (got {"type": "eos"})',
    ),
    "long finish reason is cut at 200": (
        [ev([5], LONG)],
        False,
        {},
        f'missing finish_reason (got "{LONG[:199]})',
    ),
    "message after the terminal": ([ev([5], "length"), ev([6])], False, {}, "a message after the terminal"),
    "count on the terminal": (
        [ev([5, 6], "length", completion_tokens=3)],
        False,
        {},
        "completion_tokens is 3 but 2 tokens were streamed",
    ),
    "logprobs missing": (
        [ev([5])],
        False,
        LOGPROBS,
        "logprobs were asked but output_token_logprobs is missing",
    ),
    "logprobs short": (
        [ev([5, 6], output_token_logprobs=[triple(-0.1, 5)])],
        False,
        LOGPROBS,
        "output_token_logprobs has 1 entries for 2 tokens",
    ),
    "logprob for another token": (
        [ev([5], output_token_logprobs=[triple(-0.1, 9)])],
        False,
        LOGPROBS,
        "logprob token 9 is not output id 5",
    ),
    "logprob entry malformed": (
        [ev([5], output_token_logprobs=[[-0.1]])],
        False,
        LOGPROBS,
        "output_token_logprobs entry [-0.1] is not [logprob, token_id, text]",
    ),
    "logprob entry long, cut at 200": (
        [ev([5], output_token_logprobs=[[-0.1, -5, LONG]])],
        False,
        LOGPROBS,
        f"output_token_logprobs entry {str([-0.1, -5, LONG])[:200]} is not [logprob, token_id, text]",
    ),
}


@pytest.mark.parametrize("case", list(ROWS), ids=list(ROWS))
def test_each_malformed_engine_stream_reads_exactly(case: str) -> None:
    events, cumulative, request, expected = ROWS[case]
    assert _error(events, cumulative=cumulative, **request) == f"invalid sglang response: {expected}"


def test_prompt_logprobs_sent_once_survive_the_empty_lists_that_follow() -> None:
    # Incremental SGLang sends the prompt's logprobs on the first event, then empty lists.
    request = native(return_logprob=True, prompt_logprobs=0)
    first: dict[str, Any] = {"input_token_logprobs": [[None, 1, None], triple(-0.5, 2)]}
    first["input_top_logprobs"] = [None, []]
    later: dict[str, Any] = {"input_token_logprobs": [], "input_top_logprobs": []}
    # The first event brings no token: the logprobs wait for the terminal.
    outs = run(ResponseState(request, cumulative=False), [ev([], **first), ev([6], "length", **later)])
    rows = outs[-1].engine_data.fields["prompt_logprobs"].list_value.values
    assert len(rows) == 2
    assert rows[1].list_value.values[0].struct_value.fields["logprob"].number_value == -0.5


@pytest.mark.parametrize("cumulative", [False, True])
def test_a_finish_reason_ends_the_stream_even_when_finished_is_not_set(cumulative: bool) -> None:
    state = ResponseState(native(), cumulative=cumulative)
    (out,) = run(state, [ev([5], "length", finished=False)])
    assert list(out.token_ids) == [5]
    assert out.completion_usage.completion_tokens == 1
    assert state.done


@pytest.mark.parametrize("cumulative", [False, True])
def test_text_stays_absent_when_the_engine_sent_none(cumulative: bool) -> None:
    outs = run(
        ResponseState(native(), cumulative=cumulative), [ev([5]), ev([5, 6] if cumulative else [6], "length")]
    )
    assert [o.HasField("text") for o in outs] == [False, False]


def test_incremental_text_is_forwarded_whole_every_time() -> None:
    events = [
        NativeEvent([5], {"finish_reason": None}, False, "ab"),
        NativeEvent([6], {"finish_reason": "length"}, True, "cd"),
    ]
    outs = run(ResponseState(native(), cumulative=False), events)
    assert [o.text for o in outs] == ["ab", "cd"]


def test_incremental_ids_are_never_sliced() -> None:
    outs = run(ResponseState(native(), cumulative=False), [ev([5, 6]), ev([7]), ev([8, 9], "length")])
    assert [list(o.token_ids) for o in outs] == [[5, 6], [7], [8, 9]]
