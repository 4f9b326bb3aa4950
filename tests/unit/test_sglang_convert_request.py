"""SGLang request conversion: the table of docs/sglang.md "Request conversion", on both wires."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
from google.protobuf import json_format, struct_pb2
from hypothesis import example, given
from hypothesis import strategies as st

from sidecar_common import bootstrap_handoff
from sidecar_common.api import sglang_pb2, sidecar_pb2
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_sglang.convert_request import (
    ROOM_MAX,
    Bootstrap,
    RequestSettings,
    build_native,
    handoff_info,
    to_grpc,
    to_http_json,
)

AGG = RequestSettings()
PREFILL = RequestSettings(mode="prefill", bootstrap_host="10.0.0.5", bootstrap_port=8998)
DECODE = RequestSettings(mode="decode")
PID = "0123456789abcdef0123-req"


def req(**fields: Any) -> sidecar_pb2.PreprocessedRequest:
    message = sidecar_pb2.PreprocessedRequest(token_ids=[1, 2, 3])
    json_format.ParseDict(fields, message)
    return message


def grpc_of(
    request: sidecar_pb2.PreprocessedRequest, settings: RequestSettings = AGG
) -> sglang_pb2.GenerateRequest:
    return to_grpc(build_native(request, PID, settings, room=7))


def http_of(request: sidecar_pb2.PreprocessedRequest, settings: RequestSettings = AGG) -> dict[str, Any]:
    return to_http_json(build_native(request, PID, settings, room=7))


def refused(request: sidecar_pb2.PreprocessedRequest, settings: RequestSettings = AGG) -> str:
    with pytest.raises(SidecarError) as info:
        build_native(request, PID, settings, room=7)
    assert info.value.reason is FailureReason.INVALID_ARGUMENT
    return info.value.message


def test_minimal_request_on_both_wires() -> None:
    g = grpc_of(req())
    assert list(g.input_ids) == [1, 2, 3]
    assert g.rid == PID
    assert g.stream
    assert not g.HasField("return_logprob")
    assert not g.HasField("disaggregated_params")
    assert not g.HasField("priority")
    assert http_of(req()) == {"input_ids": [1, 2, 3], "sampling_params": {}, "stream": True, "rid": PID}


def test_stop_token_ids_user_then_hidden_deduplicated() -> None:
    r = req(stopConditions={"stopTokenIds": [19, 19, 20], "stopTokenIdsHidden": [20, 21]})
    assert list(grpc_of(r).sampling_params.stop_token_ids) == [19, 20, 21]
    assert http_of(r)["sampling_params"]["stop_token_ids"] == [19, 20, 21]


def test_ignore_eos_drops_hidden_stop_ids() -> None:
    r = req(stopConditions={"stopTokenIds": [19], "stopTokenIdsHidden": [2], "ignoreEos": True})
    g = grpc_of(r)
    assert list(g.sampling_params.stop_token_ids) == [19]
    assert g.sampling_params.ignore_eos is True


def test_stops_and_lengths() -> None:
    r = req(stopConditions={"maxTokens": 16, "minTokens": 2, "stop": ["\n\n", "END"]})
    sp = http_of(r)["sampling_params"]
    assert sp == {"max_new_tokens": 16, "min_new_tokens": 2, "stop": ["\n\n", "END"]}


def test_sampling_floats_only_when_given_absent_is_not_zero() -> None:
    g = grpc_of(req(samplingOptions={"temperature": 0.0, "topK": -1}))
    assert g.sampling_params.HasField("temperature")
    assert g.sampling_params.temperature == 0.0
    assert g.sampling_params.top_k == -1
    for name in ("top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "seed"):
        assert not g.sampling_params.HasField(name)
    assert http_of(req(samplingOptions={"topP": 0.5}))["sampling_params"] == {"top_p": 0.5}


def test_float32_values_reach_the_engine_as_written() -> None:
    body = http_of(req(samplingOptions={"temperature": 0.7, "topP": 0.95, "minP": 1e-05}))
    assert body["sampling_params"] == {"temperature": 0.7, "top_p": 0.95, "min_p": 1e-05}


@example(3.4028234663852886e38)  # the float32 maximum: short roundings overflow it
@given(st.floats(min_value=0.0, width=32, allow_nan=False, allow_infinity=False))
def test_float32_shortening_never_changes_the_value(value: float) -> None:
    request = sidecar_pb2.PreprocessedRequest(token_ids=[1])
    request.sampling_options.temperature = value
    sent = http_of(request)["sampling_params"]["temperature"]
    assert struct.unpack("<f", struct.pack("<f", sent))[0] == request.sampling_options.temperature


def test_seed_is_seed_on_grpc_and_sampling_seed_on_http() -> None:
    r = req(samplingOptions={"seed": "1234567890123"})
    assert grpc_of(r).sampling_params.seed == 1234567890123
    assert http_of(r)["sampling_params"] == {"sampling_seed": 1234567890123}


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ({"logprobs": 0}, (True, 0, -1)),
        ({"logprobs": 3}, (True, 3, -1)),
        ({"promptLogprobs": 0}, (True, 0, 0)),
        ({"logprobs": 2, "promptLogprobs": 5}, (True, 5, 0)),
        ({"logprobs": 7, "promptLogprobs": 1}, (True, 7, 0)),
    ],
)
def test_logprob_table(output: dict[str, int], expected: tuple[bool, int, int]) -> None:
    g = grpc_of(req(outputOptions=output))
    assert (g.return_logprob, g.top_logprobs_num, g.logprob_start_len) == expected
    h = http_of(req(outputOptions=output))
    assert (h["return_logprob"], h["top_logprobs_num"], h["logprob_start_len"]) == expected


def test_guided_json_and_regex() -> None:
    schema = '{"type": "object"}'
    assert (
        grpc_of(req(samplingOptions={"guidedDecoding": {"json": schema}})).sampling_params.json_schema
        == schema
    )
    assert http_of(req(samplingOptions={"guidedDecoding": {"regex": "a+"}}))["sampling_params"] == {
        "regex": "a+"
    }


@pytest.mark.parametrize(
    "guided", [{"grammar": "root ::= x"}, {"structuralTag": "{}"}, {"choice": {"choices": ["a", "b"]}}]
)
def test_other_guided_kinds_refused(guided: dict[str, Any]) -> None:
    assert refused(req(samplingOptions={"guidedDecoding": guided})).startswith(
        "sampling_options.guided_decoding"
    )


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"tokenIds": []}, "token_ids"),
        ({"samplingOptions": {"n": 2}}, "sampling_options.n"),
        ({"samplingOptions": {"n": 0}}, "sampling_options.n"),
        ({"samplingOptions": {"bestOf": 3}}, "sampling_options.best_of"),
        ({"samplingOptions": {"useBeamSearch": True}}, "sampling_options.use_beam_search"),
        ({"samplingOptions": {"lengthPenalty": 0.5}}, "sampling_options.length_penalty"),
        (
            {"samplingOptions": {"includeStopStrInOutput": True}},
            "sampling_options.include_stop_str_in_output",
        ),
        ({"samplingOptions": {"logitBias": {"5": 1.0}}}, "sampling_options.logit_bias"),
        ({"extraArgs": {"frobnicate": 1}}, "extra_args.frobnicate"),
        ({"tokenIds": [1, 2**31]}, "token_ids"),
        ({"stopConditions": {"maxTokens": 2**31}}, "stop_conditions.max_tokens"),
        ({"stopConditions": {"stopTokenIds": [2**31]}}, "stop_conditions.stop_token_ids"),
        ({"routing": {"dpRank": 2**31}}, "routing.dp_rank"),
        ({"routing": {"cacheNamespace": "t"}}, "routing.cache_namespace"),
        (
            {"samplingOptions": {"guidedDecoding": {"regex": "a", "backend": "x"}}},
            "sampling_options.guided_decoding.backend",
        ),
    ],
)
def test_refusals_name_the_field(fields: dict[str, Any], named: str) -> None:
    message = refused(req(**fields))
    assert message.startswith(named)


def test_int32_message() -> None:
    assert "token ids must fit in int32" in refused(req(tokenIds=[2**32 - 1]))


def test_accepted_identities() -> None:
    r = req(samplingOptions={"n": 1, "bestOf": 1, "lengthPenalty": 1.0, "useBeamSearch": False})
    assert grpc_of(r).rid == PID


def test_media_refused_on_grpc_carried_on_http() -> None:
    r = req(multiModalData=[{"kind": "IMAGE", "url": "https://x/a.png"}, {"kind": "AUDIO", "url": "data:a"}])
    assert refused(r).startswith("multi_modal_data")
    body = http_of(r, RequestSettings(transport="http"))
    assert body["image_data"] == ["https://x/a.png"]
    assert body["audio_data"] == ["data:a"]


def test_logit_bias_refused_on_grpc_carried_on_http_with_text_keys() -> None:
    # SGLang's HTTP schema takes {"<token id>": bias} and checks the keys against its vocabulary;
    # its gRPC SamplingParams has no logit_bias field.
    r = req(samplingOptions={"logitBias": {"50": 0.7, "5": -100.0}})
    assert refused(r) == "sampling_options.logit_bias: SGLang's gRPC wire cannot carry it (HTTP can)"
    body = http_of(r, RequestSettings(transport="http"))
    assert body["sampling_params"] == {"logit_bias": {"5": -100.0, "50": 0.7}}
    assert json.loads(json.dumps(body)) == body


@pytest.mark.parametrize("bias", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_logit_bias_is_refused_by_name(bias: str) -> None:
    r = req(samplingOptions={"logitBias": {"5": bias}})
    message = refused(r, RequestSettings(transport="http"))
    assert message.startswith("sampling_options.logit_bias: must be finite numbers (got ")


def test_lora_dp_rank_priority() -> None:
    r = req(routing={"loraName": "sql", "dpRank": 3, "prefillDpRank": 1, "priority": 5})
    g = grpc_of(r)
    assert (g.lora_path, g.routed_dp_rank, g.priority) == ("sql", 3, 5)
    assert grpc_of(r, PREFILL).routed_dp_rank == 1
    assert grpc_of(req(routing={"dpRank": 3}), PREFILL).routed_dp_rank == 3


def test_priority_follows_scheduler_direction() -> None:
    low_first = RequestSettings(low_priority_values_first=True)
    assert grpc_of(req(routing={"priority": 5}), low_first).priority == -5
    assert grpc_of(req(routing={"priority": -(2**31)}), low_first).priority == 2**31 - 1
    assert http_of(req(routing={"priority": 0}))["priority"] == 0


def test_agg_ignores_bootstrap() -> None:
    r = req(bootstrapInfo={"bootstrapHost": "h", "bootstrapPort": 1, "bootstrapRoom": "2"})
    assert not grpc_of(r).HasField("disaggregated_params")


def test_bootstrap_info_first_then_prefill_result() -> None:
    params = {"bootstrap_host": "p", "bootstrap_port": 2, "bootstrap_room": "3"}
    both = req(
        bootstrapInfo={"bootstrapHost": "b", "bootstrapPort": 1, "bootstrapRoom": "9"},
        prefillResult={"disaggregatedParams": params},
    )
    d = grpc_of(both, DECODE).disaggregated_params
    assert (d.bootstrap_host, d.bootstrap_port, d.bootstrap_room) == ("b", 1, 9)
    only = req(prefillResult={"disaggregatedParams": params})
    h = http_of(only, DECODE)
    assert (h["bootstrap_host"], h["bootstrap_port"], h["bootstrap_room"]) == ("p", 2, 3)


def test_prefill_defaults_to_discovered_host_and_given_room_and_clamps() -> None:
    r = req(stopConditions={"maxTokens": 100, "minTokens": 10})
    g = to_grpc(build_native(r, PID, PREFILL, room=ROOM_MAX))
    assert (g.disaggregated_params.bootstrap_host, g.disaggregated_params.bootstrap_port) == (
        "10.0.0.5",
        8998,
    )
    assert g.disaggregated_params.bootstrap_room == ROOM_MAX
    assert g.sampling_params.max_new_tokens == 1
    assert not g.sampling_params.HasField("min_new_tokens")


def test_decode_without_bootstrap_refused() -> None:
    assert refused(req(), DECODE).startswith("prefill_result")


@pytest.mark.parametrize(
    ("info", "named"),
    [
        ({"bootstrapHost": "  ", "bootstrapPort": 1, "bootstrapRoom": "1"}, "bootstrap_info.bootstrap_host"),
        (
            {"bootstrapHost": "h", "bootstrapPort": 2**31, "bootstrapRoom": "1"},
            "bootstrap_info.bootstrap_port",
        ),
        (
            {"bootstrapHost": "h", "bootstrapPort": 1, "bootstrapRoom": str(2**63)},
            "bootstrap_info.bootstrap_room",
        ),
    ],
)
def test_bootstrap_info_ranges(info: dict[str, Any], named: str) -> None:
    assert refused(req(bootstrapInfo=info), DECODE).startswith(named)


def test_bootstrap_room_max_accepted() -> None:
    r = req(bootstrapInfo={"bootstrapHost": "h", "bootstrapPort": 1, "bootstrapRoom": str(ROOM_MAX)})
    assert grpc_of(r, DECODE).disaggregated_params.bootstrap_room == ROOM_MAX


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"bootstrap_port": 1, "bootstrap_room": "1"}, "bootstrap_host"),
        ({"bootstrap_host": "h", "bootstrap_port": 1.5, "bootstrap_room": "1"}, "bootstrap_port"),
        ({"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": str(2**63)}, "bootstrap_room"),
        ({"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": "-1"}, "bootstrap_room"),
        ({"bootstrap_host": "h", "bootstrap_port": -1, "bootstrap_room": 1}, "bootstrap_port"),
        ({"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": "²"}, "bootstrap_room"),
        ({"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": True}, "bootstrap_room"),
    ],
)
def test_prefill_result_ranges(params: dict[str, Any], named: str) -> None:
    message = refused(req(prefillResult={"disaggregatedParams": params}), DECODE)
    assert message.startswith(f"prefill_result.disaggregated_params.{named}")


@given(room=st.integers(min_value=0, max_value=ROOM_MAX), port=st.integers(0, 2**31 - 1))
def test_handoff_round_trips_exactly(room: int, port: int) -> None:
    """The prefill terminal's params, passed back by the frontend, give decode the same triple."""
    params = bootstrap_handoff.to_struct(handoff_info(Bootstrap("node-1", port, room)))
    echoed = struct_pb2.Struct()
    echoed.MergeFromString(params.SerializeToString())
    decode = build_native(
        sidecar_pb2.PreprocessedRequest(
            token_ids=[1], prefill_result=sidecar_pb2.PrefillResult(disaggregated_params=echoed)
        ),
        PID,
        DECODE,
        room=0,
    )
    assert decode.bootstrap == Bootstrap("node-1", port, room)


def test_empty_private_id_refused() -> None:
    with pytest.raises(SidecarError):
        build_native(req(), "", AGG, room=0)


@given(
    user=st.lists(st.integers(0, 2**31 - 1), max_size=6),
    hidden=st.lists(st.integers(0, 2**31 - 1), max_size=6),
)
def test_stop_ids_property(user: list[int], hidden: list[int]) -> None:
    r = sidecar_pb2.PreprocessedRequest(
        token_ids=[1],
        stop_conditions=sidecar_pb2.StopConditions(stop_token_ids=user, stop_token_ids_hidden=hidden),
    )
    ids = list(grpc_of(r).sampling_params.stop_token_ids)
    assert len(ids) == len(set(ids))
    assert set(ids) == set(user) | set(hidden)
    assert ids[: len(dict.fromkeys(user))] == list(dict.fromkeys(user))


_FLOAT_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
}


# Zero where SGLang accepts it (top_p and repetition_penalty must be above 0).
_VALID = {
    name: [0.5, 1.0] if name in ("top_p", "repetition_penalty") else [0.0, 0.5, 1.0] for name in _FLOAT_FIELDS
}


@given(
    st.sets(st.sampled_from(sorted(_FLOAT_FIELDS))).flatmap(
        lambda names: st.fixed_dictionaries({n: st.sampled_from(_VALID[n]) for n in names})
    )
)
def test_absent_is_not_zero_property(given_fields: dict[str, float]) -> None:
    """Exactly the sampling values the frontend set reach the engine, zeros included."""
    request = sidecar_pb2.PreprocessedRequest(token_ids=[1])
    for name, value in given_fields.items():
        setattr(request.sampling_options, name, value)
    sent = grpc_of(request).sampling_params
    for name, native_name in _FLOAT_FIELDS.items():
        assert sent.HasField(native_name) == (name in given_fields)  # type: ignore[arg-type]
    assert set(http_of(request)["sampling_params"]) == {_FLOAT_FIELDS[n] for n in given_fields}


# -------------------------------------------------- values SGLang's engine would refuse
# SamplingParams.verify refuses these after the request reached it (over gRPC as INTERNAL);
# the sidecar refuses them first, naming the field.
_NAN, _INF = float("nan"), float("inf")


def _sampling(name: str, value: float) -> sidecar_pb2.PreprocessedRequest:
    request = sidecar_pb2.PreprocessedRequest(token_ids=[1, 2, 3])
    setattr(request.sampling_options, name, value)
    return request


@pytest.mark.parametrize("value", [_NAN, _INF, -_INF])
@pytest.mark.parametrize("name", sorted(_FLOAT_FIELDS))
def test_non_finite_sampling_floats_are_refused_by_name(name: str, value: float) -> None:
    message = refused(_sampling(name, value))
    assert message.startswith(f"sampling_options.{name}")
    assert "finite" in message


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.1),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("frequency_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("presence_penalty", 3.0),
        ("presence_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", 2.5),
    ],
)
def test_sampling_floats_outside_sglang_ranges_are_refused_by_name(name: str, value: float) -> None:
    assert refused(_sampling(name, value)).startswith(f"sampling_options.{name}")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("temperature", 0.0),
        ("temperature", 100.0),
        ("top_p", 1.0),
        ("min_p", 0.0),
        ("min_p", 1.0),
        ("frequency_penalty", -2.0),
        ("presence_penalty", 2.0),
        ("repetition_penalty", 2.0),
    ],
)
def test_sampling_float_range_ends_sglang_takes_pass(name: str, value: float) -> None:
    assert grpc_of(_sampling(name, value)).sampling_params.HasField(name)  # type: ignore[arg-type]


def test_length_penalty_nan_is_refused_by_name() -> None:
    assert refused(_sampling("length_penalty", _NAN)).startswith("sampling_options.length_penalty")


@pytest.mark.parametrize("top_k", [0, -2, -(2**31)])
def test_top_k_sglang_refuses_is_refused_by_name(top_k: int) -> None:
    assert refused(req(samplingOptions={"topK": top_k})).startswith("sampling_options.top_k")


@pytest.mark.parametrize(("top_k", "temperature"), [(-1, None), (1, None), (2**31 - 1, None), (0, 0.0)])
def test_top_k_sglang_takes_passes(top_k: int, temperature: float | None) -> None:
    options: dict[str, Any] = {"topK": top_k}
    if temperature is not None:
        options["temperature"] = temperature  # greedy: SGLang replaces top_k with 1
    assert grpc_of(req(samplingOptions=options)).sampling_params.top_k == top_k


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"stopConditions": {"maxTokens": 2**31}}, "stop_conditions.max_tokens"),
        ({"stopConditions": {"maxTokens": 2**32 - 1}}, "stop_conditions.max_tokens"),
        ({"stopConditions": {"minTokens": 2**31}}, "stop_conditions.min_tokens"),
        ({"stopConditions": {"maxTokens": 4, "minTokens": 5}}, "stop_conditions.min_tokens"),
        ({"stopConditions": {"minTokens": 129}}, "stop_conditions.min_tokens"),  # SGLang's default max 128
        ({"stopConditions": {"stopTokenIds": [2**31]}}, "stop_conditions.stop_token_ids"),
        ({"stopConditions": {"stopTokenIdsHidden": [2**32 - 1]}}, "stop_conditions.stop_token_ids"),
        ({"outputOptions": {"logprobs": 2**31}}, "output_options.logprobs"),
        ({"routing": {"dpRank": 2**31}}, "routing.dp_rank"),
    ],
)
def test_numbers_the_wire_cannot_carry_are_refused_by_name(fields: dict[str, Any], named: str) -> None:
    assert refused(req(**fields)).startswith(named)


def test_min_tokens_up_to_the_limit_pass() -> None:
    assert grpc_of(req(stopConditions={"minTokens": 128})).sampling_params.min_new_tokens == 128
    s = grpc_of(req(stopConditions={"maxTokens": 5, "minTokens": 5})).sampling_params
    assert (s.max_new_tokens, s.min_new_tokens) == (5, 5)


def test_prefill_sends_one_token_and_no_minimum() -> None:
    r = req(
        stopConditions={"maxTokens": 40, "minTokens": 30},
        bootstrapInfo={"bootstrapHost": "h", "bootstrapPort": 1},
    )
    params = grpc_of(r, PREFILL).sampling_params
    assert params.max_new_tokens == 1
    assert not params.HasField("min_new_tokens")


def test_prefill_refuses_min_above_max_as_its_decode_half_would() -> None:
    # The same request goes to the decode half, which refuses it: refuse before the prefill work.
    r = req(
        stopConditions={"maxTokens": 4, "minTokens": 500},
        bootstrapInfo={"bootstrapHost": "h", "bootstrapPort": 1},
    )
    with pytest.raises(SidecarError) as caught:
        grpc_of(r, PREFILL)
    assert caught.value.message.startswith("stop_conditions.min_tokens:")


@pytest.mark.parametrize(
    ("routing", "settings", "named"),
    [
        ({"dpRank": 2}, RequestSettings(dp_size=2), "routing.dp_rank"),
        ({"dpRank": 1}, RequestSettings(dp_size=1), "routing.dp_rank"),
        ({"dpRank": 5}, RequestSettings(dp_size=0), "routing.dp_rank"),
        (
            {"prefillDpRank": 4, "dpRank": 0},
            RequestSettings(mode="prefill", bootstrap_host="h", bootstrap_port=1, dp_size=4),
            "routing.prefill_dp_rank",
        ),
    ],
)
def test_dp_rank_beyond_the_discovered_dp_size_is_refused_by_name(
    routing: dict[str, Any], settings: RequestSettings, named: str
) -> None:
    assert refused(req(routing=routing), settings).startswith(named)


@pytest.mark.parametrize(
    ("rank", "settings"),
    [
        (0, RequestSettings(dp_size=1)),  # SGLang ignores rank 0 on a single-rank engine
        (0, RequestSettings(dp_size=0)),
        (3, RequestSettings(dp_size=4)),
        (7, RequestSettings()),  # dp size unknown: not checked here
    ],
)
def test_dp_rank_within_the_dp_size_passes(rank: int, settings: RequestSettings) -> None:
    assert grpc_of(req(routing={"dpRank": rank}), settings).routed_dp_rank == rank


@pytest.mark.parametrize(
    ("tokens", "stop", "named"),
    [
        (8, {}, "token_ids"),
        (9, {"maxTokens": 1}, "token_ids"),
        (5, {"maxTokens": 4}, "stop_conditions.max_tokens"),
        (7, {"maxTokens": 2**31 - 1}, "stop_conditions.max_tokens"),
    ],
)
def test_past_the_context_length_is_refused_by_name(tokens: int, stop: dict[str, Any], named: str) -> None:
    r = req(tokenIds=list(range(1, tokens + 1)), stopConditions=stop)
    assert refused(r, RequestSettings(context_length=8)).startswith(named)


@pytest.mark.parametrize(
    ("tokens", "stop", "settings"),
    [
        (7, {}, RequestSettings(context_length=8)),  # no max_tokens: SGLang checks no total
        (5, {"maxTokens": 3}, RequestSettings(context_length=8)),
        (9, {"maxTokens": 100}, RequestSettings()),  # context unknown (or truncating): not checked
        (
            7,
            {"maxTokens": 100},  # the prefill half makes one token
            RequestSettings(mode="prefill", bootstrap_host="h", bootstrap_port=1, context_length=8),
        ),
    ],
)
def test_within_the_context_length_passes(
    tokens: int, stop: dict[str, Any], settings: RequestSettings
) -> None:
    r = req(tokenIds=list(range(1, tokens + 1)), stopConditions=stop)
    assert len(grpc_of(r, settings).input_ids) == tokens


def test_token_ids_logprob_is_carried_over_http_with_the_other_logprobs() -> None:
    r = req(outputOptions={"logprobs": 0, "tokenIdsLogprob": [7, 5]})
    body = http_of(r, RequestSettings(transport="http"))
    assert (body["return_logprob"], body["token_ids_logprob"]) == (True, [7, 5])
    assert refused(r) == "output_options.token_ids_logprob: SGLang's gRPC wire cannot carry it (HTTP can)"
    alone = req(outputOptions={"tokenIdsLogprob": [7]})
    assert refused(alone, RequestSettings(transport="http")) == (
        "output_options.token_ids_logprob: needs logprobs or prompt_logprobs"
    )
