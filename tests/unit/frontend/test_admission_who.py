"""Who a request is for admission: its tenant, its urgency in each format's meaning, its cost."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.admission.who import (
    DEFAULT_OUTPUT_ESTIMATE,
    MAX_TENANT_CHARS,
    Who,
    WhoRules,
    estimated_tokens,
    read_who,
    sequences,
)

RULES = WhoRules()
LOW_FIRST = WhoRules(sglang_low_priority_values_first=True)


def _request(
    priority: int | None = None, *, prompt: int = 3, n: int | None = None, max_tokens: int | None = None
) -> sidecar_pb2.PreprocessedRequest:
    request = sidecar_pb2.PreprocessedRequest(request_id="r", token_ids=list(range(prompt)))
    if priority is not None:
        request.routing.priority = priority
    if n is not None:
        request.sampling_options.n = n
    if max_tokens is not None:
        request.stop_conditions.max_tokens = max_tokens
    return request


@pytest.mark.parametrize(
    ("format_name", "rules", "stored", "header", "urgency"),
    [
        # vLLM: the format stores -priority, so the stored value is the urgency (lower first).
        ("vllm", RULES, None, None, 0),
        ("vllm", RULES, -5, None, -5),
        ("vllm", RULES, 7, None, 7),
        # The header speaks vLLM's language: priority 3 is less urgent than priority 0.
        ("vllm", RULES, 7, "3", -3),
        ("vllm", RULES, None, "-2", 2),
        # SGLang: larger first, as stored...
        ("sglang", RULES, 5, None, 5),
        ("sglang", RULES, None, "4", 4),
        # ...unless the frontend is told SGLang's --schedule-low-priority-values-first.
        ("sglang", LOW_FIRST, 5, None, -5),
        ("sglang", LOW_FIRST, None, "4", -4),
        ("sglang", LOW_FIRST, None, None, 0),
        # The vLLM format is not concerned by the SGLang flag.
        ("vllm", LOW_FIRST, -5, None, -5),
    ],
)
def test_urgency_keeps_each_formats_meaning(
    format_name: str, rules: WhoRules, stored: int | None, header: str | None, urgency: int
) -> None:
    headers = {} if header is None else {"X-Sidecar-Priority": header}
    assert read_who(format_name, headers, [_request(stored)], rules) == Who("", urgency)


@pytest.mark.parametrize(
    ("headers", "tenant"),
    [
        ({}, ""),
        ({"x-gateway-inference-fairness-id": "team-a"}, "team-a"),
        ({"X-Gateway-Inference-Fairness-Id": " team-b "}, "team-b"),
        ({"x-gateway-inference-fairness-id": ""}, ""),
        ({"x-other": "team-c"}, ""),
    ],
)
def test_the_tenant_is_the_header_or_the_default(headers: dict[str, str], tenant: str) -> None:
    assert read_who("vllm", headers, [_request()], RULES) == Who(tenant, 0)


def test_a_configured_tenant_header_is_the_one_read() -> None:
    rules = WhoRules(tenant_header="x-team")
    headers = {"x-team": "blue", "x-gateway-inference-fairness-id": "red"}
    assert read_who("sglang", headers, [_request()], rules) == Who("blue", 0)


@pytest.mark.parametrize(
    ("headers", "field", "words"),
    [
        ({"x-sidecar-priority": "high"}, "x-sidecar-priority", "integer"),
        ({"x-sidecar-priority": str(2**63)}, "x-sidecar-priority", "64-bit"),
        (
            {"x-gateway-inference-fairness-id": "t" * (MAX_TENANT_CHARS + 1)},
            "x-gateway-inference-fairness-id",
            "256",
        ),
    ],
)
def test_a_bad_header_is_named(headers: dict[str, str], field: str, words: str) -> None:
    refused = read_who("vllm", headers, [_request()], RULES)
    assert isinstance(refused, tuple)
    assert refused[0] == field
    assert words in refused[1]


@pytest.mark.parametrize(
    ("requests", "slots", "tokens"),
    [
        ([_request(prompt=10, max_tokens=5)], 1, 15),
        ([_request(prompt=10)], 1, 10 + DEFAULT_OUTPUT_ESTIMATE),
        ([_request(prompt=10, n=4, max_tokens=5)], 4, 10 + 20),
        ([_request(prompt=2, max_tokens=1), _request(prompt=3, max_tokens=0)], 2, 6),
        ([_request(prompt=0, max_tokens=0)], 1, 1),  # never free
    ],
)
def test_slots_and_estimated_tokens(
    requests: list[sidecar_pb2.PreprocessedRequest], slots: int, tokens: int
) -> None:
    assert sequences(requests) == slots
    assert estimated_tokens(requests) == tokens


@given(st.integers(min_value=-(2**31) + 1, max_value=2**31 - 1))
def test_a_header_and_the_body_field_of_the_same_value_agree(value: int) -> None:
    # vLLM's format stores -priority; SGLang's stores it as given: the same priority either way.
    for format_name, stored in (("vllm", -value), ("sglang", value)):
        from_body = read_who(format_name, {}, [_request(stored)], RULES)
        from_header = read_who(format_name, {"x-sidecar-priority": str(value)}, [_request()], RULES)
        assert from_body == from_header
