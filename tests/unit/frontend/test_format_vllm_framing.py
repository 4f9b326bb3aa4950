"""How the vLLM format frames a stream: a choice's ``finish_reason`` rides on the chunk with its
last tokens, as vLLM's streaming generator writes it, and no chunk waits when it cannot be the
last.

The sidecars send a choice's terminal as its own output, usually without tokens, right after
the last tokens. vLLM's engine finishes a choice in the step that produced its last token, so
vLLM never writes a ``{"token_ids": [], "finish_reason": "length"}`` chunk after them. The
encoder holds a chunk that may be the last (``ChoiceEnd.may_end``: ``max_tokens`` or the
context reached, or a stop token once ``min_tokens`` are out) until the next output of its
choice says whether it was; every other chunk is written in the call that brought it.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason
from sidecar_frontend.formats.base import Encoder, WorkerFailure
from sidecar_frontend.formats.vllm import FORMAT
from tests.unit.frontend.test_format_vllm_laws import generations
from tests.unit.frontend.test_format_vllm_support import accepted, context, options, sse_events

NULLS = b'"routed_experts":null,"sampling_mask":null,"weight_versions":null'


def _stream(sampling: dict[str, Any], **top: Any) -> Encoder:
    body = {"token_ids": [5, 6, 7], "sampling_params": sampling, "request_id": "r", "stream": True, **top}
    return FORMAT.new_encoder(accepted(body), 0.0)


def _out(
    ids: list[int], finish: int = sidecar_pb2.UNSPECIFIED, index: int = 0, **kw: Any
) -> sidecar_pb2.LLMEngineOutput:
    return sidecar_pb2.LLMEngineOutput(token_ids=ids, index=index, finish_reason=finish, **kw)  # type: ignore[arg-type]


def _chunk(ids: str, finish: str = "null", stop: str = "null", index: int = 0) -> bytes:
    return (
        b'data: {"request_id":"generate-tokens-r","usage":null,"output_mode":"tokens","choices":[{"index":'
        + str(index).encode()
        + b',"finish_reason":'
        + finish.encode()
        + b',"stop_reason":'
        + stop.encode()
        + b',"token_ids":['
        + ids.encode()
        + b"],"
        + NULLS
        + b',"logprobs":null}]}\n\n'
    )


def test_the_last_tokens_carry_the_length_finish_and_no_empty_chunk_follows() -> None:
    enc = _stream({"max_tokens": 3})
    assert enc.on_output(0, _out([11]), 0.0) == _chunk("11")
    assert enc.on_output(0, _out([12]), 0.0) == _chunk("12")
    assert enc.on_output(0, _out([13]), 0.0) == b"", "the third token may be the last: held"
    assert enc.on_output(0, _out([], sidecar_pb2.LENGTH), 0.0) == _chunk("13", '"length"')
    assert enc.close() == b"data: [DONE]\n\n"


def test_a_listed_stop_token_finishes_its_own_chunk_with_its_id() -> None:
    enc = _stream({"stop_token_ids": [7], "max_tokens": 50})
    assert enc.on_output(0, _out([11, 7]), 0.0) == b""
    finish = _out([], sidecar_pb2.STOP, stop_token_id=7)
    assert enc.on_output(0, finish, 0.0) == _chunk("11,7", '"stop"', "7")


def test_eos_finishes_its_own_chunk() -> None:
    enc = _stream({"max_tokens": 50})  # the served model's EOS is 2
    assert enc.on_output(0, _out([2]), 0.0) == b""
    assert enc.on_output(0, _out([], sidecar_pb2.STOP), 0.0) == _chunk("2", '"stop"')


def test_a_chunk_that_was_not_the_last_goes_out_before_the_next_one() -> None:
    enc = _stream({"max_tokens": 50})
    assert enc.on_output(0, _out([2]), 0.0) == b""  # EOS, yet the engine went on (min_tokens elsewhere)
    assert enc.on_output(0, _out([9]), 0.0) == _chunk("2") + _chunk("9")


def test_tokens_that_cannot_end_the_choice_are_written_at_once() -> None:
    enc = _stream({"max_tokens": 50, "ignore_eos": True, "min_tokens": 3, "stop_token_ids": [7]})
    assert enc.on_output(0, _out([2]), 0.0) == _chunk("2"), "EOS is ignored"
    assert enc.on_output(0, _out([7]), 0.0) == _chunk("7"), "min_tokens not reached yet"
    assert enc.on_output(0, _out([7]), 0.0) == b"", "now it can be the stop"


def test_the_context_ends_a_choice_without_max_tokens() -> None:
    call = accepted(
        {"token_ids": [5, 6, 7], "sampling_params": {}, "request_id": "r", "stream": True},
        ctx=context(max_context_length=5),
    )
    enc = FORMAT.new_encoder(call, 0.0)
    assert enc.on_output(0, _out([11]), 0.0) == _chunk("11")
    assert enc.on_output(0, _out([12]), 0.0) == b""
    assert enc.on_output(0, _out([], sidecar_pb2.LENGTH), 0.0) == _chunk("12", '"length"')


def test_choices_are_held_apart() -> None:
    enc = _stream({"max_tokens": 1, "n": 2})
    assert enc.on_output(0, _out([11], index=0), 0.0) == b""
    assert enc.on_output(0, _out([21], index=1), 0.0) == b""
    assert enc.on_output(0, _out([], sidecar_pb2.LENGTH, index=1), 0.0) == _chunk("21", '"length"', index=1)
    assert enc.on_output(0, _out([], sidecar_pb2.LENGTH, index=0), 0.0) == _chunk("11", '"length"', index=0)


def test_a_held_chunk_is_written_before_an_error_or_an_abort() -> None:
    enc = _stream({"max_tokens": 2})
    enc.on_output(0, _out([11, 12]), 0.0)
    data = enc.on_failure(0, WorkerFailure(FailureReason.ENGINE_SHUTDOWN, "gone"), 0.0)
    events = sse_events(data + enc.close())
    assert events[0]["choices"][0]["token_ids"] == [11, 12]
    assert events[0]["choices"][0]["finish_reason"] is None
    assert events[1]["error"]["message"] == "The server had an error while processing your request."
    assert events[2] == "[DONE]"

    enc = _stream({"max_tokens": 2})
    enc.on_output(0, _out([11, 12]), 0.0)
    data = enc.on_failure(0, WorkerFailure(FailureReason.CANCELLED, "aborted"), 0.0)
    assert data == _chunk("11,12") + _chunk("", '"abort"')


def test_continuous_usage_of_a_held_chunk_counts_its_choice_at_that_chunk() -> None:
    enc = _stream({"max_tokens": 50}, stream_options={"include_usage": True, "continuous_usage_stats": True})
    enc.on_output(0, _out([2]), 0.0)
    events = sse_events(enc.on_output(0, _out([9, 10]), 0.0))
    assert [e["usage"]["completion_tokens"] for e in events] == [1, 3]


def _framed(case: dict[str, Any]) -> tuple[Encoder, list[tuple[sidecar_pb2.LLMEngineOutput, bytes]]]:
    body = {
        "token_ids": [5, 6, 7],
        "sampling_params": {"n": case["n"], **case["limits"]},
        "stream": True,
    }
    call = accepted(body)
    encoder = FORMAT.new_encoder(call, 0.0)
    return encoder, [(out, encoder.on_output(0, out, 1.0)) for out in case["outputs"]]


@given(generations())
def test_no_chunk_waits_unless_it_may_be_its_choices_last(case: dict[str, Any]) -> None:
    body = {"token_ids": [5, 6, 7], "sampling_params": {"n": case["n"], **case["limits"]}, "stream": True}
    end = options(accepted(body)).end
    _, calls = _framed(case)
    generated: dict[int, int] = {}
    held: set[int] = set()  # choices with a chunk kept back
    finished: set[int] = set()
    for out, data in calls:
        if out.index in finished:
            assert data == b""
            continue
        generated[out.index] = generated.get(out.index, 0) + len(out.token_ids)
        events = sse_events(data) if data else []
        if out.finish_reason != sidecar_pb2.UNSPECIFIED:
            finished.add(out.index)
            held.discard(out.index)
            assert len(events) == 1
            assert events[0]["choices"][0]["finish_reason"] is not None
            continue
        if not out.token_ids:
            assert data == b"", "an empty output says nothing; a held chunk stays held"
            continue
        before = 1 if out.index in held else 0  # the held chunk, now known not to be the last
        if end.may_end(generated[out.index], out.token_ids[-1]):
            held.add(out.index)
            assert len(events) == before, "this chunk waits for the next output"
        else:
            held.discard(out.index)
            assert len(events) == before + 1, "written in the call that brought it"
            assert events[-1]["choices"][0]["token_ids"] == list(out.token_ids)
        assert all(e["choices"][0]["index"] == out.index for e in events)
        assert all(e["choices"][0]["finish_reason"] is None for e in events)


@given(generations())
def test_the_finish_rides_on_the_chunk_with_the_last_tokens(case: dict[str, Any]) -> None:
    body = {"token_ids": [5, 6, 7], "sampling_params": {"n": case["n"], **case["limits"]}, "stream": True}
    end = options(accepted(body)).end
    _, calls = _framed(case)
    generated: dict[int, int] = {}
    may_be_last: dict[int, list[int]] = {}  # the latest tokens of a choice, when they may end it
    done: set[int] = set()
    for out, data in calls:
        if out.index in done:
            continue
        generated[out.index] = generated.get(out.index, 0) + len(out.token_ids)
        if out.finish_reason == sidecar_pb2.UNSPECIFIED:
            if out.token_ids:
                last = end.may_end(generated[out.index], out.token_ids[-1])
                may_be_last[out.index] = list(out.token_ids) if last else []
            continue
        done.add(out.index)
        (final,) = sse_events(data)
        expected = may_be_last.get(out.index, []) + list(out.token_ids)
        assert final["choices"][0]["token_ids"] == expected
