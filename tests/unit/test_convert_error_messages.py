"""What an operator reads: the exact words of the converters' refusals and protocol errors.

The other converter tests assert the reason and the field; these assert the whole message of
each error path, since the message is all a frontend log or an operator has to go on (which
engine, which field, what was wrong). Also the edge behaviours around those paths that the
mutation run found untested.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from smg_grpc_proto.generated import vllm_engine_pb2

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason, SidecarError, from_rpc_error
from sidecar_sglang.convert_request import (
    Bootstrap,
    NativeRequest,
    NativeSampling,
    RequestSettings,
    build_native,
)
from sidecar_sglang.convert_response import NativeEvent, ResponseState, event_from_http
from sidecar_vllm.convert import ResponseState as VllmState
from sidecar_vllm.convert import to_generate_request
from tests.vllm_fixtures import chunk, complete

Req = sidecar_pb2.PreprocessedRequest


def refusal(call: Any) -> SidecarError:
    with pytest.raises(SidecarError) as info:
        call()
    return info.value


# ---------------------------------------------------------------------------- vLLM request


def vllm_request(mutate: Any) -> Req:
    req = Req(request_id="pub", token_ids=[1, 2, 3])
    mutate(req)
    return req


def vllm_convert(req: Req, mode: Any = "agg") -> vllm_engine_pb2.GenerateRequest:
    return to_generate_request(req, "priv", mode=mode, supports_vision=True)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda r: setattr(r.sampling_options.guided_decoding, "backend", "xgrammar"),
            "sampling_options.guided_decoding.backend: the vLLM wire cannot carry it",
        ),
        (
            lambda r: setattr(r.sampling_options.guided_decoding, "whitespace_pattern", " "),
            "sampling_options.guided_decoding.whitespace_pattern: the vLLM wire cannot carry it",
        ),
        (
            lambda r: r.sampling_options.guided_decoding.choice.SetInParent(),
            "sampling_options.guided_decoding.choice: no choices given",
        ),
        (
            lambda r: setattr(r.sampling_options.guided_decoding, "json", '{"a": NaN}'),
            "sampling_options.guided_decoding.json: not JSON: NaN is not a JSON number",
        ),
    ],
)
def test_vllm_guided_decoding_refusals_say_what_is_wrong(mutate: Any, message: str) -> None:
    err = refusal(lambda: vllm_convert(vllm_request(mutate)))
    assert err.reason is FailureReason.INVALID_ARGUMENT
    assert err.message == message


@pytest.mark.parametrize(
    ("port", "sent"), [(5600, "5600"), (5600.0, "5600"), ("x-port", "x-port"), (True, True)]
)
def test_vllm_decode_turns_only_a_numeric_remote_port_into_text(port: str | float, sent: object) -> None:
    def mutate(r: Req) -> None:
        r.prefill_result.disaggregated_params.update({"remote_port": port})

    native = vllm_convert(vllm_request(mutate), mode="decode")
    assert json.loads(native.kv_transfer_params_json)["remote_port"] == sent


def test_vllm_a_fractional_remote_port_is_refused_by_name() -> None:
    def mutate(r: Req) -> None:
        r.prefill_result.disaggregated_params.update({"remote_port": 1.5})

    err = refusal(lambda: vllm_convert(vllm_request(mutate), mode="decode"))
    assert err.message == "prefill_result.disaggregated_params.remote_port: 1.5 is not a port"


# --------------------------------------------------------------------------- vLLM response


def vllm_feed(msgs: list[vllm_engine_pb2.GenerateResponse], mode: Any = "agg", **out: int) -> list[Any]:
    req = Req(request_id="r", token_ids=[10, 11, 12])
    for name, value in out.items():
        setattr(req.output_options, name, value)
    state = VllmState(req, mode)
    return [o for m in msgs for o in state.feed(m)]


def prompt_logprobs(ids: int, values: int, tops: int, top_width: int = 1) -> vllm_engine_pb2.InputLogProbs:
    lp = vllm_engine_pb2.InputLogProbs(token_ids=list(range(10, 10 + ids)))
    for _ in range(values):
        lp.token_logprobs.add(value=-1.0)
    for _ in range(tops):
        lp.top_logprobs.add(token_ids=[7] * top_width, values=[-2.0])
    return lp


@pytest.mark.parametrize(
    ("lp", "message"),
    [
        (prompt_logprobs(3, 2, 0), "prompt logprobs are not aligned with the prompt tokens"),
        (prompt_logprobs(3, 3, 1), "prompt logprobs are not aligned with the prompt tokens"),
        (prompt_logprobs(3, 3, 3, top_width=2), "prompt top logprobs: 2 ids but 1 values"),
    ],
)
def test_vllm_misaligned_prompt_logprobs_are_named(lp: vllm_engine_pb2.InputLogProbs, message: str) -> None:
    err = refusal(lambda: vllm_feed([chunk([1], input_logprobs=lp), complete([1])], prompt_logprobs=1))
    assert err.reason is FailureReason.PROTOCOL_ERROR
    assert err.message == f"invalid vllm response: {message}"


def test_vllm_prompt_logprobs_without_alternatives_are_accepted() -> None:
    outs = vllm_feed([chunk([1], input_logprobs=prompt_logprobs(3, 3, 0)), complete([1])], prompt_logprobs=0)
    rows = json_format.MessageToDict(outs[-1].engine_data)["prompt_logprobs"]
    assert rows == [{str(t): {"logprob": -1.0}} for t in (10, 11, 12)]


@pytest.mark.parametrize(
    ("kv_json", "message"),
    [
        (None, "a successful prefill without kv_transfer_params_json"),
        ('{"a": NaN}', "kv_transfer_params_json is not JSON: NaN is not a JSON number"),
        ("[1, 2]", "kv_transfer_params_json is not an object"),
        ('{"block": 18014398509481985}', "cannot carry as a Struct: "),
    ],
)
def test_vllm_a_bad_prefill_handoff_is_named(kv_json: str | None, message: str) -> None:
    done = complete([5], "length", kv_json=kv_json)
    err = refusal(lambda: vllm_feed([chunk([5]), done], mode="prefill"))
    assert err.reason is FailureReason.PROTOCOL_ERROR
    assert err.message.startswith(f"invalid vllm response: {message}")
    if not message.endswith(": "):
        assert err.message == f"invalid vllm response: {message}"


# -------------------------------------------------------------------------- SGLang request


def test_sglang_dp_rank_out_of_range_names_the_engines_rank_count() -> None:
    req = Req(token_ids=[1, 2])
    req.routing.dp_rank = 1
    err = refusal(lambda: build_native(req, "p", RequestSettings(dp_size=1), room=1))
    assert err.message == "routing.dp_rank: 1 is out of range (the engine has 1 dp ranks)"


# ------------------------------------------------------------------------- SGLang response


@pytest.mark.parametrize(
    ("payload", "reason", "message"),
    [
        ([1], FailureReason.PROTOCOL_ERROR, "invalid sglang response: an event is not a JSON object"),
        (
            {"text": ""},
            FailureReason.PROTOCOL_ERROR,
            "invalid sglang response: an event has no meta_info object",
        ),
        (
            {"meta_info": {}, "output_ids": 5},
            FailureReason.PROTOCOL_ERROR,
            "invalid sglang response: output_ids is not a list",
        ),
        # A refusal is SGLang's own words, unchanged (the call and the status ride in ErrorInfo).
        ({"error": {"message": "too long", "code": 400}}, FailureReason.INVALID_ARGUMENT, "too long"),
        ({"error": {"code": "503"}}, FailureReason.CANNOT_CONNECT, "Generate: {'code': '503'} (HTTP 503)"),
        ({"error": "scheduler died"}, FailureReason.UNKNOWN, "Generate: scheduler died (HTTP 500)"),
        ({"error": {"message": "odd", "code": "4.0e2"}}, FailureReason.UNKNOWN, "Generate: odd (HTTP 500)"),
    ],
)
def test_sglang_http_events_that_are_errors(payload: object, reason: FailureReason, message: str) -> None:
    err = refusal(lambda: event_from_http(payload))
    assert err.reason is reason
    assert err.message == message


def test_sglang_http_event_fields() -> None:
    event = event_from_http({"meta_info": {"finish_reason": "length", "x": 1}, "text": "hi"})
    assert (event.output_ids, event.meta, event.finished, event.text) == (
        [],
        {"finish_reason": "length", "x": 1},
        True,
        "hi",
    )
    event = event_from_http({"meta_info": {"finish_reason": None}, "output_ids": [4], "text": 7})
    assert (event.output_ids, event.finished, event.text) == ([4], False, None)


def native(**fields: Any) -> NativeRequest:
    base: dict[str, Any] = {"rid": "r", "input_ids": (1, 2, 3, 4), "sampling": NativeSampling()}
    base.update(fields)
    return NativeRequest(**base)


def test_sglang_end_of_stream_words() -> None:
    state = ResponseState(native(), cumulative=False)
    ours = state.end_of_stream(aborted_by_us=True)
    assert (ours.reason, ours.message) == (
        FailureReason.CANCELLED,
        "Generate: the request was aborted (cancelled)",
    )
    cut = state.end_of_stream(aborted_by_us=False)
    assert (cut.reason, cut.message) == (
        FailureReason.ENGINE_SHUTDOWN,
        "Generate: the SGLang stream ended before its terminal",
    )


@pytest.mark.parametrize(
    ("finish", "message"),
    [
        (
            {"type": "abort", "status_code": 502},
            "Generate: engine aborted the request:  (type=abort, status_code=502)",
        ),
        (
            {"type": "abort", "message": "no room", "status_code": 500, "err_type": "Busy"},
            "Generate: engine aborted the request: no room (type=abort, status_code=500, err_type=Busy)",
        ),
        # A busy engine (503) or a refusal (4xx): SGLang's own words, unchanged.
        ({"type": "abort", "message": "no room", "status_code": 503, "err_type": None}, "no room"),
    ],
)
def test_sglang_engine_abort_words(finish: dict[str, object], message: str) -> None:
    state = ResponseState(native(), cumulative=False)
    err = refusal(lambda: state.feed(NativeEvent([], {"finish_reason": finish}, True), aborted_by_us=False))
    assert err.message == message
    # One the sidecar asked for is answered, whatever status the engine gave it.
    ours = ResponseState(native(), cumulative=False)
    (terminal,) = ours.feed(NativeEvent([], {"finish_reason": finish}, True), aborted_by_us=True)
    assert terminal.finish_reason == sidecar_pb2.CANCELLED


def test_sglang_prompt_logprobs_rows_exactly() -> None:
    request = native(return_logprob=True, prompt_logprobs=3)
    meta: dict[str, Any] = {
        "input_token_logprobs": [[None, 1, None], [-0.5, 2, None], [-0.25, 3, None]],
        # Shorter than the prompt: the last position has no alternatives; a null alternative
        # and the prompt token itself are not repeated.
        "input_top_logprobs": [None, [[-0.5, 2, None], [-0.75, 8, None], [None, 9, None], [-0.1, 6, None]]],
    }
    (out,) = ResponseState(request, cumulative=False).feed(
        NativeEvent([5], {**meta, "finish_reason": "length"}, True), aborted_by_us=False
    )
    rows = json_format.MessageToDict(out.engine_data)["prompt_logprobs"]
    assert rows == [
        None,
        [{"token_id": 2, "logprob": -0.5}, {"token_id": 8, "logprob": -0.75}],
        [{"token_id": 3, "logprob": -0.25}],
    ]


@pytest.mark.parametrize(
    ("key", "bad"),
    [("input_token_logprobs", [[-0.5]]), ("input_top_logprobs", [[[-0.5]]])],
)
def test_sglang_a_malformed_prompt_logprob_entry_is_named(key: str, bad: list[object]) -> None:
    request = native(return_logprob=True, prompt_logprobs=1)
    meta: dict[str, Any] = {"input_token_logprobs": [[-0.5, 2, None]], "finish_reason": "length"}
    meta[key] = bad
    state = ResponseState(request, cumulative=False)
    err = refusal(lambda: state.feed(NativeEvent([5], meta, True), aborted_by_us=False))
    assert err.reason is FailureReason.PROTOCOL_ERROR
    assert err.message.startswith(f"invalid sglang response: {key} entry ")


def test_sglang_prefill_handoff_bootstrap_survives_a_length_finish() -> None:
    bootstrap = Bootstrap("h", 1, 2)
    state = ResponseState(native(prefill=True, bootstrap=bootstrap), cumulative=False)
    (out,) = state.feed(NativeEvent([5], {"finish_reason": "length"}, True), aborted_by_us=False)
    assert out.HasField("disaggregated_params")


# ------------------------------------------------------------------------------- errors.py


class OddRpcError(grpc.RpcError):
    """An RpcError whose code and details are not what grpc promises."""

    def code(self) -> object:  # type: ignore[override]
        return 14  # the number, not the StatusCode

    def details(self) -> object:  # type: ignore[override]
        return b"bytes"


def test_an_rpc_error_without_a_status_code_or_text_is_unknown_with_no_details() -> None:
    err = from_rpc_error("Generate", OddRpcError())
    assert err.reason is FailureReason.UNKNOWN
    assert err.message == "Generate: engine error with no details (UNKNOWN)"
