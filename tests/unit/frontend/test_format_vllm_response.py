"""vLLM responses: unary and streamed shapes, finish reasons, failures, abort, info routes."""

# Expected bodies are quoted whole; splitting them would hide the bytes under test.
# ruff: noqa: E501

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason
from sidecar_common.structs import JSON, struct_from_json
from sidecar_frontend.formats.base import AbortCall, Encoder, Format, HttpReply, RouteKind, WorkerFailure
from sidecar_frontend.formats.vllm import ABORT, FORMAT, HEALTH, LEGACY_ABORT, MODELS
from tests.unit.frontend.test_format_vllm_support import accepted, context, error_of, sse_events

CHOICE_NULLS = {"routed_experts": None, "sampling_mask": None, "weight_versions": None}


def _encoder(**top: Any) -> Encoder:
    sampling = top.pop("sampling_params", {})
    call = accepted({"token_ids": [5, 6, 7], "sampling_params": sampling, "request_id": "r", **top})
    return FORMAT.new_encoder(call, 5.25)  # the handler's monotonic clock: not a date


def _out(
    ids: list[int], index: int = 0, finish: int = sidecar_pb2.UNSPECIFIED, **kw: Any
) -> sidecar_pb2.LLMEngineOutput:
    return sidecar_pb2.LLMEngineOutput(token_ids=ids, index=index, finish_reason=finish, **kw)  # type: ignore[arg-type]


def _unary(encoder: Encoder) -> dict[str, Any]:
    reply = encoder.reply()
    assert reply.status == 200
    assert reply.content_type == "application/json"
    body: dict[str, Any] = json.loads(reply.body)
    return body


# ----------------------------------------------------------------------------------- unary


def test_unary_response_is_vllms_shape_byte_for_byte() -> None:
    enc = _encoder(sampling_params={"max_tokens": 4, "n": 2})
    for i in (0, 1):
        assert enc.on_output(0, _out([8 + 1000 * i, 9 + 1000 * i], i), 1.0) == b""
        assert enc.on_output(0, _out([10 + 1000 * i, 11 + 1000 * i], i, sidecar_pb2.LENGTH), 2.0) == b""
    assert enc.reply().body == (
        b'{"request_id":"generate-tokens-r","model":"my-model","created":1796113919,'
        b'"usage":{"prompt_tokens":3,"total_tokens":11,"completion_tokens":8,"prompt_tokens_details":null,'
        b'"completion_tokens_details":null},"prompt_logprobs":null,"prompt_token_id_logprobs":null,'
        b'"prompt_token_ids":null,"mm_placeholders":null,"metrics":null,"kv_transfer_params":null,'
        b'"ec_transfer_params":null,"output_mode":"tokens","choices":['
        b'{"index":0,"finish_reason":"length","stop_reason":null,"token_ids":[8,9,10,11],"routed_experts":null,'
        b'"sampling_mask":null,"weight_versions":null,"logprobs":null},'
        b'{"index":1,"finish_reason":"length","stop_reason":null,"token_ids":[1008,1009,1010,1011],'
        b'"routed_experts":null,"sampling_mask":null,"weight_versions":null,"logprobs":null}]}'
    )


FINISHES: list[tuple[sidecar_pb2.LLMEngineOutput, str, object]] = [
    (_out([9], 0, sidecar_pb2.LENGTH), "length", None),
    (_out([9], 0, sidecar_pb2.STOP, stop_token_id=9), "stop", 9),
    (_out([9], 0, sidecar_pb2.STOP, stop_string="end"), "stop", "end"),
    (_out([2], 0, sidecar_pb2.STOP), "stop", None),  # EOS, as the vLLM sidecar reports it
    (_out([2], 0, sidecar_pb2.EOS), "stop", None),
    (_out([], 0, sidecar_pb2.CANCELLED), "abort", None),
    (_out([9], 0, sidecar_pb2.CONTENT_FILTER), "stop", None),
]


@pytest.mark.parametrize(("terminal", "finish", "stop_reason"), FINISHES)
def test_finish_and_stop_reason(
    terminal: sidecar_pb2.LLMEngineOutput, finish: str, stop_reason: object
) -> None:
    unary = _encoder()
    unary.on_output(0, _out([8]), 0.0)
    unary.on_output(0, terminal, 0.0)
    choice = _unary(unary)["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == (finish, stop_reason)
    assert choice["token_ids"] == [8, *terminal.token_ids]  # stop ids and EOS are kept

    stream = _encoder(stream=True)
    stream.on_output(0, _out([8]), 0.0)
    (event,) = sse_events(stream.on_output(0, terminal, 0.0))
    streamed = event["choices"][0]
    assert (streamed["finish_reason"], streamed["stop_reason"], streamed["token_ids"]) == (
        finish,
        stop_reason,
        list(terminal.token_ids),
    )


def test_unary_keeps_what_only_the_terminal_carries() -> None:
    enc = _encoder(sampling_params={"prompt_logprobs": 1}, return_token_ids=True)
    terminal = _out([8], 0, sidecar_pb2.LENGTH)
    terminal.disaggregated_params.CopyFrom(struct_from_json({"remote_port": 5600, "ids": [1, 2], "x": None}))
    prompt_logprobs: list[JSON] = [
        None,
        {"6": {"logprob": -1.5}, "9": {"logprob": -0.25, "rank": 1}},
        {"7": {"logprob": -1e9}},
    ]
    terminal.engine_data.CopyFrom(struct_from_json({"prompt_logprobs": prompt_logprobs}))
    enc.on_output(0, terminal, 0.0)
    body = _unary(enc)
    assert body["kv_transfer_params"] == {"remote_port": 5600, "ids": [1, 2], "x": None}
    assert body["prompt_logprobs"] == [
        None,
        {
            "6": {"logprob": -1.5, "rank": None, "decoded_token": None},
            "9": {"logprob": -0.25, "rank": 1, "decoded_token": None},
        },
        {"7": {"logprob": -9999.0, "rank": None, "decoded_token": None}},
    ]
    assert body["prompt_token_ids"] == [5, 6, 7]


def test_prompt_logprobs_list_the_prompt_token_first_then_the_best() -> None:
    # A Struct keeps no key order (the wire scrambles it): the order is rebuilt.
    enc = _encoder(sampling_params={"prompt_logprobs": 3})
    position: dict[str, JSON] = {str(t): {"logprob": -float(t)} for t in (9, 4, 6, 1, 30, 12)}
    terminal = _out([8], 0, sidecar_pb2.LENGTH)
    terminal.engine_data.CopyFrom(struct_from_json({"prompt_logprobs": [None, position, None]}))
    wire = sidecar_pb2.LLMEngineOutput.FromString(terminal.SerializeToString())
    enc.on_output(0, wire, 0.0)
    entries = _unary(enc)["prompt_logprobs"][1]
    assert list(entries) == ["6", "1", "4", "9", "12", "30"]  # prompt token 6, then by logprob


def test_prompt_logprobs_from_an_sglang_sidecar() -> None:
    # The SGLang sidecar lists each position's candidates, the prompt token first.
    enc = _encoder(sampling_params={"prompt_logprobs": 1})
    rows: list[JSON] = [None, [{"token_id": 6, "logprob": -2.5}, {"token_id": 11, "logprob": -0.5}]]
    terminal = _out([8], 0, sidecar_pb2.LENGTH)
    terminal.engine_data.CopyFrom(struct_from_json({"prompt_logprobs": rows}))
    enc.on_output(0, terminal, 0.0)
    assert _unary(enc)["prompt_logprobs"] == [
        None,
        {
            "6": {"logprob": -2.5, "rank": None, "decoded_token": None},
            "11": {"logprob": -0.5, "rank": None, "decoded_token": None},
        },
    ]


def test_prompt_logprobs_only_when_asked() -> None:
    enc = _encoder()
    terminal = _out([8], 0, sidecar_pb2.LENGTH)
    terminal.engine_data.CopyFrom(struct_from_json({"prompt_logprobs": [None]}))
    enc.on_output(0, terminal, 0.0)
    assert _unary(enc)["prompt_logprobs"] is None


def _with_logprobs(
    ids: list[int], values: list[float], tops: list[list[tuple[int, float, int | None]]]
) -> Any:
    out = _out(ids)
    out.log_probs.extend(values)
    for row in tops:
        entries = out.top_logprobs.add().entries
        for token, logprob, rank in row:
            entry = entries.add(token_id=token, logprob=logprob)
            if rank is not None:
                entry.rank = rank
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_logprob_entries_have_vllms_shape(stream: bool) -> None:
    enc = _encoder(sampling_params={"logprobs": 1}, stream=stream)
    out = _with_logprobs(
        [8, 9, 10],
        [-0.05, -math.inf, math.nan],
        [[(8, -0.05, 1), (15846, -0.8, 2)], [(9, -math.inf, None), (3, -0.1, 1)], [(10, math.nan, 0)]],
    )
    data = enc.on_output(0, out, 0.0)
    data += enc.on_output(0, _out([11], 0, sidecar_pb2.LENGTH), 0.0)  # a position without logprobs
    if stream:
        content = [e for event in sse_events(data) for e in event["choices"][0]["logprobs"]["content"]]
    else:
        content = _unary(enc)["choices"][0]["logprobs"]["content"]
    assert content == [
        {
            "token_id": 8,
            "logprob": -0.05,
            "rank": 1,
            "top_logprobs": [
                {"token_id": 8, "logprob": -0.05, "rank": 1},
                {"token_id": 15846, "logprob": -0.8, "rank": 2},
            ],
        },
        {
            "token_id": 9,
            "logprob": -9999.0,
            "rank": None,
            "top_logprobs": [
                {"token_id": 9, "logprob": -9999.0, "rank": None},
                {"token_id": 3, "logprob": -0.1, "rank": 1},
            ],
        },
        {
            "token_id": 10,
            "logprob": -9999.0,
            "rank": None,
            "top_logprobs": [{"token_id": 10, "logprob": -9999.0, "rank": None}],
        },
        {"token_id": 11, "logprob": -9999.0, "rank": None, "top_logprobs": []},
    ]


# ------------------------------------------------------------------------------- streaming


def test_stream_is_framed_as_vllm_frames_it() -> None:
    enc = _encoder(stream=True, stream_options={"include_usage": True}, sampling_params={"max_tokens": 5})
    data = enc.on_output(0, _out([8]), 1.0)
    data += enc.on_output(0, _out([9, 10]), 1.0)
    data += enc.on_output(0, _out([11, 12], 0, sidecar_pb2.LENGTH), 1.0)
    data += enc.close()

    def chunk(finish: str, ids: str) -> str:
        return (
            '{"request_id":"generate-tokens-r","usage":null,"output_mode":"tokens","choices":[{"index":0,'
            f'"finish_reason":{finish},"stop_reason":null,"token_ids":{ids},"routed_experts":null,'
            '"sampling_mask":null,"weight_versions":null,"logprobs":null}]}'
        )

    assert data.decode() == (
        f"data: {chunk('null', '[8]')}\n\n"
        f"data: {chunk('null', '[9,10]')}\n\n"
        "data: " + chunk('"length"', "[11,12]") + "\n\n"
        'data: {"request_id":"generate-tokens-r","usage":{"prompt_tokens":3,"total_tokens":8,"completion_tokens":5},"output_mode":"tokens","choices":[]}\n\n'
        "data: [DONE]\n\n"
    )


def test_a_chunk_needs_tokens_or_a_finish() -> None:
    enc = _encoder(stream=True)
    assert enc.on_output(0, _out([]), 0.0) == b""
    assert enc.close() == b"data: [DONE]\n\n"


def test_prompt_token_ids_only_on_the_first_chunk() -> None:
    enc = _encoder(stream=True, return_token_ids=True)
    first, second = (sse_events(enc.on_output(0, _out([t]), 0.0))[0] for t in (8, 9))
    assert list(first) == ["request_id", "usage", "prompt_token_ids", "output_mode", "choices"]
    assert first["prompt_token_ids"] == [5, 6, 7]
    assert "prompt_token_ids" not in second


def test_streams_never_carry_unary_only_fields() -> None:
    enc = _encoder(stream=True, sampling_params={"prompt_logprobs": 1})
    terminal = _out([8], 0, sidecar_pb2.LENGTH)
    terminal.disaggregated_params.CopyFrom(struct_from_json({"a": 1}))
    terminal.engine_data.CopyFrom(struct_from_json({"prompt_logprobs": [None]}))
    data = enc.on_output(0, terminal, 0.0) + enc.close()
    for event in sse_events(data)[:-1]:
        assert set(event) == {"request_id", "usage", "output_mode", "choices"}


def test_continuous_usage_counts_the_chunks_choice_so_far() -> None:
    enc = _encoder(
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        sampling_params={"n": 2},
    )
    data = b"".join(
        enc.on_output(0, out, 0.0)
        for out in (
            _out([1], 0),
            _out([1, 4], 1),  # not 2: the EOS, whose chunk would wait for its terminal
            _out([4, 3], 0),
            _out([3], 1, sidecar_pb2.LENGTH),
            _out([], 0, sidecar_pb2.LENGTH),
        )
    )
    events = sse_events(data + enc.close())
    counts = [e["usage"]["completion_tokens"] for e in events[:5]]
    assert counts == [1, 2, 3, 3, 3]
    assert events[0]["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 4,
        "completion_tokens": 1,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert events[5]["usage"] == {"prompt_tokens": 3, "total_tokens": 9, "completion_tokens": 6}
    assert events[6] == "[DONE]"


# -------------------------------------------------------------------------------- failures

FAILURES: list[tuple[str, int, str, str]] = [
    ("INVALID_ARGUMENT", 400, "BadRequestError", "Token id 99 is out of vocabulary"),
    (
        "OVERLOADED",
        503,
        "Service Unavailable",
        "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance.",
    ),
    ("CANNOT_CONNECT", 500, "InternalServerError", "The server had an error while processing your request."),
    ("ENGINE_SHUTDOWN", 500, "InternalServerError", "The server had an error while processing your request."),
    (
        "CONNECTION_TIMEOUT",
        500,
        "InternalServerError",
        "The server had an error while processing your request.",
    ),
    ("NO_WORKER", 500, "InternalServerError", "The server had an error while processing your request."),
    # vLLM sends "" for an EngineGenerateError; no error of ours is without words.
    ("PROTOCOL_ERROR", 500, "InternalServerError", "The server had an error while processing your request."),
    ("UNKNOWN", 500, "InternalServerError", "The server had an error while processing your request."),
]


@pytest.mark.parametrize(("reason", "status", "kind", "message"), FAILURES)
def test_failures_read_as_vllms_errors(reason: str, status: int, kind: str, message: str) -> None:
    failure = WorkerFailure(FailureReason(reason), "Token id 99 is out of vocabulary")
    unary = _encoder()
    unary.on_output(0, _out([8]), 0.0)
    assert unary.on_failure(0, failure, 0.0) == b""
    assert unary.aborted
    reply = unary.reply()
    assert error_of(reply) == {"message": message, "type": kind, "param": None, "code": status}

    stream = _encoder(stream=True, stream_options={"include_usage": True})
    before = stream.on_output(0, _out([8]), 0.0)
    assert len(sse_events(before)) == 1  # tokens sent before the failure stay sent
    event = stream.on_failure(0, failure, 0.0)
    expected = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    assert event == b"data: " + json.dumps(expected).encode() + b"\n\n"  # json.dumps spacing, as vLLM
    assert stream.aborted
    assert stream.close() == b"data: [DONE]\n\n"  # no usage chunk after an error


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ("routing.cache_namespace: the vLLM wire cannot carry a cache salt", "cache_salt"),
        ("routing.priority: the vLLM wire cannot carry a priority", "priority"),
        ("sampling_options.n: at most 1024 choices (got 2000)", "n"),
        ("stop_conditions.max_tokens: too many", "max_tokens"),
        ("output_options.logprobs: 30 does not fit", "logprobs"),
        ("extra_args.kv_transfer_params: must be an object", "kv_transfer_params"),
        ("multi_modal_data[0].kind: AUDIO is not supported by vLLM", None),
        ("Requested sample logprobs of 21, which is greater than max allowed: 20", None),
    ],
)
def test_a_workers_refusal_names_the_vllm_field(message: str, param: str | None) -> None:
    enc = _encoder()
    enc.on_failure(0, WorkerFailure(FailureReason.INVALID_ARGUMENT, message), 0.0)
    assert error_of(enc.reply()) == {
        "message": message,
        "type": "BadRequestError",
        "param": param,
        "code": 400,
    }


@pytest.mark.parametrize("reason", ["CANCELLED", "DEADLINE"])
def test_cancellation_finishes_open_choices_as_abort(reason: str) -> None:
    unary = _encoder(sampling_params={"n": 2})
    unary.on_output(0, _out([8, 9, 10]), 0.0)
    unary.on_output(0, _out([1008, 1009, 1010, 1011], 1, sidecar_pb2.LENGTH), 0.0)
    unary.on_output(0, _out([1012], 1), 0.0)  # after its terminal: ignored
    unary.on_failure(0, WorkerFailure(FailureReason(reason), "cancelled"), 0.0)
    assert unary.aborted
    body = _unary(unary)
    assert [(c["finish_reason"], c["token_ids"]) for c in body["choices"]] == [
        ("abort", [8, 9, 10]),
        ("length", [1008, 1009, 1010, 1011]),
    ]
    assert body["usage"]["completion_tokens"] == 7

    stream = _encoder(
        stream=True, stream_options={"include_usage": True}, sampling_params={"n": 2, "logprobs": 0}
    )
    stream.on_output(0, _with_logprobs([8], [-0.1], [[(8, -0.1, 1)]]), 0.0)
    events = sse_events(
        stream.on_failure(0, WorkerFailure(FailureReason(reason), "cancelled"), 0.0) + stream.close()
    )
    assert [e["choices"][0] for e in events[:2]] == [
        {
            "index": i,
            "finish_reason": "abort",
            "stop_reason": None,
            "token_ids": [],
            **CHOICE_NULLS,
            "logprobs": {"content": []},
        }
        for i in (0, 1)
    ]
    assert events[2]["usage"] == {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1}
    assert events[3] == "[DONE]"
    assert stream.on_output(0, _out([9]), 0.0) == b""  # nothing after the end


# ----------------------------------------------------------------------------------- abort


ABORTS: list[tuple[bytes, tuple[str, ...]]] = [
    (b'{"request_ids": ["x"]}', ("generate-tokens-x",)),
    (b'{"request_ids": "x"}', ("generate-tokens-x",)),
    (b'{"request_ids": ["generate-tokens-x"]}', ("generate-tokens-x", "generate-tokens-generate-tokens-x")),
    (b'{"request_ids": ["a", "b", "a"]}', ("generate-tokens-a", "generate-tokens-b")),
    (b'{"request_ids": []}', ()),
]


@pytest.mark.parametrize(("body", "ids"), ABORTS)
def test_abort_names_prefixed_and_unprefixed_ids(body: bytes, ids: tuple[str, ...]) -> None:
    for route in (ABORT, LEGACY_ABORT):
        assert FORMAT.parse_abort(route, body, {}) == AbortCall(request_ids=ids)


ABORT_REFUSALS: list[tuple[bytes, str]] = [
    (b"{}", "Missing 'request_ids' in request body"),
    (b'{"request_ids": null}', "Missing 'request_ids' in request body"),
    (b"{", "JSON decode error: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    (b"", "JSON decode error: Expecting value: line 1 column 1 (char 0)"),
    (b"[]", "The request body must be a JSON object, not a list"),
    (b'{"request_ids": [1]}', "'request_ids' must be a request id or a list of request ids"),
]


@pytest.mark.parametrize(("body", "message"), ABORT_REFUSALS)
def test_abort_refusals(body: bytes, message: str) -> None:
    reply = FORMAT.parse_abort(ABORT, body, {})
    assert isinstance(reply, HttpReply)
    assert error_of(reply) == {"message": message, "type": "Bad Request", "param": None, "code": 400}


def test_abort_reply_is_an_empty_200() -> None:
    reply = FORMAT.abort_reply(ABORT, AbortCall(("generate-tokens-x",)), 0)
    assert (reply.status, reply.body, reply.content_type) == (200, b"", "")


# ------------------------------------------------------------------------------ info, errors


def test_health_and_models() -> None:
    ctx = context()
    health = FORMAT.info(HEALTH, ctx)
    assert (health.status, health.body) == (200, b"")
    models = FORMAT.info(MODELS, ctx)
    body = json.loads(models.body)
    assert body["object"] == "list"
    (card,) = body["data"]
    assert {k: card[k] for k in ("id", "object", "owned_by", "root", "parent", "max_model_len")} == {
        "id": "my-model",
        "object": "model",
        "owned_by": "vllm",
        "root": "/models/my-model",
        "parent": None,
        "max_model_len": 4096,
    }
    assert card["permission"][0]["id"] == "modelperm-842536af25e84b36" + "0" * 16
    assert card["created"] == card["permission"][0]["created"] == 1796113919


@pytest.mark.parametrize(
    ("status", "message", "body"),
    [
        (405, "method GET is not allowed", {"detail": "Method Not Allowed"}),
        (404, "no such route", {"detail": "Not Found"}),
        (
            413,
            "too big",
            {"error": {"message": "too big", "type": "Request Entity Too Large", "param": None, "code": 413}},
        ),
        (
            503,
            "busy",
            {"error": {"message": "busy", "type": "Service Unavailable", "param": None, "code": 503}},
        ),
        (
            500,
            "boom",
            {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}},
        ),
        (400, "bad", {"error": {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}}),
    ],
)
def test_error_reply(status: int, message: str, body: dict[str, Any]) -> None:
    reply = FORMAT.error_reply(status, message)
    assert reply.status == status
    assert json.loads(reply.body) == body


def test_the_plugin_serves_vllms_routes() -> None:
    fmt: Format = FORMAT  # mypy checks the plugin against the contract
    assert fmt.name == "vllm"
    assert {(r.methods, r.path, r.kind) for r in fmt.routes} == {
        (("POST",), "/inference/v1/generate", RouteKind.GENERATE),
        (("POST",), "/inference/v1/abort_requests", RouteKind.ABORT),
        (("POST",), "/abort_requests", RouteKind.ABORT),
        (("GET",), "/health", RouteKind.INFO),
        (("GET",), "/v1/models", RouteKind.INFO),
    }
