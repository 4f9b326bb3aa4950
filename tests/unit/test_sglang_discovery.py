"""SGLang start-up discovery from server info, model info and the model list."""

from __future__ import annotations

from typing import Any

import pytest

from sidecar_common.errors import FailureReason, SidecarError
from sidecar_sglang.discovery import Discovered, discover, loads_from_json

MODEL = {
    "model_path": "/m/llama",
    "served_model_name": "llama",
    "tokenizer_path": "/m/tok",
    "has_image_understanding": False,
}
SERVER: dict[str, Any] = {
    "context_length": None,
    "max_req_input_len": 4095,
    "page_size": 16,
    "max_total_num_tokens": 1000,
    "max_running_requests": 64,
    "dp_size": 2,
    "incremental_streaming_output": False,
    "disaggregation_mode": "null",
    "disaggregation_bootstrap_port": 8998,
    "host": "0.0.0.0",
    "version": "0.5.23",
}
CARDS: list[dict[str, Any]] = [
    {"id": "sql-lora", "root": "/l", "parent": "llama"},
    {"id": "llama", "root": "llama", "max_model_len": 8192},
]


def run(
    server: dict[str, Any] | None = None,
    mode: Any = "agg",
    model: dict[str, Any] | None = None,
    cards: list[dict[str, Any]] | None = None,
) -> Discovered:
    return discover(
        MODEL if model is None else model,
        SERVER if server is None else server,
        CARDS if cards is None else cards,
        expected_mode=mode,
        transport="grpc",
        engine_host="engine.local",
    )


def test_aggregated_engine() -> None:
    found = run()
    info = found.model_info
    assert (info.engine, info.served_model_name, info.model_path, info.tokenizer_path) == (
        "sglang",
        "llama",
        "/m/llama",
        "/m/tok",
    )
    assert info.max_context_length == 8192  # the card, not the launch flag
    assert (info.kv_block_size, info.total_kv_blocks, info.max_num_seqs, info.data_parallel_size) == (
        16,
        62,
        64,
        2,
    )
    assert (info.disaggregation_mode, info.engine_version) == ("agg", "0.5.23")
    assert not found.incremental
    assert found.settings.mode == "agg"
    assert found.settings.bootstrap_port is None


def test_numbers_as_strings_and_fallbacks() -> None:
    server = {
        **SERVER,
        "page_size": "32",
        "max_total_num_tokens": "6400",
        "dp_size": "1",
        "max_running_requests": None,
    }
    server["internal_states"] = [{"max_running_requests": "12"}]
    server["incremental_streaming_output"] = "true"
    found = run(server, cards=[], model={})
    info = found.model_info
    assert (info.kv_block_size, info.total_kv_blocks, info.max_num_seqs) == (32, 200, 12)
    assert info.max_context_length == 4096  # max_req_input_len + 1 without a card
    assert found.incremental
    assert info.served_model_name == ""


def test_served_name_from_card_when_model_info_has_none() -> None:
    assert (
        run(model={}, cards=[{"id": "m1", "root": "m1", "max_model_len": 100}]).model_info.served_model_name
        == "m1"
    )


def test_prefill_engine_settings() -> None:
    server = {**SERVER, "disaggregation_mode": "prefill"}
    found = run(server, mode="prefill")
    assert found.model_info.disaggregation_mode == "prefill"
    # The engine listens on 0.0.0.0: the bootstrap host is the address the sidecar uses.
    assert (found.settings.bootstrap_host, found.settings.bootstrap_port) == ("engine.local", 8998)


@pytest.mark.parametrize(("engine", "flag"), [("null", "prefill"), ("decode", "agg"), ("prefill", "decode")])
def test_mode_disagreement_is_a_startup_error(engine: str, flag: Any) -> None:
    with pytest.raises(SidecarError) as info:
        run({**SERVER, "disaggregation_mode": engine}, mode=flag)
    assert info.value.reason is FailureReason.INVALID_ARGUMENT
    assert flag in info.value.message


def test_unknown_engine_mode_is_a_protocol_error() -> None:
    with pytest.raises(SidecarError) as info:
        run({**SERVER, "disaggregation_mode": "both"})
    assert info.value.reason is FailureReason.PROTOCOL_ERROR


def test_absent_figures_are_zero_and_vision_only_over_http() -> None:
    info = run({"disaggregation_mode": "null"}, model={"has_image_understanding": True}, cards=[]).model_info
    assert (info.kv_block_size, info.total_kv_blocks, info.data_parallel_size, info.max_num_seqs) == (
        0,
        0,
        0,
        0,
    )
    assert not info.supports_vision, "media is refused over gRPC"
    http = discover(
        {"has_image_understanding": True},
        {"disaggregation_mode": "null"},
        [],
        expected_mode="agg",
        transport="http",
        engine_host="h",
    )
    assert http.model_info.supports_vision


def test_low_priority_first_flag() -> None:
    assert run({**SERVER, "schedule_low_priority_values_first": True}).settings.low_priority_values_first


def test_request_checks_learn_dp_size_and_context_length() -> None:
    settings = run().settings
    assert (settings.dp_size, settings.context_length) == (2, 8192)


def test_unknown_figures_leave_request_checks_off() -> None:
    settings = run({"disaggregation_mode": "null"}, cards=[]).settings
    assert (settings.dp_size, settings.context_length) == (None, None)


def test_an_engine_that_truncates_prompts_gets_no_context_check() -> None:
    assert run({**SERVER, "allow_auto_truncate": True}).settings.context_length is None


def test_loads_http_and_grpc_shapes() -> None:
    http = {
        "loads": [
            {"dp_rank": 1, "num_running_reqs": 3, "num_waiting_reqs": "2", "memory": {"token_usage": 0.25}}
        ]
    }
    (rank,) = loads_from_json(http)
    assert (rank.dp_rank, rank.running_requests, rank.waiting_requests, rank.kv_usage) == (1, 3, 2, 0.25)
    ranks = loads_from_json([{"dp_rank": 0, "num_running_reqs": 0}, {"num_waiting_reqs": 1}])
    assert [r.dp_rank for r in ranks] == [0, 1]
    assert ranks[0].HasField("running_requests")
    assert not ranks[0].HasField("waiting_requests")
    assert loads_from_json("nonsense") == ()


@pytest.mark.parametrize(
    ("reported", "enabled"),
    [
        ({"enable_lora": None}, False),
        ({"enable_lora": False}, False),
        ({"enable_lora": True}, True),
        ({}, None),
    ],
)
def test_lora_is_off_when_server_info_says_null_or_false(
    reported: dict[str, Any], enabled: bool | None
) -> None:
    # SGLang reports its resolved --enable-lora: null when neither it nor --lora-paths was given.
    assert run({**SERVER, **reported}).settings.lora_enabled is enabled
