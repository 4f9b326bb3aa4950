"""SGLang /generate responses: unary bodies, SSE events, finish reasons, failures, logprob
shapes; /abort_request, the info routes and handler-level errors."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc.aio import AioRpcError, Metadata

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason, decode_rpc_error
from sidecar_frontend.formats.base import AbortCall, HttpReply, Route, RouteKind, WorkerFailure
from sidecar_frontend.formats.sglang import ABORT, FORMAT, SglangFormat
from tests.unit.frontend.test_format_sglang_support import (
    STARTED_AT,
    WALL_TIME,
    accepted,
    body,
    context,
    drive,
    out,
    sse_events,
)

PROMPT = [1, 100, 200]
META_KEYS = [
    "id",
    "finish_reason",
    "prompt_tokens",
    "weight_version",
    "num_retractions",
    "reasoning_tokens",
    "completion_tokens",
    "cached_tokens",
    "cached_tokens_details",
    "dp_rank",
]
LOGPROB_KEYS = ["input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length"]
TOP_KEYS = ["input_top_logprobs", "output_top_logprobs"]


def unary(
    fields: dict[str, Any], *outputs: sidecar_pb2.LLMEngineOutput | WorkerFailure, ctx: Any = None
) -> HttpReply:
    call = accepted({"input_ids": PROMPT, **fields}, ctx)
    _, reply = drive(call, [(0, o, STARTED_AT + 0.5 * (k + 1)) for k, o in enumerate(outputs)])
    assert reply is not None
    return reply


def streamed(
    fields: dict[str, Any],
    *outputs: sidecar_pb2.LLMEngineOutput | WorkerFailure,
    ctx: Any = None,
    incremental: bool = False,
) -> list[Any]:
    call = accepted({"input_ids": PROMPT, "stream": True, **fields}, ctx, incremental=incremental)
    written, _ = drive(call, [(0, o, STARTED_AT + 0.5 * (k + 1)) for k, o in enumerate(outputs)])
    return sse_events(written)


# ------------------------------------------------------------------ unary


def test_a_unary_response_has_sglangs_keys_in_order_and_no_text() -> None:
    reply = unary(
        {"rid": "r1", "sampling_params": {"max_new_tokens": 4}},
        out([201, 202]),
        out([203, 204], sidecar_pb2.LENGTH, usage=(3, 4), cached=0),
    )
    assert (reply.status, reply.content_type) == (200, "application/json")
    data = body(reply)
    assert list(data) == ["output_ids", "meta_info"]
    assert data["output_ids"] == [201, 202, 203, 204]
    meta = data["meta_info"]
    assert list(meta) == [*META_KEYS, "e2e_latency", "response_sent_to_client_ts"]
    assert meta["id"] == "r1"
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 4, 0)
    assert (meta["weight_version"], meta["num_retractions"], meta["reasoning_tokens"]) == ("default", 0, 0)
    assert meta["cached_tokens_details"] is None
    assert meta["dp_rank"] is None
    assert meta["e2e_latency"] == pytest.approx(1.0)
    assert meta["response_sent_to_client_ts"] == pytest.approx(WALL_TIME + 1.0)
    assert b" " not in reply.body  # compact JSON


def test_cache_hits_are_reported_with_their_details() -> None:
    meta = body(unary({}, out([7], sidecar_pb2.LENGTH, usage=(3, 1), cached=2)))["meta_info"]
    assert meta["cached_tokens"] == 2
    assert meta["cached_tokens_details"] == {"device": 2, "host": 0}


def test_prompt_token_ids_follow_meta_info() -> None:
    data = body(unary({"return_prompt_token_ids": True}, out([7], sidecar_pb2.LENGTH)))
    assert list(data) == ["output_ids", "meta_info", "prompt_token_ids"]
    assert data["prompt_token_ids"] == PROMPT


def test_a_batch_answers_a_list_in_request_order_without_index() -> None:
    call = accepted({"input_ids": [[1], [2, 3]], "rid": ["a", "b"]})
    _, reply = drive(
        call,
        [(1, out([9], sidecar_pb2.LENGTH), 101.0), (0, out([8], sidecar_pb2.STOP, stop_token=8), 102.0)],
    )
    assert reply is not None
    items = body(reply)
    assert [item["meta_info"]["id"] for item in items] == ["a", "b"]
    assert [item["output_ids"] for item in items] == [[8], [9]]
    assert all("index" not in item for item in items)
    assert [item["meta_info"]["prompt_tokens"] for item in items] == [1, 2]


FINISHES: list[tuple[dict[str, Any], sidecar_pb2.LLMEngineOutput, dict[str, Any]]] = [
    ({"max_new_tokens": 2}, out([5, 6], sidecar_pb2.LENGTH), {"type": "length", "length": 2}),
    # The effective (context-capped) limit is reported, as SGLang does.
    ({"max_new_tokens": None}, out([5], sidecar_pb2.LENGTH), {"type": "length", "length": 4091}),
    ({"stop_token_ids": [6]}, out([5, 6], sidecar_pb2.STOP, stop_token=6), {"type": "stop", "matched": 6}),
    # EOS (a hidden stop): our wire names no token; SGLang names it, and it is the last one.
    ({}, out([5, 2], sidecar_pb2.STOP), {"type": "stop", "matched": 2}),
    ({}, out([5, 2], sidecar_pb2.EOS), {"type": "stop", "matched": 2}),
    ({}, out([], sidecar_pb2.STOP), {"type": "stop", "matched": None}),
    (
        {},
        out([5], sidecar_pb2.CANCELLED),
        {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
    ),
    (
        {},
        out([5], sidecar_pb2.CONTENT_FILTER),
        {"type": "abort", "message": "Content filtered", "status_code": None, "err_type": None},
    ),
]


@pytest.mark.parametrize(("params", "output", "finish"), FINISHES)
def test_finish_reasons(
    params: dict[str, Any], output: sidecar_pb2.LLMEngineOutput, finish: dict[str, Any]
) -> None:
    assert body(unary({"sampling_params": params}, output))["meta_info"]["finish_reason"] == finish
    last = streamed({"sampling_params": params}, output)[-2]
    assert last["meta_info"]["finish_reason"] == finish


def test_a_stop_string_is_reported_as_matched_text() -> None:
    output = out([5], sidecar_pb2.STOP)
    output.stop_string = "\n\n"
    assert body(unary({}, output))["meta_info"]["finish_reason"] == {"type": "stop", "matched": "\n\n"}


def test_the_length_of_an_unlimited_request_with_unknown_context_is_the_count() -> None:
    reply = unary(
        {"sampling_params": {"max_new_tokens": None}},
        out([5, 6, 7], sidecar_pb2.LENGTH),
        ctx=context(max_context_length=0),
    )
    assert body(reply)["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


UNARY_FAILURES: list[tuple[str, int, dict[str, Any]]] = [
    ("INVALID_ARGUMENT", 400, {"error": {"message": "bad"}}),
    *[
        (reason, 503, {"object": "error", "message": "bad", "type": "503", "param": None, "code": 503})
        for reason in (
            "OVERLOADED",
            "CANNOT_CONNECT",
            "ENGINE_SHUTDOWN",
            "CONNECTION_TIMEOUT",
            "NO_WORKER",
            "DEADLINE",
        )
    ],
    *[
        (reason, 500, {"object": "error", "message": "bad", "type": "500", "param": None, "code": 500})
        for reason in ("PROTOCOL_ERROR", "UNKNOWN", "SOMETHING_NEW")
    ],
]


def as_read(reason: str) -> FailureReason:
    """The reason a frontend reads from a sidecar's ErrorInfo naming ``reason`` (a reason it
    does not know reads as UNKNOWN)."""
    info = error_details_pb2.ErrorInfo(reason=reason, domain="sidecar", metadata={"migratable": "false"})
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=2, message="bad", details=[detail])
    trailing = Metadata(("grpc-status-details-bin", status.SerializeToString()))
    error = AioRpcError(grpc.StatusCode.UNKNOWN, Metadata(), trailing, "bad", None)
    return decode_rpc_error(error).reason


@pytest.mark.parametrize(("reason", "status", "expected"), UNARY_FAILURES)
def test_unary_failures_end_the_response_with_sglangs_error(reason: str, status: int, expected: Any) -> None:
    call = accepted({"input_ids": [[1], [2]]})
    encoder = FORMAT.new_encoder(call, STARTED_AT)
    assert encoder.on_output(1, out([9], sidecar_pb2.LENGTH), 101.0) == b""
    assert encoder.on_failure(0, WorkerFailure(as_read(reason), "bad"), 101.5) == b""
    assert encoder.aborted
    reply = encoder.reply()
    assert reply.status == status
    assert body(reply) == expected


# SGLang refuses an adapter it does not have with a ValueError (the tokenizer manager's "Got
# LoRA adapter that has never been loaded: …"), a 400 like any refusal: an engine's NOT_FOUND
# (vLLM's, through an SGLang-format frontend) is the same 400 in the engine's words.
NOT_FOUND = WorkerFailure(
    FailureReason.INVALID_ARGUMENT, "no adapter sql", from_engine=True, engine_status="NOT_FOUND"
)


def test_an_engine_not_found_is_sglangs_400() -> None:
    encoder = FORMAT.new_encoder(accepted({"input_ids": PROMPT}), STARTED_AT)
    assert encoder.on_failure(0, NOT_FOUND, 101.5) == b""
    reply = encoder.reply()
    assert (reply.status, body(reply)) == (400, {"error": {"message": "no adapter sql"}})
    events = streamed({}, NOT_FOUND)
    assert events == [
        {
            "error": {
                "message": "no adapter sql",
                "type": "invalid_request_error",
                "code": 400,
                "retryable": False,
            }
        },
        "[DONE]",
    ]


def test_a_cancelled_unary_item_ends_with_the_abort_reason_and_the_rest_goes_on() -> None:
    call = accepted({"input_ids": [[1], [2]], "rid": ["a", "b"]})
    encoder = FORMAT.new_encoder(call, STARTED_AT)
    encoder.on_output(0, out([7, 8]), 101.0)
    encoder.on_failure(0, WorkerFailure(FailureReason.CANCELLED, "cancelled"), 101.5)
    assert not encoder.aborted
    encoder.on_output(1, out([9], sidecar_pb2.LENGTH), 102.0)
    reply = encoder.reply()
    assert reply.status == 200
    first, second = body(reply)
    assert first["output_ids"] == [7, 8]
    assert first["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    assert second["meta_info"]["finish_reason"]["type"] == "length"


# ------------------------------------------------------------------ streaming


def test_a_cumulative_stream_resends_everything_and_ends_with_done() -> None:
    events = streamed(
        {"rid": "s", "sampling_params": {"max_new_tokens": 3}},
        out([201]),
        out([202]),
        out([203], sidecar_pb2.LENGTH, usage=(3, 3)),
    )
    assert events[-1] == "[DONE]"
    assert [e["output_ids"] for e in events[:-1]] == [[201], [201, 202], [201, 202, 203]]
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [
        None,
        None,
        {"type": "length", "length": 3},
    ]
    assert [e["meta_info"]["completion_tokens"] for e in events[:-1]] == [1, 2, 3]
    first, middle, last = (e["meta_info"] for e in events[:-1])
    assert list(first) == [*META_KEYS, "response_sent_to_client_ts"]
    assert list(middle) == META_KEYS
    assert list(last) == [*META_KEYS, "e2e_latency"]
    assert first["response_sent_to_client_ts"] == pytest.approx(WALL_TIME + 0.5)
    assert last["e2e_latency"] == pytest.approx(1.5)
    assert all(list(e) == ["output_ids", "meta_info"] for e in events[:-1])


def test_an_incremental_stream_sends_deltas_but_cumulative_counts() -> None:
    events = streamed(
        {"return_logprob": True},
        out([201], logprobs=[-0.1]),
        out([202, 203], logprobs=[-0.2, -0.3]),
        out([], sidecar_pb2.LENGTH),
        incremental=True,
    )
    chunks = events[:-1]
    assert [e["output_ids"] for e in chunks] == [[201], [202, 203], []]
    assert [e["meta_info"]["completion_tokens"] for e in chunks] == [1, 3, 3]
    assert [e["meta_info"]["output_token_logprobs_length"] for e in chunks] == [1, 3, 3]
    assert [e["meta_info"]["output_token_logprobs"] for e in chunks] == [
        [[-0.1, 201, None]],
        [[-0.2, 202, None], [-0.3, 203, None]],
        [],
    ]


def test_an_output_with_no_new_token_sends_no_event() -> None:
    events = streamed({}, out([5]), out([]), out([6], sidecar_pb2.LENGTH))
    assert len(events) == 3


def test_a_first_event_that_is_also_the_last_carries_both_timings() -> None:
    (event, done) = streamed({}, out([5], sidecar_pb2.LENGTH))
    assert list(event["meta_info"])[-2:] == ["e2e_latency", "response_sent_to_client_ts"]
    assert done == "[DONE]"


def test_batch_streams_put_index_on_every_event_in_arrival_order_with_one_done() -> None:
    call = accepted(
        {"input_ids": [[1], [2]], "rid": ["s1", "s2"], "stream": True, "return_prompt_token_ids": True}
    )
    written, _ = drive(
        call,
        [
            (1, out([201]), 101.0),
            (0, out([101]), 101.1),
            (0, out([102], sidecar_pb2.LENGTH), 101.2),
            (1, out([202], sidecar_pb2.LENGTH), 101.3),
        ],
    )
    events = sse_events(written)
    assert events.count("[DONE]") == 1
    assert events[-1] == "[DONE]"
    assert [(e["meta_info"]["id"], e["index"]) for e in events[:-1]] == [
        ("s2", 1),
        ("s1", 0),
        ("s1", 0),
        ("s2", 1),
    ]
    assert all(list(e) == ["output_ids", "meta_info", "prompt_token_ids", "index"] for e in events[:-1])


def test_stream_value_failure_is_an_error_event_after_what_was_sent() -> None:
    events = streamed({}, out([5]), WorkerFailure(FailureReason.INVALID_ARGUMENT, "engine said no"))
    assert events[0]["output_ids"] == [5]
    assert events[1] == {
        "error": {
            "message": "engine said no",
            "type": "invalid_request_error",
            "code": 400,
            "retryable": False,
        }
    }
    assert events[2:] == ["[DONE]"]


@pytest.mark.parametrize(
    ("reason", "status", "err_type"),
    [
        ("OVERLOADED", 503, None),
        ("ENGINE_SHUTDOWN", 503, None),
        ("DEADLINE", 503, None),
        ("UNKNOWN", 500, "InternalServerError"),
    ],
)
def test_other_stream_failures_end_only_that_item_with_a_status_abort(
    reason: str, status: int, err_type: str | None
) -> None:
    call = accepted({"input_ids": [[1], [2]], "stream": True})
    encoder = FORMAT.new_encoder(call, STARTED_AT)
    encoder.on_output(0, out([5]), 101.0)
    chunk = sse_events(encoder.on_failure(0, WorkerFailure(FailureReason(reason), "gone"), 101.5))
    assert not encoder.aborted
    assert chunk[0]["output_ids"] == [5]
    assert chunk[0]["index"] == 0
    assert chunk[0]["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "gone",
        "status_code": status,
        "err_type": err_type,
    }
    assert "e2e_latency" in chunk[0]["meta_info"]
    assert sse_events(encoder.on_output(1, out([6], sidecar_pb2.LENGTH), 102.0))[0]["index"] == 1
    assert encoder.close() == b"data: [DONE]\n\n"


def test_a_cancelled_stream_item_sends_its_abort_chunk_then_nothing_more() -> None:
    call = accepted({"input_ids": PROMPT, "stream": True}, incremental=True)
    encoder = FORMAT.new_encoder(call, STARTED_AT)
    encoder.on_output(0, out([5]), 101.0)
    (chunk,) = sse_events(encoder.on_failure(0, WorkerFailure(FailureReason.CANCELLED, "cancelled"), 101.5))
    assert chunk["output_ids"] == []
    assert chunk["meta_info"]["finish_reason"]["type"] == "abort"
    assert encoder.on_output(0, out([6], sidecar_pb2.LENGTH), 102.0) == b""


# ------------------------------------------------------------------ logprobs


def test_output_logprobs_are_triples_with_top_rows_in_rank_order() -> None:
    output = out([201, 202], sidecar_pb2.LENGTH, logprobs=[-0.5, -2.0])
    output.top_logprobs.add().entries.extend(
        [
            sidecar_pb2.TopLogprob(token_id=201, logprob=-0.5, rank=1),
            sidecar_pb2.TopLogprob(token_id=9, logprob=-1.0, rank=2),
        ]
    )
    # The sampled token (no rank) was not in the top 2.
    output.top_logprobs.add().entries.extend(
        [
            sidecar_pb2.TopLogprob(token_id=202, logprob=-2.0),
            sidecar_pb2.TopLogprob(token_id=3, logprob=-0.1, rank=1),
            sidecar_pb2.TopLogprob(token_id=4, logprob=-0.2, rank=2),
        ]
    )
    meta = body(unary({"return_logprob": True, "top_logprobs_num": 2}, output))["meta_info"]
    assert list(meta) == [
        *META_KEYS[:5],
        *LOGPROB_KEYS,
        *TOP_KEYS,
        *META_KEYS[5:],
        "e2e_latency",
        "response_sent_to_client_ts",
    ]
    assert meta["input_token_logprobs"] == []
    assert meta["input_top_logprobs"] == []
    assert meta["output_token_logprobs"] == [[-0.5, 201, None], [-2.0, 202, None]]
    assert meta["output_token_logprobs_length"] == 2
    assert meta["output_top_logprobs"] == [
        [[-0.5, 201, None], [-1.0, 9, None]],
        [[-0.1, 3, None], [-0.2, 4, None]],
    ]


def test_unranked_top_logprobs_are_ordered_by_logprob_and_cut_to_k() -> None:
    output = out([201], sidecar_pb2.LENGTH, logprobs=[-3.0], tops=[[(201, -3.0), (7, -0.5), (8, -1.0)]])
    meta = body(unary({"return_logprob": True, "top_logprobs_num": 2}, output))["meta_info"]
    assert meta["output_top_logprobs"] == [[[-0.5, 7, None], [-1.0, 8, None]]]


SGLANG_SIDECAR_ROWS = [
    None,
    [{"token_id": 100, "logprob": -0.041}, {"token_id": 101, "logprob": -0.541}],
    [{"token_id": 200, "logprob": -0.072}, {"token_id": 201, "logprob": -0.572}],
]
VLLM_SIDECAR_ROWS = [
    None,
    {"100": {"logprob": -0.041}, "101": {"logprob": -0.541}},
    {"200": {"logprob": -0.072}, "201": {"logprob": -0.572}},
]


@pytest.mark.parametrize("rows", [SGLANG_SIDECAR_ROWS, VLLM_SIDECAR_ROWS], ids=["sglang-rows", "vllm-rows"])
def test_prompt_logprobs_come_from_the_terminal_in_sglangs_shape(rows: list[Any]) -> None:
    output = out([201], sidecar_pb2.LENGTH, logprobs=[-0.084], prompt_logprobs=rows)
    fields = {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}
    meta = body(unary(fields, output))["meta_info"]
    assert meta["input_token_logprobs"] == [[None, 1, None], [-0.041, 100, None], [-0.072, 200, None]]
    assert meta["input_top_logprobs"] == [
        None,
        [[-0.041, 100, None], [-0.541, 101, None]],
        [[-0.072, 200, None], [-0.572, 201, None]],
    ]


@pytest.mark.parametrize("incremental", [False, True])
def test_a_stream_shows_input_logprobs_from_the_first_event_that_has_them(incremental: bool) -> None:
    # SGLang's tokenizer manager puts the prompt's logprobs on its first event after prefill and
    # on every event after (they are not cut by incremental streaming).
    call = accepted(
        {"input_ids": PROMPT, "stream": True, "return_logprob": True, "logprob_start_len": 0},
        incremental=incremental,
    )
    outputs = [
        out([201], logprobs=[-0.1], prompt_logprobs=SGLANG_SIDECAR_ROWS),
        out([202], logprobs=[-0.2]),
        out([203], sidecar_pb2.LENGTH, logprobs=[-0.3], usage=(3, 3)),
    ]
    written, _ = drive(call, [(0, o, STARTED_AT + 0.5 * (k + 1)) for k, o in enumerate(outputs)])
    events = sse_events(written)[:-1]
    expected = [[None, 1, None], [-0.041, 100, None], [-0.072, 200, None]]
    assert [e["meta_info"]["input_token_logprobs"] for e in events] == [expected] * 3


def test_a_stream_whose_worker_sends_input_logprobs_last_shows_them_last() -> None:
    fields = {"return_logprob": True, "logprob_start_len": 1}
    events = streamed(
        fields,
        out([201], logprobs=[-0.1]),
        out([202], sidecar_pb2.LENGTH, logprobs=[-0.2], usage=(3, 2), prompt_logprobs=SGLANG_SIDECAR_ROWS),
    )
    metas = [e["meta_info"] for e in events[:-1]]
    assert [m["input_token_logprobs"] for m in metas] == [[], [[None, 100, None], [-0.072, 200, None]]]


def test_a_later_logprob_start_still_has_a_null_first_entry() -> None:
    output = out([201], sidecar_pb2.LENGTH, logprobs=[-0.084], prompt_logprobs=SGLANG_SIDECAR_ROWS)
    meta = body(unary({"return_logprob": True, "logprob_start_len": 1}, output))["meta_info"]
    assert meta["input_token_logprobs"] == [[None, 100, None], [-0.072, 200, None]]
    assert "input_top_logprobs" not in meta


def test_missing_prompt_logprobs_keep_the_shape_with_null_values() -> None:
    meta = body(
        unary({"return_logprob": True, "logprob_start_len": 0}, out([5], sidecar_pb2.LENGTH, logprobs=[-1.0]))
    )["meta_info"]
    assert meta["input_token_logprobs"] == [[None, 1, None], [None, 100, None], [None, 200, None]]


def test_non_finite_logprobs_are_written_as_null() -> None:
    output = out([5], sidecar_pb2.LENGTH, logprobs=[float("-inf")])
    reply = unary({"return_logprob": True}, output)
    assert b"Infinity" not in reply.body
    assert body(reply)["meta_info"]["output_token_logprobs"] == [[None, 5, None]]


# ------------------------------------------------------------------ abort, info, errors


ABORTS: list[tuple[bytes, AbortCall]] = [
    # A rid aborts by prefix, as SGLang's scheduler (when the rid itself is in flight).
    (b'{"rid": "job-1"}', AbortCall(request_ids=("job-1",), by_prefix=True)),
    (b'{"abort_all": true}', AbortCall(all_requests=True)),
    (b'{"rid": "x", "abort_all": true}', AbortCall(all_requests=True)),
    (b"{}", AbortCall(by_prefix=True)),
    (b'{"rid": null}', AbortCall(by_prefix=True)),
    (b'{"rid": ""}', AbortCall(by_prefix=True)),
    (b'{"rid": "a", "abort_message": "why", "unknown": 1}', AbortCall(request_ids=("a",), by_prefix=True)),
    # SGLang validates the body laxly: "yes" is true (recorded in differential_sglang.json).
    (b'{"abort_all": "yes"}', AbortCall(all_requests=True)),
]


@pytest.mark.parametrize(("raw", "expected"), ABORTS)
def test_abort_bodies(raw: bytes, expected: AbortCall) -> None:
    assert FORMAT.parse_abort(ABORT, raw, {}) == expected


@pytest.mark.parametrize("raw", [b'{"rid": 5}', b'{"abort_all": "maybe"}', b"not json", b"[]"])
def test_malformed_abort_bodies_are_the_parse_gates_400(raw: bytes) -> None:
    reply = FORMAT.parse_abort(ABORT, raw, {})
    assert isinstance(reply, HttpReply)
    assert reply.status == 400
    assert body(reply)["type"] == "Bad Request"


def test_abort_always_answers_200_with_an_empty_body_and_no_content_type() -> None:
    for aborted in (0, 3):
        assert FORMAT.abort_reply(ABORT, AbortCall(request_ids=("x",)), aborted) == HttpReply(200, b"", "")


def info(path: str, *, incremental: bool = False, **ctx: Any) -> HttpReply:
    fmt = SglangFormat(incremental_streaming_output=incremental)
    return fmt.info(Route(("GET",), path, RouteKind.INFO), context(**ctx))


def test_health_is_an_empty_200_once_a_model_is_known() -> None:
    assert info("/health") == HttpReply(200, b"", "")
    assert info("/health_generate") == HttpReply(200, b"", "")
    assert info("/health", served_model_name="").status == 503


def test_model_info_and_models_come_from_the_workers_model() -> None:
    model = body(info("/model_info", supports_vision=True))
    assert model["served_model_name"] == "my-model"
    assert model["model_path"] == "/models/my-model"
    assert model["is_generation"] is True
    assert model["has_image_understanding"] is True
    assert model["disaggregation_mode"] == "null"
    assert body(info("/get_model_info")) == body(info("/model_info"))
    assert body(info("/v1/models")) == {
        "object": "list",
        "data": [
            {
                "id": "my-model",
                "object": "model",
                "created": int(WALL_TIME),
                "owned_by": "sglang",
                "root": "my-model",
                "parent": None,
                "max_model_len": 4096,
            }
        ],
    }


def test_server_info_reports_what_a_generate_client_reads() -> None:
    server = body(info("/server_info", incremental=True))
    assert server["skip_tokenizer_init"] is True
    assert server["context_length"] == 4096
    assert server["max_req_input_len"] == 4090
    assert server["incremental_streaming_output"] is True
    assert server["version"] == "0.5.23"
    assert body(info("/get_server_info", incremental=True)) == server


def test_routes() -> None:
    declared = {(method, route.path): route.kind for route in FORMAT.routes for method in route.methods}
    assert declared[("POST", "/generate")] is RouteKind.GENERATE
    assert declared[("PUT", "/generate")] is RouteKind.GENERATE
    assert declared[("POST", "/abort_request")] is RouteKind.ABORT
    for path in ("/health", "/health_generate", "/model_info", "/server_info", "/v1/models"):
        assert declared[("GET", path)] is RouteKind.INFO


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (400, {"error": {"message": "nope"}}),
        (503, {"object": "error", "message": "nope", "type": "503", "param": None, "code": 503}),
        (405, {"detail": "Method Not Allowed"}),
        (404, {"detail": "Not Found"}),
    ],
)
def test_handler_level_errors_use_sglangs_shapes(status: int, expected: Any) -> None:
    reply = FORMAT.error_reply(status, "nope")
    assert reply.status == status
    assert json.loads(reply.body) == expected


@pytest.mark.parametrize(
    ("incremental", "expected"),
    [(False, [[101], [101, 102, 103], [101, 102, 103, 104, 105]]), (True, [[101], [102, 103], [104, 105]])],
)
def test_stream_interval_sends_the_first_token_then_every_n_and_the_end(
    incremental: bool, expected: list[list[int]]
) -> None:
    events = streamed(
        {"sampling_params": {"stream_interval": 2}},
        out([101]),
        out([102]),
        out([103]),
        out([104]),
        out([105], sidecar_pb2.LENGTH),
        incremental=incremental,
    )
    assert [e["output_ids"] for e in events[:-1]] == expected


def test_token_ids_logprobs_follow_the_top_logprobs_in_sglangs_shape() -> None:
    # SGLang's tokenizer manager: input_token_ids_logprobs (first entry null) and
    # output_token_ids_logprobs, after the top-logprob keys.
    first = out([201], logprobs=[-0.1], prompt_logprobs=SGLANG_SIDECAR_ROWS)
    first.token_ids_logprobs.add().entries.add(token_id=7, logprob=-2.5)
    first.token_ids_logprobs[0].entries.add(token_id=5, logprob=-3.0)
    first.engine_data.update(
        {
            "prompt_token_ids_logprobs": [
                None,
                [{"token_id": 7, "logprob": -1.5}, {"token_id": 5, "logprob": -1.75}],
                [{"token_id": 7, "logprob": -4.0}, {"token_id": 5, "logprob": -0.5}],
            ],
        }
    )
    last = out([202], sidecar_pb2.LENGTH, logprobs=[-0.2], usage=(3, 2))
    last.token_ids_logprobs.add().entries.extend(
        [sidecar_pb2.TopLogprob(token_id=7, logprob=-0.25), sidecar_pb2.TopLogprob(token_id=5, logprob=-9.0)]
    )
    fields = {"return_logprob": True, "logprob_start_len": 0, "token_ids_logprob": [7, 5]}
    meta = body(unary(fields, first, last))["meta_info"]
    assert list(meta) == [
        *META_KEYS[:5],
        *LOGPROB_KEYS,
        "input_token_ids_logprobs",
        "output_token_ids_logprobs",
        *META_KEYS[5:],
        "e2e_latency",
        "response_sent_to_client_ts",
    ]
    assert meta["input_token_ids_logprobs"] == [
        None,
        [[-1.5, 7, None], [-1.75, 5, None]],
        [[-4.0, 7, None], [-0.5, 5, None]],
    ]
    assert meta["output_token_ids_logprobs"] == [
        [[-2.5, 7, None], [-3.0, 5, None]],
        [[-0.25, 7, None], [-9.0, 5, None]],
    ]


def test_a_prompt_only_request_shows_the_row_after_the_prompt() -> None:
    # max_new_tokens 0: SGLang scores the next position; its row comes without a token.
    end = out([], sidecar_pb2.LENGTH, usage=(3, 0))
    end.token_ids_logprobs.add().entries.add(token_id=7, logprob=-2.0)
    fields = {"return_logprob": True, "token_ids_logprob": [7], "sampling_params": {"max_new_tokens": 0}}
    meta = body(unary(fields, end))["meta_info"]
    assert (meta["output_token_logprobs"], meta["output_token_ids_logprobs"]) == ([], [[[-2.0, 7, None]]])
    assert meta["input_token_ids_logprobs"] == []
