"""vLLM request parsing: every field accepted onto the exact sidecar.v1 fields, or refused as vLLM does."""

# The refusal tables quote vLLM's messages verbatim; splitting them further would hide the text.
# ruff: noqa: E501

from __future__ import annotations

from typing import Any

import pytest

from sidecar_common.api import sidecar_pb2
from sidecar_common.structs import json_from_struct
from tests.unit.frontend.test_format_vllm_support import (
    JSON_HEADERS,
    accepted,
    context,
    error_of,
    options,
    refused,
)

PROMPT = [5, 6, 7]


def _request(**top: Any) -> dict[str, Any]:
    return {"token_ids": PROMPT, "sampling_params": {}, **top}


def _expected(**sampling: Any) -> sidecar_pb2.PreprocessedRequest:
    """The request an empty sampling_params gives (not streamed: it asks for one answer), with
    the named sub-messages merged in."""
    req = sidecar_pb2.PreprocessedRequest(
        request_id="generate-tokens-842536af25e84b36", model="my-model", token_ids=PROMPT, eos_token_ids=[2]
    )
    req.output_options.unary = True
    for name, fields in sampling.items():
        getattr(req, name).MergeFrom(type(getattr(req, name))(**fields))
    return req


# ------------------------------------------------------------------------ accepted: sampling

SAMPLING_CASES: list[tuple[dict[str, Any], sidecar_pb2.PreprocessedRequest]] = [
    ({}, _expected()),
    ({"max_tokens": 16}, _expected(stop_conditions={"max_tokens": 16})),
    # Explicit null: up to the context (4096 - 3 prompt tokens), not the server's default cap.
    ({"max_tokens": None}, _expected(stop_conditions={"max_tokens": 4093})),
    ({"min_tokens": 0}, _expected(stop_conditions={"min_tokens": 0})),
    ({"min_tokens": 2, "max_tokens": 2}, _expected(stop_conditions={"min_tokens": 2, "max_tokens": 2})),
    ({"ignore_eos": False}, _expected(stop_conditions={"ignore_eos": False})),
    ({"ignore_eos": "yes"}, _expected(stop_conditions={"ignore_eos": True})),
    ({"stop_token_ids": [9, 2, 9]}, _expected(stop_conditions={"stop_token_ids": [9, 2]})),
    ({"stop_token_ids": None}, _expected()),
    ({"stop": []}, _expected()),
    ({"n": 3}, _expected(sampling_options={"n": 3})),
    ({"n": "2"}, _expected(sampling_options={"n": 2})),
    ({"n": 2.0}, _expected(sampling_options={"n": 2})),
    ({"temperature": 0}, _expected(sampling_options={"temperature": 0.0})),
    ({"temperature": 1.0}, _expected(sampling_options={"temperature": 1.0})),
    ({"temperature": "0.5"}, _expected(sampling_options={"temperature": 0.5})),
    ({"top_p": 0.5}, _expected(sampling_options={"top_p": 0.5})),
    ({"top_k": -1}, _expected(sampling_options={"top_k": -1})),
    ({"top_k": 0}, _expected(sampling_options={"top_k": 0})),
    ({"min_p": 0.0}, _expected(sampling_options={"min_p": 0.0})),
    ({"presence_penalty": -2}, _expected(sampling_options={"presence_penalty": -2.0})),
    ({"frequency_penalty": 2}, _expected(sampling_options={"frequency_penalty": 2.0})),
    ({"repetition_penalty": 1.5}, _expected(sampling_options={"repetition_penalty": 1.5})),
    ({"seed": 7}, _expected(sampling_options={"seed": 7})),
    ({"seed": 0}, _expected(sampling_options={"seed": 0})),
    ({"seed": -1}, _expected()),  # vLLM: -1 means no seed
    ({"seed": None}, _expected()),
    ({"include_stop_str_in_output": True}, _expected(sampling_options={"include_stop_str_in_output": True})),
    ({"logit_bias": {"5": 1.5, "7": -100}}, _expected(sampling_options={"logit_bias": {5: 1.5, 7: -100.0}})),
    ({"logprobs": 0}, _expected(output_options={"logprobs": 0})),
    ({"logprobs": 5}, _expected(output_options={"logprobs": 5})),
    ({"logprobs": True}, _expected(output_options={"logprobs": 1})),
    ({"logprobs": None}, _expected()),
    ({"prompt_logprobs": 2}, _expected(output_options={"prompt_logprobs": 2})),
    ({"skip_special_tokens": False}, _expected(output_options={"skip_special_tokens": False})),
    # Accepted and without effect on a tokens-only server, as in vLLM; unknown and private keys ignored.
    (
        {
            "detokenize": False,
            "spaces_between_special_tokens": False,
            "bad_words": ["x"],
            "stream_interval": 2,
            "output_kind": 1,
            "flat_logprobs": True,
            "skip_reading_prefix_cache": True,
            "watermarking": False,
            "unknown": {"a": 1},
            "_private": 1,
        },
        _expected(),
    ),
]


@pytest.mark.parametrize(("sampling", "expected"), SAMPLING_CASES, ids=[str(c[0]) for c in SAMPLING_CASES])
def test_sampling_params_set_exactly_the_keys_sent(
    sampling: dict[str, Any], expected: sidecar_pb2.PreprocessedRequest
) -> None:
    call = accepted({"token_ids": PROMPT, "sampling_params": sampling})
    assert call.requests[0] == expected
    assert not call.stream


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_not_streamed_asks_the_worker_for_one_answer(stream: bool) -> None:
    call = accepted(_request(stream=stream))
    assert call.stream is stream
    assert call.requests[0].output_options.unary is not stream
    # A streamed request's output options stay as they were: nothing set.
    assert call.requests[0].HasField("output_options") is not stream


def test_an_absent_key_stays_absent_where_an_explicit_zero_is_set() -> None:
    absent = accepted(_request()).requests[0]
    zero = accepted({"token_ids": PROMPT, "sampling_params": {"temperature": 0, "min_tokens": 0, "top_k": 0}})
    explicit = zero.requests[0]
    assert not absent.sampling_options.HasField("temperature")
    assert explicit.sampling_options.HasField("temperature")
    assert not absent.stop_conditions.HasField("min_tokens")
    assert explicit.stop_conditions.HasField("min_tokens")
    assert explicit.sampling_options.HasField("top_k")


def test_explicit_null_max_tokens_differs_from_absent() -> None:
    absent = accepted(_request()).requests[0]
    null = accepted({"token_ids": PROMPT, "sampling_params": {"max_tokens": None}}).requests[0]
    assert not absent.stop_conditions.HasField("max_tokens")
    assert null.stop_conditions.max_tokens == 4096 - len(PROMPT)
    # Without a known context the null has nothing to resolve to: left to the engine.
    unknown = accepted(
        {"token_ids": PROMPT, "sampling_params": {"max_tokens": None}}, ctx=context(max_context_length=0)
    )
    assert not unknown.requests[0].stop_conditions.HasField("max_tokens")


# ------------------------------------------------------------------------- accepted: top level


def test_request_id_is_prefixed_and_defaults_to_16_hex_of_a_fresh_id() -> None:
    assert accepted(_request(request_id="abc")).requests[0].request_id == "generate-tokens-abc"
    assert accepted(_request(request_id="")).requests[0].request_id == "generate-tokens-"
    call = accepted(_request())
    assert call.requests[0].request_id == "generate-tokens-842536af25e84b36"
    assert options(call).request_id == "generate-tokens-842536af25e84b36"


def test_x_request_id_header_overrides_the_body() -> None:
    headers = {**JSON_HEADERS, "x-request-id": "from-header"}
    call = accepted(_request(request_id="from-body"), headers)
    assert call.requests[0].request_id == "generate-tokens-from-header"
    assert options(call).request_id == "generate-tokens-from-header"
    assert call.headers == ()  # vLLM echoes no X-Request-Id unless started with a flag


def test_content_type_parameters_are_accepted() -> None:
    accepted(_request(), {"content-type": "Application/JSON; charset=utf-8"})


def test_stream_and_stream_options() -> None:
    cases: list[tuple[dict[str, Any], tuple[bool, bool, bool]]] = [
        ({}, (False, False, False)),
        ({"stream": None}, (False, False, False)),
        ({"stream": True}, (True, False, False)),
        ({"stream": "true", "stream_options": {"include_usage": True}}, (True, True, False)),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, (True, False, False)),
        (
            {
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True, "x": 1},
            },
            (True, True, True),
        ),
        ({"stream": True, "stream_options": None}, (True, False, False)),
    ]
    for top, (stream, usage, continuous) in cases:
        call = accepted(_request(**top))
        o = options(call)
        assert (call.stream, o.stream, o.include_usage, o.continuous_usage) == (
            stream,
            stream,
            usage,
            continuous,
        ), top


def test_routing_fields() -> None:
    assert not accepted(_request()).requests[0].HasField("routing")
    salted = accepted(_request(cache_salt="s3cret")).requests[0]
    assert salted.routing == sidecar_pb2.RoutingHints(cache_namespace="s3cret")
    # vLLM: lower priority runs earlier; sidecar.v1: higher is more urgent.
    assert accepted(_request(priority=5)).requests[0].routing == sidecar_pb2.RoutingHints(priority=-5)
    explicit_zero = accepted(_request(priority=0)).requests[0]
    assert explicit_zero.routing.HasField("priority")
    ranked = accepted(_request(), {**JSON_HEADERS, "X-data-parallel-rank": "1"}).requests[0]
    assert ranked.routing == sidecar_pb2.RoutingHints(dp_rank=1)
    # A rank that is not an integer is ignored, as vLLM does.
    assert (
        not accepted(_request(), {**JSON_HEADERS, "X-data-parallel-rank": "x"})
        .requests[0]
        .HasField("routing")
    )


def test_kv_transfer_params_travel_by_the_sidecars_mode() -> None:
    params = {"do_remote_prefill": True, "remote_port": 5600, "ids": [1, 2], "x": None}
    agg = accepted(_request(kv_transfer_params=params)).requests[0]
    assert json_from_struct(agg.extra_args) == {"kv_transfer_params": params}
    assert not agg.HasField("prefill_result")
    decode = accepted(
        _request(kv_transfer_params=params), ctx=context(disaggregation_mode="decode")
    ).requests[0]
    assert json_from_struct(decode.prefill_result.disaggregated_params) == params
    assert not decode.HasField("extra_args")
    # null is what vLLM reads as "not given".
    assert not accepted(_request(kv_transfer_params=None)).requests[0].HasField("extra_args")


def test_model_may_be_the_served_name_empty_or_null() -> None:
    for model in ("my-model", "", None):
        accepted(_request(model=model))


def test_response_options() -> None:
    o = options(
        accepted({"token_ids": PROMPT, "sampling_params": {"n": 2, "logprobs": 1}, "return_token_ids": True})
    )
    assert (o.n, o.logprobs, o.prompt_logprobs, o.prompt_tokens) == (2, True, False, 3)
    assert o.prompt_token_ids == tuple(PROMPT)
    assert o.model == "my-model"
    plain = options(accepted(_request()))
    assert (plain.n, plain.logprobs, plain.prompt_token_ids) == (1, False, None)


def test_ignored_top_level_fields_are_accepted() -> None:
    accepted(
        _request(
            output_mode="tokens",
            reasoning_ended=True,
            reasoning_parser_kwargs={"chat_template_kwargs": {}},
            parse_context={"anything": 1},
            token_offsets=[[0, 1]],
            content_parts=[],
            unknown_key=1,
        )
    )


# ---------------------------------------------------------------------------------- refused


def _pyd(*entries: str, param: str) -> dict[str, Any]:
    count = len(entries)
    label = "error" if count == 1 else "errors"
    message = f"{count} validation {label}:\n" + "\n".join(f"  {e}" for e in entries)
    return {"message": message, "type": "Bad Request", "param": param, "code": 400}


def _vllm(
    message: str, param: str | None = None, code: int = 400, kind: str = "BadRequestError"
) -> dict[str, Any]:
    return {"message": message, "type": kind, "param": param, "code": code}


REFUSALS: list[tuple[str, Any, dict[str, Any]]] = [
    (
        "body not JSON",
        b'{"token_ids": [5,',
        _pyd(
            "{'type': 'json_invalid', 'loc': 'body.17', 'msg': 'JSON decode error', 'input': '<dict of 0 items>', "
            "'ctx': {'error': 'Expecting value'}}",
            param="body.17",
        ),
    ),
    (
        "empty body",
        b"",
        _pyd("{'type': 'missing', 'loc': 'body', 'msg': 'Field required', 'input': 'None'}", param="body"),
    ),
    (
        "body a list",
        [],
        _pyd(
            "{'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid dictionary or object "
            "to extract fields from', 'input': '<list of 0 items>'}",
            param="body",
        ),
    ),
    (
        "body not UTF-8",
        b'{"token_ids": "\xff"}',
        _vllm("There was an error parsing the body", kind="Bad Request"),
    ),
    (
        "token_ids missing",
        {"sampling_params": {}},
        _pyd(
            "{'type': 'missing', 'loc': 'body.token_ids', 'msg': 'Field required', 'input': '<dict of 1 items>'}",
            param="body.token_ids",
        ),
    ),
    (
        "token_ids empty",
        {"token_ids": [], "sampling_params": {}},
        _pyd(
            "{'type': 'too_short', 'loc': 'body.token_ids', 'msg': 'List should have at least 1 item after "
            "validation, not 0', 'input': '<list of 0 items>', 'ctx': {'field_type': 'List', 'min_length': 1, "
            "'actual_length': 0}}",
            param="body.token_ids",
        ),
    ),
    (
        "token_ids negative",
        {"token_ids": [1, -1], "sampling_params": {}},
        _pyd(
            "{'type': 'value_error', 'loc': 'body.token_ids', 'msg': 'Value error, token_ids must not contain "
            "negative values', 'input': '<list of 2 items>', 'ctx': {'error': ValueError('token_ids must not "
            "contain negative values')}}",
            param="body.token_ids",
        ),
    ),
    (
        "token_ids not integers",
        {"token_ids": ["a", 1.5], "sampling_params": {}},
        _pyd(
            "{'type': 'int_parsing', 'loc': 'body.token_ids.0', 'msg': 'Input should be a valid integer, unable to "
            "parse string as an integer', 'input': 'a'}",
            "{'type': 'int_from_float', 'loc': 'body.token_ids.1', 'msg': 'Input should be a valid integer, got a "
            "number with a fractional part', 'input': '1.5'}",
            param="body.token_ids.0",
        ),
    ),
    (
        "sampling_params null",
        {"token_ids": [1], "sampling_params": None},
        _pyd(
            "{'type': 'is_instance_of', 'loc': 'body.sampling_params', 'msg': 'Input should be an instance of "
            "SamplingParams', 'input': 'None', 'ctx': {'class': 'SamplingParams'}}",
            "{'type': 'dict_type', 'loc': 'body.sampling_params', 'msg': 'Input should be a valid dictionary', "
            "'input': 'None'}",
            param="body.sampling_params",
        ),
    ),
    (
        "request_id not a string",
        _request(request_id=5),
        _pyd(
            "{'type': 'string_type', 'loc': 'body.request_id', 'msg': 'Input should be a valid string', "
            "'input': '5'}",
            param="body.request_id",
        ),
    ),
    (
        "output_mode unknown",
        _request(output_mode="words"),
        _pyd(
            "{'type': 'literal_error', 'loc': 'body.output_mode', 'msg': \"Input should be 'tokens', 'text' or "
            "'derender'\", 'input': 'words', 'ctx': {'expected': \"'tokens', 'text' or 'derender'\"}}",
            param="body.output_mode",
        ),
    ),
    (
        "output_mode text with detokenize off",
        {"token_ids": [1], "sampling_params": {"detokenize": False}, "output_mode": "text"},
        _pyd(
            "{'type': 'value_error', 'loc': 'body', 'msg': \"Value error, output_mode='text' requires "
            "sampling_params.detokenize to be true\", 'input': '<dict of 3 items>', 'ctx': {'error': "
            "ValueError(\"output_mode='text' requires sampling_params.detokenize to be true\")}}",
            param="body",
        ),
    ),
    (
        "priority beyond int64",
        _request(priority=2**63),
        _pyd(
            "{'type': 'less_than_equal', 'loc': 'body.priority', 'msg': 'Input should be less than or equal to "
            "9223372036854775807', 'input': '9223372036854775808', 'ctx': {'le': 9223372036854775807}}",
            param="body.priority",
        ),
    ),
    (
        "temperature not a number",
        {"token_ids": [1], "sampling_params": {"temperature": "hot"}},
        _pyd(
            "{'type': 'is_instance_of', 'loc': 'body.sampling_params', 'msg': 'Input should be an instance of "
            "SamplingParams', 'input': '<dict of 1 items>', 'ctx': {'class': 'SamplingParams'}}",
            "{'type': 'float_parsing', 'loc': 'body.sampling_params.temperature', 'msg': 'Input should be a valid "
            "number, unable to parse string as a number', 'input': 'hot'}",
            param="body.sampling_params",
        ),
    ),
    (
        # vLLM's web framework validates the body with from_attributes (the real server's answer
        # is in tests/integration/frontend/differential_vllm.json).
        "stream_options not an object",
        _request(stream=True, stream_options=1),
        _pyd(
            "{'type': 'model_attributes_type', 'loc': 'body.stream_options', 'msg': 'Input should be a valid "
            "dictionary or object to extract fields from', 'input': '1'}",
            param="body.stream_options",
        ),
    ),
    (
        "reasoning_parser_kwargs with an unknown key",
        _request(reasoning_parser_kwargs={"chat_template_kwargs": {}, "x": 1}),
        _pyd(
            "{'type': 'extra_forbidden', 'loc': 'body.reasoning_parser_kwargs.x', 'msg': 'Extra inputs are not "
            "permitted', 'input': '1'}",
            param="body.reasoning_parser_kwargs.x",
        ),
    ),
    (
        "output_mode text",
        _request(output_mode="text"),
        _vllm(
            "output_mode='text' requires a tokenizer, but this server does not load one (--tokens-only or "
            "--skip-tokenizer-init). Send the request to a server that loads a tokenizer, or use "
            "output_mode='tokens'."
        ),
    ),
    (
        "model unknown",
        _request(model="nope"),
        _vllm("The model `nope` does not exist. Valid aliases: my-model.", "model", 404, "NotFoundError"),
    ),
    ("n zero", {"token_ids": [1], "sampling_params": {"n": 0}}, _vllm("n must be at least 1, got 0.")),
    (
        "n beyond vLLM's sequence limit",
        {"token_ids": [1], "sampling_params": {"n": 16385}},
        _vllm(
            "n must be at most 16384, got 16385. To increase this limit, set the VLLM_MAX_N_SEQUENCES "
            "environment variable."
        ),
    ),
    (
        "n beyond max_num_seqs",
        {"token_ids": [1], "sampling_params": {"n": 257}},
        _vllm("sampling_params.n must be at most the server's max_num_seqs (256), got 257."),
    ),
    (
        "n with greedy sampling",
        {"token_ids": [1], "sampling_params": {"n": 2, "temperature": 0}},
        _vllm("n must be 1 when using greedy sampling, got 2."),
    ),
    (
        "temperature too high",
        {"token_ids": [1], "sampling_params": {"temperature": 3}},
        _vllm("temperature must be in [0, 2], got 3.0. (parameter=temperature, value=3.0)", "temperature"),
    ),
    (
        "temperature negative",
        {"token_ids": [1], "sampling_params": {"temperature": -1}},
        _vllm(
            "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)", "temperature"
        ),
    ),
    (
        "top_p zero",
        {"token_ids": [1], "sampling_params": {"top_p": 0}},
        _vllm("top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)", "top_p"),
    ),
    (
        "top_k below -1",
        {"token_ids": [1], "sampling_params": {"top_k": -2}},
        _vllm("top_k must be 0 (disable), or at least 1, got -2."),
    ),
    (
        "min_p above 1",
        {"token_ids": [1], "sampling_params": {"min_p": 2}},
        _vllm("min_p must be in [0, 1], got 2.0."),
    ),
    (
        "presence_penalty out of range",
        {"token_ids": [1], "sampling_params": {"presence_penalty": 3}},
        _vllm("presence_penalty must be in [-2, 2], got 3.0."),
    ),
    (
        "frequency_penalty out of range",
        {"token_ids": [1], "sampling_params": {"frequency_penalty": -3}},
        _vllm("frequency_penalty must be in [-2, 2], got -3.0."),
    ),
    (
        "repetition_penalty zero",
        {"token_ids": [1], "sampling_params": {"repetition_penalty": 0}},
        _vllm("repetition_penalty must be greater than zero, got 0.0."),
    ),
    (
        "max_tokens zero",
        {"token_ids": [1], "sampling_params": {"max_tokens": 0}},
        _vllm("max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", "max_tokens"),
    ),
    (
        "min_tokens above max_tokens",
        {"token_ids": [1], "sampling_params": {"max_tokens": 1, "min_tokens": 2}},
        _vllm("min_tokens must be less than or equal to max_tokens=1, got 2."),
    ),
    (
        "logprobs below -1",
        {"token_ids": [1], "sampling_params": {"logprobs": -2}},
        _vllm("logprobs must be non-negative or -1, got -2. (parameter=logprobs, value=-2)", "logprobs"),
    ),
    (
        "stop strings",
        {"token_ids": [1], "sampling_params": {"stop": ["x"]}},
        _vllm(
            "stop strings are not supported on a --tokens-only server because detokenization is disabled. Check "
            "stop strings on the coordinator, or use stop_token_ids."
        ),
    ),
    (
        "stop empty string",
        {"token_ids": [1], "sampling_params": {"stop": ""}},
        _vllm("stop cannot contain an empty string."),
    ),
    (
        "cache_salt empty",
        _request(cache_salt=""),
        _vllm(
            "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)",
            "cache_salt",
        ),
    ),
    (
        "cache_salt with a slash",
        _request(cache_salt="a/b"),
        _vllm(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL. "
            "(parameter=cache_salt)",
            "cache_salt",
        ),
    ),
    (
        "cache_salt too long",
        _request(cache_salt="x" * 129),
        _vllm(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL. "
            "(parameter=cache_salt)",
            "cache_salt",
        ),
    ),
    (
        "kv_transfer_params integer beyond msgpack",
        _request(kv_transfer_params={"a": 2**64}),
        _vllm("can't serialize ints < -2**63 or > 2**64 - 1"),
    ),
    (
        "max_tokens beyond msgpack",
        {"token_ids": [1], "sampling_params": {"max_tokens": 2**64}},
        _vllm("can't serialize ints < -2**63 or > 2**64 - 1"),
    ),
    (
        "stop_token_ids beyond msgpack",
        {"token_ids": [1], "sampling_params": {"stop_token_ids": [2**64]}},
        _vllm("can't serialize ints < -2**63 or > 2**64 - 1"),
    ),
    (
        "seed beyond msgpack",
        {"token_ids": [1], "sampling_params": {"seed": -(2**63) - 1}},
        _vllm("can't serialize ints < -2**63 or > 2**64 - 1"),
    ),
    (
        "token id out of vocabulary",
        {"token_ids": [1, 32000], "sampling_params": {}},
        _vllm("Token id 32000 is out of vocabulary"),
    ),
    (
        "prompt fills the context",
        {"token_ids": [1] * 4096, "sampling_params": {}},
        _vllm(
            "The decoder prompt (length 4096) plus the number of requested output tokens (at least 1) is longer "
            "than the maximum model length of 4096. Make sure that `max_model_len` is no smaller than the number "
            "of text tokens (prompt + requested output tokens)."
        ),
    ),
    (
        "prompt longer than the context",
        {"token_ids": [1] * 4097, "sampling_params": {}},
        _vllm(
            "The decoder prompt (length 4097) is longer than the maximum model length of 4096. Make sure that "
            "`max_model_len` is no smaller than the number of text tokens."
        ),
    ),
    (
        "stop_token_ids out of vocabulary",
        {"token_ids": [1], "sampling_params": {"stop_token_ids": [32000]}},
        _vllm(
            "token_id(s) [32000] in stop_token_ids contain out-of-vocab token ids. Vocabulary size: 32000 "
            "(parameter=stop_token_ids, value=[32000])",
            "stop_token_ids",
        ),
    ),
    (
        "logit_bias out of vocabulary",
        {"token_ids": [1], "sampling_params": {"logit_bias": {"40000": 1}}},
        _vllm(
            "token_id(s) [40000] in logit_bias contain out-of-vocab token ids. Vocabulary size: 32000 "
            "(parameter=logit_bias, value=[40000])",
            "logit_bias",
        ),
    ),
    (
        "structured outputs",
        {"token_ids": [1], "sampling_params": {"structured_outputs": {"regex": "a+"}}},
        _vllm("Structured outputs requires a tokenizer so it can't be used with 'skip_tokenizer_init'"),
    ),
    (
        "prompt_logprob_token_ids with stream",
        {"token_ids": [1], "sampling_params": {"prompt_logprob_token_ids": [[1]]}, "stream": True},
        _vllm("prompt_logprob_token_ids are not available when stream=true."),
    ),
]


@pytest.mark.parametrize(("body", "error"), [(b, e) for _, b, e in REFUSALS], ids=[n for n, _, _ in REFUSALS])
def test_refusals_read_as_vllms(body: Any, error: dict[str, Any]) -> None:
    reply = refused(body)
    assert error_of(reply) == error
    assert reply.content_type == "application/json"


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/jsonx", "application/json ; charset=utf-8"]
)
def test_content_type_must_be_json(content_type: str | None) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    reply = refused(_request(), headers)
    assert error_of(reply) == _vllm(
        "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
        kind="Bad Request",
    )


def test_a_json_syntax_error_wins_when_the_content_type_is_missing_or_names_json() -> None:
    # vLLM's web framework parses such a body before vLLM checks the content type.
    for headers in ({}, {"Content-Type": "application/vnd.x+json"}):
        assert error_of(refused(b"{", headers))["param"] == "body.1"
    assert error_of(refused(b"{", {"Content-Type": "text/plain"}))["type"] == "Bad Request"
    assert error_of(refused(b"{", {"Content-Type": "text/plain"}))["param"] is None


def test_a_null_body_is_a_missing_body() -> None:
    assert error_of(refused(b"null"))["param"] == "body"
    assert "'type': 'missing'" in error_of(refused(b"null"))["message"]


def test_data_parallel_rank_out_of_range() -> None:
    reply = refused(_request(), {**JSON_HEADERS, "X-data-parallel-rank": "2"})
    assert error_of(reply) == _vllm("data_parallel_rank 2 is out of range [0, 2).")


def test_the_first_sampling_check_wins_over_earlier_type_errors() -> None:
    # vLLM's SamplingParams checks raise out of the body's validation: earlier problems go unlisted.
    reply = refused({"token_ids": [], "sampling_params": {"max_tokens": 0}})
    assert error_of(reply)["param"] == "max_tokens"


def test_every_type_problem_is_listed() -> None:
    reply = refused({"token_ids": "x", "sampling_params": {"n": None, "top_k": "a"}, "stream": "maybe"})
    message = error_of(reply)["message"]
    assert message.startswith("5 validation errors:\n")  # the 4, and sampling_params not an instance
    for loc in ("body.token_ids", "body.sampling_params.n", "body.sampling_params.top_k", "body.stream"):
        assert f"'loc': '{loc}'" in message


UNCARRIED: list[tuple[str, dict[str, Any]]] = [
    ("ec_transfer_params", _request(ec_transfer_params={})),
    # A features object vLLM's model accepts (an incomplete one is a validation error there).
    ("features", _request(features={"mm_hashes": {}, "mm_placeholders": {}})),
    ("content_parts", _request(content_parts=[{"type": "image_url", "url": "http://x"}])),
    ("logprob_token_ids", {"token_ids": [1], "sampling_params": {"logprob_token_ids": [1]}}),
    ("prompt_logprob_token_ids", {"token_ids": [1], "sampling_params": {"prompt_logprob_token_ids": [[1]]}}),
    ("prompt_logprob_start", {"token_ids": [1], "sampling_params": {"prompt_logprob_start": 0}}),
    ("allowed_token_ids", {"token_ids": [1], "sampling_params": {"allowed_token_ids": [1]}}),
    ("thinking_token_budget", {"token_ids": [1], "sampling_params": {"thinking_token_budget": 5}}),
    ("repetition_detection", {"token_ids": [1], "sampling_params": {"repetition_detection": {}}}),
    ("trace_decode_token_ids", {"token_ids": [1], "sampling_params": {"trace_decode_token_ids": [1]}}),
    ("extra_args", {"token_ids": [1], "sampling_params": {"extra_args": {"k": 1}}}),
    ("watermarking", {"token_ids": [1], "sampling_params": {"watermarking": True}}),
    ("logprobs", {"token_ids": [1], "sampling_params": {"logprobs": -1}}),
    ("prompt_logprobs", {"token_ids": [1], "sampling_params": {"prompt_logprobs": -1}}),
    ("seed", {"token_ids": [1], "sampling_params": {"seed": 2**63}}),
    ("max_tokens", {"token_ids": [1], "sampling_params": {"max_tokens": 2**32}}),
    ("top_k", {"token_ids": [1], "sampling_params": {"top_k": 2**31}}),
    ("priority", _request(priority=-(2**31))),
    ("kv_transfer_params", _request(kv_transfer_params={"big": 2**60})),
]


@pytest.mark.parametrize(("name", "body"), UNCARRIED, ids=[n for n, _ in UNCARRIED])
def test_what_cannot_be_carried_is_refused_by_name(name: str, body: dict[str, Any]) -> None:
    error = error_of(refused(body))
    assert error["type"] == "BadRequestError"
    assert error["param"] == name
    assert error["message"].startswith(f"{name} is not supported by this server: ")
    assert error["message"].endswith(f"(parameter={name})")


NUMERIC_SAMPLING = [
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "stream_interval",
]


@pytest.mark.parametrize("name", NUMERIC_SAMPLING)
@pytest.mark.parametrize("value", [10**400, -(10**400), 2**64, float("inf"), float("nan")])
def test_absurd_numbers_are_refused_not_raised(name: str, value: float) -> None:
    if name == "seed" and value == -(10**400):
        value = -(2**64)
    body = {"token_ids": [1], "sampling_params": {name: value}}
    if name == "repetition_penalty" and value == 2**64:
        assert accepted(body).requests[0].sampling_options.repetition_penalty == pytest.approx(2.0**64)
        return
    assert error_of(refused(body))["code"] == 400


@pytest.mark.parametrize(
    ("name", "value"),
    [("repetition_penalty", 1e39), ("logit_bias", {"5": 1e39}), ("logit_bias", {"5": -1e39})],
)
def test_a_float_beyond_32_bits_is_refused_by_name(name: str, value: object) -> None:
    error = error_of(refused({"token_ids": [1], "sampling_params": {name: value}}))
    assert error["param"] == name
