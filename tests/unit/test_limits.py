"""The one table of sampling limits, through both sidecars' request conversion.

Every bad value is refused INVALID_ARGUMENT naming the same field by the vLLM and the SGLang
converters (where the engines' ranges differ, only the engine that refuses it does); every
boundary value the engine accepts is carried.
"""

from __future__ import annotations

import math
from typing import Any, Final

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_common.limits import SAMPLING_LIMITS, EngineKind, Span, check_sampling_limits, exact_integer
from sidecar_sglang.convert_request import RequestSettings, build_native, to_http_json
from sidecar_sglang.convert_response import NativeEvent, ResponseState
from sidecar_sglang.discovery import discover
from sidecar_vllm.convert import to_generate_request

Req = sidecar_pb2.PreprocessedRequest
ENGINES: Final[tuple[EngineKind, ...]] = ("vllm", "sglang")
BOTH: Final = frozenset(ENGINES)
ONLY_VLLM: Final = frozenset({"vllm"})
ONLY_SGLANG: Final = frozenset({"sglang"})


def make(**values: Any) -> Req:
    """A request with the given ``sampling_options`` / ``stop_conditions`` fields set."""
    req = Req(request_id="pub", token_ids=[1, 2, 3])
    for path, value in values.items():
        section, name = path.split("__")
        setattr(getattr(req, section), name, value)
    return req


def convert(engine: EngineKind, req: Req) -> None:
    if engine == "vllm":
        to_generate_request(req, "priv-1", mode="agg", supports_vision=True)
    else:
        build_native(req, "priv-1", RequestSettings(transport="http"), room=7)


def refusal(engine: EngineKind, req: Req) -> str | None:
    """The refusal's message, or None when the request converts."""
    try:
        convert(engine, req)
    except SidecarError as err:
        caught = err
    else:
        return None
    assert caught.reason is FailureReason.INVALID_ARGUMENT
    return caught.message


# (field path, value, the engines that refuse it). Field paths name PreprocessedRequest fields.
BAD_VALUES: Final[list[tuple[str, float, frozenset[str]]]] = [
    ("sampling_options.temperature", -1.0, BOTH),
    ("sampling_options.temperature", -1e-30, BOTH),
    ("sampling_options.temperature", 2.5, ONLY_VLLM),
    ("sampling_options.top_p", 0.0, BOTH),
    ("sampling_options.top_p", -0.5, BOTH),
    ("sampling_options.top_p", 1.5, BOTH),
    ("sampling_options.min_p", -0.25, BOTH),
    ("sampling_options.min_p", 1.25, BOTH),
    ("sampling_options.frequency_penalty", 2.5, BOTH),
    ("sampling_options.frequency_penalty", -2.5, BOTH),
    ("sampling_options.presence_penalty", 2.5, BOTH),
    ("sampling_options.presence_penalty", -2.5, BOTH),
    ("sampling_options.repetition_penalty", 0.0, BOTH),
    ("sampling_options.repetition_penalty", -1.0, BOTH),
    ("sampling_options.repetition_penalty", 2.5, ONLY_SGLANG),
    ("sampling_options.top_k", -2, BOTH),
    ("sampling_options.top_k", 0, ONLY_SGLANG),
] + [(limit.field, bad, BOTH) for limit in SAMPLING_LIMITS for bad in (math.nan, math.inf, -math.inf)]


def request_with(path: str, value: float) -> Req:
    return make(**{path.replace(".", "__"): value})


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("path", "value", "refused_by"), BAD_VALUES)
def test_each_bad_value_is_refused_by_name_by_the_engines_that_refuse_it(
    engine: EngineKind, path: str, value: float, refused_by: frozenset[str]
) -> None:
    message = refusal(engine, request_with(path, value))
    if engine in refused_by:
        assert message is not None, f"{engine} accepted {path}={value}"
        assert message.startswith(f"{path}: "), message
    else:
        assert message is None, message


# (field path, value): the edges the engines accept.
GOOD_EDGES: Final[list[tuple[str, float]]] = [
    ("sampling_options.temperature", 0.0),
    ("sampling_options.temperature", 2.0),
    ("sampling_options.top_p", 1.0),
    ("sampling_options.top_p", 1e-6),
    ("sampling_options.min_p", 0.0),
    ("sampling_options.min_p", 1.0),
    ("sampling_options.frequency_penalty", -2.0),
    ("sampling_options.frequency_penalty", 2.0),
    ("sampling_options.presence_penalty", -2.0),
    ("sampling_options.presence_penalty", 2.0),
    ("sampling_options.repetition_penalty", 2.0),
    ("sampling_options.repetition_penalty", 1e-6),
    ("sampling_options.top_k", -1),
    ("sampling_options.top_k", 1),
    ("stop_conditions.max_tokens", 1),
    ("stop_conditions.min_tokens", 0),
]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("path", "value"), GOOD_EDGES)
def test_edge_values_the_engines_accept_are_carried(engine: EngineKind, path: str, value: float) -> None:
    assert refusal(engine, request_with(path, value)) is None


def test_vllm_temperature_above_two_and_sglang_repetition_above_two_name_the_engine() -> None:
    message = refusal("vllm", request_with("sampling_options.temperature", 3.0))
    assert message == "sampling_options.temperature: must be in [0, 2] for vllm (got 3)"
    message = refusal("sglang", request_with("sampling_options.repetition_penalty", 3.0))
    assert message == "sampling_options.repetition_penalty: must be in (0, 2] for sglang (got 3)"


def test_non_finite_values_are_named_as_such() -> None:
    message = refusal("sglang", request_with("sampling_options.top_p", math.nan))
    assert message == "sampling_options.top_p: must be a finite number (got nan)"


@pytest.mark.parametrize("temperature", [0.0, 5e-7])
def test_sglang_takes_any_top_k_when_it_samples_greedily(temperature: float) -> None:
    # SGLang turns temperature < 1e-6 into top_k 1 before its own check.
    req = make(sampling_options__temperature=temperature, sampling_options__top_k=0)
    assert refusal("sglang", req) is None
    req.sampling_options.top_k = -7
    assert refusal("sglang", req) is None
    assert refusal("vllm", req) is not None


def test_sglang_refuses_top_k_0_just_above_the_greedy_threshold() -> None:
    req = make(sampling_options__temperature=2e-6, sampling_options__top_k=0)
    assert (refusal("sglang", req) or "").startswith("sampling_options.top_k: ")


def test_max_tokens_0_is_served_by_sglang_and_refused_in_vllms_words() -> None:
    # SGLang runs a prompt-only request (max_new_tokens 0); vLLM's SamplingParams refuses it.
    req = make(stop_conditions__max_tokens=0)
    assert refusal("sglang", req) is None
    native = build_native(req, "priv-1", RequestSettings(transport="http"), room=7)
    assert native.sampling.max_new_tokens == 0
    assert to_http_json(native)["sampling_params"] == {"max_new_tokens": 0}
    assert refusal("vllm", req) == "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"


@pytest.mark.parametrize("engine", ENGINES)
def test_min_tokens_above_max_tokens_is_refused_on_both(engine: EngineKind) -> None:
    req = make(stop_conditions__max_tokens=3, stop_conditions__min_tokens=4)
    assert (refusal(engine, req) or "").startswith("stop_conditions.min_tokens: ")
    req.stop_conditions.min_tokens = 3
    assert refusal(engine, req) is None


def test_the_first_bad_field_in_table_order_is_named_the_same_for_both() -> None:
    req = make(sampling_options__temperature=-1.0, sampling_options__top_p=5.0)
    assert {refusal(e, req) or "" for e in ENGINES} == {
        "sampling_options.temperature: must be in [0, 2] for vllm (got -1)",
        "sampling_options.temperature: must be in [0, +inf) for sglang (got -1)",
    }


@given(value=st.floats(width=32, allow_nan=True, allow_infinity=True), which=st.sampled_from(SAMPLING_LIMITS))
def test_the_check_agrees_with_the_span_for_every_float(value: float, which: Any) -> None:
    req = Req(token_ids=[1])
    setattr(req.sampling_options, which.name, value)
    for engine in ENGINES:
        if value in which.span(engine):
            check_sampling_limits(req, engine)
        else:
            with pytest.raises(SidecarError, match=rf"^{which.field}: "):
                check_sampling_limits(req, engine)


def test_span_contains_and_text() -> None:
    span = Span(0.0, 1.0, low_closed=False)
    assert 1.0 in span
    assert 0.5 in span
    assert 0.0 not in span
    assert 1.0000001 not in span
    assert math.nan not in span
    assert str(span) == "(0, 1]"
    assert str(Span(-2.0, 2.0)) == "[-2, 2]"
    assert str(Span(0.0, 1.0, high_closed=False)) == "[0, 1)"
    assert str(Span(0.0, math.inf, high_closed=False)) == "[0, +inf)"
    assert 1e300 in Span(0.0, math.inf, high_closed=False)
    assert math.inf not in Span(0.0, math.inf, high_closed=False)


# ------------------------------------------------------------------- drift: one rule each


@pytest.mark.parametrize("engine", ENGINES)
def test_an_empty_cache_namespace_is_no_namespace_on_both(engine: EngineKind) -> None:
    req = make()
    req.routing.cache_namespace = ""
    assert refusal(engine, req) is None
    req.routing.cache_namespace = "tenant"
    assert (refusal(engine, req) or "").startswith("routing.cache_namespace: ")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("kind", "url", "named"),
    [
        (sidecar_pb2.MultimodalItem.KIND_UNSPECIFIED, "", "multi_modal_data[0].kind"),
        (sidecar_pb2.MultimodalItem.KIND_UNSPECIFIED, "https://x/a.png", "multi_modal_data[0].kind"),
        (9, "https://x/a.png", "multi_modal_data[0].kind"),
        (sidecar_pb2.MultimodalItem.IMAGE, "", "multi_modal_data[0].url"),
        (sidecar_pb2.MultimodalItem.VIDEO, "", "multi_modal_data[0].url"),
    ],
)
def test_a_media_item_without_kind_or_url_is_refused_on_both(
    engine: EngineKind, kind: int, url: str, named: str
) -> None:
    req = make()
    req.multi_modal_data.add(kind=kind, url=url)
    assert (refusal(engine, req) or "").startswith(f"{named}: ")


def test_sglang_http_never_sends_an_empty_image_url() -> None:
    req = make()
    req.multi_modal_data.add(url="")
    with pytest.raises(SidecarError):
        to_http_json(build_native(req, "p", RequestSettings(transport="http"), room=1))
    req.multi_modal_data[0].kind = sidecar_pb2.MultimodalItem.IMAGE
    req.multi_modal_data[0].url = "https://x/a.png"
    body = to_http_json(build_native(req, "p", RequestSettings(transport="http"), room=1))
    assert body["image_data"] == ["https://x/a.png"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (5, 5),
        (-5, -5),
        (5.0, 5),
        (2.0**60, 2**60),
        (" 42 ", 42),
        ("+7", 7),
        ("-7", -7),
        ("1.0", None),
        ("1e3", None),
        ("0x10", None),
        ("²", None),
        ("", None),
        (1.5, None),
        (math.nan, None),
        (math.inf, None),
        (True, None),
        (None, None),
        ([1], None),
        ("1" * 21, None),
    ],
)
def test_one_integer_rule(value: object, expected: int | None) -> None:
    assert exact_integer(value) == expected


@pytest.mark.parametrize(("text", "expected"), [("7", 7), ("7.0", None), (7.0, 7), ("+7", 7)])
def test_discovery_the_handoff_and_sglang_usage_read_integers_the_same_way(
    text: str | float, expected: int | None
) -> None:
    found = discover({}, {"dp_size": text}, [], expected_mode="agg", transport="grpc", engine_host="h")
    assert found.settings.dp_size == expected
    req = make()
    req.prefill_result.disaggregated_params.update(
        {"bootstrap_host": "h", "bootstrap_port": text, "bootstrap_room": "1"}
    )
    # SGLang's own usage counts in its responses: an unreadable one falls back to the prompt's length.
    state = ResponseState(build_native(make(), "p", RequestSettings(), room=1), cumulative=False)
    (terminal,) = state.feed(
        NativeEvent([5], {"finish_reason": "length", "prompt_tokens": text}, True), aborted_by_us=False
    )
    assert terminal.completion_usage.prompt_tokens == (3 if expected is None else expected)
    decode = RequestSettings(mode="decode")
    if expected is None:
        with pytest.raises(SidecarError, match=r"^prefill_result.disaggregated_params.bootstrap_port: "):
            build_native(req, "p", decode, room=1)
    else:
        assert build_native(req, "p", decode, room=1).bootstrap is not None
