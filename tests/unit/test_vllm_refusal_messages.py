"""The exact refusal a vLLM client reads: field first, then the problem (docs/vllm.md).

One row per refusal of the vLLM request converter and of the shared limits it applies,
plus the exact protocol errors for misaligned engine logprobs.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from google.protobuf import struct_pb2
from smg_grpc_proto.generated import vllm_engine_pb2

from sidecar_common.api import sidecar_pb2
from sidecar_common.disaggregation import DisaggregationMode
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_vllm.convert import MAX_CHOICES, ResponseState, to_generate_request
from tests.vllm_fixtures import chunk, complete, output_logprobs

Req = sidecar_pb2.PreprocessedRequest
Mutate = Callable[[Req], None]
NAN = float("nan")


def _kv(req: Req, value: struct_pb2.Value) -> None:
    req.extra_args.fields["kv_transfer_params"].CopyFrom(value)


def _kv_text(req: Req) -> None:
    _kv(req, struct_pb2.Value(string_value="x"))


def _kv_nan(req: Req) -> None:
    inner = struct_pb2.Struct()
    inner.fields["a"].number_value = NAN
    _kv(req, struct_pb2.Value(struct_value=inner))


def _handoff_nan(req: Req) -> None:
    req.prefill_result.disaggregated_params.fields["remote_host"].number_value = NAN


def _media(kind: int, url: str) -> Mutate:
    def mutate(req: Req) -> None:
        req.multi_modal_data.add(kind=sidecar_pb2.MultimodalItem.IMAGE, url="http://a/0.png")
        req.multi_modal_data.add(kind=kind, url=url)

    return mutate


def _set(path: str, value: object) -> Mutate:
    def mutate(req: Req) -> None:
        *parents, leaf = path.split(".")
        msg = req
        for name in parents:
            msg = getattr(msg, name)
        setattr(msg, leaf, value)

    return mutate


def _extra_unknown(req: Req) -> None:
    req.extra_args.fields["zeta"].string_value = "z"
    req.extra_args.fields["alpha"].string_value = "a"


def _prefill_result(req: Req) -> None:
    req.prefill_result.disaggregated_params.fields["remote_host"].string_value = "h"


# (mutation, mode, vision, data_parallel_size, exact message)
Row = tuple[Mutate, DisaggregationMode, bool, int, str]
ROWS: dict[str, Row] = {
    "best_of": (
        _set("sampling_options.best_of", 2),
        "agg",
        False,
        0,
        "sampling_options.best_of: vLLM supports only best_of = 1",
    ),
    "beam": (
        _set("sampling_options.use_beam_search", True),
        "agg",
        False,
        0,
        "sampling_options.use_beam_search: beam search is not supported",
    ),
    "length_penalty": (
        _set("sampling_options.length_penalty", 0.5),
        "agg",
        False,
        0,
        "sampling_options.length_penalty: only applies to beam search",
    ),
    "lora": (
        _set("routing.lora_name", "ad"),
        "agg",
        False,
        0,
        "routing.lora_name: the vLLM wire cannot carry a LoRA adapter",
    ),
    "cache_salt": (
        _set("routing.cache_namespace", "ns"),
        "agg",
        False,
        0,
        "routing.cache_namespace: the vLLM wire cannot carry a cache salt",
    ),
    "priority": (
        _set("routing.priority", 3),
        "agg",
        False,
        0,
        "routing.priority: the vLLM wire cannot carry a priority",
    ),
    "unknown_extra_first_sorted": (
        _extra_unknown,
        "agg",
        False,
        0,
        "extra_args.alpha: unknown key (known: kv_transfer_params)",
    ),
    "handoff_outside_decode": (
        _prefill_result,
        "prefill",
        False,
        0,
        "prefill_result: only a decode sidecar takes a handoff (mode is prefill)",
    ),
    "n_zero": (
        _set("sampling_options.n", 0),
        "agg",
        False,
        0,
        "sampling_options.n: must be at least 1",
    ),
    "n_too_many": (
        _set("sampling_options.n", MAX_CHOICES + 1),
        "agg",
        False,
        0,
        f"sampling_options.n: at most {MAX_CHOICES} choices (got {MAX_CHOICES + 1})",
    ),
    "top_k_below_all": (
        _set("sampling_options.top_k", -2),
        "agg",
        False,
        0,
        "sampling_options.top_k: must be -1 (all) or at least 0 for vllm (got -2)",
    ),
    "no_vision": (
        _media(sidecar_pb2.MultimodalItem.IMAGE, "http://a/1.png"),
        "agg",
        False,
        0,
        "multi_modal_data: the served model does not support vision",
    ),
    "media_kind": (
        _media(sidecar_pb2.MultimodalItem.KIND_UNSPECIFIED, "http://a/1.png"),
        "agg",
        True,
        0,
        "multi_modal_data[1].kind: must be IMAGE, VIDEO or AUDIO (got 0)",
    ),
    "media_url": (
        _media(sidecar_pb2.MultimodalItem.IMAGE, ""),
        "agg",
        True,
        0,
        "multi_modal_data[1].url: empty",
    ),
    "dp_rank_32_bit": (
        _set("routing.dp_rank", 2**31),
        "agg",
        False,
        0,
        f"routing.dp_rank: {2**31} does not fit the engine's 32-bit field",
    ),
    "prefill_dp_rank_32_bit": (
        _set("routing.prefill_dp_rank", 2**31),
        "prefill",
        False,
        0,
        f"routing.prefill_dp_rank: {2**31} does not fit the engine's 32-bit field",
    ),
    "prefill_dp_rank_range": (
        _set("routing.prefill_dp_rank", 4),
        "prefill",
        False,
        2,
        "routing.prefill_dp_rank: rank 4 is out of range: the engine has data_parallel_size 2",
    ),
    "kv_not_object": (
        _kv_text,
        "agg",
        False,
        0,
        "extra_args.kv_transfer_params: must be an object",
    ),
    "kv_not_json": (
        _kv_nan,
        "agg",
        False,
        0,
        "extra_args.kv_transfer_params: a: nan is not a JSON number",
    ),
    "decode_without_handoff": (
        lambda req: None,
        "decode",
        False,
        0,
        "prefill_result.disaggregated_params: required on a decode request",
    ),
    "decode_handoff_not_json": (
        _handoff_nan,
        "decode",
        False,
        0,
        "prefill_result.disaggregated_params: remote_host: nan is not a JSON number",
    ),
}


@pytest.mark.parametrize("case", list(ROWS), ids=list(ROWS))
def test_each_refusal_reads_exactly(case: str) -> None:
    mutate, mode, vision, dp_size, expected = ROWS[case]
    req = Req(request_id="pub", token_ids=[1, 2, 3])
    mutate(req)
    with pytest.raises(SidecarError) as info:
        to_generate_request(req, "priv", mode=mode, supports_vision=vision, data_parallel_size=dp_size)
    assert info.value.reason is FailureReason.INVALID_ARGUMENT
    assert info.value.message == expected


def test_empty_prompt_reads_exactly() -> None:
    with pytest.raises(SidecarError) as info:
        to_generate_request(Req(request_id="pub"), "priv", mode="agg", supports_vision=False)
    assert info.value.reason is FailureReason.INVALID_ARGUMENT
    assert info.value.message == "token_ids: the prompt is empty"


@pytest.mark.parametrize("number", ["1e999", "-1e999"])
def test_a_json_schema_number_beyond_any_float_is_refused_naming_the_field(number: str) -> None:
    # Python reads 1e999 as infinity, which strict JSON (what the engine gets) cannot carry.
    req = Req(request_id="pub", token_ids=[1])
    req.sampling_options.guided_decoding.json = f'{{"type": "number", "maximum": {number}}}'
    with pytest.raises(SidecarError) as info:
        to_generate_request(req, "priv", mode="agg", supports_vision=False)
    assert info.value.reason is FailureReason.INVALID_ARGUMENT
    assert info.value.message == (
        f"sampling_options.guided_decoding.json: not JSON: the number {number} is out of range"
    )


def test_a_json_schema_with_ordinary_numbers_reaches_the_engine_as_strict_json() -> None:
    req = Req(request_id="pub", token_ids=[1])
    req.sampling_options.guided_decoding.json = '{"type": "number", "maximum": 1.5e300, "minimum": -2}'
    native = to_generate_request(req, "priv", mode="agg", supports_vision=False)
    assert json.loads(native.sampling_params.json_schema) == {
        "type": "number",
        "maximum": 1.5e300,
        "minimum": -2,
    }


# ------------------------------------------------------------- engine logprobs errors


def _protocol_error(lp: vllm_engine_pb2.OutputLogProbs) -> str:
    req = Req(request_id="r", token_ids=[10])
    req.output_options.logprobs = 2
    state = ResponseState(req, "agg")
    with pytest.raises(SidecarError) as info:
        state.feed(chunk([4, 5], logprobs=lp))
    assert info.value.reason is FailureReason.PROTOCOL_ERROR
    return info.value.message


def test_output_logprobs_misaligned_reads_exactly() -> None:
    assert (
        _protocol_error(output_logprobs([4, 6], [-0.5, -0.1]))
        == "invalid vllm response: output logprobs are not aligned with the token ids"
    )


def test_top_logprobs_misaligned_reads_exactly() -> None:
    assert (
        _protocol_error(output_logprobs([4, 5], [-0.5, -0.1], [[(1, -1.0)]]))
        == "invalid vllm response: top logprobs are not aligned with the token ids"
    )


def test_top_logprob_pair_count_mismatch_reads_exactly() -> None:
    lp = vllm_engine_pb2.OutputLogProbs(
        token_ids=[4, 5],
        token_logprobs=[-0.5, -0.1],
        top_logprobs=[vllm_engine_pb2.TopLogProbs(token_ids=[1, 2], values=[-1.0])] * 2,
    )
    assert _protocol_error(lp) == "invalid vllm response: top logprobs: 2 ids but 1 values"


# ------------------------------------------------------------- malformed engine streams


def _bad(c: vllm_engine_pb2.GenerateResponse, count: int) -> vllm_engine_pb2.GenerateResponse:
    msg = c.chunk if c.HasField("chunk") else c.complete
    msg.completion_tokens = count
    return c


# One row per protocol error of the response converter: the messages an operator greps the
# sidecar's log for, naming the engine, the message kind and what did not add up.
STREAM_ERRORS: dict[str, tuple[list[vllm_engine_pb2.GenerateResponse], str]] = {
    "neither chunk nor complete": (
        [vllm_engine_pb2.GenerateResponse()],
        "a Generate message with neither chunk nor complete",
    ),
    "chunk count": ([_bad(chunk([4, 5]), 3)], "chunk says completion_tokens 3 but carries 2 ids"),
    "complete count": (
        [chunk([4]), _bad(complete([4, 6]), 1)],
        "complete says completion_tokens 1 but carries 2 ids",
    ),
    "chunk index": ([chunk([4], index=2)], "choice index 2 but n = 1"),
    "complete index": ([complete([4], index=1)], "choice index 1 but n = 1"),
    "finish reason": ([complete([4], reason="eos")], "unknown finish reason 'eos'"),
    "complete rewrites the stream": (
        [chunk([4]), chunk([5]), complete([4, 6, 7])],
        "complete.output_ids of choice 0 neither restate the last chunk nor extend the 2 tokens streamed",
    ),
}


@pytest.mark.parametrize("case", list(STREAM_ERRORS), ids=list(STREAM_ERRORS))
def test_each_malformed_engine_stream_reads_exactly(case: str) -> None:
    msgs, expected = STREAM_ERRORS[case]
    state = ResponseState(Req(request_id="r", token_ids=[10]), "agg")
    *before, last = msgs
    for msg in before:
        state.feed(msg)
    with pytest.raises(SidecarError) as info:
        state.feed(last)
    assert info.value.reason is FailureReason.PROTOCOL_ERROR
    assert info.value.message == f"invalid vllm response: {expected}"
