"""Edges of request and response conversion that the mutation run found unpinned: exact bounds,
which field a refusal names, what the native request carries for the response side, and the
rendering of SGLang's top logprobs."""

from __future__ import annotations

import struct
from typing import Any

import pytest
from google.protobuf import json_format
from smg_grpc_proto.generated import common_pb2

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_sglang.convert_request import (
    INT32_MAX,
    ROOM_MAX,
    Bootstrap,
    NativeRequest,
    NativeSampling,
    RequestSettings,
    build_native,
    to_http_json,
)
from sidecar_sglang.convert_response import NativeEvent, ResponseState
from sidecar_vllm.convert import ResponseState as VllmState
from sidecar_vllm.convert import to_generate_request
from tests.vllm_fixtures import chunk, complete

Req = sidecar_pb2.PreprocessedRequest
AGG = RequestSettings()
DECODE = RequestSettings(mode="decode")


def req(**fields: Any) -> Req:
    message = Req(token_ids=[1, 2, 3])
    json_format.ParseDict(fields, message)
    return message


def message_of(call: Any) -> str:
    with pytest.raises(SidecarError) as info:
        call()
    assert info.value.reason is FailureReason.INVALID_ARGUMENT
    return info.value.message


# ---------------------------------------------------------------------------- SGLang request


def test_sglang_the_largest_int32_token_id_is_accepted() -> None:
    assert build_native(req(tokenIds=[INT32_MAX]), "p", AGG, room=1).input_ids == (INT32_MAX,)


def test_sglang_a_float32_near_its_maximum_is_sent_in_its_shortest_form() -> None:
    biggest = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]
    body = to_http_json(build_native(req(samplingOptions={"temperature": biggest}), "p", AGG, room=1))
    sampling = body["sampling_params"]
    assert isinstance(sampling, dict)
    assert sampling["temperature"] == 3.4028235e38


def test_sglang_min_tokens_is_bounded_by_the_given_max_tokens_not_by_sglangs_default() -> None:
    native = build_native(req(stopConditions={"maxTokens": 200, "minTokens": 150}), "p", AGG, room=1)
    assert (native.sampling.max_new_tokens, native.sampling.min_new_tokens) == (200, 150)
    message = message_of(lambda: build_native(req(stopConditions={"minTokens": 150}), "p", AGG, room=1))
    assert message == "stop_conditions.min_tokens: 150 is more than SGLang's default max_new_tokens (128)"


def test_sglang_handoff_bounds_are_inclusive() -> None:
    params = {"bootstrap_host": "h", "bootstrap_port": INT32_MAX, "bootstrap_room": str(ROOM_MAX)}
    native = build_native(req(prefillResult={"disaggregatedParams": params}), "p", DECODE, room=1)
    assert native.bootstrap == Bootstrap("h", INT32_MAX, ROOM_MAX)
    info = {"bootstrapHost": "h", "bootstrapPort": INT32_MAX, "bootstrapRoom": 5}
    assert build_native(req(bootstrapInfo=info), "p", DECODE, room=1).bootstrap == Bootstrap(
        "h", INT32_MAX, 5
    )


@pytest.mark.parametrize(
    ("fields", "settings", "message"),
    [
        (
            {
                "prefillResult": {
                    "disaggregatedParams": {"bootstrap_host": 5, "bootstrap_port": 1, "bootstrap_room": 1}
                }
            },
            DECODE,
            "prefill_result.disaggregated_params.bootstrap_host: must be a string",
        ),
        (
            {
                "prefillResult": {
                    "disaggregatedParams": {"bootstrap_host": " ", "bootstrap_port": 1, "bootstrap_room": 1}
                }
            },
            DECODE,
            "prefill_result.disaggregated_params.bootstrap_host: must not be blank",
        ),
        (
            {"prefillResult": {}},
            DECODE,
            "prefill_result: a decode request needs bootstrap_info or prefill_result",
        ),
        (
            {},
            RequestSettings(mode="prefill", bootstrap_host="h", bootstrap_port=None),
            "bootstrap_info: the engine reported no bootstrap host/port to default to",
        ),
        (
            {},
            RequestSettings(mode="prefill", bootstrap_host=" ", bootstrap_port=8998),
            "bootstrap_info.bootstrap_host: must not be blank",
        ),
        (
            {"routing": {"prefillDpRank": 2**31}},
            RequestSettings(mode="prefill", bootstrap_host="h", bootstrap_port=1),
            "routing.prefill_dp_rank: 2147483648 does not fit in int32",
        ),
        (
            {"routing": {"dpRank": 5, "prefillDpRank": 0}},
            RequestSettings(dp_size=2),
            "routing.dp_rank: 5 is out of range (the engine has 2 dp ranks)",
        ),
    ],
)
def test_sglang_bootstrap_and_rank_refusals_name_the_field(
    fields: dict[str, Any], settings: RequestSettings, message: str
) -> None:
    assert message_of(lambda: build_native(req(**fields), "p", settings, room=1)) == message


def test_sglang_native_request_carries_what_the_response_side_needs() -> None:
    r = req(stopConditions={"stopTokenIds": [7, 8], "stopTokenIdsHidden": [2]}, outputOptions={"logprobs": 3})
    native = build_native(r, "p", AGG, room=1)
    assert native.user_stop_token_ids == frozenset({7, 8})
    assert (native.logprobs, native.prompt_logprobs, native.prefill) == (3, None, False)
    plain = build_native(req(), "p", AGG, room=1)
    assert (plain.return_logprob, plain.top_logprobs_num, plain.logprob_start_len) == (False, None, None)
    prefill = build_native(
        req(), "p", RequestSettings(mode="prefill", bootstrap_host="h", bootstrap_port=1), room=1
    )
    assert prefill.prefill is True


def test_sglang_http_body_names_the_lora_path() -> None:
    body = to_http_json(build_native(req(routing={"loraName": "sql"}), "p", AGG, room=1))
    assert body["lora_path"] == "sql"


# --------------------------------------------------------------------------- SGLang response


def native(**fields: Any) -> NativeRequest:
    base: dict[str, Any] = {"rid": "r", "input_ids": (1, 2, 3, 4), "sampling": NativeSampling()}
    base.update(fields)
    return NativeRequest(**base)


def test_sglang_top_logprob_entries_carry_text_rank_and_zero_for_a_null_logprob() -> None:
    request = native(return_logprob=True, logprobs=3)
    meta = {
        "output_token_logprobs": [[None, 5, "a"]],
        "output_top_logprobs": [[[-0.5, 9, "z"], [None, 8, "y"], [None, 5, "a"], [-3.0, 4, None]]],
        "finish_reason": "length",
    }
    (out,) = ResponseState(request, cumulative=False).feed(NativeEvent([5], meta, True), aborted_by_us=False)
    assert list(out.log_probs) == [0.0]
    entries = out.top_logprobs[0].entries
    assert [(e.token_id, e.logprob, e.token, e.rank) for e in entries] == [
        (5, 0.0, "a", 3),
        (9, -0.5, "z", 1),
        (8, 0.0, "y", 2),
    ]


@pytest.mark.parametrize(("reported", "usage"), [(0, 0), (INT32_MAX, INT32_MAX), (-1, 4)])
def test_sglang_prompt_tokens_reported_within_bounds_are_kept(reported: int, usage: int) -> None:
    (out,) = ResponseState(native(), cumulative=False).feed(
        NativeEvent([5], {"finish_reason": "length", "prompt_tokens": reported}, True), aborted_by_us=False
    )
    assert out.completion_usage.prompt_tokens == usage


def test_sglang_a_decode_terminal_never_carries_a_handoff() -> None:
    state = ResponseState(native(bootstrap=Bootstrap("h", 1, 2)), cumulative=False)
    (out,) = state.feed(NativeEvent([5], {"finish_reason": "length"}, True), aborted_by_us=False)
    assert not out.HasField("disaggregated_params")


# ----------------------------------------------------------------------------- vLLM request


def vllm(request: Req, mode: Any = "agg") -> Any:
    return to_generate_request(request, "p", mode=mode, supports_vision=True)


@pytest.mark.parametrize("info", [{"bootstrapPort": 1}, {"bootstrapRoom": 1}, {"bootstrapHost": "h"}])
def test_vllm_refuses_any_part_of_an_sglang_rendezvous(info: dict[str, Any]) -> None:
    message = message_of(lambda: vllm(req(bootstrapInfo=info)))
    assert message == "bootstrap_info: SGLang rendezvous; vLLM hands off KV via disaggregated_params"


def test_vllm_sends_its_own_default_for_spaces_between_special_tokens() -> None:
    # The wire's default (false) is not vLLM's (true): it is always sent explicitly.
    assert vllm(req()).sampling_params.spaces_between_special_tokens is True


def test_vllm_decode_refuses_handoff_params_given_the_aggregated_way() -> None:
    r = req(
        extraArgs={"kv_transfer_params": {"a": 1}},
        prefillResult={"disaggregatedParams": {"engine_id": "x"}},
    )
    message = message_of(lambda: vllm(r, mode="decode"))
    assert message == "extra_args.kv_transfer_params: a decode request takes its handoff from prefill_result"


def test_vllm_names_the_media_kind_its_wire_cannot_carry() -> None:
    r = req(multiModalData=[{"kind": "AUDIO", "url": "data:a"}])
    assert message_of(lambda: vllm(r)) == "multi_modal_data[0].kind: AUDIO is not supported by vLLM"
    video = vllm(req(multiModalData=[{"kind": "VIDEO", "url": "https://x/v.mp4"}]))
    assert [(i.modality, i.url) for i in video.media_refs.items] == [(common_pb2.VIDEO, "https://x/v.mp4")]


def test_sglang_top_logprobs_keep_the_sampled_logprob_and_every_alternative_after_it() -> None:
    request = native(return_logprob=True, logprobs=3)
    meta = {
        "output_token_logprobs": [[-0.5, 5, "a"]],
        # The sampled token first among the alternatives; entries of two items carry no text.
        "output_top_logprobs": [[[-0.5, 5, "a"], [-1.0, 9, "z"], [-2.0, 8]]],
        "finish_reason": "length",
    }
    (out,) = ResponseState(request, cumulative=False).feed(NativeEvent([5], meta, True), aborted_by_us=False)
    entries = out.top_logprobs[0].entries
    assert [(e.token_id, e.logprob, e.rank, e.HasField("token")) for e in entries] == [
        (5, -0.5, 1, True),
        (9, -1.0, 2, True),
        (8, -2.0, 3, False),
    ]


UINT32_MAX = 2**32 - 1


@pytest.mark.parametrize(
    ("entry", "ok"),
    [
        ([-0.5, 0], True),
        ([-0.5, UINT32_MAX, None], True),
        ([-0.5, 7, 12], True),  # a text that is not a string is left out
        ([-0.5, UINT32_MAX + 1], False),
        ([-0.5, -1], False),
        (["x", 7], False),
        ([-0.5], False),
    ],
)
def test_sglang_logprob_entries_bounds(entry: list[object], ok: bool) -> None:
    request = native(return_logprob=True, logprobs=0)
    tid = entry[1] if len(entry) > 1 else 0
    meta = {"output_token_logprobs": [entry], "finish_reason": "length"}
    state = ResponseState(request, cumulative=False)
    ids = [tid] if isinstance(tid, int) and 0 <= tid <= UINT32_MAX else [0]
    if ok:
        (out,) = state.feed(NativeEvent(ids, meta, True), aborted_by_us=False)
        assert list(out.log_probs) == [-0.5]
        assert not out.top_logprobs[0].entries[0].HasField("token")
    else:
        with pytest.raises(SidecarError) as info:
            state.feed(NativeEvent(ids, meta, True), aborted_by_us=False)
        assert info.value.reason is FailureReason.PROTOCOL_ERROR


# ---------------------------------------------------------------------------- vLLM response


def vllm_usage(*msgs: Any) -> tuple[int, int, int, int]:
    state = VllmState(Req(request_id="r", token_ids=[10, 11, 12]), "agg")
    outs = [o for m in msgs for o in state.feed(m)]
    u = outs[-1].completion_usage
    return (u.prompt_tokens, u.completion_tokens, u.total_tokens, u.cached_tokens)


@pytest.mark.parametrize(
    ("msgs", "usage"),
    [
        # Counts reported on a chunk only, one at a time, are kept for the terminal.
        ((chunk([1], prompt=9, cached=0), complete([1], prompt=0)), (9, 1, 10, 0)),
        ((chunk([1], prompt=0, cached=2), complete([1], prompt=0)), (3, 1, 4, 2)),
        ((chunk([1], prompt=0), complete([1], prompt=7, cached=0)), (7, 1, 8, 0)),
        ((chunk([1], prompt=0), complete([1], prompt=0, cached=2)), (3, 1, 4, 2)),
        # Nothing reported: the prompt's own length, no cached tokens.
        ((chunk([1], prompt=0), complete([1], prompt=0)), (3, 1, 4, 0)),
    ],
)
def test_vllm_usage_takes_each_count_from_wherever_the_engine_reported_it(
    msgs: tuple[Any, ...], usage: tuple[int, int, int, int]
) -> None:
    assert vllm_usage(*msgs) == usage
