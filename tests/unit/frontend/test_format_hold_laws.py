"""Laws of holding (``base.HoldingEncoder``): while a client reads slower than the stream
comes, the handler gives outputs to ``encoder.hold`` and writes ``encoder.flush`` once the
client has read; a choice's events then carry several outputs' tokens. For any outputs and any
schedule of holds and flushes:

* the stream still folds to the same answer as without holding (every token, logprob, finish
  and usage, once, in order), and so to the unary reply;
* every framing rule of the format holds (vLLM: one choice per chunk, nothing after a choice's
  final chunk, no chunk without tokens or finish, the prompt's ids on the first chunk only,
  continuous usage counting the choice through that chunk; SGLang: no finish before the last
  event, ``stream_interval`` tokens at least in every event but the first and the last);
* holding never adds an event, and flushing an encoder that held nothing writes nothing (a
  client that keeps up gets the same bytes whenever the handler looks).
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.formats.base import HoldingEncoder, HttpReply, WorkerFailure
from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from tests.unit.frontend import test_format_sglang_support as sglang_support
from tests.unit.frontend import test_format_vllm_support as vllm_support
from tests.unit.frontend.test_format_sglang_laws import LAW_SETTINGS, fold_cases, without
from tests.unit.frontend.test_format_vllm_laws import generations

# (hold this output, flush after it): one pair per output.
Schedule = list[tuple[bool, bool]]


def schedules(size: int) -> st.SearchStrategy[Schedule]:
    return st.lists(st.tuples(st.booleans(), st.booleans()), min_size=size, max_size=size)


# ---------------------------------------------------------------------------------------- vLLM


def _vllm_body(case: dict[str, Any]) -> dict[str, Any]:
    return {
        "token_ids": [5, 6, 7],
        "sampling_params": {
            "n": case["n"],
            **({"logprobs": 2} if case["logprobs"] else {}),
            **case["limits"],
        },
        "stream": True,
        "stream_options": {
            "include_usage": case["include_usage"],
            "continuous_usage_stats": case["continuous"],
        },
        "return_token_ids": case["return_token_ids"],
    }


def _vllm_stream(case: dict[str, Any], schedule: Schedule | None) -> bytes:
    """The stream's bytes; ``schedule`` None: every output by ``on_output`` (a client that
    keeps up)."""
    encoder = VLLM.new_encoder(vllm_support.accepted(_vllm_body(case)), 100.0)
    assert isinstance(encoder, HoldingEncoder)
    data = b""
    for k, output in enumerate(case["outputs"]):
        hold, flush = schedule[k] if schedule is not None else (False, False)
        data += encoder.hold(0, output, 101.0) if hold else encoder.on_output(0, output, 101.0)
        if flush:
            data += encoder.flush(101.0)
    if case["ending"] is not None:
        data += encoder.on_failure(0, WorkerFailure(case["ending"], "it ended"), 102.0)
    return data + encoder.close()


def _vllm_fold(events: list[Any], prompt_ids: bool, prompt_tokens: int) -> dict[str, Any]:
    """The stream folded per choice, checking every framing rule on the way."""
    assert events[-1] == "[DONE]"
    assert "[DONE]" not in events[:-1]
    choices: dict[int, dict[str, Any]] = {}
    other: list[Any] = []
    chunks = [e for e in events[:-1] if isinstance(e, dict) and e.get("choices")]
    for position, event in enumerate(events[:-1]):
        if event not in chunks:
            other.append(event)  # the usage chunk, an error event
            continue
        (choice,) = event["choices"]
        into = choices.setdefault(choice["index"], {"ids": [], "logprobs": [], "finish": None, "stop": None})
        assert into["finish"] is None, "nothing after a choice's final chunk"
        assert choice["token_ids"] or choice["finish_reason"] is not None, "no empty chunk"
        into["ids"] += choice["token_ids"]
        if choice["logprobs"] is not None:
            into["logprobs"] += choice["logprobs"]["content"]
        into["finish"], into["stop"] = choice["finish_reason"], choice["stop_reason"]
        assert ("prompt_token_ids" in event) == (prompt_ids and event is chunks[0])
        if event["usage"] is not None:
            # Continuous usage counts the chunk's choice through this chunk.
            assert event["usage"]["completion_tokens"] == len(into["ids"])
            assert event["usage"]["total_tokens"] == prompt_tokens + len(into["ids"])
        del position
    return {"choices": choices, "other": other, "events": len(events)}


@given(generations(), st.data())
def test_vllm_holding_keeps_the_fold_and_the_framing(case: dict[str, Any], data: st.DataObject) -> None:
    schedule = data.draw(schedules(len(case["outputs"])))
    plain = _vllm_fold(vllm_support.sse_events(_vllm_stream(case, None)), case["return_token_ids"], 3)
    held = _vllm_fold(vllm_support.sse_events(_vllm_stream(case, schedule)), case["return_token_ids"], 3)
    assert held["choices"] == plain["choices"]
    assert held["other"] == plain["other"]
    assert held["events"] <= plain["events"]
    reply = _vllm_unary(case)
    if reply.status == 200:
        # Joined, each choice's chunks are the unary reply's choice.
        for choice in json.loads(reply.body)["choices"]:
            got = held["choices"].get(choice["index"], {"ids": [], "logprobs": []})
            assert got["ids"] == choice["token_ids"]
            assert got["logprobs"] == (choice["logprobs"]["content"] if case["logprobs"] else [])


def _vllm_unary(case: dict[str, Any]) -> HttpReply:
    body = {**_vllm_body(case), "stream": False}
    del body["stream_options"]
    encoder = VLLM.new_encoder(vllm_support.accepted(body), 100.0)
    for output in case["outputs"]:
        assert encoder.on_output(0, output, 101.0) == b""
    if case["ending"] is not None:
        encoder.on_failure(0, WorkerFailure(case["ending"], "it ended"), 102.0)
    return encoder.reply()


@given(generations(), st.data())
def test_vllm_flushing_what_was_never_held_writes_nothing(case: dict[str, Any], data: st.DataObject) -> None:
    flushes = data.draw(schedules(len(case["outputs"])))
    never_held = [(False, flush) for _, flush in flushes]
    assert _vllm_stream(case, never_held) == _vllm_stream(case, None)


# -------------------------------------------------------------------------------------- SGLang


def _sglang_stream(
    fields: dict[str, Any], steps: list[Any], schedule: Schedule | None, incremental: bool
) -> bytes:
    call = sglang_support.accepted({**fields, "stream": True}, incremental=incremental)
    encoder = SGLANG.new_encoder(call, sglang_support.STARTED_AT)
    assert isinstance(encoder, HoldingEncoder)
    data = b""
    for k, step in enumerate(steps):
        now = sglang_support.STARTED_AT + 0.25 * (k + 1)
        hold, flush = schedule[k] if schedule is not None else (False, False)
        if isinstance(step, WorkerFailure):
            data += encoder.on_failure(0, step, now)
            if encoder.aborted:
                break
        else:
            data += encoder.hold(0, step, now) if hold else encoder.on_output(0, step, now)
        if flush:
            data += encoder.flush(now)
            if incremental and not encoder.aborted:
                _all_sent_but_the_interval(fields, steps[: k + 1], data)
    return data + encoder.close()


def _all_sent_but_the_interval(fields: dict[str, Any], given: list[Any], data: bytes) -> None:
    """After a flush, what was given went out, but for fewer than ``stream_interval`` tokens
    held back after a first event (as ``on_output`` holds them)."""
    tokens = [t for step in given if not isinstance(step, WorkerFailure) for t in step.token_ids]
    events = sglang_support.sse_events(data + b"data: [DONE]\n\n")[:-1]
    sent = [t for event in events for t in event["output_ids"]]
    assert tokens[: len(sent)] == sent
    interval = fields["sampling_params"].get("stream_interval", 1)
    assert len(tokens) - len(sent) < (interval if events else 1)


def _sglang_events(data: bytes, interval: int, incremental: bool) -> list[dict[str, Any]]:
    events = sglang_support.sse_events(data)
    assert events[-1] == "[DONE]"
    chunks: list[dict[str, Any]] = events[:-1]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    if incremental:
        assert all(len(c["output_ids"]) >= interval for c in chunks[1:-1])
    return chunks


def _unary(fields: dict[str, Any], steps: list[Any]) -> dict[str, Any]:
    call = sglang_support.accepted({**fields, "stream": False})
    _, reply = sglang_support.drive(
        call, [(0, s, sglang_support.STARTED_AT + 0.25 * (k + 1)) for k, s in enumerate(steps)]
    )
    assert reply is not None
    result: dict[str, Any] = sglang_support.body(reply)
    return result


OUTPUT_LISTS = ("output_token_logprobs", "output_top_logprobs")
TIMES = ("response_sent_to_client_ts", "e2e_latency")


@LAW_SETTINGS
@given(fold_cases(), st.data(), st.booleans())
def test_sglang_holding_keeps_the_fold_and_the_framing(
    case: tuple[dict[str, Any], list[Any]], data: st.DataObject, incremental: bool
) -> None:
    fields, steps = case
    schedule = data.draw(schedules(len(steps)))
    interval = fields["sampling_params"].get("stream_interval", 1)
    plain = _sglang_events(_sglang_stream(fields, steps, None, incremental), interval, incremental)
    held = _sglang_events(_sglang_stream(fields, steps, schedule, incremental), interval, incremental)
    assert len(held) <= len(plain)
    unary = _unary(fields, steps)
    if incremental:
        assert [t for c in held for t in c["output_ids"]] == unary["output_ids"]
        for key in OUTPUT_LISTS:
            if key in unary["meta_info"]:
                assert [row for c in held for row in c["meta_info"][key]] == unary["meta_info"][key]
    else:
        assert held[-1]["output_ids"] == unary["output_ids"]
        assert without(held[-1]["meta_info"], *TIMES) == without(unary["meta_info"], *TIMES)
    # The last event (the finish, the counts) is the same as without holding, but for times.
    assert without(held[-1]["meta_info"], *OUTPUT_LISTS, *TIMES) == without(
        plain[-1]["meta_info"], *OUTPUT_LISTS, *TIMES
    )


@LAW_SETTINGS
@given(fold_cases(), st.data(), st.booleans())
def test_sglang_flushing_what_was_never_held_writes_nothing(
    case: tuple[dict[str, Any], list[Any]], data: st.DataObject, incremental: bool
) -> None:
    fields, steps = case
    flushes = data.draw(schedules(len(steps)))
    never_held = [(False, flush) for _, flush in flushes]
    assert _sglang_stream(fields, steps, never_held, incremental) == _sglang_stream(
        fields, steps, None, incremental
    )


def test_sglang_held_outputs_are_one_event_with_the_tokens_of_several() -> None:
    call = sglang_support.accepted({"input_ids": [5], "stream": True}, incremental=True)
    encoder = SGLANG.new_encoder(call, sglang_support.STARTED_AT)
    assert isinstance(encoder, HoldingEncoder)
    now = sglang_support.STARTED_AT + 1.0
    held = b"".join(encoder.hold(0, sglang_support.out([t]), now) for t in (300, 301, 302))
    assert held == b""
    (event,) = sglang_support.sse_events(encoder.flush(now))
    assert event["output_ids"] == [300, 301, 302]
    assert encoder.flush(now) == b""


def test_a_held_output_is_one_event_with_the_tokens_of_several() -> None:
    """A table case: three one-token outputs held, then flushed: one event, three tokens."""
    call = vllm_support.accepted({"token_ids": [5], "sampling_params": {"max_tokens": 8}, "stream": True})
    encoder = VLLM.new_encoder(call, 0.0)
    assert isinstance(encoder, HoldingEncoder)
    held = b"".join(encoder.hold(0, sidecar_pb2.LLMEngineOutput(token_ids=[t]), 1.0) for t in (300, 301, 302))
    assert held == b""
    (event,) = vllm_support.sse_events(encoder.flush(1.0))
    assert event["choices"][0]["token_ids"] == [300, 301, 302]
    assert encoder.flush(1.0) == b""
