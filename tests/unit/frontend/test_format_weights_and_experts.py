"""Weights and routed experts in the two formats (docs/metadata.md): SGLang's
``meta_info.weight_version`` / ``weight_versions`` / ``routed_experts`` and vLLM's
``weight_versions`` as the worker sent them, the request fields passed on, and the fields no
wire carries refused by name."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason
from sidecar_common.structs import json_from_struct
from sidecar_frontend.formats.base import HttpReply, WorkerFailure
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from tests.unit.frontend.test_format_sglang_support import (
    STARTED_AT,
    accepted,
    body,
    drive,
    refused,
    sse_events,
)
from tests.unit.frontend.test_format_vllm_support import accepted as vllm_accepted
from tests.unit.frontend.test_format_vllm_support import refused as vllm_refused
from tests.unit.frontend.test_format_vllm_support import sse_events as vllm_events

PROMPT = [1, 100, 200]
ROWS = bytes(range(16))


def out(ids: list[int], version: str | None = None, **terminal: Any) -> sidecar_pb2.LLMEngineOutput:
    message = sidecar_pb2.LLMEngineOutput(token_ids=ids)
    if version is not None:
        message.weight_version = version
    if terminal:
        message.finish_reason = sidecar_pb2.LENGTH
        message.completion_usage.prompt_tokens = len(PROMPT)
        spans = terminal.get("spans", ())
        message.weight_versions.extend(
            sidecar_pb2.WeightVersionSpan(version=v, start=s, end=e) for v, s, e in spans
        )
        if "experts" in terminal:
            message.routed_experts = terminal["experts"]
    return message


SPLIT = [("default", 0, 1), ("step-1", 1, 3)]


def outputs() -> list[sidecar_pb2.LLMEngineOutput]:
    return [out([5], "default"), out([6], "step-1"), out([7], "step-1", spans=SPLIT, experts=ROWS)]


def sglang_unary(fields: dict[str, Any], outs: list[Any]) -> dict[str, Any]:
    call = accepted({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}, **fields})
    _, reply = drive(call, [(0, o, STARTED_AT + k + 1) for k, o in enumerate(outs)])
    assert reply is not None
    meta: dict[str, Any] = body(reply)["meta_info"]
    return meta


def sglang_stream(fields: dict[str, Any], outs: list[Any], incremental: bool = False) -> list[dict[str, Any]]:
    call = accepted(
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}, "stream": True, **fields},
        incremental=incremental,
    )
    written, _ = drive(call, [(0, o, STARTED_AT + k + 1) for k, o in enumerate(outs)])
    return [e["meta_info"] for e in sse_events(written) if e != "[DONE]"]


SPANS_JSON = [{"version": v, "start": s, "end": e} for v, s, e in SPLIT]


# ------------------------------------------------------------------ SGLang: the answer


def test_sglang_unary_answers_the_workers_label_spans_and_experts_where_sglang_puts_them() -> None:
    meta = sglang_unary({"return_routed_experts": True}, outputs())
    assert meta["weight_version"] == "step-1"
    assert meta["weight_versions"] == SPANS_JSON
    assert base64.b64decode(meta["routed_experts"]) == ROWS
    keys = list(meta)
    # SGLang's tokenizer manager: spans right after cached_tokens, experts before dp_rank.
    assert keys.index("weight_versions") == keys.index("cached_tokens") + 1
    assert keys.index("routed_experts") == keys.index("dp_rank") - 1


@pytest.mark.parametrize("incremental", [False, True])
def test_sglang_stream_labels_every_event_and_ends_with_the_spans(incremental: bool) -> None:
    metas = sglang_stream({"return_routed_experts": True}, outputs(), incremental)
    assert [m["weight_version"] for m in metas] == ["default", "step-1", "step-1"]
    assert [m.get("weight_versions") for m in metas] == [None, None, SPANS_JSON]
    assert [m.get("routed_experts") for m in metas[:-1]] == [None, None]
    assert base64.b64decode(metas[-1]["routed_experts"]) == ROWS


def test_sglang_routed_experts_only_when_asked() -> None:
    assert "routed_experts" not in sglang_unary({}, outputs())


@pytest.mark.parametrize("stream", [False, True])
def test_a_worker_whose_wire_does_not_say_answers_sglangs_default(stream: bool) -> None:
    plain = [out([5]), out([6, 7], spans=())]
    metas = sglang_stream({}, plain) if stream else [sglang_unary({}, plain)]
    assert {m["weight_version"] for m in metas} == {"default"}
    assert all("weight_versions" not in m and "routed_experts" not in m for m in metas)


def test_an_abort_by_rid_answers_no_spans() -> None:
    call = accepted({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}})
    failure = WorkerFailure(FailureReason.CANCELLED, "aborted")
    _, reply = drive(call, [(0, out([5], "v1"), 1.0), (0, failure, 2.0)])
    assert reply is not None
    meta = body(reply)["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["weight_version"] == "v1"
    assert "weight_versions" not in meta


# ------------------------------------------------------------------ SGLang: the request


@pytest.mark.parametrize(
    ("fields", "options"),
    [
        ({}, {}),
        ({"return_routed_experts": True}, {"return_routed_experts": True}),
        (
            {"return_routed_experts": True, "routed_experts_start_len": 2},
            {"return_routed_experts": True, "routed_experts_start_len": 2},
        ),
        ({"routed_experts_start_len": -3}, {"routed_experts_start_len": -3}),
        ({"return_routed_experts": False, "routed_experts_start_len": 0}, {}),
    ],
)
def test_sglang_routed_experts_fields_reach_every_sub_request(
    fields: dict[str, Any], options: dict[str, Any]
) -> None:
    call = accepted({"input_ids": [PROMPT, PROMPT], **fields})
    for sub in call.requests:
        got = {
            name: getattr(sub.output_options, name)
            for name in ("return_routed_experts", "routed_experts_start_len")
            if sub.output_options.HasField(name)
        }
        assert got == options


def error_message(reply: HttpReply) -> str:
    data = body(reply)
    error = data.get("error", data)
    return str(error["message"])


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"routed_experts_start_len": 2**31}, "routed_experts_start_len"),
        ({"sampling_params": {"custom_params": ["not", "an", "object"]}}, "sampling_params.custom_params"),
    ],
)
def test_sglang_fields_no_wire_carries_are_refused_by_name(fields: dict[str, Any], named: str) -> None:
    reply = refused({"input_ids": PROMPT, **fields})
    assert reply.status == 400
    assert named in error_message(reply)


def test_sglang_custom_params_go_to_the_worker_as_extra_args() -> None:
    params = {"__sglang_reasoning_end_token_ids": [151668], "scale": 0.5, "tag": "x"}
    call = accepted({"input_ids": PROMPT, "sampling_params": {"custom_params": params}})
    (sub,) = call.requests
    assert json_from_struct(sub.extra_args)["custom_params"] == params
    plain = accepted({"input_ids": PROMPT})
    assert not plain.requests[0].HasField("extra_args")


# ------------------------------------------------------------------ SGLang: sampling masks


def masked(
    ids: list[int], rows: list[list[int]], logprobs: list[object], **terminal: Any
) -> sidecar_pb2.LLMEngineOutput:
    message = out(ids, "v", **terminal)
    message.engine_data.update({"sampling_mask": rows, "sampling_logprobs": logprobs})  # type: ignore[dict-item]
    return message


MASKED = [
    masked([5], [[5, 9]], [-0.5]),
    masked([6, 7], [[6], [7, 8, 9]], [-0.25, -1.0], spans=[("v", 0, 3)]),
]


@pytest.mark.parametrize(
    ("fields", "extra"),
    [
        ({"return_sampling_mask": True}, {"return_sampling_mask": True}),
        (
            {"return_sampling_mask": True, "sampling_logprobs_mode": "support"},
            {"return_sampling_mask": True, "sampling_logprobs_mode": "support"},
        ),
        ({"return_sampling_mask": False}, None),
    ],
)
def test_sglang_sampling_mask_request_goes_as_extra_args(
    fields: dict[str, Any], extra: dict[str, Any] | None
) -> None:
    (sub,) = accepted({"input_ids": PROMPT, **fields}).requests
    got = json_from_struct(sub.extra_args) if sub.HasField("extra_args") else None
    assert got == extra


def test_sglang_per_prompt_sampling_masks() -> None:
    call = accepted({"input_ids": [PROMPT, PROMPT], "return_sampling_mask": [True, False]})
    assert [json_from_struct(r.extra_args).get("return_sampling_mask") for r in call.requests] == [True, None]


def test_sglang_a_mode_without_the_mask_is_sglangs_refusal() -> None:
    reply = refused({"input_ids": PROMPT, "sampling_logprobs_mode": "selected"})
    assert reply.status == 400
    assert "sampling_logprobs_mode can only be set when return_sampling_mask=true." in error_message(reply)


def test_sglang_sampling_masks_are_answered_as_sglang_writes_them() -> None:
    meta = sglang_unary({"return_sampling_mask": True}, MASKED)
    assert meta["output_token_sampling_mask"] == [[5, 9], [6], [7, 8, 9]]
    assert meta["output_token_sampling_logprobs"] == [-0.5, -0.25, -1.0]
    assert meta["output_token_sampling_mask_length"] == 3
    keys = list(meta)
    assert keys.index("output_token_sampling_mask_length") == keys.index("reasoning_tokens") - 1


@pytest.mark.parametrize("incremental", [False, True])
def test_sglang_sampling_masks_stream_like_the_logprobs(incremental: bool) -> None:
    metas = sglang_stream({"return_sampling_mask": True}, MASKED, incremental)
    first, last = metas
    assert first["output_token_sampling_mask"] == [[5, 9]]
    assert last["output_token_sampling_mask"] == (
        [[6], [7, 8, 9]] if incremental else [[5, 9], [6], [7, 8, 9]]
    )
    assert last["output_token_sampling_mask_length"] == 3


def test_sglang_no_mask_keys_when_the_worker_sent_none_or_none_was_asked() -> None:
    assert "output_token_sampling_mask" not in sglang_unary({"return_sampling_mask": True}, outputs())
    assert "output_token_sampling_mask" not in sglang_unary({}, MASKED)


# ------------------------------------------------------------------ vLLM


def vllm_call(stream: bool) -> Any:
    return vllm_accepted(
        {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3}, "request_id": "r", "stream": stream}
    )


def test_vllm_unary_choice_carries_the_spans() -> None:
    encoder = VLLM.new_encoder(vllm_call(False), 1.0)
    for output in outputs():
        encoder.on_output(0, output, 2.0)
    choice = json.loads(encoder.reply().body)["choices"][0]
    assert choice["weight_versions"] == SPANS_JSON
    assert choice["routed_experts"] is None


def test_vllm_stream_carries_the_spans_on_the_final_chunk_only() -> None:
    encoder = VLLM.new_encoder(vllm_call(True), 1.0)
    written = b"".join(encoder.on_output(0, output, 2.0) for output in outputs()) + encoder.close()
    chunks = [e for e in vllm_events(written) if e != "[DONE]" and e.get("choices")]
    spans = [c["choices"][0]["weight_versions"] for c in chunks]
    assert spans[-1] == SPANS_JSON
    assert all(s is None for s in spans[:-1])


def test_vllm_spans_are_null_where_the_wire_does_not_say() -> None:
    encoder = VLLM.new_encoder(vllm_call(False), 1.0)
    encoder.on_output(0, out([5, 6, 7], spans=()), 2.0)
    assert json.loads(encoder.reply().body)["choices"][0]["weight_versions"] is None


def test_vllm_routed_experts_prompt_start_is_refused_by_name() -> None:
    reply = vllm_refused({"token_ids": [5, 6], "sampling_params": {"routed_experts_prompt_start": 2}})
    assert reply.status == 400
    assert "routed_experts_prompt_start" in reply.body.decode()
    vllm_accepted({"token_ids": [5, 6], "sampling_params": {"routed_experts_prompt_start": 0}})
