"""SGLang's sampling_params names live once, in the kernel: the frontend's SGLang format refuses
any other key and lists exactly these, and the SGLang sidecar writes only these to its engine,
under each wire's name (``sampling_seed`` over HTTP, ``seed`` over gRPC)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sidecar_common import sampling_schema
from sidecar_common.api import sglang_pb2
from sidecar_frontend.formats.sglang.checks import check_contract
from sidecar_frontend.formats.sglang.wire import ContractError
from sidecar_sglang.convert_request import RequestSettings
from tests.unit.test_sglang_convert_request import grpc_of, http_of, req

HTTP = RequestSettings(transport="http")

# Every sampling option the sidecar carries, set.
FULL: dict[str, Any] = {
    "samplingOptions": {
        "temperature": 0.5,
        "topP": 0.9,
        "topK": 5,
        "minP": 0.1,
        "frequencyPenalty": 0.1,
        "presencePenalty": 0.1,
        "repetitionPenalty": 1.1,
        "seed": 7,
        "logitBias": {"5": 1.0},
    },
    "stopConditions": {"maxTokens": 8, "minTokens": 1, "stopTokenIds": [9], "ignoreEos": True},
}


def test_the_grpc_keys_are_keys_of_the_http_schema_and_fields_of_the_message() -> None:
    assert set(sampling_schema.GRPC_FIELDS) <= set(sampling_schema.SAMPLING_FIELDS)
    message_fields = [field.name for field in sglang_pb2.SamplingParams.DESCRIPTOR.fields]
    assert [sampling_schema.grpc_name(key) for key in sampling_schema.GRPC_FIELDS] == message_fields


def test_the_frontend_refuses_an_unknown_key_listing_the_kernels_names() -> None:
    listed = ", ".join(f"`{name}`" for name in sampling_schema.SAMPLING_FIELDS)
    with pytest.raises(ContractError) as refused:
        check_contract({"input_ids": [1], "sampling_params": {"max_new_token": 3}})
    assert str(refused.value) == f"unknown field `max_new_token`, expected one of {listed}"
    for name in sampling_schema.SAMPLING_FIELDS:
        check_contract({"input_ids": [1], "sampling_params": {name: None}})  # known: not refused


def test_the_sidecar_writes_only_the_kernels_names_on_either_wire() -> None:
    body = http_of(req(**FULL), HTTP)
    sampling = body["sampling_params"]
    assert set(sampling) <= set(sampling_schema.SAMPLING_FIELDS)
    assert sampling[sampling_schema.SEED] == 7
    assert sampling[sampling_schema.LOGIT_BIAS] == {"5": 1.0}
    # gRPC has no logit_bias (the sidecar refuses it there by name): the rest, seed as seed.
    grpc_full = dict(
        FULL, samplingOptions={k: v for k, v in FULL["samplingOptions"].items() if k != "logitBias"}
    )
    sent = grpc_of(req(**grpc_full))
    assert sent.sampling_params.seed == 7
    assert sent.sampling_params.max_new_tokens == 8


def test_the_names_and_their_order_are_the_real_servers() -> None:
    # SGLang 0.5.23's own refusal of an unknown key, recorded by tools/record_differential.py.
    table = json.loads(
        (Path(__file__).parents[1] / "integration/frontend/differential_sglang.json").read_text()
    )
    row = next(r for r in table["rows"] if r["name"] == "unknown key in sampling_params")
    listed = ", ".join(f"`{name}`" for name in sampling_schema.SAMPLING_FIELDS)
    assert json.loads(row["real"]["body"]) == {
        "error": f"unknown field `max_new_token`, expected one of {listed}"
    }
