"""SGLang /generate request parsing: every field accepted (-> the exact sub-request fields)
or refused (-> the status and body SGLang's gate writes, naming the field)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from google.protobuf import json_format

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.formats.base import SSE_CONTENT_TYPE, HttpReply, parse_whole
from sidecar_frontend.formats.sglang import FORMAT, GENERATE
from tests.unit.frontend.test_format_sglang_support import (
    accepted,
    body,
    context,
    fresh_id,
    one,
    options,
    parse,
    refused,
)

PROMPT = [1, 100, 200]


def proto(**fields: Any) -> sidecar_pb2.PreprocessedRequest:
    return json_format.ParseDict(fields, sidecar_pb2.PreprocessedRequest())


def case_id(value: object) -> str | None:
    return json.dumps(value)[:60] if isinstance(value, dict) else None


def request(**fields: Any) -> dict[str, Any]:
    return {"input_ids": PROMPT, **fields}


def sampled(**params: Any) -> sidecar_pb2.PreprocessedRequest:
    return one(request(sampling_params=params))


# ------------------------------------------------------------------ accepted fields


def test_a_bare_prompt_gets_sglang_defaults_and_a_fresh_rid() -> None:
    sub = one({"input_ids": PROMPT})
    assert sub.request_id == fresh_id(0)
    assert list(sub.token_ids) == PROMPT
    assert sub.model == "my-model"
    assert list(sub.eos_token_ids) == [2]
    assert sub.stop_conditions == sidecar_pb2.StopConditions(max_tokens=128)
    assert sub.sampling_options == sidecar_pb2.SamplingOptions()
    # Not streamed (SGLang's default): it asks the worker for one answer.
    assert sub.output_options == sidecar_pb2.OutputOptions(unary=True)
    assert sub.routing == sidecar_pb2.RoutingHints()


SAMPLING_CASES: list[tuple[dict[str, Any], sidecar_pb2.PreprocessedRequest]] = [
    ({"max_new_tokens": 7}, proto(stop_conditions={"max_tokens": 7})),
    ({"max_new_tokens": 0}, proto(stop_conditions={"max_tokens": 0})),
    # null = unlimited, capped by the context as SGLang's scheduler does (4096 - 1 - 3 - 1).
    ({"max_new_tokens": None}, proto(stop_conditions={"max_tokens": 4091})),
    ({"min_new_tokens": 0}, proto(stop_conditions={"max_tokens": 128})),
    (
        {"stop_token_ids": [5, 3, 5]},
        proto(stop_conditions={"max_tokens": 128, "stop_token_ids": [5, 3]}),
    ),
    ({"stop_token_ids": []}, proto(stop_conditions={"max_tokens": 128})),
    ({"stop": []}, proto(stop_conditions={"max_tokens": 128})),
    # ignore_eos also disables stop_token_ids in SGLang's scheduler.
    (
        {"ignore_eos": True, "stop_token_ids": [5]},
        proto(stop_conditions={"max_tokens": 128, "ignore_eos": True}),
    ),
    (
        {"ignore_eos": False, "stop_token_ids": [5]},
        proto(stop_conditions={"max_tokens": 128, "ignore_eos": False, "stop_token_ids": [5]}),
    ),
    ({"temperature": 0.5}, proto(sampling_options={"temperature": 0.5})),
    ({"temperature": 1}, proto(sampling_options={"temperature": 1.0})),
    ({"top_p": 0.25}, proto(sampling_options={"top_p": 0.25})),
    ({"top_k": 40}, proto(sampling_options={"top_k": 40})),
    ({"top_k": -1}, proto(sampling_options={"top_k": -1})),
    ({"top_k": 2**40}, proto(sampling_options={"top_k": -1})),
    # Greedy: SGLang forces top_k 1, so an otherwise refused top_k 0 is accepted.
    (
        {"temperature": 0, "top_k": 0},
        proto(sampling_options={"temperature": 0.0, "top_k": 1}),
    ),
    ({"min_p": 0.5}, proto(sampling_options={"min_p": 0.5})),
    (
        {"frequency_penalty": -2},
        proto(sampling_options={"frequency_penalty": -2.0}),
    ),
    ({"presence_penalty": 2}, proto(sampling_options={"presence_penalty": 2.0})),
    (
        {"repetition_penalty": 1.5},
        proto(sampling_options={"repetition_penalty": 1.5}),
    ),
    ({"sampling_seed": -(2**63)}, proto(sampling_options={"seed": -(2**63)})),
    (
        {"logit_bias": {"5": 1.5, " 7": -1}},
        proto(sampling_options={"logit_bias": {"5": 1.5, "7": -1.0}}),
    ),
    (
        {"json_schema": '{"type":"object"}'},
        proto(sampling_options={"guided_decoding": {"json": '{"type":"object"}'}}),
    ),
    ({"regex": "a+"}, proto(sampling_options={"guided_decoding": {"regex": "a+"}})),
    (
        {"ebnf": 'root ::= "a"'},
        proto(sampling_options={"guided_decoding": {"grammar": 'root ::= "a"'}}),
    ),
    (
        {"structural_tag": "{}"},
        proto(sampling_options={"guided_decoding": {"structural_tag": "{}"}}),
    ),
    # "" means unset, so it does not count against "only one grammar".
    (
        {"regex": "", "json_schema": "{}"},
        proto(sampling_options={"guided_decoding": {"json": "{}"}}),
    ),
    ({"n": 1}, proto()),
    ({"n": None}, proto()),
    ({"n": 0}, proto()),
    ({"beam_width": 1}, proto()),
    ({"custom_params": None, "watermark": None, "choice": []}, proto()),
    (
        {"skip_special_tokens": False, "spaces_between_special_tokens": False, "no_stop_trim": True},
        proto(),
    ),
    ({"stream_interval": 4}, proto()),
    # null on any key means "the default".
    (
        {"temperature": None, "top_p": None, "top_k": None, "ignore_eos": None},
        proto(),
    ),
]


@pytest.mark.parametrize(("params", "expected"), SAMPLING_CASES, ids=case_id)
def test_sampling_params_map_to_the_sub_request(
    params: dict[str, Any], expected: sidecar_pb2.PreprocessedRequest
) -> None:
    sub = sampled(**params)
    if not expected.HasField("stop_conditions"):
        expected.stop_conditions.max_tokens = 128
    assert sub.stop_conditions == expected.stop_conditions
    assert sub.sampling_options == expected.sampling_options


def test_explicit_null_max_new_tokens_differs_from_absent() -> None:
    assert sampled().stop_conditions.max_tokens == 128
    assert sampled(max_new_tokens=None).stop_conditions.max_tokens == 4091
    unknown_context = context(max_context_length=0)
    assert not one(
        request(sampling_params={"max_new_tokens": None}), unknown_context
    ).stop_conditions.HasField("max_tokens")
    assert one(request(), unknown_context).stop_conditions.max_tokens == 128


def test_the_default_and_explicit_caps_shrink_to_fit_the_context() -> None:
    long_prompt = list(range(4000))
    assert one({"input_ids": long_prompt}).stop_conditions.max_tokens == 94
    assert (
        one({"input_ids": long_prompt, "sampling_params": {"max_new_tokens": 96}}).stop_conditions.max_tokens
        == 94
    )
    assert (
        one({"input_ids": long_prompt, "sampling_params": {"max_new_tokens": 50}}).stop_conditions.max_tokens
        == 50
    )


TOP_LEVEL_CASES: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"rid": "abc"}, {"request_id": "abc"}),
    ({"rid": ""}, {"request_id": fresh_id(0)}),
    ({"return_logprob": True}, {"output_options": {"logprobs": 0}}),
    ({"return_logprob": [True]}, {"output_options": {"logprobs": 0}}),
    ({"return_logprob": True, "top_logprobs_num": 3}, {"output_options": {"logprobs": 3}}),
    (
        {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0},
        {"output_options": {"logprobs": 2, "prompt_logprobs": 2}},
    ),
    (
        {"return_logprob": True, "logprob_start_len": 2},
        {"output_options": {"logprobs": 0, "prompt_logprobs": 0}},
    ),
    # Start at the prompt's end: output logprobs only.
    ({"return_logprob": True, "logprob_start_len": 3}, {"output_options": {"logprobs": 0}}),
    # Without return_logprob both are ignored, as SGLang does.
    ({"top_logprobs_num": 5, "logprob_start_len": 99}, {}),
    ({"lora_path": "adapter-a"}, {"routing": {"lora_name": "adapter-a"}}),
    ({"lora_path": None}, {}),
    ({"priority": 7}, {"routing": {"priority": 7}}),
    ({"priority": -(2**31)}, {"routing": {"priority": -(2**31)}}),
    ({"text": "ignored when input_ids are given"}, {}),
    ({"input_embeds": [[0.5]]}, {}),
    ({"return_text_in_logprobs": True, "log_metrics": False}, {}),
    ({"return_routed_experts": True}, {"output_options": {"return_routed_experts": True}}),
    (
        {"return_routed_experts": True, "routed_experts_start_len": 2},
        {"output_options": {"return_routed_experts": True, "routed_experts_start_len": 2}},
    ),
    ({"routed_experts_start_len": 0}, {}),
    ({"routed_dp_rank": 0, "bootstrap_port": 0, "session_params": None, "custom_logit_processor": None}, {}),
    ({"unknown_top_level_key": {"any": "thing"}}, {}),
]


@pytest.mark.parametrize(("fields", "expected"), TOP_LEVEL_CASES, ids=case_id)
def test_top_level_fields_map_to_the_sub_request(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    sub = one(request(**fields))
    want = sidecar_pb2.PreprocessedRequest(**expected)
    want.output_options.unary = True  # not streamed: one answer
    assert sub.request_id == (want.request_id or fresh_id(0))
    assert sub.output_options == want.output_options
    assert sub.routing == want.routing


def test_stream_and_return_prompt_token_ids_are_response_options() -> None:
    call = accepted(request(stream=True, return_prompt_token_ids=True))
    assert call.stream
    assert options(call).items[0].return_prompt_token_ids
    assert not accepted(request()).stream


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_not_streamed_asks_each_worker_for_one_answer(stream: bool) -> None:
    call = accepted({"input_ids": [[1, 2], [3]], "stream": stream, "return_logprob": True})
    assert [r.output_options.unary for r in call.requests] == [not stream] * 2
    assert all(r.output_options.HasField("logprobs") for r in call.requests)


def test_incremental_streaming_follows_the_context() -> None:
    assert options(accepted(request(), incremental=True)).incremental
    assert not options(accepted(request())).incremental


# ------------------------------------------------------------------ batches and n


def test_a_batch_gets_one_sub_request_per_prompt_with_suffixed_rids() -> None:
    call = accepted({"input_ids": [[1, 2], [3]], "rid": "job"})
    assert [r.request_id for r in call.requests] == ["job_0", "job_1"]
    assert [list(r.token_ids) for r in call.requests] == [[1, 2], [3]]
    assert options(call).batch


def test_a_batch_takes_a_list_of_rids_and_per_prompt_params() -> None:
    call = accepted(
        {
            "input_ids": [[1, 2], [3]],
            "rid": ["a", "b"],
            "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}],
            "return_logprob": [False, True],
            "lora_path": ["x", None],
        }
    )
    assert [r.request_id for r in call.requests] == ["a", "b"]
    assert [r.stop_conditions.max_tokens for r in call.requests] == [1, 2]
    assert [r.output_options.HasField("logprobs") for r in call.requests] == [False, True]
    assert [r.routing.HasField("lora_name") for r in call.requests] == [True, False]


def test_a_batch_without_rids_gets_a_fresh_id_per_prompt() -> None:
    call = accepted({"input_ids": [[1], [2]]})
    assert [r.request_id for r in call.requests] == [fresh_id(0), fresh_id(1)]


def test_n_samples_become_single_sample_sub_requests_in_prompt_major_order_with_fresh_ids() -> None:
    call = accepted({"input_ids": [[1], [2]], "rid": "job", "sampling_params": {"n": 2, "max_new_tokens": 3}})
    assert [list(r.token_ids) for r in call.requests] == [[1], [1], [2], [2]]
    assert [r.request_id for r in call.requests] == [fresh_id(i) for i in range(4)]
    assert all(not r.sampling_options.HasField("n") for r in call.requests)
    assert all(r.stop_conditions.max_tokens == 3 for r in call.requests)
    assert options(call).batch


def test_a_single_prompt_with_n_answers_as_a_batch() -> None:
    call = accepted({"input_ids": [1], "sampling_params": {"n": 3}})
    assert len(call.requests) == 3
    assert options(call).batch
    assert len({r.request_id for r in call.requests}) == 3


# ------------------------------------------------------------------ refusals


def value_error(reply_body: Any) -> str:
    assert set(reply_body) == {"error"}
    assert set(reply_body["error"]) == {"message"}
    message: str = reply_body["error"]["message"]
    return message


VALUE_REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({}, "Either text, input_ids or input_embeds should be provided."),
    (
        {"input_ids": None, "sampling_params": {}},
        "Either text, input_ids or input_embeds should be provided.",
    ),
    ({"input_ids": []}, "input_ids cannot be empty."),
    (
        {"text": "hello"},
        "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. Please provide "
        "input_ids or re-initialize the engine with skip_tokenizer_init=False.",
    ),
    ({"input_embeds": [[0.1]]}, "input_embeds is not supported by this server: only token ids are carried"),
    (request(sampling_params={"max_new_tokens": -1}), "max_new_tokens must be at least 0, got -1."),
    (
        request(sampling_params={"temperature": -0.5}),
        "temperature must be a non-negative finite number, got -0.5.",
    ),
    (request(sampling_params={"top_p": 0}), "top_p must be in (0, 1], got 0."),
    (request(sampling_params={"top_p": 1.5}), "top_p must be in (0, 1], got 1.5."),
    (request(sampling_params={"top_k": 0}), "top_k must be -1 (disable) or at least 1, got 0."),
    (request(sampling_params={"top_k": -2}), "top_k must be -1 (disable) or at least 1, got -2."),
    (request(sampling_params={"min_p": 1.5}), "min_p must be in [0, 1], got 1.5."),
    (request(sampling_params={"frequency_penalty": 3}), "frequency_penalty must be in [-2, 2], got 3."),
    (request(sampling_params={"presence_penalty": -3}), "presence_penalty must be in [-2, 2], got -3."),
    (
        request(sampling_params={"repetition_penalty": 0}),
        "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 0.",
    ),
    (
        request(sampling_params={"min_new_tokens": -1}),
        "min_new_tokens must be in [0, max_new_tokens], got -1.",
    ),
    (
        request(sampling_params={"min_new_tokens": 2}),
        "min_new_tokens=2 is unavailable when skip_tokenizer_init=True "
        "(requires tokenizer for eos_token_id).",
    ),
    # normalize() runs before verify(): the tokenizer text wins over min > max.
    (
        request(sampling_params={"min_new_tokens": 5, "max_new_tokens": 4}),
        "min_new_tokens=5 is unavailable when skip_tokenizer_init=True "
        "(requires tokenizer for eos_token_id).",
    ),
    (
        request(sampling_params={"stop": "\n"}),
        "stop=['\\n'] is unavailable when skip_tokenizer_init=True (requires tokenizer to decode tokens to "
        "text for matching).",
    ),
    (
        request(sampling_params={"stop": ""}),
        "stop=[''] is unavailable when skip_tokenizer_init=True (requires tokenizer to decode tokens to "
        "text for matching).",
    ),
    (
        request(sampling_params={"stop_regex": ["a+"]}),
        "stop_regex=['a+'] is unavailable when skip_tokenizer_init=True (requires tokenizer to decode tokens "
        "to text for matching).",
    ),
    (
        request(sampling_params={"json_schema": "{}", "regex": "a"}),
        "Only one of json_schema, regex, ebnf, or structural_tag can be set.",
    ),
    (
        request(sampling_params={"logit_bias": {"40000": 1}}),
        "logit_bias must has keys in [0, 31999], got 40000.",
    ),
    (request(sampling_params={"logit_bias": {"abc": 1}}), "invalid literal for int() with base 10: 'abc'"),
    (
        request(sampling_params={"sampling_seed": 2**63}),
        "sampling_seed must be in [-2**63, 2**63 - 1], got 9223372036854775808.",
    ),
    (request(sampling_params={"beam_width": 0}), "beam_width must be at least 1, got 0."),
    (
        {"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]},
        "The parallel_sample_num should be the same for all samples in sample params.",
    ),
    (
        {"input_ids": [[1], [2]], "rid": ["a"]},
        "The specified rids length mismatch with the batch_size for batch processing.",
    ),
    (
        {"input_ids": [[1], [2]], "rid": ["a", "a"]},
        "Duplicate request IDs detected within the request: ['a']",
    ),
    (
        {"input_ids": [[1], [2]], "return_logprob": [True, False], "sampling_params": {"n": 2}},
        "Cannot use list return_logprob with parallel_sample_num > 1",
    ),
    (
        request(priority=2**63),
        "priority must be a signed 64-bit integer between -9223372036854775808 and 9223372036854775807",
    ),
    (
        request(max_thinking_tokens=10),
        "max_thinking_tokens requires the server to be launched with --enable-strict-thinking",
    ),
    (
        request(custom_logit_processor="x"),
        "The server is not configured to enable custom logit processor. Please set "
        "`--enable-custom-logit-processor` to enable this feature.",
    ),
    (
        request(return_hidden_states=True),
        "The server is not configured to return hidden states. Please set "
        "`--return-hidden-states-mode last`, `--return-hidden-states-mode full`, "
        "or the legacy `--enable-return-hidden-states` flag.",
    ),
    (
        {"input_ids": list(range(4096))},
        "The input (4096 tokens) is longer than the model's context length (4096 tokens).",
    ),
    (
        {"input_ids": list(range(4000)), "sampling_params": {"max_new_tokens": 200}},
        "Requested token count exceeds the model's maximum context length of 4096 tokens. You requested a "
        "total of 4200 tokens: 4000 tokens from the input messages and 200 tokens for the completion. Please "
        "reduce the number of tokens in the input messages or the completion to fit within the limit.",
    ),
    (
        {"input_ids": list(range(4092))},
        "Input length (4092 tokens) exceeds the maximum allowed length (4090 tokens). Use a shorter input or "
        "enable --allow-auto-truncate.",
    ),
    (
        request(return_logprob=True, logprob_start_len=5),
        "req.logprob_start_len=5 is higher than the number of input tokens len(req.origin_input_ids)=3. "
        "Please use a smaller logprob_start_len.",
    ),
]


@pytest.mark.parametrize(("fields", "message"), VALUE_REFUSALS, ids=case_id)
def test_value_refusals_are_400_unary_and_an_sse_error_event_when_streaming(
    fields: dict[str, Any], message: str
) -> None:
    unary = refused(fields)
    assert unary.status == 400
    assert unary.content_type == "application/json"
    assert value_error(body(unary)).startswith(message)
    stream = refused({**fields, "stream": True})
    assert stream.status == 200
    assert stream.content_type == SSE_CONTENT_TYPE
    event, done, tail = stream.body.split(b"\n\n")
    assert tail == b""
    assert done == b"data: [DONE]"
    assert event.startswith(b"data: ")
    error = json.loads(event[len(b"data: ") :])["error"]
    assert list(error) == ["message", "type", "code", "retryable"]
    assert error["message"].startswith(message)
    assert (error["type"], error["code"], error["retryable"]) == ("invalid_request_error", 400, False)


def test_a_rid_in_flight_is_refused_with_sglangs_text() -> None:
    reply = refused(request(rid="dup-1"), context(inflight=["dup-1"]))
    assert body(reply) == {"error": {"message": "Duplicate request ID detected: dup-1"}}
    batch = refused({"input_ids": [[1], [2]], "rid": "b"}, context(inflight=["b_1"]))
    assert body(batch) == {"error": {"message": "Duplicate request ID detected: b_1"}}
    assert isinstance(accepted(request(rid="dup-2"), context(inflight=["dup-1"])).requests, tuple)


# Where SGLang answers 500 (or cannot carry the field): ours is a 400 naming the field.
OUR_REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({"input_ids": [-5]}, "input_ids contains -5, which is not a token id"),
    ({"input_ids": [2**32]}, "input_ids contains 4294967296, which is not a token id"),
    ({"input_ids": [[1], []]}, "input_ids[1] cannot be empty."),
    ({"input_ids": [[1], [2, -1]]}, "input_ids[1] contains -1"),
    (request(rid=["a"]), "rid must be a string for a single prompt"),
    (
        request(sampling_params=[{"max_new_tokens": 1}]),
        "sampling_params must be an object for a single prompt",
    ),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "The length of sampling_params should be equal"),
    (
        {"input_ids": [[1], [2]], "sampling_params": {"n": 0}},
        "sampling_params.n must be at least 1 for a batch",
    ),
    (request(sampling_params={"n": 1025}), "sampling_params.n must be at most 1024"),
    (
        {"input_ids": [[1], [2]], "lora_path": ["a"]},
        "The length of lora_path should be equal to the batch size.",
    ),
    (request(lora_path=["a"]), "lora_path must be a string for a single prompt"),
    ({"input_ids": [[1], [2]], "return_logprob": [True]}, "The length of return_logprob should be equal"),
    (request(priority=2**31), "priority is not supported by this server"),
    (request(return_logprob=True, logprob_start_len=-2), "logprob_start_len is not supported by this server"),
    (request(return_logprob=True, top_logprobs_num=-1), "top_logprobs_num is not supported by this server"),
    (request(sampling_params={"custom_params": [1]}), "sampling_params.custom_params is not supported"),
    (
        request(sampling_params={"custom_params": {"k": 2**60}}),
        "sampling_params.custom_params is not supported",
    ),
    (request(sampling_params={"watermark": {"enabled": True}}), "sampling_params.watermark is not supported"),
    (request(sampling_params={"choice": ["a", "b"]}), "sampling_params.choice is not supported"),
    (request(sampling_params={"beam_width": 2}), "sampling_params.beam_width is not supported"),
    (request(sampling_params={"stop_token_ids": [-1]}), "sampling_params.stop_token_ids is not supported"),
    (request(sampling_params={"temperature": 1e300}), "sampling_params.temperature is not supported"),
    (request(sampling_params={"logit_bias": {"5": 1e300}}), "sampling_params.logit_bias is not supported"),
    (request(image_data="http://x/cat.png"), "image_data is not supported by this server"),
    (request(video_data=["v"]), "video_data is not supported by this server"),
    (request(audio_data="a"), "audio_data is not supported by this server"),
    (request(bootstrap_host="10.0.0.1"), "bootstrap_host is not supported by this server"),
    (request(bootstrap_port=8998), "bootstrap_port is not supported by this server"),
    (request(bootstrap_room=12345), "bootstrap_room is not supported by this server"),
    (request(bootstrap_pair_key="k"), "bootstrap_pair_key is not supported by this server"),
    (request(decode_tp_size=2), "decode_tp_size is not supported by this server"),
    (request(routed_dp_rank=1), "routed_dp_rank is not supported by this server"),
    (request(data_parallel_rank=1), "data_parallel_rank is not supported by this server"),
    (request(disagg_prefill_dp_rank=1), "disagg_prefill_dp_rank is not supported by this server"),
    (request(routing_key="k"), "routing_key is not supported by this server"),
    (request(kv_hints={"v": 1}), "kv_hints is not supported by this server"),
    (request(session_params={"id": "s"}), "session_params is not supported by this server"),
    (request(session_id="s"), "session_id is not supported by this server"),
    (request(extra_key="k"), "extra_key is not supported by this server"),
    (request(cache_salt="salt"), "cache_salt is not supported by this server"),
    (request(return_flat_raw_top_logprobs=True), "return_flat_raw_top_logprobs is not supported"),
    (request(require_reasoning=True), "require_reasoning is not supported by this server"),
]


@pytest.mark.parametrize(("fields", "message"), OUR_REFUSALS, ids=case_id)
def test_what_we_cannot_carry_is_refused_by_name(fields: dict[str, Any], message: str) -> None:
    reply = refused(fields)
    assert reply.status == 400
    assert value_error(body(reply)).startswith(message)


def test_a_number_beyond_any_double_is_a_json_error_as_sglangs_orjson_parse_says() -> None:
    # SGLang's routes parse with orjson, which refuses it before any check (recorded from the
    # real server in tests/integration/frontend/differential_sglang.json, as are lone surrogates).
    reply = refused(request(sampling_params={"temperature": 10**400}))
    message = body(reply)["message"]
    assert "'type': 'json_invalid'" in message
    assert "'ctx': {'error': 'number is infinity when parsed as double'}" in message


def test_logit_bias_ids_are_range_checked_when_the_vocabulary_is_unknown() -> None:
    reply = refused(request(sampling_params={"logit_bias": {str(2**32): 1}}), context(vocab_size=0))
    assert value_error(body(reply)).startswith("sampling_params.logit_bias is not supported")
    sub = one(request(sampling_params={"logit_bias": {"40000": 1}}), context(vocab_size=0))
    assert dict(sub.sampling_options.logit_bias) == {40000: 1.0}


def test_a_deeply_nested_input_is_echoed_briefly() -> None:
    nested: Any = 1
    for _ in range(500):
        nested = [nested]
    reply = refused({"input_ids": [nested]})
    assert reply.status == 400
    assert len(body(reply)["message"]) < 400


def test_max_new_tokens_beyond_32_bits_is_refused_when_the_context_is_unknown() -> None:
    reply = refused(request(sampling_params={"max_new_tokens": 2**32}), context(max_context_length=0))
    assert value_error(body(reply)).startswith("sampling_params.max_new_tokens is not supported")


CONTRACT_REFUSALS: list[tuple[dict[str, Any], str]] = [
    (
        request(sampling_params={"max_tokens": 5}),
        "unknown field `max_tokens`, expected one of `max_new_tokens`, `stop`, `stop_token_ids`, "
        "`stop_regex`, `temperature`, `top_p`, `top_k`, `min_p`, `frequency_penalty`, `presence_penalty`, "
        "`repetition_penalty`, `min_new_tokens`, `n`, `json_schema`, `regex`, `ebnf`, `structural_tag`, "
        "`ignore_eos`, `skip_special_tokens`, `spaces_between_special_tokens`, `no_stop_trim`, "
        "`stream_interval`, `logit_bias`, `sampling_seed`, `custom_params`, `beam_width`, `watermark`, "
        "`choice`",
    ),
    (request(sampling_params={"max_new_tokens": "5"}), 'invalid type: string "5", expected i64'),
    (request(sampling_params={"max_new_tokens": 5.0}), "invalid type: floating point `5.0`, expected i64"),
    (request(sampling_params={"temperature": "hot"}), 'invalid type: string "hot", expected f64'),
    (request(sampling_params={"stop_token_ids": 5}), "invalid type: integer `5`, expected a sequence"),
    (request(sampling_params={"ignore_eos": 1}), "invalid type: integer `1`, expected a boolean"),
    (request(sampling_params={"n": True}), "invalid type: boolean `true`, expected i64"),
    ({"input_ids": [True, False]}, "invalid type: boolean `true`, expected a sequence"),
    (request(stream="yes"), 'invalid type: string "yes", expected a boolean'),
    (request(stream=1), "invalid type: integer `1`, expected a boolean"),
    (
        request(return_logprob="yes"),
        'invalid type: string "yes", expected a value or an array of values for BoolOrList',
    ),
    (
        request(top_logprobs_num="2"),
        'invalid type: string "2", expected a value or an array of values for Int64OrList',
    ),
    (request(routed_dp_rank="1"), 'invalid type: string "1", expected i64'),
    (request(max_thinking_tokens=-1), "invalid value: integer `-1`, expected u64"),
    (request(return_prompt_token_ids="yes"), 'invalid type: string "yes", expected a boolean'),
]


@pytest.mark.parametrize(("fields", "message"), CONTRACT_REFUSALS, ids=case_id)
def test_type_errors_are_the_contract_gates_bare_string_even_when_streaming(
    fields: dict[str, Any], message: str
) -> None:
    for stream in (False, True):
        reply = refused({**fields, "stream": stream} if "stream" not in fields else fields)
        assert reply.status == 400
        assert body(reply) == {"error": message}


# Where pydantic lists several problems (a union's branches), each is in the message; the
# real server's whole answers are in tests/integration/frontend/differential_sglang.json.
PARSE_REFUSALS: list[tuple[bytes, str, str]] = [
    (b"", "body", "Field required"),
    (b"{not json", "body", "json_invalid"),
    (b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}', "body", "json_invalid"),
    (b"[1, 2]", "body", "dataclass_type"),
    (b'{"input_ids": "abc"}', "input_ids", "must be list or null; got str"),
    (b'{"input_ids": ["a"]}', "input_ids", "elements must be int or list; got str"),
    (b'{"input_ids": [1.0]}', "input_ids", "elements must be int or list; got float"),
    (b'{"input_ids": [[[1]]]}', "input_ids", "row 0: elements must be int; got list"),
    (b'{"input_ids": [1, "a"]}', "input_ids", "contains non-int64 element"),
    (b'{"input_ids": [1, 9223372036854775808]}', "input_ids", "contains non-int64 element"),
    (b'{"input_ids": [1], "rid": 5}', "rid", "Input should be a valid string"),
    (b'{"input_ids": [1], "sampling_params": "x"}', "sampling_params", "Input should be a valid dictionary"),
    (b'{"input_ids": [1], "stream": null}', "stream", "Input should be a valid boolean"),
    (b'{"input_ids": [1], "priority": 1.5}', "priority", "fractional part"),
    (b'{"input_ids": [1], "lora_path": 5}', "lora_path", "Input should be a valid string"),
    (b'{"input_ids": [1], "session_params": 5}', "session_params", "Input should be a valid dictionary"),
]


@pytest.mark.parametrize(("raw", "field", "text"), PARSE_REFUSALS, ids=lambda p: str(p)[:50])
def test_malformed_bodies_get_the_parse_gates_error_object(raw: bytes, field: str, text: str) -> None:
    reply = refused(raw)
    assert reply.status == 400
    error = body(reply)
    assert list(error) == ["object", "message", "type", "param", "code"]
    assert (error["object"], error["type"], error["param"], error["code"]) == (
        "error",
        "Bad Request",
        None,
        400,
    )
    assert error["message"].startswith(("1 validation error:", "2 validation errors:"))
    assert f"'loc': ('body', '{field}'" in error["message"] or field == "body"
    assert text in error["message"]


@pytest.mark.parametrize(
    ("headers", "ok"),
    [
        ({}, True),
        ({"Content-Type": "application/json"}, True),
        ({"content-type": "application/json; charset=utf-8"}, True),
        ({"Content-Type": "application/vnd.api+json"}, True),
        ({"Content-Type": "text/plain"}, False),
        ({"Content-Type": "application/x-www-form-urlencoded"}, False),
    ],
)
def test_the_body_must_be_json_unless_no_content_type_is_given(headers: dict[str, str], ok: bool) -> None:
    reply = parse_whole(FORMAT, GENERATE, json.dumps(request()).encode(), headers, context())
    if ok:
        assert not isinstance(reply, HttpReply)
    else:
        assert isinstance(reply, HttpReply)
        assert reply.status == 400
        assert "dataclass_type" in body(reply)["message"]


def test_a_lone_surrogate_is_a_json_error_and_the_answer_is_json() -> None:
    reply = refused(b'{"input_ids": "\\ud800"}')
    assert reply.status == 400
    assert "'ctx': {'error': 'no low surrogate in string'}" in body(reply)["message"]


def test_json_is_written_as_sglangs_orjson_writes_it() -> None:
    reply = refused(request(sampling_params={"top_p": 1e-05 * 2e6}))
    assert reply.body == b'{"error":{"message":"top_p must be in (0, 1], got 20.0."}}'
    small = refused(request(sampling_params={"min_p": -1e-05}))
    assert b"got -1e-05." in small.body  # SGLang's own sentence keeps Python's spelling


@pytest.mark.parametrize(
    ("fields", "refused_by_name"),
    [
        (request(bootstrap_room=[0]), True),
        (request(image_data=[None]), False),
        (request(cache_salt=[""]), False),
        (request(return_hidden_states=[False]), False),
    ],
)
def test_list_values_count_as_set_unless_every_item_is_a_default(
    fields: dict[str, Any], refused_by_name: bool
) -> None:
    assert isinstance(parse(fields), HttpReply) == refused_by_name


def test_samples_without_a_rid_take_the_first_fresh_ids() -> None:
    call = accepted({"input_ids": [1], "sampling_params": {"n": 2}})
    assert [r.request_id for r in call.requests] == [fresh_id(0), fresh_id(1)]


def test_a_samples_rid_is_still_checked_against_requests_in_flight() -> None:
    reply = refused({"input_ids": [1], "rid": "r", "sampling_params": {"n": 2}}, context(inflight=["r_1"]))
    assert body(reply) == {"error": {"message": "Duplicate request ID detected: r_1"}}


# ------------------------------------------------------------------ token_ids_logprob


def test_token_ids_logprob_goes_with_return_logprob_to_the_sub_request() -> None:
    call = accepted(request(token_ids_logprob=[7, 5, 7], return_logprob=True))
    assert list(call.requests[0].output_options.token_ids_logprob) == [7, 5, 7]
    alone = accepted(request(token_ids_logprob=[7]))
    assert list(alone.requests[0].output_options.token_ids_logprob) == []  # SGLang shows none then


def test_token_ids_logprob_in_a_batch_is_shared_or_per_prompt() -> None:
    shared = accepted({"input_ids": [[1], [2]], "token_ids_logprob": [5], "return_logprob": True})
    assert [list(r.output_options.token_ids_logprob) for r in shared.requests] == [[5], [5]]
    each = accepted({"input_ids": [[1], [2]], "token_ids_logprob": [[5], []], "return_logprob": True})
    assert [list(r.output_options.token_ids_logprob) for r in each.requests] == [[5], []]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        # SGLang's tokenizer manager, in its words.
        (request(token_ids_logprob=[[1]]), "token_ids_logprob must be a flat list of integers."),
        (
            request(token_ids_logprob=[32000]),
            "token_ids_logprob contains out-of-vocabulary token id 32000; valid range is [0, 32000).",
        ),
        (
            {"input_ids": [[1], [2]], "token_ids_logprob": [[5]]},
            "The length of token_ids_logprob should be equal to the batch size.",
        ),
        (
            {"input_ids": [[1], [2]], "token_ids_logprob": [[5], [6]], "sampling_params": {"n": 2}},
            "Cannot use list token_ids_logprob with parallel_sample_num > 1",
        ),
    ],
)
def test_token_ids_logprob_refusals(fields: dict[str, Any], message: str) -> None:
    assert body(refused(fields)) == {"error": {"message": message}}
