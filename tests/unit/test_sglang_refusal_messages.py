"""SGLang request conversion: the exact refusal a client reads (field first, then the reason),
and the native fields the refusal-free paths must carry."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import struct_pb2

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import NOT_SENT, EngineOrigin, FailureReason, SidecarError
from sidecar_sglang.convert_request import RequestSettings, build_native, to_http_json
from tests.unit.test_sglang_convert_request import DECODE, PID, req

AGG = RequestSettings()
HTTP = RequestSettings(transport="http")
WHERE = "prefill_result.disaggregated_params"


def refusal(
    request: sidecar_pb2.PreprocessedRequest, settings: RequestSettings = AGG, private_id: str = PID
) -> str:
    with pytest.raises(SidecarError) as info:
        build_native(request, private_id, settings, room=7)
    assert info.value.reason is FailureReason.INVALID_ARGUMENT
    return info.value.message


def params(**values: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"bootstrap_host": "10.0.0.5", "bootstrap_port": 8998, "bootstrap_room": "7"}
    base.update(values)
    return {k: v for k, v in base.items() if v is not None}


@pytest.mark.parametrize(
    ("fields", "settings", "message"),
    [
        ({"tokenIds": []}, AGG, "token_ids: the prompt must not be empty"),
        ({"samplingOptions": {"n": 2}}, AGG, "sampling_options.n: only n = 1 is supported by SGLang (got 2)"),
        (
            {"samplingOptions": {"bestOf": 3}},
            AGG,
            "sampling_options.best_of: only best_of = 1 is supported (got 3)",
        ),
        (
            {"samplingOptions": {"useBeamSearch": True}},
            AGG,
            "sampling_options.use_beam_search: beam search is not supported",
        ),
        (
            {"samplingOptions": {"lengthPenalty": 2.0}},
            AGG,
            "sampling_options.length_penalty: only 1 is supported (no beam search)",
        ),
        (
            {"samplingOptions": {"includeStopStrInOutput": True}},
            AGG,
            "sampling_options.include_stop_str_in_output: not supported by SGLang's native API",
        ),
        (
            {"samplingOptions": {"logitBias": {"5": 1.0}}},
            AGG,
            "sampling_options.logit_bias: SGLang's gRPC wire cannot carry it (HTTP can)",
        ),
        (
            {"routing": {"cacheNamespace": "t"}},
            AGG,
            "routing.cache_namespace: SGLang has no cache namespaces",
        ),
        (
            {"samplingOptions": {"guidedDecoding": {"json": "{}", "backend": "xgrammar"}}},
            AGG,
            "sampling_options.guided_decoding.backend: SGLang has no per-request choice",
        ),
        (
            {"samplingOptions": {"guidedDecoding": {"regex": "a+", "whitespacePattern": " "}}},
            AGG,
            "sampling_options.guided_decoding.whitespace_pattern: SGLang has no per-request choice",
        ),
        (
            {"samplingOptions": {"guidedDecoding": {"grammar": "root ::= 'a'"}}},
            AGG,
            "sampling_options.guided_decoding.grammar: SGLang accepts only json or regex",
        ),
        (
            {"multiModalData": [{"kind": "IMAGE", "url": "https://x/a.png"}]},
            AGG,
            "multi_modal_data: media is not supported over SGLang's native gRPC",
        ),
        ({"extraArgs": {"zeta": 1, "alpha": 2}}, AGG, "extra_args.alpha: unknown key for SGLang"),
        (
            {"tokenIds": [1, 2, 3, 4], "stopConditions": {"maxTokens": 8}},
            RequestSettings(context_length=4),
            "token_ids: the prompt (4 tokens) must be shorter than the context (4)",
        ),
        (
            {"stopConditions": {"maxTokens": 8}},
            RequestSettings(context_length=10),
            "stop_conditions.max_tokens: 3 prompt tokens + 8 exceed the context length (10)",
        ),
        (
            {"bootstrapInfo": {"bootstrapHost": "h", "bootstrapPort": 2**31, "bootstrapRoom": 1}},
            DECODE,
            "bootstrap_info.bootstrap_port: 2147483648 does not fit in int32",
        ),
        (
            {"bootstrapInfo": {"bootstrapHost": "h", "bootstrapPort": 1, "bootstrapRoom": str(2**63)}},
            DECODE,
            "bootstrap_info.bootstrap_room: 9223372036854775808 is out of range (0..2^63-1)",
        ),
        (
            {"prefillResult": {"disaggregatedParams": params(bootstrap_host=None)}},
            DECODE,
            f"{WHERE}.bootstrap_host: is missing",
        ),
        (
            {"prefillResult": {"disaggregatedParams": params(bootstrap_room=None)}},
            DECODE,
            f"{WHERE}.bootstrap_room: is missing",
        ),
        (
            {"prefillResult": {"disaggregatedParams": params(bootstrap_port="eighty")}},
            DECODE,
            f"{WHERE}.bootstrap_port: must be an integer",
        ),
        (
            {"prefillResult": {"disaggregatedParams": params(bootstrap_room=1.5)}},
            DECODE,
            f"{WHERE}.bootstrap_room: must be an integer",
        ),
        (
            {"prefillResult": {"disaggregatedParams": params(bootstrap_port=2**31)}},
            DECODE,
            f"{WHERE}.bootstrap_port: 2147483648 is out of range (0..2147483647)",
        ),
        (
            {"prefillResult": {"disaggregatedParams": params(bootstrap_room="-1")}},
            DECODE,
            f"{WHERE}.bootstrap_room: -1 is out of range (0..9223372036854775807)",
        ),
    ],
)
def test_refusal_message_is_exact(fields: dict[str, Any], settings: RequestSettings, message: str) -> None:
    assert refusal(req(**fields), settings) == message


def test_an_empty_private_id_is_refused_by_name() -> None:
    assert refusal(req(), private_id="") == "request_id: the private id must not be empty"


def test_media_over_http_is_not_refused() -> None:
    native = build_native(req(multiModalData=[{"kind": "IMAGE", "url": "u"}]), PID, HTTP, room=7)
    assert native.media == (("image_data", "u"),)


def test_the_prompt_logprobs_asked_reach_the_response_side() -> None:
    native = build_native(req(outputOptions={"promptLogprobs": 2}), PID, AGG, room=7)
    assert (native.prompt_logprobs, native.logprobs) == (2, None)
    assert (native.top_logprobs_num, native.logprob_start_len) == (2, 0)
    plain = build_native(req(outputOptions={"logprobs": 3}), PID, AGG, room=7)
    assert (plain.prompt_logprobs, plain.logprobs) == (None, 3)


def test_the_http_body_names_the_routed_dp_rank() -> None:
    native = build_native(req(routing={"dpRank": 1}), PID, RequestSettings(dp_size=2), room=7)
    body = to_http_json(native)
    assert body["routed_dp_rank"] == 1
    assert "ROUTED_DP_RANK" not in body


def test_struct_params_may_carry_port_as_a_number_and_room_as_text() -> None:
    p = struct_pb2.Struct()
    p.update(params(bootstrap_port=8998.0, bootstrap_room=str(2**63 - 1)))
    request = sidecar_pb2.PreprocessedRequest(token_ids=[1])
    request.prefill_result.disaggregated_params.CopyFrom(p)
    bootstrap = build_native(request, PID, DECODE, room=7).bootstrap
    assert bootstrap is not None
    assert (bootstrap.host, bootstrap.port, bootstrap.room) == ("10.0.0.5", 8998, 2**63 - 1)


@pytest.mark.parametrize(
    ("given", "sent"),
    [
        (0.699999988079071, 0.7),  # the frontend's 0.7 as float32
        (1.401298464324817e-45, 1e-45),  # the least float32: one digit is already enough
    ],
)
def test_a_float32_sampling_value_reaches_the_engine_as_its_shortest_decimal(
    given: float, sent: float
) -> None:
    native = build_native(req(samplingOptions={"temperature": given, "topP": given}), PID, AGG, room=7)
    assert (native.sampling.temperature, native.sampling.top_p) == (sent, sent)
    assert to_http_json(native)["sampling_params"] == {"temperature": sent, "top_p": sent}


@pytest.mark.parametrize("lora_enabled", [None, True])
def test_a_lora_adapter_is_carried_unless_discovery_says_lora_is_off(lora_enabled: bool | None) -> None:
    request = req(routing={"loraName": "sql"})
    native = build_native(request, PID, RequestSettings(lora_enabled=lora_enabled), room=1)
    assert native.lora_path == "sql"


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_a_lora_adapter_while_lora_is_off_is_refused_in_sglangs_words(transport: Any) -> None:
    request = req(routing={"loraName": "sql"})
    with pytest.raises(SidecarError) as info:
        build_native(request, PID, RequestSettings(transport=transport, lora_enabled=False), room=1)
    assert info.value.reason is FailureReason.INVALID_ARGUMENT
    assert info.value.message == (
        "LoRA adapter 'sql' was requested, but LoRA is not enabled. Please launch the server with "
        "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
    )
    assert info.value.origin == EngineOrigin("Generate", NOT_SENT)
